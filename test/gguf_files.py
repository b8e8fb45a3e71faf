"""Tiny GGUF files written here (gguf.GGUFWriter) with the quantization types llama.cpp uses, a config for
them, and transformers' own reading of a file as the reference."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS, EOS = 0, 2  # <|endoftext|>, <|im_end|>
# Uses bos_token and eos_token, so the special tokens of the GGUF must come through to render it.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LAYERS, HIDDEN, FF = 2, 64, 256  # FF = 256: one K-quant block per row of ffn_down
SHAPES = {"llama": dict(heads=4, kv_heads=2, head_dim=16),
          # transformers' GGUF loader ignores qwen3.attention.key_length (Qwen3Config's head_dim, 128, stays)
          "qwen3": dict(heads=2, kv_heads=1, head_dim=128),
          # transformers takes query_pre_attn_scalar 256 (its default) where llama.cpp takes head_dim: equal at 256;
          # Gemma 3's first global layer is its sixth
          "gemma2": dict(heads=2, kv_heads=1, head_dim=256),
          "gemma3": dict(heads=2, kv_heads=1, head_dim=256, layers=6)}
WINDOW = 8  # Gemma's sliding window: the 24-token comparisons pass it
# GGUF holds no soft-caps transformers reads: it takes Gemma 2's defaults, which real files hold too
GEMMA2_CAPS = (50.0, 30.0)
# One tensor type per weight, every supported family at least once (the rest F32).
LLAMA_TYPES = {"token_embd.weight": Q.Q8_0, "output.weight": Q.F16,
               "blk.0.attn_q.weight": Q.Q4_0, "blk.0.attn_k.weight": Q.Q4_1, "blk.0.attn_v.weight": Q.BF16,
               "blk.0.attn_output.weight": Q.Q8_0, "blk.0.ffn_gate.weight": Q.Q5_1, "blk.0.ffn_up.weight": Q.F16,
               "blk.0.ffn_down.weight": Q.Q4_K, "blk.1.attn_q.weight": Q.Q8_0, "blk.1.attn_k.weight": Q.Q4_0,
               "blk.1.attn_v.weight": Q.Q4_1, "blk.1.ffn_gate.weight": Q.Q4_0, "blk.1.ffn_up.weight": Q.Q5_0,
               "blk.1.ffn_down.weight": Q.Q6_K}
QWEN3_TYPES = {"token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q4_1, "blk.1.ffn_down.weight": Q.Q6_K}
QWEN2_TYPES = {"token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q4_0, "blk.0.attn_k.weight": Q.Q4_1,
               "blk.1.ffn_up.weight": Q.Q8_0}
GEMMA_TYPES = {"token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q4_0, "blk.1.attn_v.weight": Q.Q4_1,
               "blk.1.ffn_down.weight": Q.Q6_K, "blk.0.ffn_gate.weight": Q.F16}
PHI3_TYPES = {"token_embd.weight": Q.Q8_0, "blk.0.attn_qkv.weight": Q.Q4_0, "blk.1.ffn_up.weight": Q.Q4_1,
              "blk.1.ffn_down.weight": Q.Q6_K}
PROMPT = "What is the capital of France? Answer in one sentence."


def vocabulary():
    """A small byte-level BPE vocabulary (tokens by id, merges, token types) as llama.cpp stores one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the robot picks up the red block and puts it in the bowl",
                             "what is the capital of france? paris is."] * 50, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]  # 3: CONTROL, 1: NORMAL
    return tokens, merges, types


def k_quant_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random Q4_K / Q6_K blocks (gguf has no quantizer for them) with small fp16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.full((rows, cols // block, 1), 2e-4, np.float16).view(np.uint8)
    if qtype == Q.Q4_K:  # d, dmin, scales[12], qs[128]
        raw[..., 0:2], raw[..., 2:4] = scale, scale
    else:  # Q6_K: ql[128], qh[64], scales[16], d
        raw[..., -2:] = np.full((rows, cols // block, 1), 1e-3, np.float16).view(np.uint8)
    return raw.reshape(rows, cols // block * size)


def write_gguf(path, arch: str = "llama", seed: int = 0, types: dict | None = None, template: str = TEMPLATE,
               tied: bool = False, extra_tensors: dict | None = None, theta: float = 10000.0,
               layers: int | None = None) -> str:
    rng = np.random.default_rng(seed)
    s = SHAPES.get(arch, SHAPES["llama"])
    heads, kv, hd = s["heads"], s["kv_heads"], s["head_dim"]
    layers = layers or s.get("layers", LAYERS)
    tokens, merges, token_types = vocabulary()
    if arch in ("gemma2", "gemma3"):  # transformers' Gemma tokenizer adds a <mask> token where the vocabulary has none
        tokens, token_types = tokens + ["<mask>"], token_types + [3]
    vocab = len(tokens)
    types = LLAMA_TYPES if types is None else types
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-6)
    if arch in ("llama", "phi3"):
        w.add_rope_dimension_count(hd)
    else:
        w.add_key_length(hd)
        w.add_value_length(hd)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(WINDOW)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(GEMMA2_CAPS[0])
        w.add_final_logit_softcapping(GEMMA2_CAPS[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_add_bos_token(False)
    if arch == "phi3":  # else transformers' Phi3Config keeps its pad_token_id 32000, beyond this vocabulary
        w.add_pad_token_id(EOS)
    if template:
        w.add_chat_template(template)
    shapes = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,)}
    if not tied:
        shapes["output.weight"] = (vocab, HIDDEN)
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                       f"blk.{i}.attn_q.weight": (heads * hd, HIDDEN), f"blk.{i}.attn_k.weight": (kv * hd, HIDDEN),
                       f"blk.{i}.attn_v.weight": (kv * hd, HIDDEN), f"blk.{i}.attn_output.weight": (HIDDEN, heads * hd),
                       f"blk.{i}.ffn_gate.weight": (FF, HIDDEN), f"blk.{i}.ffn_up.weight": (FF, HIDDEN),
                       f"blk.{i}.ffn_down.weight": (HIDDEN, FF)})
        if arch in ("qwen3", "gemma3"):
            shapes.update({f"blk.{i}.attn_q_norm.weight": (hd,), f"blk.{i}.attn_k_norm.weight": (hd,)})
        if arch in ("gemma2", "gemma3"):  # sandwich norms
            shapes.update({f"blk.{i}.post_attention_norm.weight": (HIDDEN,), f"blk.{i}.post_ffw_norm.weight": (HIDDEN,)})
        if arch == "phi3":  # fused q/k/v and gate/up
            for k in ("attn_q", "attn_k", "attn_v", "ffn_gate"):
                del shapes[f"blk.{i}.{k}.weight"]
            shapes.update({f"blk.{i}.attn_qkv.weight": ((heads + 2 * kv) * hd, HIDDEN),
                           f"blk.{i}.ffn_up.weight": (2 * FF, HIDDEN)})
        if arch == "qwen2":  # biased q/k/v projections
            shapes.update({f"blk.{i}.attn_q.bias": (heads * hd,), f"blk.{i}.attn_k.bias": (kv * hd,),
                           f"blk.{i}.attn_v.bias": (kv * hd,)})
    for name, shape in shapes.items():
        qtype = types.get(name, Q.F32)
        data = (rng.standard_normal(shape) * (0.1 if len(shape) == 2 else 0.2) + (len(shape) == 1)).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, data)
        elif qtype == Q.F16:
            w.add_tensor(name, data.astype(np.float16))
        elif qtype in (Q.Q4_K, Q.Q6_K):
            w.add_tensor(name, k_quant_blocks(*shape, qtype, rng), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config")


def base_yaml(tmp_path, prefill=(16,), decode=(64,), max_seq=64, name="gguf", vision=False) -> str:
    """config/vlm_demo.yaml (its llm dimensions are replaced by the GGUF's) with these buckets; without its
    vision section unless ``vision``."""
    import yaml
    with open(os.path.join(CONFIG, "vlm_demo.yaml"), encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    raw["name"] = name
    if not vision:
        raw["vision"] = None
    raw["llm"].update(prefill_buckets=list(prefill), decode_buckets=list(decode), max_seq_len=max_seq)
    raw["session"]["max_sessions"] = 1
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def hf_reference(path: str):
    """transformers' own reading of the GGUF file: the model (float32) and the tokenizer."""
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF model
    d, name = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
    return model, tok
