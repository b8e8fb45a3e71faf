"""synflux-build --from-gguf: a llama.cpp GGUF file read as a Hugging Face checkpoint (build time only).

::

    with gguf_checkpoint("SmolLM2-135M-Instruct.Q4_1.gguf", workdir=out) as hf_dir:
        build(cfg, out, hf_dir=hf_dir)            # then exactly the --from-hf path

:func:`gguf_checkpoint` checks the file first (:func:`inspect_gguf`) and writes a temporary checkpoint
directory that the ``--from-hf`` path reads unchanged: the tensors dequantized to float32 with llama.cpp's
own code, ``config.json``, the tokenizer and, for ``Q4_0``/``Q4_1``/``Q8_0`` tensors, their raw blocks
(:data:`BLOCKS_FILE`), which ``--weights int4|int8`` carries into the graphs exactly. Architectures ``llama``,
``qwen3``, ``qwen2``, ``gemma2``, ``gemma3`` and ``phi3``, text only; anything else is a :class:`GGUFImportError`
naming what is not supported. The
files written are described in docs/internals/build.md.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Iterator

from ..core.config import ConfigError
from ..graphset import cache

MAGIC = b"GGUF"
SHARD_BYTES = 2 << 30
"""float32 bytes per safetensors shard of the temporary checkpoint."""
BLOCKS_FILE = "ggml_blocks.safetensors"
"""The raw blocks of the tensors stored in a :data:`CARRIED_TYPES` type, beside the float32 weights."""
CARRIED_TYPES = ("Q4_0", "Q4_1", "Q8_0")
"""GGML types whose blocks (32 values: integers, an fp16 scale, for Q4_1 an fp16 minimum) ``--weights``
can hold exactly: ``x = d * (q - 8)`` (Q4_0), ``x = d * q + m`` (Q4_1), ``x = d * q`` (Q8_0)."""
GGML_BLOCK = 32

ARCHITECTURES = {"llama": "llama", "qwen3": "qwen3", "qwen2": "qwen2", "gemma2": "gemma2", "gemma3": "gemma3_text",
                 "phi3": "phi3"}
"""GGUF ``general.architecture`` -> Hugging Face ``model_type`` of the checkpoint written."""
_GEMMAS = ("gemma2", "gemma3")
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
"""The 27B models scale scores by hidden / heads rather than head_dim (their query_pre_attn_scalar), which GGUF
does not store: llama.cpp tells them by their layer count, and so does this import. The rest GGUF leaves out
(Gemma 2's alternating layers, Gemma 3's five sliding layers to a global one and their rope base 10000, soft-caps
a file omits) are the defaults the --from-hf path takes for a config without them, which are llama.cpp's too."""

UNSUPPORTED = {
    "qwen2moe": "mixture-of-experts layers",
    "qwen3moe": "mixture-of-experts layers",
    "qwen35": "hybrid linear-attention layers",
    "qwen35moe": "hybrid linear-attention and mixture-of-experts layers",
    "gemma": "transformers cannot load Gemma GGUF files, so there is no reference to check the import against",
    "gemma4": "mixed sliding/global attention with two head sizes",
    "mistral3": "a vision tower",
    "gpt-oss": "mixture-of-experts layers and attention sinks",
    "minimax-m2": "mixture-of-experts layers",
    "lfm2": "short-convolution layers",
    "mamba": "state-space layers instead of attention",
    "t5": "an encoder-decoder model",
    "t5encoder": "an encoder model",
    "falcon": "LayerNorm blocks with parallel attention and MLP",
    "bloom": "ALiBi positions and LayerNorm blocks",
    "gpt2": "learned absolute positions, LayerNorm and biased, ungated MLPs",
    "starcoder2": "LayerNorm blocks with biases and ungated MLPs",
    "stablelm": "LayerNorm blocks with partial rotary embeddings",
    "nemotron": "LayerNorm1P blocks, squared-ReLU ungated MLPs and partial rotary embeddings",
    "deci": "layers of differing head counts and widths",
}
"""Architectures transformers' GGUF loader reads that these graphs cannot express, and why."""

_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}
_BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_QKV_BIASES = {"attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
               "attn_v.bias": "self_attn.v_proj.bias"}
_SANDWICH = {"attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
             "ffn_norm.weight": "pre_feedforward_layernorm.weight",
             "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_FUSED = {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
_EXTRA_TENSORS = {"qwen3": _QK_NORMS, "qwen2": _QKV_BIASES, "gemma2": _SANDWICH, "gemma3": dict(_SANDWICH, **_QK_NORMS),
                  "phi3": _FUSED}
"""Per-layer tensors an architecture has beside (or instead of) :data:`_BLOCK_TENSORS`."""
_NOT_IN = {"phi3": ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight")}
"""Of :data:`_BLOCK_TENSORS`, those an architecture's GGUF has not (Phi-3: fused q/k/v and gate/up)."""
_HF_CLASS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_ROPE_FREQS = "rope_freqs.weight"


class GGUFImportError(ConfigError):
    """The GGUF file cannot be imported: not a GGUF file, or an architecture, tensor or type the graphs
    do not support. The message names the file."""


@dataclass
class GGUFModel:
    """What :func:`inspect_gguf` found: the checkpoint's ``config.json`` and the tensors to convert."""

    path: str
    architecture: str
    config: dict
    tensors: dict[str, str] = field(default_factory=dict)  # GGUF name -> HF name (rope_freqs: "")
    types: dict[str, int] = field(default_factory=dict)    # tensor type name -> count
    chat_template: str = ""
    specials: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... -> token text
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None


def _need_gguf():
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise GGUFImportError("--from-gguf needs the 'gguf' package (llama.cpp's GGUF reader): "
                              "pip install gguf") from None
    return gguf


def _reader(path: str):
    """An open ``gguf.GGUFReader`` of ``path`` (memory-mapped), after checking that it is a GGUF file."""
    if not os.path.isfile(path):
        raise GGUFImportError(f"{path}: GGUF file not found")
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head != MAGIC:
        raise GGUFImportError(f"{path}: not a GGUF file (it starts with {head!r}, a GGUF file with {MAGIC!r})")
    gguf = _need_gguf()
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # a truncated or corrupted file: the reader fails in many ways
        raise GGUFImportError(f"{path}: cannot read this GGUF file ({type(exc).__name__}: {exc})") from None


def _meta(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:
        return default


@functools.lru_cache(maxsize=1)
def supported_types() -> tuple[str, ...]:
    """The GGML tensor types this import reads (dequantizes to float32)."""
    gguf = _need_gguf()
    return tuple(t.name for t in gguf.GGMLQuantizationType if _dequantizable(t))


def _dequantizable(qtype) -> bool:
    import numpy as np
    gguf = _need_gguf()
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    T = gguf.GGMLQuantizationType
    try:
        if qtype == T.F32:
            gguf.quants.dequantize(np.zeros(block, np.float32), qtype)
        elif qtype == T.F16:
            gguf.quants.dequantize(np.zeros(block, np.float16), qtype)
        else:
            gguf.quants.dequantize(np.zeros((1, size), np.uint8), qtype)
    except (NotImplementedError, ValueError, TypeError):
        return False
    return True


def _llama3_rope(freqs, theta: float, head_dim: int, context: int | None, path: str) -> dict:
    """The ``llama3`` rope parameters that give llama.cpp's ``rope_freqs`` factors (its converter writes
    them instead of the parameters), checked by recomputing the factors as the converter does."""
    import numpy as np
    freqs = np.asarray(freqs, dtype=np.float64)
    factor = float(freqs.max())
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    for ctx in dict.fromkeys(c for c in (context, 8192) if c):
        params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": int(ctx)}
        lo_wave, hi_wave = ctx / 1.0, ctx / 4.0
        want = []
        for f in inv:
            wave = 2 * math.pi / f
            if wave < hi_wave:
                want.append(1.0)
            elif wave > lo_wave:
                want.append(factor)
            else:
                smooth = (ctx / wave - 1.0) / (4.0 - 1.0)
                want.append(1.0 / ((1 - smooth) / factor + smooth))
        if len(want) == len(freqs) and np.allclose(freqs, want, rtol=1e-4, atol=0):
            return params
    raise GGUFImportError(f"{path}: tensor {_ROPE_FREQS} holds rope frequency factors that are not Llama 3's "
                          f"scaling (factor {factor:g}, low/high frequency factors 1/4); not supported")


def inspect_gguf(path: str) -> GGUFModel:
    """Check ``path`` and work out the checkpoint it becomes, reading the metadata and tensor table only."""
    reader = _reader(path)
    arch = str(_meta(reader, "general.architecture", ""))
    if not arch:
        raise GGUFImportError(f"{path}: no general.architecture in the GGUF metadata")
    if arch not in ARCHITECTURES:
        why = UNSUPPORTED.get(arch)
        raise GGUFImportError(f"{path}: GGUF architecture {arch!r} is not supported"
                              f"{f' ({why})' if why else ''}; supported: {', '.join(ARCHITECTURES)}")
    splits = _meta(reader, "split.count", 1) or 1
    if int(splits) > 1:
        raise GGUFImportError(f"{path}: one part of a split GGUF ({splits} files); merge the parts first "
                              f"(llama-gguf-split --merge FIRST_PART OUT.gguf)")

    def need(key):
        value = _meta(reader, f"{arch}.{key}")
        if value is None:
            raise GGUFImportError(f"{path}: {arch}.{key} is missing from the GGUF metadata")
        if isinstance(value, list):
            raise GGUFImportError(f"{path}: {arch}.{key} differs from layer to layer ({value[:4]} ...); "
                                  f"not supported")
        return value

    layers = int(need("block_count"))
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(_meta(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_meta(reader, f"{arch}.attention.key_length", 0) or hidden // heads)
    value_dim = int(_meta(reader, f"{arch}.attention.value_length", 0) or head_dim)
    if value_dim != head_dim:
        raise GGUFImportError(f"{path}: key length {head_dim} != value length {value_dim}; not supported")
    rot = _meta(reader, f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise GGUFImportError(f"{path}: rope over {rot} of the {head_dim} head dimensions (partial rotary); "
                              f"not supported")
    theta = float(_meta(reader, f"{arch}.rope.freq_base", 10000.0))
    eps = float(need("attention.layer_norm_rms_epsilon"))

    gguf = _need_gguf()
    readable = set(supported_types())
    tensors: dict[str, str] = {}
    shapes: dict[str, tuple] = {}
    types: dict[str, int] = {}
    bad_type: dict[str, str] = {}
    unknown: list[str] = []
    block_names = {k: v for k, v in _BLOCK_TENSORS.items() if k not in _NOT_IN.get(arch, ())}
    block_names.update(_EXTRA_TENSORS.get(arch, {}))
    for t in reader.tensors:
        qtype = t.tensor_type
        shapes[t.name] = tuple(int(d) for d in reversed(t.shape.tolist()))  # torch order
        if t.name in _GLOBAL_TENSORS:
            tensors[t.name] = _GLOBAL_TENSORS[t.name]
        elif t.name == _ROPE_FREQS and arch == "llama":
            tensors[t.name] = ""
        elif (m := _BLOCK.match(t.name)) and m.group(2) in block_names and int(m.group(1)) < layers:
            tensors[t.name] = f"model.layers.{m.group(1)}.{block_names[m.group(2)]}"
        elif t.name.startswith("rope_factors_") and arch == "phi3":
            raise GGUFImportError(f"{path}: tensor {t.name}: Phi-3's long-context rope scaling (longrope) is not "
                                  f"supported; a 4k-context Phi-3 imports")
        else:
            unknown.append(t.name)
            continue
        if qtype.name not in readable:
            bad_type[t.name] = qtype.name
        types[qtype.name] = types.get(qtype.name, 0) + 1
    if unknown:
        biases = [n for n in unknown if n.endswith(".bias")]
        what = (f"bias tensors ({', '.join(biases[:3])}{' ...' if len(biases) > 3 else ''}): the graphs have no "
                f"biases" if biases else
                f"tensors a {arch} decoder does not have: {', '.join(unknown[:6])}{' ...' if len(unknown) > 6 else ''}")
        raise GGUFImportError(f"{path}: {what}; not supported")
    if bad_type:
        kinds = sorted(set(bad_type.values()))
        raise GGUFImportError(f"{path}: tensor type{'s' if len(kinds) > 1 else ''} {', '.join(kinds)} "
                              f"(e.g. {next(iter(bad_type))}) cannot be dequantized; supported: "
                              f"{', '.join(sorted(readable))}")

    if "token_embd.weight" not in shapes:
        raise GGUFImportError(f"{path}: no token_embd.weight tensor")
    vocab = shapes["token_embd.weight"][0]
    ff = int(need("feed_forward_length"))
    want = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if "output.weight" in shapes:
        want["output.weight"] = (vocab, hidden)
    per_layer = {"attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
                 "attn_q.weight": (heads * head_dim, hidden), "attn_k.weight": (kv_heads * head_dim, hidden),
                 "attn_v.weight": (kv_heads * head_dim, hidden), "attn_output.weight": (hidden, heads * head_dim),
                 "ffn_gate.weight": (ff, hidden), "ffn_up.weight": (ff, hidden), "ffn_down.weight": (hidden, ff)}
    if arch in ("qwen3", "gemma3"):
        per_layer.update({"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)})
    if arch in _GEMMAS:
        per_layer.update({"post_attention_norm.weight": (hidden,), "post_ffw_norm.weight": (hidden,)})
    if arch == "phi3":
        for k in _NOT_IN["phi3"]:
            del per_layer[k]
        per_layer.update({"attn_qkv.weight": ((heads + 2 * kv_heads) * head_dim, hidden),
                          "ffn_up.weight": (2 * ff, hidden)})
    if arch == "qwen2":
        per_layer.update({"attn_q.bias": (heads * head_dim,), "attn_k.bias": (kv_heads * head_dim,),
                          "attn_v.bias": (kv_heads * head_dim,)})
    for i in range(layers):
        want.update({f"blk.{i}.{k}": v for k, v in per_layer.items()})
    missing = [n for n in want if n not in shapes]
    if missing:
        raise GGUFImportError(f"{path}: tensors missing for a {layers}-layer {arch} decoder: "
                              f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    wrong = [f"{n} {list(shapes[n])} (expected {list(s)})" for n, s in want.items() if shapes[n] != s]
    if wrong:
        raise GGUFImportError(f"{path}: tensor shapes do not match the metadata: {'; '.join(wrong[:4])}")

    rope: dict = {}
    scaling = str(_meta(reader, f"{arch}.rope.scaling.type", "none") or "none")
    factor = _meta(reader, f"{arch}.rope.scaling.factor", _meta(reader, f"{arch}.rope.scale_linear"))
    if _ROPE_FREQS in shapes:
        ctx = _meta(reader, f"{arch}.rope.scaling.original_context_length")
        freqs = next(t for t in reader.tensors if t.name == _ROPE_FREQS)
        rope = _llama3_rope(gguf.quants.dequantize(freqs.data, freqs.tensor_type).reshape(-1), theta, head_dim,
                            int(ctx) if ctx else None, path)
    elif scaling == "linear" or (scaling == "none" and factor not in (None, 1.0)):
        if factor is None:
            raise GGUFImportError(f"{path}: linear rope scaling without {arch}.rope.scaling.factor")
        rope = {"rope_type": "linear", "factor": float(factor)}
    elif scaling != "none":
        raise GGUFImportError(f"{path}: rope scaling {scaling!r} is not supported (supported: none, linear, "
                              f"Llama 3's rope_freqs)")

    tokens_field = reader.fields.get("tokenizer.ggml.tokens")
    if tokens_field is None:
        raise GGUFImportError(f"{path}: no tokenizer in the GGUF metadata (tokenizer.ggml.tokens)")
    n_tokens = len(tokens_field.data)

    def token(key):
        idx = _meta(reader, f"tokenizer.ggml.{key}")
        if idx is None or not 0 <= int(idx) < n_tokens:
            return None
        return tokens_field.contents(int(idx))

    specials = {name: text for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                                             ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))
                if (text := token(key)) is not None}
    config = {
        "architectures": [_HF_CLASS[arch]],
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "intermediate_size": ff,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": int(_meta(reader, f"{arch}.context_length", 4096)),
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "hidden_act": "gelu_pytorch_tanh" if arch in _GEMMAS else "silu",
        **({} if arch in ("qwen2", "gemma2", "gemma3", "phi3") else {"attention_bias": False, "mlp_bias": False}),
        "tie_word_embeddings": "output.weight" not in shapes,
        "torch_dtype": "float32",
    }
    if rope:
        config["rope_scaling"] = rope
    window = _meta(reader, f"{arch}.attention.sliding_window")
    if window is not None:
        config["sliding_window"] = int(window)
    if arch in _GEMMAS:
        config["query_pre_attn_scalar"] = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if (cap := _meta(reader, f"{arch}.{key}")) is not None:
                config[key] = float(cap)
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        if (idx := _meta(reader, f"tokenizer.ggml.{key}")) is not None:
            config[name] = int(idx)
    template = _meta(reader, "tokenizer.chat_template", "") or ""
    add_bos, add_eos = _meta(reader, "tokenizer.ggml.add_bos_token"), _meta(reader, "tokenizer.ggml.add_eos_token")
    return GGUFModel(os.path.abspath(path), arch, config, tensors, types, str(template), specials,
                     None if add_bos is None else bool(add_bos), None if add_eos is None else bool(add_eos))


def _unpermute(w, n_head: int):
    """Undo llama.cpp's Q/K row permutation (its converter interleaves the two rotary halves per head)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def ggml_blocks(raw, type_name: str, rows: int, cols: int) -> dict:
    """The blocks of a ``Q4_0`` / ``Q4_1`` / ``Q8_0`` tensor of ``rows`` x ``cols`` values (``raw``: its
    bytes) as arrays: ``q`` [rows, cols] (uint8 0..15 for Q4_x, int8 for Q8_0), ``d`` and (Q4_1) ``m``
    [rows, cols / 32] float32. Dequantized as in :data:`CARRIED_TYPES`, in float32, they are bitwise what
    llama.cpp's reference dequantization gives."""
    import numpy as np
    n = rows * cols // GGML_BLOCK
    if type_name == "Q8_0":
        b = np.asarray(raw, np.uint8).reshape(n, 2 + GGML_BLOCK)
        return {"q": b[:, 2:].view(np.int8).reshape(rows, cols).copy(),
                "d": b[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)}
    head = 4 if type_name == "Q4_1" else 2
    b = np.asarray(raw, np.uint8).reshape(n, head + GGML_BLOCK // 2)
    packed = b[:, head:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1)  # values 0..15 low nibbles first, then high
    out = {"q": q.reshape(rows, cols), "d": b[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)}
    if type_name == "Q4_1":
        out["m"] = b[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    return out


def _float32_tensors(model: GGUFModel) -> Iterator[tuple[str, "object", "dict | None"]]:
    """(HF name, float32 numpy array, its :func:`ggml_blocks` or None) for every weight, one tensor at a
    time; a tensor's blocks only when its type is one of :data:`CARRIED_TYPES`."""
    import numpy as np
    gguf = _need_gguf()
    reader = _reader(model.path)
    heads, kv = model.config["num_attention_heads"], model.config["num_key_value_heads"]
    for t in reader.tensors:
        name = model.tensors.get(t.name)
        if not name:
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        w = np.ascontiguousarray(w, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
        blocks = None
        if t.tensor_type.name in CARRIED_TYPES and w.ndim == 2 and w.shape[1] % GGML_BLOCK == 0:
            blocks = ggml_blocks(t.data, t.tensor_type.name, *w.shape)
        n_head = heads if t.name.endswith(".attn_q.weight") else kv if t.name.endswith(".attn_k.weight") else 0
        if model.architecture == "llama" and n_head:
            w = _unpermute(w, n_head)
            blocks = {k: _unpermute(v, n_head) for k, v in blocks.items()} if blocks else None
        if model.architecture in _GEMMAS and t.name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # llama.cpp stores Gemma's (1 + w) norm gains as 1 + w
        if blocks:
            blocks["type"] = t.tensor_type.name
        yield name, np.ascontiguousarray(w), blocks


def _write_weights(model: GGUFModel, out_dir: str) -> int:
    """The float32 tensors as safetensors (one file, or shards of :data:`SHARD_BYTES` with an index), and
    the blocks of those stored in a :data:`CARRIED_TYPES` type in :data:`BLOCKS_FILE`."""
    import numpy as np
    from safetensors.numpy import save_file
    shards: list[dict] = [{}]
    size = 0
    total = 0
    paths = []

    def flush():
        name = f"shard-{len(paths):05d}.safetensors"
        save_file(shards[-1], os.path.join(out_dir, name), metadata={"format": "pt"})
        paths.append((name, list(shards[-1])))
        shards.append({})

    carried: dict = {}
    types: dict = {}
    for name, w, blocks in _float32_tensors(model):
        if blocks:
            types[name] = blocks.pop("type")
            carried.update({f"{name}.ggml_{k}": np.ascontiguousarray(v) for k, v in blocks.items()})
        if shards[-1] and size + w.nbytes > SHARD_BYTES:
            flush()
            size = 0
        shards[-1][name] = w
        size += w.nbytes
        total += w.nbytes
    flush()
    if carried:
        save_file(carried, os.path.join(out_dir, BLOCKS_FILE), metadata={"types": json.dumps(types)})
    if len(paths) == 1:
        os.replace(os.path.join(out_dir, paths[0][0]), os.path.join(out_dir, "model.safetensors"))
    else:
        weight_map = {key: f for f, keys in paths for key in keys}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1)
    return total


def _write_tokenizer(model: GGUFModel, out_dir: str) -> None:
    """tokenizer.json (transformers' conversion of the GGUF vocabulary) and tokenizer_config.json with the
    file's chat template and special tokens."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise GGUFImportError("--from-gguf needs transformers for the tokenizer (pip install transformers)") \
            from None
    with tempfile.TemporaryDirectory(prefix="synflux_gguf_tok_") as tmp:
        # The file alone in a directory: transformers would otherwise take a tokenizer.json lying beside it.
        link = os.path.join(tmp, "model.gguf")
        os.symlink(model.path, link)
        try:
            tok = AutoTokenizer.from_pretrained(tmp, gguf_file="model.gguf")
        except Exception as exc:
            raise GGUFImportError(f"{model.path}: transformers cannot build a tokenizer from this file "
                                  f"({type(exc).__name__}: {exc})") from None
        saved = os.path.join(tmp, "saved")
        tok.save_pretrained(saved)
        shutil.copyfile(os.path.join(saved, "tokenizer.json"), os.path.join(out_dir, "tokenizer.json"))
        try:
            with open(os.path.join(saved, "tokenizer_config.json"), encoding="utf-8") as fh:
                tok_config = json.load(fh)
        except (OSError, ValueError):
            tok_config = {}
    for key in ("is_local", "local_files_only", "name_or_path", "gguf_file", "vocab_file"):
        tok_config.pop(key, None)
    tok_config.update(model.specials)
    for key, value in (("add_bos_token", model.add_bos_token), ("add_eos_token", model.add_eos_token)):
        if value is not None:
            tok_config[key] = value
    if model.chat_template:
        tok_config["chat_template"] = model.chat_template
    else:
        tok_config.pop("chat_template", None)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(tok_config, fh, indent=1, ensure_ascii=False)


def _importer_version() -> str:
    """This module's source and the versions of the packages the conversion uses: a change to any of them
    changes config.json, hence the weights fingerprint, so the graphs are rebuilt."""
    from importlib.metadata import PackageNotFoundError, version

    def ver(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "?"
    source = cache.digest([os.path.abspath(__file__)], length=12)
    return f"{source};gguf {ver('gguf')};transformers {ver('transformers')}"


def convert(path: str, out_dir: str, progress: Callable[[str], None] | None = None,
            model: GGUFModel | None = None) -> GGUFModel:
    """Write the Hugging Face checkpoint of the GGUF file ``path`` into ``out_dir`` (the files of
    docs/internals/build.md; ``model``: what :func:`inspect_gguf` found, if already known)."""
    say = progress or (lambda msg: None)
    model = model or inspect_gguf(path)
    digest = cache.digest([path])
    types = ", ".join(f"{n} {k}" for k, n in sorted(model.types.items(), key=lambda kv: -kv[1]))
    c = model.config
    say(f"  GGUF {os.path.basename(path)}: {model.architecture}, {c['num_hidden_layers']} layers, hidden "
        f"{c['hidden_size']}, {c['num_attention_heads']}/{c['num_key_value_heads']} heads, vocab {c['vocab_size']}; "
        f"tensors {types}")
    os.makedirs(out_dir, exist_ok=True)
    total = _write_weights(model, out_dir)
    _write_tokenizer(model, out_dir)
    config = dict(model.config, synflux_gguf={"file": os.path.basename(path), "sha256": digest,
                                              "tensor_types": model.types, "importer": _importer_version()})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=1)
    # The build fingerprints a checkpoint by its files' names, sizes and times and config.json's content
    # (which holds the GGUF's SHA-256): fixed times make it follow the GGUF's content only.
    for name in os.listdir(out_dir):
        os.utime(os.path.join(out_dir, name), (0, 0))
    if not model.chat_template:
        say("  GGUF has no tokenizer.chat_template: a base model, served as plain text completion")
    say(f"  dequantized {sum(model.types.values())} tensors to float32 ({total / 2**20:.1f} MiB)")
    return model


def text_only(cfg, path: str, progress: Callable[[str], None] | None = None):
    """``cfg`` for the model of a GGUF file, which is a text-only decoder: a ``vlm`` config's ``vision``
    section is dropped (a random vision encoder, and a chat template without the image marker, would make
    the runtimes refuse the graph set), so the graph set is a text-only chat model. Other configs as they are."""
    if cfg.mode == "vlm" and cfg.vision is not None:
        if progress:
            progress(f"  {os.path.basename(path)} holds a text-only model: the config's vision section is left out "
                     f"(a text-only chat graph set)")
        return cfg.with_overrides(vision=None)
    return cfg


@contextlib.contextmanager
def gguf_checkpoint(path: str, workdir: str | None = None,
                    progress: Callable[[str], None] | None = None) -> Iterator[str]:
    """The GGUF file ``path`` as a temporary Hugging Face checkpoint directory (created in ``workdir``,
    default the system's temporary directory; removed on exit)."""
    model = inspect_gguf(path)  # errors before any directory is made
    if workdir:
        os.makedirs(workdir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".synflux-gguf-", dir=workdir or None) as tmp:
        convert(path, tmp, progress, model)
        yield tmp


def record_source(out: str, path: str, hf_dir: str) -> None:
    """Name the GGUF file (not the temporary checkpoint) as the weight source in ``out``'s manifest."""
    from ..graphset import reader as graphset, writer as graphset_writer
    manifest = graphset.read_manifest(out)
    source = dict(manifest.get("source") or {}, hf_dir="")
    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as fh:
        source["gguf"] = {"path": os.path.abspath(path), "sha256": json.load(fh)["synflux_gguf"]["sha256"]}
    manifest["source"] = source
    graphset_writer.write_manifest(out, manifest)
