"""π0 through synflux-build -> vla_node (onnxruntime, fp32) equals LeRobot's π0 on the same checkpoint, for the
checkpoints of LeRobot 0.4.4 and of LeRobot 0.6.1, each against the release that saved it.

A small π0 with random weights is built and saved by LeRobot itself (``test/reference/lerobot_pi0.py
make-checkpoint``, in the reference venv ``.venv-pi0ref`` made by ``make pi0ref-venv``, or ``.venv-lerobot06`` made
by ``make lerobot06-venv``): LeRobot's config.json, model.safetensors and processor files with normalisation
statistics (0.6.1 saves its normaliser as another step, after a disabled relative-actions step, and the embedding
table beside the head). A π0 and a π0.5 LeRobot 0.6.1 trained on actions relative to the state are compared too,
in this process. ``synflux-build --from-hf`` imports it;
vla_node serves it over DDS with one or two cameras and a joint state per frame. For each published chunk the
reference computes ``PI0Policy.predict_action_chunk`` on the same images (uint8 -> [0, 1], as LeRobot takes
them), the same instruction tokens, the same raw state, normalised and un-normalised by LeRobot's own processor
steps, and the same noise (vla_node's: ``default_rng(action.seed + frame_seq)``); the actions must agree to 1e-4.
"""
from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

pytest.importorskip("torch", reason="synflux-build needs torch (make test installs it)")
pytest.importorskip("onnxruntime")

import rclpy  # noqa: E402
from rclpy.qos import qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image, JointState  # noqa: E402
from synflux_ros.buildtool import export as build_tool  # noqa: E402
from synflux_ros.core.config import load_config  # noqa: E402
from synflux_ros.msg import ActionChunk  # noqa: E402
from synflux_ros.tools import harness as testing  # noqa: E402
from synflux_ros.tools.harness import chunk_for_frame, spin_until  # noqa: E402
from synflux_ros.model.tokenizer import load_tokenizer  # noqa: E402

from checkpoints import write_tokenizer  # noqa: E402
from pi0_reference import JOINTS, SIDE, base_config, lerobot_params, reference  # noqa: E402


INSTRUCTION = "pick up the red block"
TOLERANCE = 1e-4

pytestmark = pytest.mark.reference


@pytest.fixture(scope="module", params=lerobot_params("1-camera", "2-cameras"))
def served(request, tmp_path_factory, ros_env):
    lerobot, cams = request.param
    cameras = ["base", "wrist"][:int(cams[0])]
    tmp = tmp_path_factory.mktemp(f"pi0_{lerobot}_" + "_".join(cameras))
    ckpt = tmp / "checkpoint"
    made = reference("make-checkpoint", "--out", str(ckpt), "--cameras", ",".join(cameras), "--seed", "3",
                     "--state-norm", "MEAN_STD", "--action-norm", "QUANTILES" if len(cameras) > 1 else "MEAN_STD",
                     lerobot=lerobot)
    assert made
    write_tokenizer(str(ckpt), first_specials=("<pad>", "<eos>", "<bos>"))  # ids 0, 1, 2 as in Gemma's
    out = tmp / "graphs"
    assert build_tool.main(["--config", base_config(tmp / "base.yaml"), "--out", str(out), "--from-hf", str(ckpt),
                            "--backend", "onnxruntime"]) == 0
    cfg = load_config(str(out / "config.yaml"))
    assert cfg.vision.cameras == tuple(cameras) and cfg.llm.prefill_attention == "bidirectional"
    assert cfg.action.output_dim == 6 and cfg.action.state_norm is not None and cfg.action.action_norm is not None
    tok = load_tokenizer(cfg, shipped=str(out / "tokenizer.json"))
    ids = [tok.special("<bos>")] + tok.encode(INSTRUCTION + "\n")
    node = rclpy.create_node(f"pi0_parity_{uuid.uuid4().hex[:8]}")
    chunks = []
    node.create_subscription(ActionChunk, "/pi0/action_chunk", chunks.append, 50)
    pubs = {cam: node.create_publisher(Image, f"/pi0/{cam}/image", qos_profile_sensor_data) for cam in cameras}
    state_pub = node.create_publisher(JointState, "/pi0/joint_states", 50)
    with testing.NodeProcess("vla_node", {"config": str(out / "config.yaml"), "default_instruction": INSTRUCTION},
                             env=ros_env, remaps={"__ns": "/pi0"}) as proc:
        for pub in [*pubs.values(), state_pub]:
            assert spin_until(node, lambda: pub.get_subscription_count() > 0, 60.0), proc.output()[-3000:]
        yield dict(ckpt=ckpt, cfg=cfg, ids=ids, node=node, pubs=pubs, state_pub=state_pub, chunks=chunks,
                   cameras=cameras, tmp=tmp, lerobot=lerobot)
        assert proc.alive(), proc.output()[-3000:]
    node.destroy_node()


def publish_frame(s: dict, stamp: int, images: dict, state) -> None:
    msg = JointState(name=list(JOINTS), position=[float(v) for v in state])
    msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(stamp - 5_000_000, 10**9)
    s["state_pub"].publish(msg)
    for cam in s["cameras"][1:] + s["cameras"][:1]:  # the first camera's frame last: it triggers inference
        rgb = images[cam]
        img = Image(height=rgb.shape[0], width=rgb.shape[1], encoding="rgb8", step=3 * rgb.shape[1],
                    data=rgb.tobytes())
        img.header.stamp.sec, img.header.stamp.nanosec = divmod(stamp, 10**9)
        s["pubs"][cam].publish(img)
        time.sleep(0.02)


def chunk_for(s: dict, stamp: int, images: dict, state, timeout: float = 60.0):
    """Publish the frame (again with later stamps while best-effort messages are lost) until its chunk comes."""
    return chunk_for_frame(s["node"], s["chunks"], lambda t: publish_frame(s, t, images, state), stamp, timeout,
                           wait=2.0)


def lerobot_actions(s: dict, images: dict, state, noise: np.ndarray, name: str) -> np.ndarray:
    inputs = s["tmp"] / f"{name}.npz"
    np.savez(inputs, lang_tokens=np.array(s["ids"], np.int64), state=np.asarray(state, np.float32),
             noise=noise.astype(np.float32), **{f"observation.images.{c}": images[c] for c in s["cameras"]})
    out = s["tmp"] / f"{name}_out.npz"
    reference("run", "--checkpoint", str(s["ckpt"]), "--inputs", str(inputs), "--out", str(out), lerobot=s["lerobot"])
    return np.load(out)["actions"]


@pytest.mark.parametrize("case", [0, 1])
def test_actions_equal_lerobot(served, case):
    s = served
    rng = np.random.default_rng(100 + case)
    images = {c: rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8) for c in s["cameras"]}
    state = rng.uniform(-1.5, 1.5, len(JOINTS)).astype(np.float32)
    c = chunk_for(s, (200 + 10 * case) * 10**9, images, state)
    got = np.array(c.actions, np.float32).reshape(c.horizon, c.action_dim)
    cfg = s["cfg"]
    assert got.shape == (cfg.action.action_horizon, 6)
    noise = np.random.default_rng(cfg.action.seed + c.frame_seq).standard_normal(
        (cfg.action.action_horizon, cfg.action.action_dim)).astype(np.float32)
    want = lerobot_actions(s, images, state, noise, f"case{case}")
    assert want.shape == got.shape
    err = float(np.abs(got - want).max())
    scale = float(np.abs(want).max())
    print(f"{s['lerobot']}, {len(s['cameras'])} camera(s), case {case}: max |synflux - LeRobot| = {err:.2e} "
          f"(actions up to {scale:.2f})")
    assert err <= TOLERANCE * max(1.0, scale), f"max difference {err} (actions up to {scale})"
    # the comparison has teeth: another state gives other actions in both
    other = lerobot_actions(s, images, state + 0.5, noise, f"case{case}_other")
    assert np.abs(other - want).max() > 100 * TOLERANCE


ACTION_NAMES = ["shoulder", "upper_arm", "elbow", "forearm", "wrist", "Gripper"]
"""The relative checkpoints' action_feature_names: LeRobot's default relative_exclude_joints ("gripper") keeps the
last action absolute."""


@pytest.mark.parametrize("policy", ["pi0", "pi05"])
@pytest.mark.parametrize("lerobot", [p for p in lerobot_params() if p.values[0] == "lerobot061"])
def test_relative_actions_equal_lerobots(lerobot, policy, tmp_path, capsys):
    """A checkpoint LeRobot 0.6.1 trained on actions relative to the state (``use_relative_actions``: its
    postprocessor adds the raw state to the un-normalised actions but where ``relative_exclude_joints`` matches an
    action name) imports with ``action.relative_mask`` and equals LeRobot's ``predict_action_chunk`` and
    postprocessor to 1e-4, in this process; exactly the state is added where the mask says. RTC, which steers
    towards the last chunk in model space, is refused for it at build and left out by ``execution.mode: auto``."""
    from synflux_ros.runtimes.vla import VLARuntime
    ckpt = tmp_path / "checkpoint"
    reference("make-checkpoint", "--policy", policy, "--out", str(ckpt), "--seed", "3", "--relative-actions", "true",
              "--action-names", ",".join(ACTION_NAMES), "--state-norm", "MEAN_STD", "--action-norm", "MEAN_STD",
              lerobot=lerobot)
    write_tokenizer(str(ckpt), first_specials=("<pad>", "<eos>", "<bos>"))
    out = tmp_path / "graphs"
    assert build_tool.main(["--config", base_config(tmp_path / "base.yaml"), "--out", str(out), "--from-hf", str(ckpt),
                            "--backend", "onnxruntime"]) == 0
    cfg = load_config(str(out / "config.yaml"))
    assert cfg.action.relative_mask == (True,) * 5 + (False,) and cfg.resolved_execution.mode == "replace"
    rc = build_tool.main(["--config", base_config(tmp_path / "base-rtc.yaml", {"mode": "rtc"}), "--out",
                          str(tmp_path / "rtc"), "--from-hf", str(ckpt), "--backend", "onnxruntime"])
    assert rc == 2 and "action.relative_mask" in capsys.readouterr().err

    rng = np.random.default_rng(41)
    image = rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    state = rng.uniform(-1.5, 1.5, len(JOINTS)).astype(np.float32)
    padded = np.r_[state, np.zeros(cfg.action.state_dim - len(state), np.float32)]
    tok = load_tokenizer(cfg, shipped=str(out / "tokenizer.json"))
    absolute = cfg.with_overrides(action={"relative_mask": []})
    got = {}
    for name, c in (("relative", cfg), ("absolute", absolute)):
        rt = VLARuntime(c)
        try:
            rt.set_instruction(INSTRUCTION)
            got[name] = rt.infer(image, seq=3, state=padded).actions
            ids = rt.prompt_ids(INSTRUCTION, rt.maps.state_in(padded))  # π0.5: the state's bins in the prompt
        finally:
            rt.close()
    mask = np.array(cfg.action.relative_mask, np.float32)
    np.testing.assert_allclose(got["relative"] - got["absolute"], np.broadcast_to(state[:6] * mask, (10, 6)),
                               rtol=0, atol=1e-5)
    noise = np.random.default_rng(cfg.action.seed + 3).standard_normal(
        (cfg.action.action_horizon, cfg.action.action_dim)).astype(np.float32)
    if policy == "pi0":
        assert ids == [tok.special("<bos>")] + tok.encode(INSTRUCTION + "\n")
    inputs, result = tmp_path / "inputs.npz", tmp_path / "lerobot.npz"
    np.savez(inputs, lang_tokens=np.array(ids, np.int64), state=state, noise=noise, **{"observation.images.base": image})
    ran = reference("run", "--checkpoint", str(ckpt), "--inputs", str(inputs), "--out", str(result), "--task",
                    INSTRUCTION, lerobot=lerobot)
    if policy == "pi05":
        assert tok.encode(ran["prompt"]) == ids[1:]  # LeRobot's prompt, with the state's bins, is the one given
    want = np.load(result)["actions"]
    err, scale = float(np.abs(got["relative"] - want).max()), float(np.abs(want).max())
    print(f"{policy} with relative actions: max |synflux - LeRobot| = {err:.2e} (actions up to {scale:.2f})")
    assert err <= TOLERANCE * max(1.0, scale), f"max difference {err} (actions up to {scale})"
