"""π0.5 through synflux-build -> vla_node (onnxruntime, fp32) equals LeRobot's π0.5 on the same checkpoint, for the
checkpoints of LeRobot 0.4.4 and of LeRobot 0.6.1, each against the release that saved it.

A small π0.5 with random weights (its adaptive-RMSNorm expert included) is built and saved by LeRobot itself
(``test/reference/lerobot_pi0.py make-checkpoint --policy pi05``, in ``.venv-pi0ref`` or ``.venv-lerobot06``), with
QUANTILES
normalisation of state and actions as π0.5 trains by default. ``synflux-build --from-hf`` imports it; vla_node
serves it over DDS with a joint state per frame, which π0.5 writes into its prompt as 256-bin indices (LeRobot 0.4
the state zero-padded to 32 values, 0.6 the 8 joints alone: the import tells the checkpoints apart). For each
published chunk the reference computes ``PI05Policy.predict_action_chunk`` on the same image, the same prompt
tokens and the same noise (vla_node's: ``default_rng(action.seed + frame_seq)``); the actions must agree to
1e-4. The prompt text itself is compared with the one LeRobot's own processor steps (normalizer, then
``Pi05PrepareStateTokenizerProcessorStep``) write for the raw state. Real-Time Chunking (the ``lerobot``
guidance) is compared the same way, in this process.
"""
from __future__ import annotations

import json
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
from synflux_ros.model.normalization import StateActionMaps, state_prompt_text  # noqa: E402
from synflux_ros.model.tokenizer import load_tokenizer  # noqa: E402
from synflux_ros.msg import ActionChunk  # noqa: E402
from synflux_ros.tools import harness as testing  # noqa: E402
from synflux_ros.tools.harness import chunk_for_frame, spin_until  # noqa: E402

from checkpoints import write_tokenizer  # noqa: E402
from pi0_reference import (  # noqa: E402
    JOINTS, SIDE, base_config, check_rtc_against_lerobot, lerobot_params, random_frame, reference)

INSTRUCTION = "pick up the red block"
TOLERANCE = 1e-4

pytestmark = pytest.mark.reference


@pytest.fixture(scope="module", params=lerobot_params())
def imported(request, tmp_path_factory):
    """The π0.5 saved by one LeRobot release and its graph set."""
    lerobot = request.param
    tmp = tmp_path_factory.mktemp(f"pi05_{lerobot}")
    ckpt = tmp / "checkpoint"
    assert reference("make-checkpoint", "--policy", "pi05", "--out", str(ckpt), "--cameras", "base", "--seed", "5",
                     "--state-norm", "QUANTILES", "--action-norm", "QUANTILES", lerobot=lerobot)
    write_tokenizer(str(ckpt), first_specials=("<pad>", "<eos>", "<bos>"))  # ids 0, 1, 2 as in Gemma's
    out = tmp / "graphs"
    assert build_tool.main(["--config", base_config(tmp / "base.yaml"), "--out", str(out), "--from-hf", str(ckpt),
                            "--backend", "onnxruntime"]) == 0
    cfg = load_config(str(out / "config.yaml"))
    assert (cfg.action.time_conditioning, cfg.action.state_input, cfg.action.state_token_dim) == ("adarms", "prompt", 0)
    assert cfg.action.state_norm.mode == "bounds" and cfg.action.output_dim == 6
    assert cfg.action.prompt_state == ("joints" if lerobot == "lerobot061" else "padded")
    return dict(tmp=tmp, ckpt=ckpt, out=out, cfg=cfg, tok=load_tokenizer(cfg, shipped=str(out / "tokenizer.json")),
                lerobot=lerobot)


def prompt(s: dict, state: np.ndarray) -> tuple[str, list[int]]:
    """The prompt text and ids vla_node builds for a raw joint state (the runtime's rules, spelled out)."""
    cfg = s["cfg"]
    padded = np.r_[state, np.zeros(cfg.action.state_dim - len(state), np.float32)]
    written = StateActionMaps(cfg.action).state_in(padded)
    if cfg.action.prompt_state == "joints":
        written = written[:len(state)]
    text = cfg.tokenizer.prompt_template.format(instruction=INSTRUCTION, state=state_prompt_text(written))
    return text, [s["tok"].special("<bos>")] + s["tok"].encode(text)


def lerobot(s: dict, name: str, image, state, ids, noise, rtc: list | None = None, prev=None):
    """LeRobot's π0.5 on these inputs: (its JSON result, the arrays it wrote)."""
    inputs = s["tmp"] / f"{name}.npz"
    extra = {"prev_chunk": prev} if prev is not None else {}
    np.savez(inputs, lang_tokens=np.array(ids, np.int64), state=np.asarray(state, np.float32),
             noise=noise.astype(np.float32), **{"observation.images.base": image}, **extra)
    out = s["tmp"] / f"{name}_out.npz"
    args = ["run", "--checkpoint", str(s["ckpt"]), "--inputs", str(inputs), "--out", str(out), "--task", INSTRUCTION]
    if rtc:
        cases = s["tmp"] / f"{name}_rtc.json"
        cases.write_text(json.dumps(rtc))
        args += ["--rtc", str(cases)]
    return reference(*args, lerobot=s["lerobot"]), np.load(out)


@pytest.fixture(scope="module")
def served(imported, ros_env):
    s = dict(imported)
    node = rclpy.create_node(f"pi05_parity_{uuid.uuid4().hex[:8]}")
    chunks = []
    node.create_subscription(ActionChunk, "/pi05/action_chunk", chunks.append, 50)
    pub = node.create_publisher(Image, "/pi05/base/image", qos_profile_sensor_data)
    state_pub = node.create_publisher(JointState, "/pi05/joint_states", 50)
    with testing.NodeProcess("vla_node", {"config": str(s["out"] / "config.yaml"), "default_instruction": INSTRUCTION},
                             env=ros_env, remaps={"__ns": "/pi05"}) as proc:
        for p in (pub, state_pub):
            assert spin_until(node, lambda: p.get_subscription_count() > 0, 60.0), proc.output()[-3000:]
        s.update(node=node, pub=pub, state_pub=state_pub, chunks=chunks)
        yield s
        assert proc.alive(), proc.output()[-3000:]
    node.destroy_node()


def publish_frame(s: dict, stamp: int, image, state) -> None:
    msg = JointState(name=list(JOINTS), position=[float(v) for v in state])
    msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(stamp - 5_000_000, 10**9)
    s["state_pub"].publish(msg)
    time.sleep(0.02)
    img = Image(height=image.shape[0], width=image.shape[1], encoding="rgb8", step=3 * image.shape[1],
                data=image.tobytes())
    img.header.stamp.sec, img.header.stamp.nanosec = divmod(stamp, 10**9)
    s["pub"].publish(img)


@pytest.mark.parametrize("case", [0, 1])
def test_actions_and_prompt_equal_lerobot(served, case):
    s, cfg = served, served["cfg"]
    rng = np.random.default_rng(300 + case)
    image = rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    state = rng.uniform(-1.5, 1.5, len(JOINTS)).astype(np.float32)
    stamp = (400 + 10 * case) * 10**9
    c = chunk_for_frame(s["node"], s["chunks"], lambda t: publish_frame(s, t, image, state), stamp, 60.0, wait=2.0)
    got = np.array(c.actions, np.float32).reshape(c.horizon, c.action_dim)
    noise = np.random.default_rng(cfg.action.seed + c.frame_seq).standard_normal(
        (cfg.action.action_horizon, cfg.action.action_dim)).astype(np.float32)
    text, ids = prompt(s, state)
    result, want = lerobot(s, f"case{case}", image, state, ids, noise)
    assert result["prompt"] == text  # the state's bins, as LeRobot's processor writes them
    assert want["actions"].shape == got.shape == (cfg.action.action_horizon, 6)
    err, scale = float(np.abs(got - want["actions"]).max()), float(np.abs(want["actions"]).max())
    print(f"{s['lerobot']}, case {case}: max |synflux - LeRobot| = {err:.2e} (actions up to {scale:.2f}); "
          f"{len(ids)} prompt tokens")
    assert err <= TOLERANCE * max(1.0, scale), f"max difference {err} (actions up to {scale})"
    # the comparison has teeth: another state writes another prompt, which gives other actions
    _, other_ids = prompt(s, state + 0.5)
    assert other_ids != ids
    _, other = lerobot(s, f"case{case}_other", image, state + 0.5, other_ids, noise)
    assert np.abs(other["actions"] - want["actions"]).max() > 100 * TOLERANCE


@pytest.mark.parametrize("guidance", ["lerobot", "vjp"])
def test_real_time_chunking_equals_lerobots(imported, guidance):
    """RTC on π0.5: a previous chunk's leftover (normalised model actions) steers the next chunk as LeRobot's RTC
    does, for two schedules and delays: the lerobot guidance, and the vjp guidance (its action_expert_vjp graphs,
    through the adaptive norms) against the same step with torch autograd through LeRobot's π0.5; the guided
    chunks differ from the plain one."""
    s = imported
    image, state, _ = random_frame(21, s["cfg"].action.state_dim)

    def run_lerobot(noise, cases, leftover):
        return lerobot(s, f"rtc-{guidance}", image, state, prompt(s, state)[1], noise, rtc=cases, prev=leftover)[1]
    check_rtc_against_lerobot(s, guidance, base_config, INSTRUCTION, image, state, run_lerobot, TOLERANCE)
