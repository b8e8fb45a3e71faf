"""torch graph modules of synflux-build: graph contracts, KV-cache semantics, parity with transformers, ONNX.

Needs torch and transformers (the build extra); skipped without them.
"""
import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from synflux_ros.backends.mock.executor import MockExecutor  # noqa: E402
from synflux_ros.core.kv_cache import KVCachePool  # noqa: E402
from synflux_ros.core.config import ConfigError, load_config  # noqa: E402
from synflux_ros.core.contract import graph_set, select_bucket
from synflux_ros.model.normalization import PI05_PROMPT  # noqa: E402
from synflux_ros.model.time_embedding import time_embedding  # noqa: E402
from synflux_ros.model.backbone import LLMBackbone  # noqa: E402
from synflux_ros.buildtool import export as build_tool  # noqa: E402
from synflux_ros.graphset import reader as graphset  # noqa: E402
from synflux_ros.graphkit.torch_models import build_graph_modules, config_from_hf  # noqa: E402

torch.set_num_threads(2)

CONFIG_DIR = Path(__file__).resolve().parents[3] / "config"
TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16, "int64": torch.int64}
TINY_LLM = {"num_layers": 2, "hidden_dim": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
            "vocab_size": 512, "intermediate_size": 128}


def cfg_of(name, **overrides):
    cfg = load_config(str(CONFIG_DIR / f"{name}.yaml"))
    return cfg.with_overrides(**overrides) if overrides else cfg


def tiny_openvla():
    """OpenVLA-like: Llama decoder, autoregressive action tokens, fp16 KV cache, pooled ViT patches."""
    return cfg_of("vla_openvla",
                  llm={**TINY_LLM, "num_kv_heads": 4, "prefill_buckets": [32], "decode_buckets": [48, 64],
                       "max_seq_len": 64},
                  vision={"tokens_per_tile": 16, "hidden_dim": 32, "num_layers": 1, "num_heads": 2,
                          "intermediate_size": 64},
                  action={"token_vocab_size": 500})


def tiny_gemma():
    """pi0-like: Gemma decoder with one KV head, tied embeddings, fp16 KV, narrower action expert."""
    return cfg_of("vla_pi0",
                  llm={**TINY_LLM, "num_kv_heads": 1, "prefill_buckets": [32, 48], "decode_buckets": [48, 64],
                       "max_seq_len": 64},
                  vision={"tokens_per_tile": 16, "hidden_dim": 32, "num_layers": 1, "num_heads": 2,
                          "intermediate_size": 64},
                  action={"action_dim": 6, "action_horizon": 8, "expert_hidden_dim": 32,
                          "expert_intermediate_size": 48})


def tiny_pi05():
    """pi0.5-like: tiny_gemma's model with an adaptive-RMSNorm expert and the state in the prompt (no state
    token)."""
    return tiny_gemma().with_overrides(
        action={"time_conditioning": "adarms", "state_input": "prompt", "state_dim": 8,
                "state_joints": [f"j{i}" for i in range(8)]},
        tokenizer={"prompt_template": PI05_PROMPT})


def tiny_gemma3():
    """Gemma 3 text: sandwich and q/k norms, a sliding window of 5 on layer 0 with its own rope base, Gemma 2's
    soft-caps too (the graphs take both features together), fp16 KV."""
    return cfg_of("vlm_demo", vision=None,
                  llm={**TINY_LLM, "architecture": "gemma3", "kv_dtype": "float16", "prefill_buckets": [16, 32],
                       "decode_buckets": [48, 64], "max_seq_len": 64, "sliding_window": 5,
                       "sliding_window_layers": [0], "rope_local_theta": 100.0, "query_pre_attn_scalar": 24.0,
                       "attn_logit_softcapping": 1.5, "final_logit_softcapping": 4.0})


def small_qwen3(**llm):
    return cfg_of("vlm_demo", llm={"prefill_buckets": [16, 64], "decode_buckets": [64, 128], "max_seq_len": 128,
                                   **llm})


def text_base(**llm):
    """small_qwen3 without its (vit) vision section: the base for reading any text checkpoint, Qwen3-VL's too
    (whose multimodal positions need its own vision tower)."""
    return small_qwen3(**llm).with_overrides(vision=None)


CONTRACT_CONFIGS = {
    "vla_demo_orin": lambda: cfg_of("vla_demo_orin"),
    "vlm_demo": lambda: cfg_of("vlm_demo"),
    "openvla_tiny": tiny_openvla,
    "gemma_tiny": tiny_gemma,
}


def example_inputs(meta, rng, cache_position=3, num_tokens=5, prefix_len=7, timestep=0.4):
    """Valid inputs of a graph with random tensors and the given positions / counts."""
    out = []
    for spec in meta.inputs:
        if spec.name == "num_tokens":
            a = np.array([min(num_tokens, meta.inputs[0].shape[1])], np.int64)
        elif spec.name == "cache_position":
            a = np.array([cache_position], np.int64)
        elif spec.name == "prefix_len":
            a = np.array([prefix_len], np.int64)
        elif spec.name == "time_embedding":
            a = time_embedding(timestep, spec.shape[-1])
        elif spec.dtype == "int64":
            a = rng.integers(0, 256, spec.shape).astype(np.int64)
        else:
            a = rng.standard_normal(spec.shape).astype(spec.dtype)
        out.append(torch.from_numpy(a))
    return out


def onnx_feeds(meta, inputs):
    """Contract inputs -> the exported graph's inputs (views of past_kv taken as numpy views)."""
    feeds = {}
    for t, x in zip(meta.inputs, inputs):
        lead = graphset.VIEW_INPUTS.get(t.name, 0)
        if lead:
            for idx in graphset.view_indices(t.shape, lead):
                feeds[graphset.view_name(t.name, idx)] = x.numpy()[idx]
        else:
            feeds[t.name] = x.numpy()
    return feeds


def call(module, inputs):
    with torch.no_grad():
        return module(*inputs)


# ==================================================================================== 1. contracts

@pytest.mark.parametrize("name", sorted(CONTRACT_CONFIGS))
def test_every_graph_matches_its_contract(name):
    cfg = CONTRACT_CONFIGS[name]()
    gm = build_graph_modules(cfg, seed=0)
    metas = graph_set(cfg)
    assert set(gm.modules) == {m.name for m in metas} and gm.missing == []
    assert gm.source == {"weights": "random", "seed": 0} and gm.tokenizer_path is None
    rng = np.random.default_rng(0)
    for meta in metas:
        inputs = example_inputs(meta, rng)
        outs = call(gm.modules[meta.name], inputs)
        assert isinstance(outs, tuple) and len(outs) == len(meta.outputs), meta.name
        if any(t.name == "past_kv" for t in meta.inputs):
            # the exported form: the cache as per-layer (keys, values) views gives the same results
            i = [t.name for t in meta.inputs].index("past_kv")
            views = [(layer[0], layer[1]) for layer in inputs[i]]
            for a, b in zip(call(gm.modules[meta.name], inputs[:i] + [views] + inputs[i + 1:]), outs):
                torch.testing.assert_close(a, b, atol=0, rtol=0)
        for spec, t in zip(meta.outputs, outs):
            assert tuple(t.shape) == spec.shape and t.dtype == TORCH_DTYPE[spec.dtype], (meta.name, spec.name)
            assert torch.isfinite(t.float()).all(), (meta.name, spec.name)


def test_modules_share_one_backbone_and_one_expert():
    cfg = cfg_of("vla_demo_orin")
    gm = build_graph_modules(cfg)
    lms = {id(m.lm) for n, m in gm.modules.items() if n.startswith(("embed_", "prefill_", "decode_"))}
    experts = {id(m.expert) for n, m in gm.modules.items() if n.startswith("action_expert_")}
    assert len(lms) == 1 and len(experts) == 1
    w = gm.modules["embed_96"].lm.model.layers[1].self_attn.q_proj.weight
    assert gm.modules["prefill_160"].lm.model.layers[1].self_attn.q_proj.weight is w
    assert not any(n.startswith("decode_") for n in gm.modules)  # a flow-matching VLA reads no logits
    names = set(gm.modules["prefill_96"].lm.state_dict())
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_norm.weight", "model.layers.1.mlp.down_proj.weight",
            "model.norm.weight", "lm_head.weight"} <= names


def test_random_weights_are_seeded_and_tied_when_configured():
    cfg = tiny_gemma()
    a, b, c = build_graph_modules(cfg, seed=3), build_graph_modules(cfg, seed=3), build_graph_modules(cfg, seed=4)
    lm_a, lm_b, lm_c = (g.modules["prefill_48"].lm for g in (a, b, c))
    for (name, pa), pb in zip(lm_a.named_parameters(), lm_b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(lm_a.model.embed_tokens.weight, lm_c.model.embed_tokens.weight)
    assert lm_a.lm_head.weight is lm_a.model.embed_tokens.weight
    assert float(lm_a.model.norm.weight.abs().max()) == 0.0  # gemma norms scale by (1 + w)
    assert abs(float(lm_a.model.layers[0].mlp.up_proj.weight.std()) - 0.02) < 0.002


def test_qwen3_vl_vision_tower_is_built_by_its_own_builder():
    from synflux_ros.graphkit.torch_models.qwen3_vl_vision import Qwen3VLVision, build_qwen3_vl_vision
    # 224 x 224 tiles of 16-pixel patches merged 2 x 2: 7 x 7 tokens
    cfg = cfg_of("vlm_demo", vision={"architecture": "qwen3_vl", "patch_size": 16, "spatial_merge_size": 2,
                                     "num_layers": 1, "num_heads": 2, "tokens_per_tile": 49})
    gm = build_graph_modules(cfg, seed=2)
    assert gm.missing == [] and set(gm.modules) == {m.name for m in graph_set(cfg)}
    tower = gm.modules["vision_encoder"]
    assert isinstance(tower, Qwen3VLVision) and not tower.training
    alone = build_qwen3_vl_vision(cfg, seed=2)
    for (name, a), b in zip(tower.state_dict().items(), alone.state_dict().values()):
        assert torch.equal(a, b), name


def test_vit_geometry_errors_are_config_errors():
    cfg = cfg_of("vlm_demo", vision={"patch_size": 16, "tokens_per_tile": 15})
    with pytest.raises(ConfigError, match="tokens_per_tile"):
        build_graph_modules(cfg)


# ==================================================================================== 2. cache semantics

def sharpen(lm, factor=4.0):
    """Scale the random projection weights so attention is far from uniform (stronger tests)."""
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if p.dim() == 2 and "embed_tokens" not in name and "rope_" not in name:  # not the rotary tables
                p.mul_(factor)


@pytest.fixture(scope="module", params=["float32", "float16"])
def qwen3_small(request):
    cfg = small_qwen3(kv_dtype=request.param)
    gm = build_graph_modules(cfg, seed=1)
    sharpen(gm.modules["decode_64"].lm)
    return cfg, gm


def _prefill(gm, cfg, past, embeds, start, bucket):
    n = embeds.shape[0]
    x = torch.zeros(1, bucket, cfg.llm.hidden_dim)
    x[0, :n] = embeds
    logits, new = call(gm.modules[f"prefill_{bucket}"],
                       (x, torch.tensor([n]), torch.tensor([start]), past))
    assert torch.all(new[:, :, :, n:] == 0)
    past[:, :, :, start:start + n] = new[:, :, :, :n]
    return logits[0]


def _decode(gm, cfg, past, token, pos, bucket=None):
    d = bucket or select_bucket(cfg.llm.decode_buckets, pos + 1)
    logits, new = call(gm.modules[f"decode_{d}"], (torch.tensor([[token]]), torch.tensor([pos]), past))
    past[:, :, :, pos:pos + 1] = new
    return logits[0]


def test_prefill_at_once_equals_chunks_equals_decode_steps(qwen3_small):
    cfg, gm = qwen3_small
    dtype = TORCH_DTYPE[cfg.llm.kv_dtype]
    # fp32 arithmetic differs slightly between call shapes; with an fp16 cache such a difference can move
    # a K/V entry by one fp16 step, hence the looser bound there
    tol = {"atol": 1e-5 if dtype == torch.float32 else 1e-4, "rtol": 0}
    kv_tol = {"atol": 1e-5, "rtol": 0 if dtype == torch.float32 else 1e-3}
    ids = torch.tensor([(i * 37 + 11) % 500 for i in range(40)])
    emb = call(gm.modules["embed_64"], (torch.nn.functional.pad(ids, (0, 24))[None],))[0][0, :40]
    # garbage in the unused cache positions must not matter: the graphs mask by position
    noise = torch.randn(cfg.llm.kv_shape).to(dtype)

    once = noise.clone()
    full = _prefill(gm, cfg, once, emb, 0, 64)

    chunked = noise.clone()
    _prefill(gm, cfg, chunked, emb[:13], 0, 16)
    two = _prefill(gm, cfg, chunked, emb[13:], 13, 64)
    torch.testing.assert_close(two, full, **tol)
    torch.testing.assert_close(chunked[:, :, :, :40].float(), once[:, :, :, :40].float(), **kv_tol)

    stepped = noise.clone()
    logits = _prefill(gm, cfg, stepped, emb[:13], 0, 16)
    for pos in range(13, 40):
        # each step's logits are those of a prefill of the same prefix
        ref = _prefill(gm, cfg, noise.clone(), emb[:pos], 0, 64)
        torch.testing.assert_close(logits, ref, **tol)
        logits = _decode(gm, cfg, stepped, int(ids[pos]), pos)
    torch.testing.assert_close(logits, full, **tol)
    torch.testing.assert_close(stepped[:, :, :, :40].float(), once[:, :, :, :40].float(), **kv_tol)

    # a larger decode span gives the same result; the tests are sensitive to the prefix
    a = _decode(gm, cfg, once.clone(), 7, 40, bucket=64)
    b = _decode(gm, cfg, once.clone(), 7, 40, bucket=128)
    torch.testing.assert_close(a, b, **tol)
    other = once.clone()
    other[:, :, :, 5] = 0
    assert float((_decode(gm, cfg, other, 7, 40) - a).abs().max()) > 1e-2


def test_action_expert_reads_only_the_prefix():
    cfg = cfg_of("vla_demo_orin")
    gm = build_graph_modules(cfg, seed=2)
    sharpen(gm.modules["action_expert_160"].expert)
    past = torch.randn(cfg.llm.kv_shape)
    x = torch.randn(1, cfg.action.action_horizon, cfg.action.action_dim)

    def v(graph, kv, plen=100, t=0.7):
        return call(gm.modules[graph], (x, torch.tensor([t]), torch.tensor([plen]), kv))[0]

    base = v("action_expert_160", past)
    changed_tail = past.clone()
    changed_tail[:, :, :, 100:] = torch.randn_like(changed_tail[:, :, :, 100:])
    torch.testing.assert_close(v("action_expert_160", changed_tail), base, atol=1e-5, rtol=0)
    torch.testing.assert_close(v("action_expert_256", past), base, atol=1e-5, rtol=0)
    changed_prefix = past.clone()
    changed_prefix[:, :, :, 50] = 0
    assert float((v("action_expert_160", changed_prefix) - base).abs().max()) > 1e-3
    assert float((v("action_expert_160", past, t=0.2) - base).abs().max()) > 1e-3
    assert float((v("action_expert_160", past, plen=99) - base).abs().max()) > 1e-3
    # action tokens attend to each other: changing one action changes the velocity of the others
    x2 = x.clone()
    x2[0, 0] += 1.0
    out2 = call(gm.modules["action_expert_160"], (x2, torch.tensor([0.7]), torch.tensor([100]), past))[0]
    assert float((out2[0, 1:] - base[0, 1:]).abs().max()) > 1e-4


# ==================================================================================== 3. parity with transformers

class TorchExecutor(MockExecutor):
    """The mock's host memory, but graphs run as the torch modules (to drive the real LLMBackbone)."""

    name = "torch"

    def __init__(self, graphs, modules):
        super().__init__(graphs)
        self.modules = modules

    def _load_graph(self, path, meta):
        return self.modules[meta.name]

    def _execute(self, handle, device_inputs, device_outputs, meta):
        ins = [torch.from_numpy(self._view(device_inputs[s.name], s.shape, s.dtype).copy()) for s in meta.inputs]
        outs = call(handle, ins)
        for spec, t in zip(meta.outputs, outs):
            self._view(device_outputs[spec.name], spec.shape, spec.dtype)[...] = t.numpy()


HF_VARIANTS = {
    "qwen3": ("qwen3", {}),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}),
    "llama3_rope_sharded": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "gemma": ("gemma", {"tie_word_embeddings": False}),  # tied + scaled embeddings just echo at this size
    "qwen3_vl": ("qwen3_vl", {}),
}


def make_hf_model(kind, extra):
    from transformers import (GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)
    dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, vocab_size=512, initializer_range=0.1)
    torch.manual_seed(0)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**dims, **extra))
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**dims, **extra))
    if kind == "gemma":
        return GemmaForCausalLM(GemmaConfig(**dims, **extra))
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    text = {**dims, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                        "mrope_interleaved": True}}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0])
    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=508, video_token_id=509,
        vision_start_token_id=510, vision_end_token_id=511))


@pytest.fixture(scope="module", params=sorted(HF_VARIANTS))
def hf_checkpoint(request, tmp_path_factory):
    kind, extra = HF_VARIANTS[request.param]
    model = make_hf_model(kind, extra).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    path = tmp_path_factory.mktemp(request.param)
    shard = {"max_shard_size": "100KB"} if "sharded" in request.param else {}
    model.save_pretrained(str(path), **shard)
    (path / "tokenizer.json").write_text("{}")
    return request.param, model, str(path)


def test_greedy_decoding_matches_transformers(hf_checkpoint):
    variant, model, path = hf_checkpoint
    if "sharded" in variant:
        assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    cfg = config_from_hf(path, text_base())
    assert cfg.llm.prefill_buckets == (16, 64) and cfg.llm.max_seq_len == 128
    gm = build_graph_modules(cfg, hf_dir=path)
    assert gm.tokenizer_path == os.path.join(path, "tokenizer.json")
    assert gm.source["weights"] == "hf" and gm.source["model_type"] == HF_VARIANTS[variant][0]
    ex = TorchExecutor(graph_set(cfg), gm.modules).load()
    pool = KVCachePool(ex, 1, cfg.llm.kv_shape, cfg.llm.kv_dtype)
    ex.freeze()
    bb = LLMBackbone(cfg, ex)
    slot = pool.tensor(0)
    worst = 0.0
    # 1 token, mid-bucket, a full bucket, the larger bucket, and two chunks (64 + 6)
    for n in (1, 10, 16, 40, 70):
        prompt = [(i * 37 + 11) % 500 for i in range(n)]
        logits = bb.prefill(slot, 0, bb.embed(prompt))
        with torch.no_grad():
            ref_logits = model(torch.tensor([prompt])).logits[0, -1].numpy()
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32)[0, n:].tolist()
        worst = max(worst, float(np.abs(logits - ref_logits).max()))
        tokens = []
        for pos in range(n, n + 32):
            tokens.append(int(np.argmax(logits)))
            if pos < n + 31:
                logits = bb.decode(slot, pos, tokens[-1])
        assert tokens == ref, (variant, n)
        assert len(set(tokens)) > 2  # a model that does not just repeat itself
    assert worst < 1e-4, worst


def test_config_from_hf_reads_dimensions(hf_checkpoint):
    variant, model, path = hf_checkpoint
    cfg = config_from_hf(path, text_base(kv_dtype="float16"))
    text = model.config.get_text_config()
    assert (cfg.llm.num_layers, cfg.llm.hidden_dim, cfg.llm.num_heads, cfg.llm.num_kv_heads, cfg.llm.head_dim,
            cfg.llm.intermediate_size, cfg.llm.vocab_size) == (2, 64, 4, 2, 16, 128, 512)
    assert cfg.llm.kv_dtype == "float16" and cfg.llm.decode_buckets == (64, 128)
    assert cfg.llm.tie_word_embeddings == bool(model.config.tie_word_embeddings)
    assert cfg.llm.architecture == {"qwen3": "qwen3", "llama": "llama", "gemma": "gemma",
                                    "qwen3_vl": "qwen3"}[HF_VARIANTS[variant][0]]
    assert cfg.llm.rope_theta == float(text.rope_parameters["rope_theta"])
    vl = HF_VARIANTS[variant][0] == "qwen3_vl"
    assert cfg.llm.mrope_section == (tuple(text.rope_parameters["mrope_section"]) if vl else ())


def _write_config(path, **fields):
    path.mkdir(parents=True, exist_ok=True)
    base = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512,
            "rope_theta": 1e6, "rms_norm_eps": 1e-6}
    (path / "config.json").write_text(json.dumps({**base, **fields}))
    return str(path)


def test_checkpoint_errors(tmp_path):
    base = small_qwen3()
    with pytest.raises(ConfigError, match="model_type 'falcon' is not supported"):
        config_from_hf(_write_config(tmp_path / "a", model_type="falcon"), base)
    with pytest.raises(ConfigError, match="attention_bias"):
        config_from_hf(_write_config(tmp_path / "b", attention_bias=True), base)
    with pytest.raises(ConfigError, match="rope_type 'yarn'"):
        config_from_hf(_write_config(tmp_path / "c", rope_scaling={"rope_type": "yarn", "factor": 4.0}), base)
    with pytest.raises(ConfigError, match="no config.json"):
        config_from_hf(str(tmp_path), base)
    # transformers 4 layout: rope_theta at top level
    d = _write_config(tmp_path / "d")
    assert config_from_hf(d, base).llm.rope_theta == 1e6
    # dimensions that differ from the checkpoint, and checkpoints whose tensors do not match by name
    with pytest.raises(ConfigError, match="use config_from_hf"):
        build_graph_modules(base.with_overrides(llm={"hidden_dim": 32, "head_dim": 8}), hf_dir=d)
    with pytest.raises(ConfigError, match="no safetensors"):
        build_graph_modules(config_from_hf(d, base), hf_dir=d)
    from safetensors.torch import save_file
    cfg = config_from_hf(d, base)
    good = build_graph_modules(cfg).modules["decode_64"].lm.state_dict()
    bad = {k: v.contiguous() for k, v in good.items() if k != "model.layers.1.self_attn.k_norm.weight"}
    bad["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(bad, os.path.join(d, "model.safetensors"))
    with pytest.raises(ConfigError, match=r"missing \['model.layers.1.self_attn.k_norm.weight'\].*unexpected"):
        build_graph_modules(cfg, hf_dir=d)


# ==================================================================================== 4. ONNX round trip

ONNX_CONFIGS = {"vla_demo_orin": lambda: cfg_of("vla_demo_orin"), "gemma_tiny": tiny_gemma,
                "openvla_tiny": tiny_openvla, "gemma3_tiny": tiny_gemma3, "pi05_tiny": tiny_pi05}
STANDARD_OPS = {"Add", "And", "Cast", "Clip", "Concat", "Constant", "ConstantOfShape", "Conv", "Cos", "Div", "Equal",
                "Erf", "Expand", "Gather", "Gemm", "Greater", "Identity", "LayerNormalization", "Less", "MatMul", "Mul",
                "Neg", "Not", "Pow",
                "ReduceMean", "Reshape", "Sigmoid", "Sin", "Slice", "Softmax", "Sqrt", "Sub", "Tanh",
                "Transpose", "Unsqueeze", "Where"}


@pytest.mark.parametrize("name", sorted(ONNX_CONFIGS))
def test_onnx_export_round_trip(name, tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    cfg = ONNX_CONFIGS[name]()
    gm = build_graph_modules(cfg, seed=5)
    rng = np.random.default_rng(1)
    for meta in graph_set(cfg):
        module = gm.modules[meta.name]
        # exported as synflux-build does (traced with its example values), run with others
        model = build_tool.export_graph(module, meta, str(tmp_path))
        names = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
        assert names == [n for n, _, _ in build_tool.onnx_inputs(meta)]
        if any(t.name == "past_kv" for t in meta.inputs):
            # the cache comes as one input per layer and K/V: nothing slices it inside the graph
            assert "past_kv" not in names and f"past_kv.{cfg.llm.num_layers - 1}.1" in names
        onnx.checker.check_model(model)
        ops = {(n.domain, n.op_type) for n in model.graph.node}
        assert all(d in ("", "ai.onnx") for d, _ in ops) and {o for _, o in ops} <= STANDARD_OPS, (meta.name, ops)
        weights = {i.name for i in model.graph.initializer if len(i.dims) == 2}
        matmuls = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]
        if meta.kind in ("decode", "action_expert"):
            # fused projections: per block one QKV and one gate/up product, plus O and down, all plain
            # MatMuls against [in, out] weights (plus the head in the decoder; the expert's small input
            # and output layers keep their biased Linear)
            gemms = [n for n in model.graph.node if n.op_type == "Gemm"]
            blocks = 4 * cfg.llm.num_layers
            if meta.kind == "decode":
                assert (len(matmuls), len(gemms)) == (blocks + 1, 0), (meta.name, len(matmuls), len(gemms))
            elif cfg.action.time_conditioning == "adarms":
                # plus pi0.5's time MLP and the dense layer of each adaptive norm (two a block, the final one)
                assert len(matmuls) == blocks + 2 + 2 * cfg.llm.num_layers + 1, (meta.name, len(matmuls))
            else:
                assert len(matmuls) == blocks, (meta.name, len(matmuls))
        if meta.kind == "prefill" and not any(m.kind == "decode" for m in graph_set(cfg)):
            # a backbone that only prefills (flow matching) keeps Q, K, V, gate and up apart: no product is
            # split; its last layer only gives the cache its keys and values
            assert len(matmuls) == 7 * (cfg.llm.num_layers - 1) + 2, (meta.name, len(matmuls))
            assert not any(n.op_type in ("Slice", "Split") and n.input[0] in {m.output[0] for m in matmuls}
                           for n in model.graph.node), meta.name
        if cfg.llm.tie_word_embeddings and meta.kind == "decode":
            # the lookup reads the [V, H] embedding, the head one [H, V] table: one copy of each
            v, h = cfg.llm.vocab_size, cfg.llm.hidden_dim
            big = sorted(list(i.dims) for i in model.graph.initializer if v in i.dims)
            assert big == [[h, v], [v, h]], big
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        for cp, n in ((5, 3), (17, 9)):
            inputs = example_inputs(meta, rng, cache_position=cp, num_tokens=n, prefix_len=cp + n, timestep=0.3)
            got = sess.run(None, onnx_feeds(meta, inputs))
            ref = call(module, inputs)
            for spec, g, r in zip(meta.outputs, got, ref):
                assert g.shape == spec.shape and g.dtype == np.dtype(spec.dtype), (meta.name, spec.name)
                # fp16 outputs (new_kv) may differ by one fp16 step where the fp32 value sits on a rounding edge
                rtol = 2e-3 if spec.dtype == "float16" else 0
                np.testing.assert_allclose(g.astype(np.float32), r.float().numpy(), atol=1e-4, rtol=rtol,
                                           err_msg=f"{name}/{meta.name}/{spec.name}")


def test_tanh_gelu_runs_as_one_fused_kernel_in_onnxruntime(tmp_path):
    """Gemma's MLPs and the SigLIP-style tower use the tanh GELU: the exported graphs spell it as ONNX Runtime's
    optimiser fuses it (``decoder.gelu_tanh``), so every MLP runs one FastGelu kernel and no Tanh is left; the
    graphs themselves stay standard ops and compute torch's GELU (the round trip above)."""
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    import onnx
    cfg = tiny_gemma()
    gm = build_graph_modules(cfg, seed=5)
    # (the flow-matching prefix returns only the cache: its last layer's MLP is not exported)
    mlps = {"vision_encoder": cfg.vision.num_layers, "prefill_32": cfg.llm.num_layers - 1,
            "action_expert_48": cfg.llm.num_layers}
    metas = {m.name: m for m in graph_set(cfg)}
    for name, count in mlps.items():
        model = build_tool.export_graph(gm.modules[name], metas[name], str(tmp_path))
        assert not any(n.domain not in ("", "ai.onnx") for n in model.graph.node)
        so = ort.SessionOptions()
        so.optimized_model_filepath = str(tmp_path / f"{name}.opt.onnx")
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        ops = [n.op_type for n in onnx.load(so.optimized_model_filepath, load_external_data=False).graph.node]
        assert (ops.count("FastGelu"), ops.count("Tanh")) == (count, 0), (name, sorted(set(ops)))
