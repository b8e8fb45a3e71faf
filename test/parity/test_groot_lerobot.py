"""GR00T N1.7 through synflux-build -> vla_node (onnxruntime, fp32) equals LeRobot 0.6.1's GR00T N1.7 on the same
checkpoint.

A small GR00T N1.7 with random weights is built and saved by LeRobot 0.6.1 itself
(``test/reference/lerobot_groot.py make-checkpoint``, in ``.venv-lerobot06``): a Qwen3-VL backbone cut at its
select_layer with DeepStack and multimodal rope, the VL self-attention, a DiT alternating cross-attention to the
text and image rows with self-attention, per-embodiment encoders (embodiment ``new_embodiment``, id 10 of 32),
two cameras of 240x320, min-max statistics of state and actions. ``synflux-build --from-hf`` imports it with the
base model and backbone directories it names; vla_node serves it over DDS with both cameras and a joint state per
frame. For each published chunk LeRobot computes ``GrootPolicy.predict_action_chunk`` and its postprocessor on
the same images, state, instruction and initial noise (vla_node's: ``default_rng(action.seed + frame_seq)``); the
actions must agree to 1e-4. The prompt ids and rotary positions are compared with those LeRobot's processor
makes, and the intermediate tensors (backbone features, the denoising steps' velocities) with LeRobot's.
"""
from __future__ import annotations

import numpy as np
import pytest
import yaml

pytest.importorskip("torch", reason="synflux-build needs torch (make test installs it)")
pytest.importorskip("onnxruntime")

from synflux_ros.buildtool import export as build_tool  # noqa: E402
from synflux_ros.core.config import load_config  # noqa: E402
from synflux_ros.runtimes.vla import Frame, VLARuntime  # noqa: E402
from synflux_ros.tools.harness import chunk_for_frame  # noqa: E402

import pi0_reference  # noqa: E402
from pi0_reference import LEROBOT_VENVS, ROOT, publish_cameras, serve_cameras  # noqa: E402

INSTRUCTION = "Pick up the red cube, then place it in the bowl!"
TOLERANCE = 1e-4
CAMERAS = ("base", "wrist")
JOINTS = [f"joint_{i}" for i in range(7)]
HEIGHT, WIDTH = 240, 320  # the checkpoint's cameras
SCRIPT = ROOT / "test" / "reference" / "lerobot_groot.py"

pytestmark = pytest.mark.reference


def reference(*args: str) -> dict:
    if not LEROBOT_VENVS["lerobot061"][0].exists():
        pytest.skip(f"LeRobot 0.6.1's venv is missing ({LEROBOT_VENVS['lerobot061'][1]})")
    return pi0_reference.reference(*args, lerobot="lerobot061", script=SCRIPT, timeout=900)


def base_config(path) -> str:
    """The config the import starts from: the joint names (not in a LeRobot checkpoint), the image size the
    model reads (GR00T's image_target_size), the buckets, the executor."""
    raw = {
        "name": "groot-small", "mode": "vla",
        "vision": {"resolution": [256, 256], "tile_size": [256, 256], "tokens_per_tile": 64,
                   "architecture": "qwen3_vl"},
        "llm": {"num_layers": 1, "hidden_dim": 8, "num_heads": 1, "vocab_size": 512, "prefill_buckets": [160, 192],
                "decode_buckets": [192], "max_seq_len": 192},
        "action": {"head_type": "flow_matching", "action_dim": 1, "action_horizon": 1, "state_dim": 7,
                   "state_joints": JOINTS},
        "executor": {"backend": "onnxruntime"},
    }
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh)
    return str(path)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("groot")
    ckpt = tmp / "checkpoint"
    # a chunk of 12 of the model's 16 steps: LeRobot publishes the first 12 (action.output_horizon)
    reference("make-checkpoint", "--out", str(ckpt), "--seed", "7", "--options", '{"chunk_size": 12}')
    out = tmp / "graphs"
    assert build_tool.main(["--config", base_config(tmp / "base.yaml"), "--out", str(out), "--from-hf", str(ckpt),
                            "--backend", "onnxruntime"]) == 0
    cfg = load_config(str(out / "config.yaml"))
    act = cfg.action
    assert (act.expert_type, act.embodiment, act.state_dim, act.output_dim) == ("dit", 10, 24, 6)
    assert (act.action_horizon, act.published_horizon) == (16, 12)
    assert cfg.vision.cameras == CAMERAS and act.state_norm.clip and act.action_norm.clip
    return dict(tmp=tmp, ckpt=ckpt, out=out, cfg=cfg)


def frame_inputs(seed: int):
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8) for _ in CAMERAS]
    return images, rng.uniform(-1.0, 1.0, len(JOINTS)).astype(np.float32)


def lerobot(s: dict, name: str, images, state, noise) -> np.lib.npyio.NpzFile:
    """LeRobot's GR00T on these inputs: the arrays its run wrote (one frame)."""
    inputs, out = s["tmp"] / f"{name}.npz", s["tmp"] / f"{name}_out.npz"
    np.savez(inputs, **{f"observation.images.{c}": img for c, img in zip(CAMERAS, images)}, state=state,
             noise=noise[None].astype(np.float32), task=np.array(INSTRUCTION))
    reference("run", "--checkpoint", str(s["ckpt"]), "--inputs", str(inputs), "--out", str(out))
    return np.load(out)


def close(got, want) -> float:
    """max |got - want|, asserted within TOLERANCE of the reference's scale."""
    err, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
    assert err <= TOLERANCE * max(1.0, scale), f"max difference {err} (values up to {scale})"
    return err


def its_pixels(want, camera: int) -> np.ndarray:
    """LeRobot's pixel_values of one camera (Qwen's patch rows) as the image [1, 3, 256, 256] the vision encoder
    graph takes: rows in 2x2 merge blocks, each (channel, temporal, 16, 16) with the frame twice in time."""
    _, gh, gw = want["image_grid_thw"][0][camera]
    rows = gh * gw
    x = want["pixel_values"][0][camera * rows:(camera + 1) * rows]
    x = x.reshape(gh // 2, gw // 2, 2, 2, 3, 2, 16, 16)[:, :, :, :, :, 0]
    return x.transpose(4, 0, 2, 5, 1, 3, 6).reshape(1, 3, gh * 16, gw * 16).astype(np.float32)


def from_its_pixels(rt, want, state, seq: int, rtc=None) -> Frame:
    """A frame through the backbone and the head, its vision encoder run on LeRobot's pixel values."""
    from synflux_ros.model.vision import ImageFeatures
    pixels = np.concatenate([its_pixels(want, camera) for camera in range(len(CAMERAS))])  # one call, as the node
    out = rt.executor.run("vision_encoder", {"pixel_values": pixels})
    n = rt.cfg.vision.num_tokens
    feats = [ImageFeatures(out["vision_embeds"][c * n:(c + 1) * n].copy(),
                           out["deepstack_embeds"][:, c * n:(c + 1) * n].copy()) for c in range(len(CAMERAS))]
    padded = np.r_[state, np.zeros(rt.cfg.action.state_dim - len(state), np.float32)]
    frame = Frame(seq, None, state=padded, rtc=rtc)
    frame.vision_embeds = feats
    return rt.stage_backbone(frame)


def test_stages_equal_lerobots(imported):
    """In process, from LeRobot's pixel values: the prompt, its positions, the backbone features, the normalised
    state, the chunk before and after un-normalisation."""
    s, cfg = imported, imported["cfg"]
    rt = VLARuntime(cfg)
    rt.set_instruction(INSTRUCTION)
    images, state = frame_inputs(11)
    noise = rt.head.initial_noise(cfg.action.seed + 5)[0]
    want = lerobot(s, "stages", images, state, noise)
    prompt = rt._instruction
    n = len(prompt.tokens)
    ids = [t if isinstance(t, int) else rt._image_id for t in prompt.tokens]
    assert ids == want["input_ids"][0].tolist()
    np.testing.assert_array_equal(prompt.positions[:, :n], want["position_ids"][0][-3:])
    frame = from_its_pixels(rt, want, state, 5)
    err = close(frame.logits[0, :n], want["backbone_features"][0])
    np.testing.assert_allclose(rt.maps.state_in(frame.state), want["state_normalized"][0], atol=1e-6)
    done = rt.stage_head(frame)
    err_raw = close(done.raw_actions[:, :6], want["actions_normalized"][0])
    err_out = close(done.actions, want["actions"][0])
    print(f"GR00T N1.7 from LeRobot's pixels: features {err:.1e}, normalised actions {err_raw:.1e}, actions "
          f"{err_out:.1e}")


@pytest.mark.parametrize("delay, horizon, steps", [(3, 8, 10), (0, 16, 16), (5, 4, 7)])
def test_real_time_chunking_equals_lerobots(imported, delay, horizon, steps):
    """GR00T's own RTC: a leftover of ``steps`` rows, ``delay`` of them executed, the overlap cut at ``horizon``."""
    from synflux_ros.model.heads.rtc import RTCGuidance
    s, cfg = imported, imported["cfg"]
    rt = VLARuntime(cfg)
    rt.set_instruction(INSTRUCTION)
    images, state = frame_inputs(20 + delay)
    noise = rt.head.initial_noise(cfg.action.seed + 9)[0]
    prev = np.random.default_rng(delay).uniform(-1, 1, (steps, 6)).astype(np.float32)
    inputs, out = s["tmp"] / f"rtc{delay}.npz", s["tmp"] / f"rtc{delay}_out.npz"
    np.savez(inputs, **{f"observation.images.{c}": img for c, img in zip(CAMERAS, images)}, state=state,
             noise=noise[None], task=np.array(INSTRUCTION), prev_chunk_left_over=prev,
             inference_delay=np.int64(delay), execution_horizon=np.int64(horizon))
    reference("run", "--rtc", "--checkpoint", str(s["ckpt"]), "--inputs", str(inputs), "--out", str(out))
    want = np.load(out)
    assert int(want["rtc_overlap_steps"][0]) == min(steps, horizon)
    guided = rt.stage_head(from_its_pixels(rt, want, state, 9, RTCGuidance(prev, delay, horizon))).raw_actions
    err = close(guided[:, :6], want["actions_normalized"][0])
    frozen = min(delay, horizon)
    np.testing.assert_array_equal(guided[:frozen, :6], prev[steps - min(steps, horizon):][:frozen])
    plain = rt.stage_head(from_its_pixels(rt, want, state, 9)).raw_actions
    assert np.abs(plain[:, :6] - want["actions_normalized"][0]).max() > 100 * TOLERANCE  # RTC changed the chunk
    print(f"GR00T N1.7 RTC delay {delay}, horizon {horizon}, {steps} rows: {err:.1e}")


def test_pixels_equal_lerobots(imported):
    """The image geometry: the pixel values of both cameras (240x320) equal those LeRobot's processor makes."""
    s, cfg = imported, imported["cfg"]
    rt = VLARuntime(cfg)
    images, state = frame_inputs(12)
    want = lerobot(s, "pixels", images, state, rt.head.initial_noise(0)[0])
    for camera, image in enumerate(images):
        close(rt.vision.preprocess(image), its_pixels(want, camera))


@pytest.fixture(scope="module")
def served(imported, ros_env):
    yield from serve_cameras(imported, ros_env, "/groot", CAMERAS, INSTRUCTION)


def publish_frame(s: dict, stamp: int, images, state) -> None:
    publish_cameras(s, stamp, images, state, JOINTS)


@pytest.mark.parametrize("case", [0, 1])
def test_actions_equal_lerobot(served, case):
    s, cfg = served, served["cfg"]
    images, state = frame_inputs(300 + case)
    stamp = (400 + 10 * case) * 10**9
    c = chunk_for_frame(s["node"], s["chunks"], lambda t: publish_frame(s, t, images, state), stamp, 60.0, wait=2.0)
    got = np.array(c.actions, np.float32).reshape(c.horizon, c.action_dim)
    noise = np.random.default_rng(cfg.action.seed + c.frame_seq).standard_normal(
        (cfg.action.action_horizon, cfg.action.action_dim)).astype(np.float32)
    want = lerobot(s, f"case{case}", images, state, noise)
    assert want["actions"][0].shape == got.shape == (cfg.action.published_horizon, 6)
    err, scale = float(np.abs(got - want["actions"][0]).max()), float(np.abs(want["actions"]).max())
    print(f"GR00T N1.7, case {case}: max |synflux - LeRobot| = {err:.2e} (actions up to {scale:.2f})")
    assert err <= TOLERANCE * max(1.0, scale), f"max difference {err} (actions up to {scale})"
    # the comparison has teeth: another state, another wrist image each give other actions (compared before the
    # un-normalisation, whose clip to the bounds hides differences of a random model's outputs)
    other = lerobot(s, f"case{case}_state", images, state + 0.5, noise)
    assert np.abs(other["actions_normalized"] - want["actions_normalized"]).max() > 10 * TOLERANCE
    other = lerobot(s, f"case{case}_wrist", [images[0], images[1][::-1].copy()], state, noise)
    assert np.abs(other["actions_normalized"] - want["actions_normalized"]).max() > 10 * TOLERANCE
