"""Qwen3-VL vision encoder (build/torch_models/qwen3_vl_vision.py): equality with Hugging Face's
vision tower on a tiny random checkpoint, the graph contract, ONNX export, config errors."""
import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from synflux_ros.core.config import ConfigError, from_dict  # noqa: E402
from synflux_ros.core.contract import graph_set  # noqa: E402
from synflux_ros.model.image import Preprocessor
from synflux_ros.core.config import PreprocessSpec  # noqa: E402
from synflux_ros.buildtool import export as build_tool  # noqa: E402
from synflux_ros.graphkit.torch_models.qwen3_vl_vision import (  # noqa: E402
    Qwen3VLVision,
    build_qwen3_vl_vision,
    load_hf_vision_state_dict,
    vision_config_from_hf,
    vision_geometry,
)

from checkpoints import LLM_HIDDEN, MEAN, STD, H, W, hf_image_processor, tiny_hf_config  # noqa: E402


def base_config(resolution=(H, W), tile=None, vision=None, hidden=LLM_HIDDEN):
    return from_dict(dict(
        name="tiny-qwen3-vl", mode="vlm",
        vision=dict(resolution=list(resolution), tile_size=list(tile or resolution), tokens_per_tile=1,
                    architecture="qwen3_vl", **(vision or {})),
        llm=dict(num_layers=1, hidden_dim=hidden, num_heads=2, vocab_size=256, prefill_buckets=[16],
                 decode_buckets=[64], max_seq_len=64)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Qwen3-VL saved with save_pretrained, every vision tensor randomised (non-trivial norms,
    biases and a 7x7 position table resampled to the 8x6 grid) so a misplaced weight shows."""
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(tiny_hf_config()).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.model.visual.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif "pos_embed" in name:
                p.copy_(noise)
            elif p.dim() == 2:
                p.copy_(noise / p.shape[1] ** 0.5)
            else:
                p.copy_(0.05 * noise)
    path = tmp_path_factory.mktemp("qwen3_vl_tiny")
    model.save_pretrained(path)
    hf_image_processor(min_pixels=H * W, max_pixels=H * W).save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module")
def image():
    return np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8)


def per_token_cosine(a, b):
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


# ------------------------------------------------------------------ config from the checkpoint

def test_vision_config_from_hf(checkpoint):
    path, _ = checkpoint
    cfg = vision_config_from_hf(path, base_config())
    vis = cfg.vision
    assert (vis.architecture, vis.patch_size, vis.hidden_dim, vis.num_layers, vis.num_heads) == \
        ("qwen3_vl", 16, 32, 3, 2)
    assert (vis.intermediate_size, vis.spatial_merge_size, vis.deepstack_layers) == (64, 2, (0, 2))
    assert vis.tokens_per_tile == 12 and vis.num_tokens == 12
    assert vis.mean == pytest.approx(MEAN) and vis.std == pytest.approx(STD)  # from preprocessor_config.json
    assert vision_geometry(cfg) == (8, 6, 12)


# ------------------------------------------------------------------ equality with Hugging Face

def test_matches_hf_image_features(checkpoint, image):
    """Our Preprocessor + module against HF's image processor + Qwen3VLModel.get_image_features."""
    from PIL import Image

    path, hf_model = checkpoint
    cfg = vision_config_from_hf(path, base_config())
    ours_model = build_qwen3_vl_vision(cfg, hf_dir=path)

    # HF input: min/max pixels pin the size, so the image (already at the fixed size) is not resized.
    proc = hf_image_processor(min_pixels=H * W, max_pixels=H * W)
    hf_in = proc(images=[Image.fromarray(image)], return_tensors="pt")
    assert hf_in["image_grid_thw"].tolist() == [[1, H // 16, W // 16]]
    no_resize = proc(images=[Image.fromarray(image)], return_tensors="pt", do_resize=False)
    assert torch.equal(hf_in["pixel_values"], no_resize["pixel_values"])

    with torch.no_grad():
        hf_out = hf_model.model.get_image_features(hf_in["pixel_values"], image_grid_thw=hf_in["image_grid_thw"])
        pre = Preprocessor(PreprocessSpec(resolution=cfg.vision.resolution, tile_size=cfg.vision.tile_size,
                                          mean=cfg.vision.mean, std=cfg.vision.std))
        pixel_values = torch.from_numpy(pre(image))
        assert tuple(pixel_values.shape) == (1, 3, H, W)
        graph_out = ours_model(pixel_values)  # what the vision_encoder graph returns
        embeds = graph_out[0]
        embeds_ds, deepstack = ours_model.forward_with_deepstack(pixel_values)
    assert len(graph_out) == 2 and torch.equal(graph_out[1], torch.stack(deepstack))

    ref = hf_out.pooler_output[0]
    assert embeds.shape == ref.shape == (12, LLM_HIDDEN)
    assert torch.equal(embeds, embeds_ds)
    cos = per_token_cosine(embeds, ref)
    diff = (embeds - ref).abs().max().item()
    print(f"\nvision_embeds: min cosine {cos.min().item():.9f}, max abs diff {diff:.2e} "
          f"(max |ref| {ref.abs().max().item():.2f})")
    assert cos.min().item() > 0.999
    assert diff < 1e-4

    assert len(deepstack) == len(hf_out.deepstack_features) == 2
    for k, (ours_k, hf_k) in enumerate(zip(deepstack, hf_out.deepstack_features)):
        ref_k = hf_k[0]
        cos_k = per_token_cosine(ours_k, ref_k)
        diff_k = (ours_k - ref_k).abs().max().item()
        print(f"deepstack[{k}]: min cosine {cos_k.min().item():.9f}, max abs diff {diff_k:.2e}")
        assert ours_k.shape == ref_k.shape and cos_k.min().item() > 0.999 and diff_k < 1e-4


def test_matches_hf_visual_with_processor_pixels(checkpoint, image):
    """Same tower fed HF's own patchified pixels: isolates the model from the preprocessing."""
    from PIL import Image

    path, hf_model = checkpoint
    ours_model = build_qwen3_vl_vision(vision_config_from_hf(path, base_config()), hf_dir=path)
    hf_in = hf_image_processor().__call__(images=[Image.fromarray(image)], return_tensors="pt", do_resize=False)
    # Undo HF's patchify (merge-block order, temporal copies) to get the [1, 3, H, W] tile back.
    gh, gw = H // 16, W // 16
    tile = (hf_in["pixel_values"].reshape(gh // 2, gw // 2, 2, 2, 3, 2, 16, 16)[:, :, :, :, :, 0]
            .permute(4, 0, 2, 5, 1, 3, 6).reshape(1, 3, H, W))
    with torch.no_grad():
        ref = hf_model.model.visual(hf_in["pixel_values"], grid_thw=hf_in["image_grid_thw"]).pooler_output
        embeds = ours_model(tile)[0]
    assert per_token_cosine(embeds, ref).min().item() > 0.999
    assert (embeds - ref).abs().max().item() < 1e-4


# ------------------------------------------------------------------ graph contract, random weights

def random_config(resolution=(64, 64), tile=None, tokens=4):
    cfg = base_config(resolution, tile, vision=dict(patch_size=16, hidden_dim=32, num_layers=2, num_heads=4,
                                                    intermediate_size=48, spatial_merge_size=2,
                                                    deepstack_layers=[1]))
    return cfg.with_overrides(vision={"tokens_per_tile": tokens})


def test_random_module_meets_the_graph_contract():
    cfg = random_config()
    meta = next(g for g in graph_set(cfg) if g.name == "vision_encoder")
    model = build_qwen3_vl_vision(cfg, seed=0)
    assert isinstance(model, Qwen3VLVision) and not model.training
    x = torch.randn(*meta.inputs[0].shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(x)
        again = build_qwen3_vl_vision(cfg, seed=0)(x)[0]
        other = build_qwen3_vl_vision(cfg, seed=1)(x)[0]
        embeds, deepstack = model.forward_with_deepstack(x)
    assert isinstance(out, tuple) and len(out) == 2  # vision_embeds, deepstack_embeds
    assert tuple(out[0].shape) == meta.outputs[0].shape == (4, LLM_HIDDEN)
    assert tuple(out[1].shape) == meta.outputs[1].shape == (1, 4, LLM_HIDDEN)
    assert out[0].dtype == torch.float32 and torch.isfinite(out[0]).all()
    assert torch.equal(out[0], again) and not torch.allclose(out[0], other)
    assert torch.equal(embeds, out[0]) and len(deepstack) == 1 and deepstack[0].shape == (4, LLM_HIDDEN)


def test_tiles_are_encoded_independently():
    cfg = random_config(resolution=(64, 128), tile=(64, 64))
    model = build_qwen3_vl_vision(cfg, seed=3)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        both = model(x)[0]
        first, second = model(x[:1])[0], model(x[1:])[0]
    assert both.shape == (8, LLM_HIDDEN)
    torch.testing.assert_close(both, torch.cat([first, second]), rtol=1e-5, atol=1e-6)


def test_onnx_export_matches_onnxruntime(tmp_path):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    import onnx

    cfg = random_config()
    meta = next(g for g in graph_set(cfg) if g.name == "vision_encoder")
    model = build_qwen3_vl_vision(cfg, seed=0)
    with torch.no_grad():   # larger weights than the default init so the comparison is not trivial
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    build_tool.export_graph(model, meta, str(tmp_path))   # as synflux-build exports it
    path = str(tmp_path / "vision_encoder.onnx")
    graph = onnx.load(path)
    onnx.checker.check_model(graph)
    assert {op.domain for op in graph.graph.node} <= {"", "ai.onnx"}
    assert [i.name for i in graph.graph.input] == ["pixel_values"]
    assert [o.name for o in graph.graph.output] == ["vision_embeds", "deepstack_embeds"]
    # The resampled position table and the time-summed patch kernel are folded into constants.
    assert "pos_embed.weight" not in {i.name for i in graph.graph.initializer}
    assert sum(n.op_type == "Conv" for n in graph.graph.node) == 1
    assert not any(n.op_type == "ReduceSum" for n in graph.graph.node)
    x = np.random.default_rng(1).standard_normal((1, 3, 64, 64)).astype(np.float32)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got, got_ds = sess.run(["vision_embeds", "deepstack_embeds"], {"pixel_values": x})
    with torch.no_grad():
        want, want_ds = (t.numpy() for t in model(torch.from_numpy(x)))
    assert got.shape == want.shape == (4, LLM_HIDDEN) and got_ds.shape == want_ds.shape == (1, 4, LLM_HIDDEN)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_ds, want_ds, rtol=1e-4, atol=1e-5)


def test_shipped_qwen3_config_geometry():
    from pathlib import Path

    from synflux_ros.core.config import load_config
    cfg = load_config(str(Path(__file__).resolve().parents[3] / "config" / "vlm_qwen3.yaml"))
    assert vision_geometry(cfg) == (28, 28, cfg.vision.tokens_per_tile)


# ------------------------------------------------------------------ errors

def test_resolution_not_a_multiple_of_the_merged_patch(checkpoint):
    path, _ = checkpoint
    bad = base_config(resolution=(80, 96))
    with pytest.raises(ConfigError, match=r"resolution 80x96 is not a multiple of .*= 32"):
        vision_config_from_hf(path, bad)
    with pytest.raises(ConfigError, match="not a multiple"):
        build_qwen3_vl_vision(bad.with_overrides(vision=dict(
            patch_size=16, hidden_dim=32, num_layers=3, num_heads=2, intermediate_size=64,
            deepstack_layers=[0, 2])), hf_dir=path)


def test_wrong_tokens_per_tile_and_mismatched_checkpoint(checkpoint):
    path, _ = checkpoint
    with pytest.raises(ConfigError, match="tokens_per_tile: 5"):
        build_qwen3_vl_vision(random_config(tokens=5))
    with pytest.raises(ConfigError, match=r"vision\.num_layers: 2 in the config, 3 in the checkpoint"):
        build_qwen3_vl_vision(random_config(resolution=(128, 96), tokens=12), hf_dir=path)
    with pytest.raises(ConfigError, match="out_hidden_size 48 differs from llm.hidden_dim 64"):
        vision_config_from_hf(path, base_config(hidden=64))


def test_strict_weight_names(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = checkpoint
    state = load_hf_vision_state_dict(path)
    assert "blocks.0.attn.qkv.weight" in state and "deepstack_merger_list.1.linear_fc2.bias" in state
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    files = [f for f in os.listdir(broken) if f.endswith(".safetensors")]
    assert files and not os.path.exists(broken / "model.safetensors.index.json")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(broken / f)))
        os.remove(broken / f)
    tensors.pop("model.visual.blocks.1.mlp.linear_fc1.weight")
    tensors["model.visual.blocks.9.norm1.weight"] = torch.ones(32)
    save_file(tensors, str(broken / "model.safetensors"))
    cfg = vision_config_from_hf(str(broken), base_config())
    with pytest.raises(ConfigError, match=r"missing: blocks\.1\.mlp\.linear_fc1\.weight.*"
                                          r"unexpected: blocks\.9\.norm1\.weight"):
        build_qwen3_vl_vision(cfg, hf_dir=str(broken))


def test_not_a_qwen3_vl_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}}))
    with pytest.raises(ConfigError, match="not a Qwen3-VL model"):
        vision_config_from_hf(str(tmp_path), base_config())
    with pytest.raises(ConfigError, match="not found"):
        vision_config_from_hf(str(tmp_path / "nowhere"), base_config())
