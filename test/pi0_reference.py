"""The small π0 the LeRobot parity tests share: the reference runners (LeRobot 0.4.4 in .venv-pi0ref, LeRobot 0.6.1
in .venv-lerobot06: each saves its own checkpoints and is the reference for them) and the config the ``--from-hf``
import starts from."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
LEROBOT_VENVS = {"lerobot044": (ROOT / ".venv-pi0ref" / "bin" / "python", "make pi0ref-venv"),
                 "lerobot061": (ROOT / ".venv-lerobot06" / "bin" / "python", "make lerobot06-venv")}
"""The LeRobot releases the parity tests save checkpoints with and compare against: the interpreter of each one's
venv and the target that makes it."""
REF_PY = LEROBOT_VENVS["lerobot044"][0]
REF_SCRIPT = ROOT / "test" / "reference" / "lerobot_pi0.py"
JOINTS = [f"joint_{i}" for i in range(8)]
SIDE = 56  # the checkpoint's image_resolution: 4x4 patches of 14 per camera


def lerobot_params(*also) -> list:
    """pytest params, one per LeRobot release of :data:`LEROBOT_VENVS` (each combined with every value of
    ``also`` when given), skipped where that release's venv is missing."""
    import pytest

    params = []
    for release, (python, target) in LEROBOT_VENVS.items():
        mark = pytest.mark.skipif(not python.exists(), reason=f"the {release} reference venv is missing ({target})")
        for value in also or [None]:
            values = release if value is None else (release, value)
            params.append(pytest.param(values, marks=mark, id=release if value is None else f"{release}-{value}"))
    return params


def reference(*args: str, lerobot: str = "lerobot044", script: Path = REF_SCRIPT, timeout: float = 600) -> dict:
    """Run a reference script (``script``) in the venv of the LeRobot release ``lerobot``; its last stdout line is
    a JSON result."""
    proc = subprocess.run([str(LEROBOT_VENVS[lerobot][0]), str(script), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, f"reference {args[0]} ({lerobot}) failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def random_frame(seed: int, state_dim: int) -> tuple:
    """A camera image of the checkpoint's resolution, a joint state (robot units) and that state zero-padded to
    ``state_dim`` (the runtime's state vector)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    state = rng.uniform(-1.5, 1.5, len(JOINTS)).astype(np.float32)
    return image, state, np.r_[state, np.zeros(state_dim - len(JOINTS), np.float32)]


def base_config(path: Path, execution: dict | None = None) -> str:
    """The config the import starts from: the joint names (not in a LeRobot checkpoint), buckets, executor, and
    an ``execution`` section when given."""
    raw = {
        "name": "pi0-small", "mode": "vla",
        "vision": {"resolution": [SIDE, SIDE], "tile_size": [SIDE, SIDE], "tokens_per_tile": 16, "patch_size": 14,
                   "hidden_dim": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64},
        "llm": {"num_layers": 2, "hidden_dim": 64, "num_heads": 8, "num_kv_heads": 1, "head_dim": 16,
                "vocab_size": 257152, "prefill_buckets": [32], "decode_buckets": [128], "max_seq_len": 128,
                "architecture": "gemma"},
        "action": {"head_type": "flow_matching", "action_dim": 32, "action_horizon": 10, "state_dim": 32,
                   "state_joints": JOINTS, "state_max_age": 0.1, "seed": 7},
        "executor": {"backend": "onnxruntime"},
    }
    if execution:
        raw["execution"] = execution
    path.write_text(yaml.safe_dump(raw))
    return str(path)


RTC_CASES = [("linear", 2, 6, 10.0), ("exp", 3, 8, 5.0)]  # schedule, inference delay, execution horizon, weight
"""The Real-Time Chunking cases the flow-matching parity tests compare with LeRobot's."""


def check_rtc_against_lerobot(s: dict, guidance: str, base, instruction: str, image, state, run_lerobot,
                              tolerance: float) -> None:
    """RTC through the imported graph set (``s``: out, tmp, ckpt, cfg) equals LeRobot's RTC for :data:`RTC_CASES`,
    and each guided chunk differs from the plain one. With the ``vjp`` guidance the checkpoint is imported again
    with ``base(path, execution)`` asking for its action_expert_vjp graphs. ``image``: one, or a list per camera;
    ``state``: the raw joint state; ``run_lerobot(noise, cases, leftover)`` returns LeRobot's arrays."""
    import json

    import numpy as np

    from synflux_ros.buildtool import export as build_tool
    from synflux_ros.core.config import load_config
    from synflux_ros.model.heads.rtc import RTCGuidance
    from synflux_ros.runtimes.vla import VLARuntime

    cfg = s["cfg"]
    if guidance == "vjp":
        out = s["tmp"] / "graphs-vjp"
        assert build_tool.main(["--config", base(s["tmp"] / "base-vjp.yaml", {"rtc": {"guidance": "vjp"}}),
                                "--out", str(out), "--from-hf", str(s["ckpt"]), "--backend", "onnxruntime"]) == 0
        cfg = load_config(str(out / "config.yaml"))
        names = [m["name"] for m in json.loads((out / "manifest.json").read_text())["graphs"]]
        assert any(n.startswith("action_expert_vjp_") for n in names), names  # execution.mode auto: rtc
    padded = np.r_[state, np.zeros(cfg.action.state_dim - len(state), np.float32)]
    rt = VLARuntime(cfg)
    try:
        rt.set_instruction(instruction)
        leftover = rt.infer(image, seq=4, state=padded - 0.2).raw_actions[3:]
        plain = rt.infer(image, seq=5, state=padded)
        guided = [rt.infer(image, seq=5, state=padded, rtc=RTCGuidance(
            leftover, inference_delay=d, execution_horizon=h, schedule=sch, max_guidance_weight=w,
            flavour=guidance)) for sch, d, h, w in RTC_CASES]
    finally:
        rt.close()
    noise = np.random.default_rng(cfg.action.seed + 5).standard_normal(
        (cfg.action.action_horizon, cfg.action.action_dim)).astype(np.float32)
    cases = [{"prev_chunk": "prev_chunk", "inference_delay": d, "execution_horizon": h, "schedule": sch.upper(),
              "max_guidance_weight": w, "guidance": guidance} for sch, d, h, w in RTC_CASES]
    want = run_lerobot(noise, cases, leftover)
    np.testing.assert_allclose(plain.actions, want["actions"], atol=tolerance * max(1.0, np.abs(want["actions"]).max()))
    for i, frame in enumerate(guided):
        ref = want[f"actions_rtc_{i}"]
        err = float(np.abs(frame.actions - ref).max())
        assert err <= tolerance * max(1.0, float(np.abs(ref).max())), (RTC_CASES[i], err)
        assert np.abs(frame.actions - plain.actions).max() > 100 * tolerance, RTC_CASES[i]


def serve_cameras(s: dict, ros_env, ns: str, cameras, instruction: str):
    """A generator for a module fixture: vla_node serving ``s["out"]``'s graph set in namespace ``ns``, with a
    publisher per camera of ``cameras``, one of joint states and a subscription to its chunks; yields ``s`` with
    ``node``, ``pubs``, ``state_pub`` and ``chunks`` added, and checks at the end that the node is still up."""
    import uuid

    import rclpy
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import Image, JointState
    from synflux_ros.msg import ActionChunk
    from synflux_ros.tools import harness as testing
    from synflux_ros.tools.harness import spin_until

    s = dict(s)
    node = rclpy.create_node(f"{ns.strip('/')}_parity_{uuid.uuid4().hex[:8]}")
    chunks = []
    node.create_subscription(ActionChunk, f"{ns}/action_chunk", chunks.append, 50)
    pubs = [node.create_publisher(Image, f"{ns}/{c}/image", qos_profile_sensor_data) for c in cameras]
    state_pub = node.create_publisher(JointState, f"{ns}/joint_states", 50)
    with testing.NodeProcess("vla_node", {"config": str(s["out"] / "config.yaml"), "default_instruction": instruction},
                             env=ros_env, remaps={"__ns": ns}) as proc:
        for p in (*pubs, state_pub):
            assert spin_until(node, lambda: p.get_subscription_count() > 0, 60.0), proc.output()[-3000:]
        s.update(node=node, pubs=pubs, state_pub=state_pub, chunks=chunks)
        yield s
        assert proc.alive(), proc.output()[-3000:]
    node.destroy_node()


def publish_cameras(s: dict, stamp: int, images, state, joints) -> None:
    """One frame to a :func:`serve_cameras` node: the joint state 5 ms before ``stamp``, then the cameras' images,
    the last first, each 1 ms before the next (the first camera's at ``stamp``)."""
    import time

    from sensor_msgs.msg import Image, JointState

    msg = JointState(name=list(joints), position=[float(v) for v in state])
    msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(stamp - 5_000_000, 10**9)
    s["state_pub"].publish(msg)
    time.sleep(0.02)
    for i, (pub, image) in enumerate(reversed(list(zip(s["pubs"], images)))):
        img = Image(height=image.shape[0], width=image.shape[1], encoding="rgb8", step=3 * image.shape[1],
                    data=image.tobytes())
        img.header.stamp.sec, img.header.stamp.nanosec = divmod(stamp - (len(images) - 1 - i) * 1_000_000, 10**9)
        pub.publish(img)
        time.sleep(0.01)
