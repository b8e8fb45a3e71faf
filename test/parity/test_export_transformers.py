"""End to end against transformers: checkpoint -> synflux-build --from-hf -> ONNX graphs -> onnxruntime
executor -> runtime, compared token for token with the reference implementation."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

from synflux_ros.core.kv_cache import KVCachePool  # noqa: E402
from synflux_ros.core.config import ConfigError, load_config  # noqa: E402
from synflux_ros.model.backbone import LLMBackbone  # noqa: E402
from synflux_ros.model.tokenizer import HFTokenizer  # noqa: E402
from synflux_ros.runtimes.base import create_executor  # noqa: E402
from synflux_ros.runtimes.vlm import ChatRequest, VLMRuntime  # noqa: E402
from synflux_ros.buildtool import export as build_tool  # noqa: E402
from synflux_ros.graphkit.torch_models import config_from_hf  # noqa: E402
from checkpoints import write_tokenizer  # noqa: E402

pytestmark = pytest.mark.reference

VOCAB = 512
BUCKET = 16  # smallest prefill bucket


def base_yaml(tmp_path, **over) -> str:
    raw = {"name": "parity", "mode": "vlm",
           "vision": {"resolution": [64, 64], "tile_size": [64, 64], "tokens_per_tile": 4},
           "llm": {"num_layers": 1, "hidden_dim": 32, "num_heads": 2, "vocab_size": VOCAB,
                   "prefill_buckets": [BUCKET, 64], "decode_buckets": [64, 128], "max_seq_len": 128},
           "text": {"max_new_tokens": 8}, "session": {"max_sessions": 2}}
    for k, v in over.items():
        raw[k] = {**raw.get(k, {}), **v}
    import yaml
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny random Qwen3 checkpoint (with a tokenizer.json) and its graph set built with --from-hf."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                      vocab_size=VOCAB, max_position_embeddings=256,
                                      tie_word_embeddings=False)).eval()
    ckpt = tmp_path_factory.mktemp("qwen3_ckpt")
    hf.save_pretrained(ckpt)
    write_tokenizer(str(ckpt))
    out = tmp_path_factory.mktemp("qwen3_graphs")
    base = base_yaml(tmp_path_factory.mktemp("cfg"))
    assert build_tool.main(["--config", base, "--out", str(out), "--from-hf", str(ckpt)]) == 0
    return hf, str(ckpt), str(out)


def backbone(graph_dir: str):
    cfg = load_config(os.path.join(graph_dir, "config.yaml"))
    assert cfg.executor.backend == "onnxruntime"
    ex = create_executor(cfg)
    pool = KVCachePool(ex, 1, cfg.llm.kv_shape, cfg.llm.kv_dtype)
    ex.freeze()
    return cfg, LLMBackbone(cfg, ex), pool.tensor(0)


def test_manifest_and_effective_config(qwen3):
    hf, _, out = qwen3
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    cfg = load_config(os.path.join(out, "config.yaml"))
    assert (cfg.llm.hidden_dim, cfg.llm.num_layers, cfg.llm.num_kv_heads, cfg.llm.head_dim) == (64, 2, 2, 16)
    assert manifest["tokenizer"] == "tokenizer.json" and manifest["source"]["weights"].startswith("hf:")
    assert manifest["config_hash"] == cfg.graph_hash()
    names = {g["name"] for g in manifest["graphs"]}
    assert names == {"vision_encoder", "embed_16", "prefill_16", "embed_64", "prefill_64", "decode_64", "decode_128"}
    # weights once: every graph references the shared file; the decoder's tensors are stored a single
    # time although the embed/prefill/decode graphs all use them
    import onnx
    referenced = {}
    for g in manifest["graphs"]:
        model = onnx.load(os.path.join(out, g["file"]), load_external_data=False)
        referenced[g["name"]] = sum(int({e.key: e.value for e in i.external_data}["length"])
                                    for i in model.graph.initializer if i.external_data)
    stored = os.path.getsize(os.path.join(out, "weights.bin"))
    text_bytes = sum(p.numel() for p in hf.parameters()) * 4
    assert stored <= (text_bytes + referenced["vision_encoder"]) * 1.05
    assert sum(referenced.values()) > 3 * (stored - referenced["vision_encoder"])


@pytest.mark.parametrize("prompt_len", [1, BUCKET // 2 + 1, BUCKET, 40])
def test_greedy_32_tokens_equal_transformers_generate(qwen3, prompt_len):
    hf, _, out = qwen3
    cfg, llm, slot = backbone(out)
    ids = np.random.default_rng(prompt_len).integers(0, VOCAB, prompt_len)
    with torch.no_grad():
        ref = hf.generate(torch.from_numpy(ids)[None], do_sample=False, max_new_tokens=32, min_new_tokens=32,
                          attention_mask=torch.ones(1, prompt_len, dtype=torch.long), pad_token_id=0)[0, prompt_len:]
        ref_logits = hf(torch.from_numpy(ids)[None]).logits[0, -1].numpy()
    logits = llm.prefill(slot, 0, llm.embed(ids))
    diff = float(np.abs(logits - ref_logits).max())
    assert diff < 1e-3, f"prefill logits differ by {diff}"
    tokens, pos = [], prompt_len
    for _ in range(32):
        tok = int(np.argmax(logits))
        tokens.append(tok)
        logits = llm.decode(slot, pos, tok)
        pos += 1
    assert tokens == ref.tolist()


def test_decode_logits_match_transformers_at_every_step(qwen3):
    hf, _, out = qwen3
    _, llm, slot = backbone(out)
    ids = np.random.default_rng(7).integers(0, VOCAB, 20)
    llm.prefill(slot, 0, llm.embed(ids[:12]))
    worst = 0.0
    with torch.no_grad():
        for i in range(12, 20):
            ours = llm.decode(slot, i, int(ids[i]))
            ref = hf(torch.from_numpy(ids[: i + 1])[None]).logits[0, -1].numpy()
            worst = max(worst, float(np.abs(ours - ref).max()))
    assert worst < 1e-3


def test_runtime_uses_the_checkpoint_tokenizer_and_reuse_equals_one_prefill(qwen3):
    _, _, out = qwen3
    cfg = load_config(os.path.join(out, "config.yaml"))
    reuse = VLMRuntime(cfg)
    single = VLMRuntime(cfg.with_overrides(session={"reuse_kv_cache": False}))
    assert isinstance(reuse.tokenizer, HFTokenizer)
    turns = ["the robot picks up", "the red block", "and puts it in the bowl"]
    for i, prompt in enumerate(turns):
        a = reuse.chat(ChatRequest("s", prompt, max_new_tokens=6, temperature=0.0))
        b = single.chat(ChatRequest("s", prompt, max_new_tokens=6, temperature=0.0))
        assert a.token_ids == b.token_ids and a.reply == b.reply
        assert (a.cached_tokens > 0) == (i > 0) and b.cached_tokens == 0


def test_rebuild_skips_unchanged_graphs(qwen3, tmp_path, capsys):
    _, ckpt, out = qwen3
    base = base_yaml(tmp_path)
    assert build_tool.main(["--config", base, "--out", out, "--from-hf", ckpt]) == 0
    assert "all graphs up to date" in capsys.readouterr().out
    # one more prefill bucket: only its two graphs are exported, the weights are reused
    size = os.path.getsize(os.path.join(out, "weights.bin"))
    more = base_yaml(tmp_path, llm={"prefill_buckets": [BUCKET, 32, 64]})
    assert build_tool.main(["--config", more, "--out", out, "--from-hf", ckpt]) == 0
    log = capsys.readouterr().out
    assert log.count("exporting") == 2 and "embed_32: exporting" in log and "prefill_32: exporting" in log
    assert log.count("unchanged, skipped") == 7
    assert os.path.getsize(os.path.join(out, "weights.bin")) == size
    _, llm, slot = backbone(out)
    ids = np.arange(30) % VOCAB
    assert np.isfinite(llm.prefill(slot, 0, llm.embed(ids))).all()
    # the bucket dropped again: nothing is exported, its graphs leave the manifest and the directory
    assert build_tool.main(["--config", base_yaml(tmp_path), "--out", out, "--from-hf", ckpt]) == 0
    log = capsys.readouterr().out
    assert "all graphs up to date" in log and "removed prefill_32.onnx" in log and "removed embed_32.onnx" in log
    names = {g["name"] for g in json.loads(open(os.path.join(out, "manifest.json")).read())["graphs"]}
    assert not {"embed_32", "prefill_32"} & names and not os.path.exists(os.path.join(out, "prefill_32.onnx"))
    assert os.path.isfile(os.path.join(out, f"prefill_{BUCKET}.onnx"))


def worst_logit_difference(hf, tmp_path, architecture: str, seed: int) -> tuple[float, np.ndarray, np.ndarray]:
    """Save ``hf``, build its graph set with --from-hf (``llm.architecture`` must come out as ``architecture``)
    and compare prefill (12 tokens) and 8 decode steps with transformers: (worst difference, the ids, the
    reference logits of each step)."""
    hf.save_pretrained(tmp_path / "ckpt")
    write_tokenizer(str(tmp_path / "ckpt"))
    out = tmp_path / "graphs"
    assert build_tool.main(["--config", base_yaml(tmp_path), "--out", str(out), "--from-hf",
                            str(tmp_path / "ckpt")]) == 0
    cfg, llm, slot = backbone(str(out))
    assert cfg.llm.architecture == architecture
    ids = np.random.default_rng(seed).integers(0, VOCAB, 20)
    with torch.no_grad():
        ref = [hf(torch.from_numpy(ids[:i + 1])[None]).logits[0, -1].numpy() for i in range(11, 20)]
    got = [llm.prefill(slot, 0, llm.embed(ids[:12]))] + [llm.decode(slot, i, int(ids[i])) for i in range(12, 20)]
    return max(float(np.abs(g - r).max()) for g, r in zip(got, ref)), ids, np.stack(ref)


def test_qwen2_biased_qkv_logits_match_transformers(tmp_path):
    """Qwen2's q/k/v biases: prefill and decode logits of the built graphs within 1e-4 of transformers'."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB,
                                      max_position_embeddings=256, tie_word_embeddings=False)).eval()
    biases = [p for name, p in hf.named_parameters() if name.endswith("_proj.bias")]
    with torch.no_grad():
        for p in biases:  # zero at init
            p.normal_(0.0, 1.0)
    worst, ids, ref = worst_logit_difference(hf, tmp_path, "qwen2", seed=3)
    assert worst < 1e-4, f"logits differ by {worst}"
    with torch.no_grad():
        for p in biases:
            p.zero_()
        unbiased = hf(torch.from_numpy(ids[:12])[None]).logits[0, -1].numpy()
    assert np.abs(ref[0] - unbiased).max() > 100 * 1e-4  # the biases count


def windowed_model(family: str):
    """A tiny transformers model of a family with a sliding window (128 positions)."""
    import transformers
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256, sliding_window=128)
    if family == "phi3":  # fused qkv_proj and gate_up_proj tensors
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(**common, pad_token_id=0))
    return transformers.MistralForCausalLM(transformers.MistralConfig(**common, head_dim=16))  # Llama's decoder


@pytest.mark.parametrize("family,seed", [("phi3", 4), ("mistral", 5)])
def test_windowed_llama_families_logits_match_transformers(tmp_path, family, seed):
    """Phi-3 (its fused qkv_proj / gate_up_proj tensors split into the projections) and Mistral build as Llama's
    decoder: prefill and decode logits within 1e-4 of transformers'; a sliding window shorter than the context
    is refused, naming it."""
    torch.manual_seed(0)
    worst, _, _ = worst_logit_difference(windowed_model(family).eval(), tmp_path, "llama", seed=seed)
    assert worst < 1e-4, f"logits differ by {worst}"
    longer = base_yaml(tmp_path, llm={"decode_buckets": [64, 256], "max_seq_len": 256})
    with pytest.raises(ConfigError, match=r"sliding_window 128: .*llm.max_seq_len \(256\) must be at most 128"):
        config_from_hf(str(tmp_path / "ckpt"), load_config(longer))


def test_qwen3_vl_image_embeddings_match_transformers(tmp_path):
    from PIL import Image
    from checkpoints import H, W, hf_image_processor, tiny_hf_config
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    hf = Qwen3VLForConditionalGeneration(tiny_hf_config()).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in hf.model.visual.named_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    ckpt = tmp_path / "ckpt"
    hf.save_pretrained(ckpt)
    proc = hf_image_processor(min_pixels=H * W, max_pixels=H * W)
    proc.save_pretrained(ckpt)
    base = base_yaml(tmp_path, vision={"resolution": [H, W], "tile_size": [H, W], "tokens_per_tile": 12,
                                       "architecture": "qwen3_vl"})
    out = tmp_path / "graphs"
    assert build_tool.main(["--config", base, "--out", str(out), "--from-hf", str(ckpt)]) == 0
    from synflux_ros.model.vision import VisionEncoder
    cfg, llm, slot = backbone(str(out))
    image = np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8)
    ours = VisionEncoder(cfg, llm.ex)(image)  # Preprocessor + vision_encoder graph on onnxruntime
    hf_in = proc(images=[Image.fromarray(image)], return_tensors="pt")
    with torch.no_grad():
        ref = hf.model.get_image_features(hf_in["pixel_values"], image_grid_thw=hf_in["image_grid_thw"])
    ref = ref.pooler_output[0].numpy()
    cos = (ours * ref).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(ref, axis=-1))
    assert ours.shape == ref.shape and cos.min() > 0.999, cos.min()
    # the text model of the same checkpoint decodes like transformers (text-only prompt)
    ids = np.random.default_rng(1).integers(0, 240, 9)
    with torch.no_grad():
        ref_tokens = hf.generate(torch.from_numpy(ids)[None], do_sample=False, max_new_tokens=8, min_new_tokens=8,
                                 attention_mask=torch.ones(1, 9, dtype=torch.long), pad_token_id=0)[0, 9:]
    logits = llm.prefill(slot, 0, llm.embed(ids))
    tokens = []
    for i in range(8):
        tokens.append(int(np.argmax(logits)))
        logits = llm.decode(slot, 9 + i, tokens[-1])
    assert tokens == ref_tokens.tolist()


def gemma_model(family: str, **over):
    """A tiny transformers Gemma 2 or Gemma 3 (text) model: 3 layers, sliding-window layers 0 and 2 with a window
    of 6 positions (the 12-token prefill and the decode steps pass it), scores scaled by query_pre_attn_scalar
    24 instead of head_dim 16; Gemma 2 soft-caps scores and logits, Gemma 3 gives its sliding layers their
    own rope base. Weights at 0.1 so that the caps bite."""
    import transformers
    common = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256, sliding_window=6,
                  query_pre_attn_scalar=24, initializer_range=0.1, attn_implementation="eager")
    if family == "gemma2":
        common.update(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
        common.update(over)
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common))
    common.update(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}})
    common.update(over)
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**common))


@pytest.mark.parametrize("family,seed", [("gemma2", 6), ("gemma3", 7)])
def test_gemma2_and_gemma3_logits_match_transformers(tmp_path, family, seed):
    """Gemma 2 and 3: sandwich norms, soft-capped scores and logits (2), q/k norms and a rope base of their own
    for the sliding-window layers (3), sliding-window layers among global ones: prefill and decode logits within
    1e-4 of transformers'; each feature changes the reference's logits, so the comparison sees it."""
    torch.manual_seed(seed)
    hf = gemma_model(family).eval()
    with torch.no_grad():  # norms away from identity (zero at init), so that a (1 + w) slip shows
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    worst, ids, ref = worst_logit_difference(hf, tmp_path, family, seed=seed)
    assert worst < 1e-4, f"{family}: logits differ by {worst}"
    cfg = load_config(str(tmp_path / "graphs" / "config.yaml"))
    assert (cfg.llm.sliding_window, cfg.llm.sliding_window_layers, cfg.llm.query_pre_attn_scalar) == (6, (0, 2), 24)
    if family == "gemma2":
        assert (cfg.llm.attn_logit_softcapping, cfg.llm.final_logit_softcapping) == (2.0, 3.0)
        variants = {"attn cap": dict(attn_logit_softcapping=None), "logit cap": dict(final_logit_softcapping=None)}
    else:
        assert cfg.llm.rope_local_theta == 10.0 and cfg.llm.rope_theta == 1_000_000.0
        variants = {"local rope": dict(rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}})}
    variants["window"] = dict(sliding_window=64)
    variants["score scale"] = dict(query_pre_attn_scalar=16)
    for what, over in variants.items():
        other = gemma_model(family, **over).eval()
        other.load_state_dict(hf.state_dict())
        with torch.no_grad():
            got = other(torch.from_numpy(ids[:12])[None]).logits[0, -1].numpy()
        assert np.abs(got - ref[0]).max() > 100 * 1e-4, f"{family}: the {what} does not change the logits"
