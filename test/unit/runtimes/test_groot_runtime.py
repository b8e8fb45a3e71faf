"""GR00T N1.7's DiT head (``action.expert_type: dit``): its config checks, its graph set, and the runtime's three
stages on the mock executor and on onnxruntime with random weights (exported by synflux-build). Parity with
LeRobot's GR00T is test/parity/test_groot_lerobot.py."""
from __future__ import annotations

import numpy as np
import pytest

from synflux_ros.core.config import ConfigError, from_dict
from synflux_ros.core.contract import graph_set
from synflux_ros.model.heads.rtc import RTCGuidance
from synflux_ros.runtimes.groot import GrootVLARuntime, formalized
from synflux_ros.runtimes.vla import VLARuntime

JOINTS = ["a", "b", "c", "d", "e", "f", "g"]


def raw(**action) -> dict:
    act = dict(head_type="flow_matching", expert_type="dit", action_dim=12, action_horizon=8, num_denoise_steps=4,
               dit_layers=4, dit_heads=2, dit_head_dim=16, dit_hidden_dim=48, vl_layers=2, vl_heads=4, vl_head_dim=16,
               embodiment=3, num_embodiments=4, state_dim=10, state_joints=JOINTS, output_dim=6,
               state_norm={"mode": "bounds", "low": [-1.0] * 7, "high": [2.0] * 7, "clip": True},
               action_norm={"mode": "bounds", "low": [-3.0] * 6, "high": [1.0] * 6, "clip": True})
    act.update(action)
    return {"name": "groot-tiny", "mode": "vla",
            "vision": dict(resolution=[64, 64], tile_size=[64, 64], tokens_per_tile=4, architecture="qwen3_vl",
                           patch_size=16, hidden_dim=32, num_layers=3, num_heads=2, intermediate_size=64,
                           spatial_merge_size=2, deepstack_layers=[0, 1], cameras=["base", "wrist"]),
            "llm": dict(num_layers=2, hidden_dim=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=512,
                        prefill_buckets=[32, 64], decode_buckets=[64], max_seq_len=64, architecture="qwen3",
                        mrope_section=[4, 2, 2], tie_word_embeddings=True),
            "action": act, "executor": {"backend": "mock"}}


@pytest.mark.parametrize("change, error", [
    ({"dit_layers": 3}, "come in pairs"),
    ({"dit_heads": 0}, "dit_heads: expert_type dit needs it"),
    ({"embodiment": 4}, "not below num_embodiments"),
    ({"state_dim": 0, "state_joints": [], "state_norm": None}, "state_dim: expert_type dit"),
    ({"vl_heads": 3}, "must equal llm.hidden_dim"),
    ({"time_conditioning": "adarms"}, "not of expert_type dit"),
    ({"relative_mask": [True] * 6}, "relative_mask: not supported"),
])
def test_bad_dit_configs_are_refused_naming_the_field(change, error):
    with pytest.raises(ConfigError, match=error):
        from_dict(raw(**change))


def test_dit_fields_belong_to_dit_only():
    r = raw(expert_type="llm")
    with pytest.raises(ConfigError, match="for expert_type dit only"):
        from_dict(r)


def test_graph_set_has_no_cache_and_one_context_per_bucket():
    cfg = from_dict(raw())
    metas = {m.name: m for m in graph_set(cfg)}
    assert sorted(metas) == sorted(["vision_encoder"] + [f"{k}_{p}" for p in (32, 64)
                                                        for k in ("embed", "features", "vl_context", "dit")])
    assert not any(s.name == "past_kv" for m in metas.values() for s in m.inputs)
    ctx = metas["vl_context_64"]
    assert ctx.output("cross_kv").shape == (2, 2, 2, 64, 16)  # 2 cross blocks, k and v, 2 heads, rows, head width
    assert metas["dit_32"].input("noisy_actions").shape == (1, 8, 12)


def test_formalized_instruction():
    assert formalized("Pick up the RED cube, then place it!  x_y") == "pick up the red cube then place it  x_y"


def frame(seed: int, cfg):
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 256, (48, 80, 3), dtype=np.uint8) for _ in range(2)]
    state = np.zeros(cfg.action.state_dim, np.float32)
    state[:7] = rng.uniform(-1.0, 2.0, 7)
    return images, state


def test_mock_runtime_runs_the_three_stages_and_integrates_from_noise_to_data():
    cfg = from_dict(raw())
    rt = VLARuntime(cfg)
    assert isinstance(rt, GrootVLARuntime) and rt.kv_pool is None
    images, state = frame(0, cfg)
    a = rt.infer(images, seq=1, state=state)
    assert a.actions.shape == (8, 6) and np.isfinite(a.actions).all()
    # the mock's velocity is the exact one of the straight path from the noise (t = 0) to its target (t = 1):
    # integrated over t = 0, 1/4, 2/4, 3/4 it lands on the target whatever the noise
    b = rt.infer(images, seq=2, state=state)
    np.testing.assert_allclose(a.raw_actions, b.raw_actions, atol=1e-5)
    assert not np.allclose(rt.head.initial_noise(1), rt.head.initial_noise(2))
    # the state, an image and the instruction each move the result
    other = rt.infer(images, seq=1, state=state + np.r_[np.full(7, 0.3, np.float32), np.zeros(3, np.float32)])
    assert np.abs(other.raw_actions - a.raw_actions).max() > 1e-3
    moved = rt.infer([images[0], 255 - images[1]], seq=1, state=state)
    assert np.abs(moved.raw_actions - a.raw_actions).max() > 1e-3
    rt.set_instruction("stack the blocks")
    assert np.abs(rt.infer(images, seq=1, state=state).raw_actions - a.raw_actions).max() > 1e-3


def test_prompt_is_the_chat_of_every_camera_then_the_instruction():
    cfg = from_dict(raw())
    rt = VLARuntime(cfg)
    tokens = rt.prompt_tokens("Pick it UP!")
    rows = [t for t in tokens if not isinstance(t, int)]
    assert rows == [(c, r) for c in range(2) for r in range(4)]
    text = rt.tokenizer.decode([t for t in tokens if isinstance(t, int)])
    assert text == "user\npick it up\n"  # formalized; the special tokens are no bytes: they decode to nothing
    with pytest.raises(ValueError, match="over the largest prefill bucket"):
        rt.set_instruction("x" * 60)
    assert rt.instruction == "pick up the object"  # the refused one left the last in force


def test_missing_state_is_refused():
    cfg = from_dict(raw())
    rt = VLARuntime(cfg)
    images, _ = frame(1, cfg)
    with pytest.raises(ValueError, match="robot state"):
        rt.infer(images, seq=1)


def test_real_time_chunking_is_groots_own():
    """The leftover's last rows replace the first rows of the noise; the rows executed before the chunk arrives
    keep it exactly, the ramped ones move less than free ones; a wider leftover is refused, and the vjp flavour
    on a graph set built without its graphs."""
    cfg = from_dict(raw())
    rt = VLARuntime(cfg)
    images, state = frame(3, cfg)
    plain = rt.infer(images, seq=4, state=state).raw_actions
    prev = np.random.default_rng(0).uniform(-1, 1, (6, 6)).astype(np.float32)
    guided = rt.infer(images, seq=4, state=state, rtc=RTCGuidance(prev, 2, 5)).raw_actions
    np.testing.assert_array_equal(guided[:2, :6], prev[1:3])  # overlap 5: the leftover's last 5 rows, 2 frozen
    np.testing.assert_array_equal(guided[:2, 6:], 0.0)  # its padded dimensions
    np.testing.assert_allclose(guided[5:], plain[5:], atol=1e-6)  # the mock's rows after the overlap: free
    start, scale = rt.head.rtc_start(rt.head.initial_noise(1), RTCGuidance(prev, 2, 5))
    assert scale[0, :, 0].tolist()[:2] == [0.0, 0.0] and scale[0, 5:, 0].tolist() == [1.0] * 3
    assert 0.0 < scale[0, 2, 0] < scale[0, 3, 0] < scale[0, 4, 0] < 1.0
    # trailing all-zero rows are padding: the same as the leftover without them
    padded = np.r_[prev, np.zeros((2, 6), np.float32)]
    again = rt.infer(images, seq=4, state=state, rtc=RTCGuidance(padded, 2, 5)).raw_actions
    np.testing.assert_array_equal(again, guided)
    with pytest.raises(ValueError, match="build it with execution.mode: rtc and execution.rtc.guidance: vjp"):
        rt.infer(images, seq=4, state=state, rtc=RTCGuidance(prev, 2, 5, flavour="vjp"))
    with pytest.raises(ValueError, match="13 dimensions"):
        rt.infer(images, seq=4, state=state, rtc=RTCGuidance(np.ones((3, 13), np.float32), 1, 3))


def vjp_config():
    r = raw()
    r["execution"] = {"mode": "rtc", "rtc": {"guidance": "vjp"}}
    return from_dict(r)


def test_the_vjp_guidance_adds_one_dit_vjp_graph_per_bucket():
    metas = {m.name: m for m in graph_set(vjp_config())}
    assert {"dit_vjp_32", "dit_vjp_64", "dit_32", "dit_64"} <= set(metas)
    vjp = metas["dit_vjp_32"]
    assert [t.name for t in vjp.inputs] == [t.name for t in metas["dit_32"].inputs] + ["target", "weights",
                                                                                         "flow_time"]
    assert [t.name for t in vjp.outputs] == ["velocity", "correction"]
    assert not any("vjp" in name for name in (m.name for m in graph_set(from_dict(raw()))))


def test_the_vjp_guidance_adds_the_weighted_correction_at_each_step():
    """Each Euler step runs dit_vjp_<p> at GR00T time τ = k / N with the padded leftover and the prefix weights,
    and adds dt (v + w(τ) c), w the guidance weight at π0 time 1 - τ (recorded on the mock)."""
    from synflux_ros.model.heads.rtc import guidance_weight, prefix_weights
    cfg = vjp_config()
    rt = VLARuntime(cfg)
    images, state = frame(3, cfg)
    calls, run = [], rt.head.ex.run

    def recording(graph, feeds):
        out = run(graph, feeds)
        calls.append((graph, {k: np.array(v) for k, v in feeds.items()}, {k: np.array(v) for k, v in out.items()}))
        return out
    rt.head.ex.run = recording
    prev = np.random.default_rng(0).uniform(-1, 1, (6, 10)).astype(np.float32)
    guided = rt.infer(images, seq=4, state=state, rtc=RTCGuidance(prev, 2, 5, flavour="vjp",
                                                                  max_guidance_weight=4.0)).raw_actions
    steps = [c for c in calls if c[0].startswith("dit")]
    assert len(steps) == 4 and len({c[0] for c in steps}) == 1 and steps[0][0] in ("dit_vjp_32", "dit_vjp_64")
    x = rt.head.initial_noise(rt.head.seed + 4)
    for k, (_, feeds, out) in enumerate(steps):
        np.testing.assert_array_equal(feeds["noisy_actions"], x)
        assert feeds["flow_time"].tolist() == [k / 4] and feeds["timestep"].tolist() == [k * 250]
        np.testing.assert_array_equal(feeds["target"][0, :6, :10], prev)
        np.testing.assert_array_equal(feeds["target"][0, 6:], 0.0)
        np.testing.assert_array_equal(feeds["weights"][0, :, 0], prefix_weights(2, 5, 8, "linear"))
        w = np.float32(guidance_weight(1.0 - k / 4, 4.0))
        x = x + np.float32(0.25) * (out["velocity"] + w * out["correction"])
    np.testing.assert_allclose(guided, x[0][:len(guided)], atol=1e-6)


def test_onnxruntime_graphs_run_with_random_weights(tmp_path):
    pytest.importorskip("torch", reason="synflux-build needs torch")
    pytest.importorskip("onnxruntime")
    from synflux_ros.buildtool.export import build
    cfg = from_dict(raw())
    build(cfg, str(tmp_path))
    rt = VLARuntime(cfg.with_overrides(executor={"backend": "onnxruntime", "graph_dir": str(tmp_path)}))
    images, state = frame(2, cfg)
    a, b = rt.infer(images, seq=1, state=state), rt.infer(images, seq=1, state=state)
    np.testing.assert_array_equal(a.actions, b.actions)
    c = rt.infer(images, seq=2, state=state)  # other noise, other chunk (a real DiT, unlike the mock)
    assert np.abs(c.raw_actions - a.raw_actions).max() > 1e-4
    # the clipped min-max un-normalisation: model outputs beyond [-1, 1] publish at the bounds
    assert (a.actions >= -3.0 - 1e-6).all() and (a.actions <= 1.0 + 1e-6).all()

    # One vision call takes both cameras, and each camera's features depend on its own image only.
    vision = {m.name: m for m in graph_set(cfg)}["vision_encoder"]
    assert vision.input("pixel_values").shape == (2, 3, 64, 64)
    assert vision.output("vision_embeds").shape == (8, 64) and vision.output("deepstack_embeds").shape == (2, 8, 64)
    (a_img, b_img), _ = frame(3, cfg)
    (c_img, _), _ = frame(4, cfg)
    ab, cb, ac = (rt.vision.features_of(pair) for pair in ([a_img, b_img], [c_img, b_img], [a_img, c_img]))
    for one, other in ((ab[0], ac[0]), (ab[1], cb[1])):
        np.testing.assert_allclose(one.embeds, other.embeds, rtol=0, atol=1e-5)
        np.testing.assert_allclose(one.deepstack, other.deepstack, rtol=0, atol=1e-5)
        assert one.embeds.shape == (4, 64) and one.deepstack.shape == (2, 4, 64)
    assert np.abs(ab[0].embeds - cb[0].embeds).max() > 1e-3  # another image, other features


@pytest.mark.parametrize("bad", [0, 1])
def test_a_bad_image_of_either_camera_is_refused_and_the_next_frame_runs(bad):
    """The cameras of one vision call are resized side by side; a bad one's error reaches the caller."""
    from synflux_ros.model.image import ImageError
    rt = VLARuntime(from_dict(raw()))
    assert rt.vision.per_call == 2
    images, state = frame(7, rt.cfg)
    broken = list(images)
    broken[bad] = images[bad].astype(np.float32)
    with pytest.raises(ImageError, match="expected dtype uint8, got float32"):
        rt.vision.features_of(broken)
    with pytest.raises(ValueError, match="takes 2 images per call, got 1 images"):
        rt.vision.features_of(images[:1])
    assert rt.infer(images, seq=1, state=state).actions.shape == (8, 6)


def test_output_horizon_publishes_the_first_steps():
    """LeRobot publishes GR00T's first chunk_size steps of its horizon: action.output_horizon."""
    full = VLARuntime(from_dict(raw()))
    cut = VLARuntime(from_dict(raw(output_horizon=5)))
    images, state = frame(6, full.cfg)
    a, b = full.infer(images, seq=2, state=state), cut.infer(images, seq=2, state=state)
    assert cut.horizon == 5 and b.actions.shape == (5, 6) and b.raw_actions.shape == (5, 12)
    np.testing.assert_array_equal(b.actions, a.actions[:5])
    with pytest.raises(ConfigError, match="output_horizon: 9 exceeds action_horizon 8"):
        from_dict(raw(output_horizon=9))
