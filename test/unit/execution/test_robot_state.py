"""The robot state of a flow-matching VLA: config rules, the joint-state buffer that matches states to frames,
the action expert's state token and the runtime's refusal to run without a state."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from synflux_ros.core.config import ConfigError, load_config
from synflux_ros.core.contract import graph_set
from synflux_ros.execution.robot_state import NoFreshState, RobotStateBuffer

CONFIG_DIR = Path(__file__).resolve().parents[3] / "config"
JOINTS = ("shoulder", "elbow", "wrist")


def with_state(name="vla_demo_orin", **action):
    cfg = load_config(str(CONFIG_DIR / f"{name}.yaml"))
    return cfg.with_overrides(action={"state_dim": 8, "state_joints": list(JOINTS), "state_max_age": 0.1, **action})


def test_config_rules():
    cfg = with_state()
    assert cfg.action.state_dim == 8 and cfg.action.state_joints == JOINTS
    with pytest.raises(ConfigError, match="1 to state_dim \\(2\\) joint names"):
        with_state(state_dim=2)
    with pytest.raises(ConfigError, match="1 to state_dim"):
        with_state(state_joints=[])
    with pytest.raises(ConfigError, match="unique and not empty"):
        with_state(state_joints=["a", "a"])
    with pytest.raises(ConfigError, match="given without action.state_dim"):
        with_state(state_dim=0)
    with pytest.raises(ConfigError, match="supported for flow_matching heads and the fast codec only"):
        load_config(str(CONFIG_DIR / "vla_openvla.yaml")).with_overrides(
            action={"state_dim": 4, "state_joints": ["a"]})
    # the joints and the age limit shape no graph; the state width does
    assert with_state(state_max_age=0.5, state_joints=["a"]).graph_hash() == cfg.graph_hash()
    assert with_state(state_dim=9).graph_hash() != cfg.graph_hash()


def test_the_action_expert_takes_the_state_in_the_contract():
    metas = {m.name: m for m in graph_set(load_config(str(CONFIG_DIR / "vla_pi0.yaml")))}
    assert metas["action_expert_384"].input("state").shape == (1, 32)
    plain = {m.name: m for m in graph_set(load_config(str(CONFIG_DIR / "vla_demo_orin.yaml")))}
    assert "state" not in {t.name for m in plain.values() for t in m.inputs}


def buffer(**action):
    return RobotStateBuffer(with_state(**action).action, capacity=4)


def test_the_state_vector_holds_the_configured_joints_in_order_zero_padded():
    b = buffer()
    v = b.add(10.0, ["wrist", "gripper", "shoulder", "elbow"], [3.0, 9.0, 1.0, 2.0])
    assert v.tolist() == [1.0, 2.0, 3.0, 0, 0, 0, 0, 0] and v.dtype == np.float32


@pytest.mark.parametrize("names, positions, why", [
    (["shoulder", "elbow"], [1.0, 2.0], "joint 'wrist' missing"),
    (["shoulder"], [1.0], "joints 'elbow', 'wrist' missing"),
    (["shoulder", "elbow", "wrist"], [1.0, 2.0], "3 joint names but 2 positions"),
    (["shoulder", "elbow", "wrist"], [1.0, float("nan"), 3.0], "joint 'elbow': position nan is not finite"),
])
def test_a_bad_message_is_refused_with_its_reason_and_the_buffer_keeps_the_rest(names, positions, why):
    b = buffer()
    b.add(10.0, JOINTS, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=why):
        b.add(10.05, names, positions)
    assert b.at(10.06)[0][:3].tolist() == [1.0, 2.0, 3.0]


def test_a_frame_gets_the_newest_state_at_its_stamp():
    b = buffer()
    for t, x in ((10.00, 1.0), (10.04, 2.0), (10.08, 3.0)):
        b.add(t, JOINTS, [x, 0, 0])
    state, age = b.at(10.05)
    assert state[0] == 2.0 and age == pytest.approx(0.01)
    assert b.at(10.08)[0][0] == 3.0 and b.at(10.15)[0][0] == 3.0  # within 0.1 s of the newest
    # every state newer than the frame: the oldest one, if it is close enough
    state, age = b.at(9.95)
    assert state[0] == 1.0 and age == pytest.approx(-0.05)
    b.add(10.02, JOINTS, [1.5, 0, 0])  # out of order: placed by stamp
    assert b.at(10.03)[0][0] == 1.5


def test_no_fresh_state_says_how_far_the_nearest_one_is():
    b = buffer()
    with pytest.raises(NoFreshState, match="no joint state received yet on 'joint_states'"):
        b.at(10.0)
    b.add(10.0, JOINTS, [1, 2, 3])
    with pytest.raises(NoFreshState, match="250 ms older than the frame \\(action.state_max_age: 100 ms\\)"):
        b.at(10.25)
    with pytest.raises(NoFreshState, match="500 ms newer"):
        b.at(9.5)


def test_the_buffer_keeps_the_newest_states_only():
    b = buffer()  # capacity 4
    for i in range(10):
        b.add(10.0 + 0.01 * i, JOINTS, [float(i), 0, 0])
    assert b.at(10.0)[0][0] == 6.0  # the oldest kept state (10.06) is 60 ms newer: within the limit
    with pytest.raises(NoFreshState, match="160 ms newer"):
        b.at(9.9)


def test_the_state_token_conditions_the_velocity_and_the_exported_graph_agrees():
    torch = pytest.importorskip("torch")
    ort = pytest.importorskip("onnxruntime")
    from synflux_ros.graphkit.onnx_export import example_inputs, export_graph
    from synflux_ros.graphkit.torch_models import build_graph_modules
    cfg = with_state()
    meta = next(m for m in graph_set(cfg) if m.kind == "action_expert")
    module = build_graph_modules(cfg, seed=0).modules[meta.name]
    rng = np.random.default_rng(0)
    feeds = {}
    for spec, example in zip(meta.inputs, example_inputs(meta)):
        if spec.name == "prefix_len":
            feeds[spec.name] = np.array([5], np.int64)
        elif spec.dtype == "float32":
            feeds[spec.name] = rng.standard_normal(spec.shape).astype(np.float32) * 0.5
        else:
            feeds[spec.name] = example.numpy()
    kv = feeds["past_kv"]
    views = [(torch.from_numpy(kv[i, 0]), torch.from_numpy(kv[i, 1])) for i in range(kv.shape[0])]

    def run_torch(state):
        with torch.no_grad():
            return module(torch.from_numpy(feeds["noisy_actions"]), torch.from_numpy(feeds["time_embedding"]),
                          torch.from_numpy(feeds["prefix_len"]), views, torch.from_numpy(state))[0].numpy()
    a, b = run_torch(feeds["state"]), run_torch(feeds["state"] + 1.0)
    assert a.shape == (1, cfg.action.action_horizon, cfg.action.action_dim)
    assert np.abs(a - b).max() > 1e-3  # the state moves the velocity
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        model = export_graph(module, meta, d)
        import onnx
        path = f"{d}/x.onnx"
        onnx.save(model, path)
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        ort_feeds = {"noisy_actions": feeds["noisy_actions"], "time_embedding": feeds["time_embedding"],
                     "prefix_len": feeds["prefix_len"], "state": feeds["state"]}
        for i in range(kv.shape[0]):
            ort_feeds[f"past_kv.{i}.0"], ort_feeds[f"past_kv.{i}.1"] = kv[i, 0], kv[i, 1]
        got = sess.run(["velocity"], ort_feeds)[0]
    np.testing.assert_allclose(got, a, rtol=1e-4, atol=1e-5)


def test_the_runtime_refuses_to_run_a_state_model_without_a_state():
    from synflux_ros.runtimes.vla import VLARuntime
    rt = VLARuntime(with_state().with_overrides(executor={"backend": "mock"}))
    try:
        image = np.random.default_rng(0).integers(0, 256, (120, 160, 3), np.uint8)
        with pytest.raises(ValueError, match="takes the robot state"):
            rt.infer(image)
        with pytest.raises(ValueError, match="expected 8 finite values, got 3"):
            rt.infer(image, state=np.zeros(3, np.float32))
        a = rt.infer(image, state=np.zeros(8, np.float32)).actions
        b = rt.infer(image, state=np.full(8, 0.2, np.float32)).actions
        assert a.shape == b.shape and not np.allclose(a, b)  # the mock's target moves with the state too
    finally:
        rt.close()
