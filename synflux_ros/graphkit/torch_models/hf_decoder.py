"""Hugging Face decoder checkpoints: which model types the decoder (:mod:`.decoder`) builds, the
:class:`~synflux_ros.core.config.LLMConfig` fields a checkpoint's config.json gives (checking what the graphs
cannot do), and the mapping of its tensor names onto the decoder's parameters (:func:`load_hf_weights`).
Kept apart from the model code: this is what changes when a new checkpoint family is supported.
"""
from __future__ import annotations

import os

import torch

from ...core.config import ConfigError
from .checkpoint import copy_checked, read_config, read_tensors, tensor_files
from .decoder import GEMMA_FAMILY, CausalLM, rope_inv_freq

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral", "phi3", "gemma", "gemma2", "gemma3_text", "qwen3_vl")
# Mistral is Llama's decoder (its sliding window is checked against the context where the config is made).
_ARCH_OF = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama", "mistral": "llama", "phi3": "llama",
            "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3", "qwen3_vl": "qwen3"}
_TIED_DEFAULT = {"qwen3": False, "qwen2": False, "llama": False, "mistral": False, "phi3": False, "gemma": True,
                 "gemma2": True, "gemma3_text": True, "qwen3_vl": False}
_SLIDING_PATTERN = {"gemma2": 2, "gemma3_text": 6}
"""Every n-th layer attends globally, the others through the sliding window, where a config lists no
layer_types (Gemma 2 and 3 before transformers wrote them)."""
_GEMMA_DEFAULTS = {
    "gemma2": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "sliding_window": 4096, "rope_theta": 10000.0},
    "gemma3_text": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": None, "final_logit_softcapping": None,
                    "sliding_window": 4096, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0},
}
"""What transformers' Gemma2Config / Gemma3TextConfig take for a key a config.json leaves out (an explicit null
is kept: no soft-cap)."""
_FUSED = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                        "self_attn.v_proj.weight"),
          "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
"""Phi-3's fused projections: checkpoint tensor suffix -> the parameters its rows are, in order."""


def read_hf_config(hf_dir: str) -> tuple[str, dict, dict]:
    """(model_type, text config, top-level config) of a checkpoint directory."""
    path, top = read_config(hf_dir)
    model_type = str(top.get("model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{path}: model_type {model_type!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    text = top.get("text_config") if model_type == "qwen3_vl" else top
    if not isinstance(text, dict):
        raise ConfigError(f"{path}: model_type {model_type!r} needs a 'text_config' section")
    return model_type, text, top


def hf_rope(text: dict) -> tuple[float, dict]:
    """(rope theta, rope parameters dict) of a text config (transformers 5 or 4 layout)."""
    params = text.get("rope_parameters")
    if not isinstance(params, dict):
        params = text.get("rope_scaling")
        params = dict(params) if isinstance(params, dict) else {}
    else:
        params = dict(params)
    theta = params.get("rope_theta", text.get("rope_theta", 10000.0))
    return float(theta), params


def _gemma_fields(model_type: str, text: dict, where: str) -> tuple[dict, float, dict]:
    """Gemma 2/3's LLMConfig fields (score scale, soft-capping, sliding-window layers, the local rope base), the
    global layers' rope theta and rope parameters."""
    layers = int(text["num_hidden_layers"])
    text = {**_GEMMA_DEFAULTS[model_type], **text}
    types = text.get("layer_types")
    if not types:  # Gemma 2 always alternates (transformers ignores a pattern key there)
        n = _SLIDING_PATTERN[model_type] if model_type == "gemma2" else \
            int(text.get("sliding_window_pattern") or text.get("_sliding_window_pattern") or _SLIDING_PATTERN[model_type])
        types = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != layers:
        raise ConfigError(f"{where}: layer_types {unknown or types!r}: {layers} of sliding_attention or "
                          f"full_attention are supported")
    if text.get("use_bidirectional_attention"):
        raise ConfigError(f"{where}: use_bidirectional_attention: true (an embedding model) is not supported")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    fields = {"query_pre_attn_scalar": float(text.get("query_pre_attn_scalar") or 0.0),
              "attn_logit_softcapping": float(text.get("attn_logit_softcapping") or 0.0),
              "final_logit_softcapping": float(text.get("final_logit_softcapping") or 0.0),
              "sliding_window": int(text.get("sliding_window") or 0) if sliding else 0,
              "sliding_window_layers": sliding if text.get("sliding_window") else ()}
    params = text.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # transformers 5: one rope per layer type
        theta, rope = hf_rope({"rope_parameters": params["full_attention"]})
        local_theta, local = hf_rope({"rope_parameters": params.get("sliding_attention") or {}})
    else:
        theta, rope = hf_rope(text)
        local_theta, local = float(text.get("rope_local_base_freq") or theta), {}
    if model_type == "gemma3_text" and fields["sliding_window_layers"]:
        if (local.get("rope_type") or "default") != "default":
            raise ConfigError(f"{where}: sliding-window layers with rope_type {local.get('rope_type')!r}: only "
                              f"default is supported there")
        fields["rope_local_theta"] = local_theta
    return fields, theta, rope


def hf_llm_fields(hf_dir: str) -> tuple[str, dict, dict]:
    """(model_type, LLMConfig fields, rope dict) read from a checkpoint, checking unsupported features."""
    model_type, text, top = read_hf_config(hf_dir)
    where = os.path.join(hf_dir, "config.json")

    def need(key):
        if key not in text:
            raise ConfigError(f"{where}: {key} is missing")
        return text[key]

    arch = _ARCH_OF[model_type]
    # Gemma's legacy "gelu" means the tanh approximation (transformers maps it the same way).
    gemma = arch in GEMMA_FAMILY
    act = text.get("hidden_activation") or text.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    allowed_acts = ("gelu_pytorch_tanh", "gelu_tanh", "gelu") if gemma else ("silu", "swish")
    if act not in allowed_acts:
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported for {model_type} "
                          f"(supported: {', '.join(allowed_acts)})")
    for key in ("attention_bias", "mlp_bias"):  # llama's flags (Qwen2's q/k/v biases come with its architecture)
        if text.get(key):
            raise ConfigError(f"{where}: {key}: true is not supported (the graphs have no biases there)")
    if text.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window: true is not supported")
    extra: dict = {}
    if model_type in _GEMMA_DEFAULTS:
        extra, theta, rope = _gemma_fields(model_type, text, where)
    else:
        theta, rope = hf_rope(text)
    rope_inv_freq(2, theta, rope)  # rejects unsupported rope types early
    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    tied = top.get("tie_word_embeddings", text.get("tie_word_embeddings", _TIED_DEFAULT[model_type]))
    fields = {
        "num_layers": int(need("num_hidden_layers")),
        "hidden_dim": hidden,
        "num_heads": heads,
        "num_kv_heads": int(text.get("num_key_value_heads") or heads),
        "head_dim": int(text.get("head_dim") or hidden // heads),
        "vocab_size": int(need("vocab_size")),
        "intermediate_size": int(need("intermediate_size")),
        "rope_theta": theta,
        "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(tied),
        "architecture": arch,
        **extra,
    }
    section = rope.get("mrope_section")
    if model_type == "qwen3_vl":
        if not section:
            raise ConfigError(f"{where}: rope_parameters.mrope_section is missing (Qwen3-VL positions images in 3-D)")
        # transformers always interleaves Qwen3-VL's sections (mrope_interleaved is not read), and so do the graphs
        fields["mrope_section"] = tuple(int(v) for v in section)
    return model_type, fields, rope


def _map_name(name: str, model_type: str) -> str | None:
    """Checkpoint tensor name -> CausalLM parameter name; None = not part of the text decoder."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if model_type == "qwen3_vl":
        for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head.")):
            if name.startswith(old):
                return new + name[len(old):]
        if name.startswith(("model.visual.", "visual.")):
            return None
    return name


def load_hf_weights(lm: CausalLM, hf_dir: str, model_type: str) -> None:
    """Copy the checkpoint's text-decoder tensors into ``lm`` (float32), with strict name matching; Phi-3's
    fused q/k/v and gate/up tensors are split by rows into their projections (:data:`_FUSED`)."""
    params = dict(lm.named_parameters(remove_duplicate=False))
    tied = lm.llm.tie_word_embeddings
    expected = {n for n in params if not (tied and n == "lm_head.weight")}
    wanted: dict[str, str] = {}   # checkpoint key -> parameter name
    fused: dict[str, tuple[str, ...]] = {}  # checkpoint key -> the parameters its rows go to
    unexpected: list[str] = []
    files = tensor_files(hf_dir)
    for key in files:
        name = _map_name(key, model_type)
        if name is None or (tied and name == "lm_head.weight"):
            continue
        suffix = next((s for s in _FUSED if model_type == "phi3" and name.endswith("." + s)), None)
        if suffix:
            parts = tuple(name[:-len(suffix)] + p for p in _FUSED[suffix])
            if set(parts) <= expected:
                fused[key] = parts
                continue
        if name in expected:
            wanted[key] = name
        else:
            unexpected.append(key)
    split = {p for parts in fused.values() for p in parts}
    copy_checked(params, files, wanted, expected - split, unexpected, hf_dir,
                 f"a {lm.llm.architecture} decoder of this config", "build the config with config_from_hf")
    with torch.no_grad():
        for key, tensor in read_tensors({key: files[key] for key in fused}):
            targets = [params[p] for p in fused[key]]
            rows = [t.shape[0] for t in targets]
            if tuple(tensor.shape) != (sum(rows), *targets[0].shape[1:]):
                raise ConfigError(f"{hf_dir}: {key} has shape {list(tensor.shape)}, the graphs expect "
                                  f"{[sum(rows), *targets[0].shape[1:]]} (build the config with config_from_hf)")
            for target, part in zip(targets, torch.split(tensor, rows)):
                target.copy_(part)
