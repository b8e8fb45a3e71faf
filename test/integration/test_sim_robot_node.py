"""sim_robot_node as a process over real DDS: it starts headless, publishes camera frames of the configured size and
joint states at about their rates, follows joint_command with its servos within the joint ranges, refuses bad
commands (counted, the last target held), fails at start on a bad parameter naming it, and stops cleanly on
SIGTERM."""
from __future__ import annotations

import ctypes.util
import importlib.util
import math
import re
import signal
import subprocess
import time

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Float64MultiArray

from synflux_ros.nodes.process import LIVE_THREADS_MESSAGE
from synflux_ros.tools.harness import NodeProcess, spin_until

needs_mujoco = pytest.mark.skipif(importlib.util.find_spec("mujoco") is None,
                                  reason="mujoco is not installed (make sim-venv)")

NS = "/simarm"
JOINTS = ["joint_1", "joint_2", "joint_3", "joint_4", "joint_5", "joint_6", "gripper"]
HOME = [0.0, 0.35, 1.6, 0.0, 1.19, 0.0, 0.02]
LOWER = np.array([-2.96, -2.0, -2.6, -3.05, -2.0, -3.05, 0.0])
UPPER = np.array([2.96, 2.0, 2.6, 3.05, 2.0, 3.05, 0.04])
WIDTH, HEIGHT, CAMERA_HZ, STATE_HZ = 160, 120, 10.0, 50.0


class Client:
    """Subscriptions to the node's image, joint_states and diagnostics; a publisher of joint_command."""

    def __init__(self, node):
        self.node = node
        self.images, self.states, self.diags = [], [], []
        node.create_subscription(Image, f"{NS}/image", self.images.append, qos_profile_sensor_data)
        node.create_subscription(JointState, f"{NS}/joint_states", self.states.append, 200)
        node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, 20)
        self.commands = node.create_publisher(Float64MultiArray, f"{NS}/joint_command", 10)

    def _on_diag(self, msg):
        for st in msg.status:
            if st.name == f"{NS}/sim_robot_node: sim_robot":
                self.diags.append({kv.key: kv.value for kv in st.values} | {"_message": st.message})

    def spin(self, seconds: float):
        spin_until(self.node, lambda: False, seconds)

    def position(self) -> np.ndarray:
        return np.array(self.states[-1].position)

    def command(self, values):
        assert spin_until(self.node, lambda: self.commands.get_subscription_count() > 0, 20), \
            "sim_robot_node never subscribed to joint_command"
        self.commands.publish(Float64MultiArray(data=[float(v) for v in values]))

    def diag_where(self, predicate, timeout=10.0) -> dict:
        start = len(self.diags)
        assert spin_until(self.node, lambda: any(predicate(d) for d in self.diags[start:]), timeout), \
            f"no /diagnostics as expected within {timeout} s; last: {self.diags[-1:]}"
        return next(d for d in self.diags[start:] if predicate(d))


@pytest.fixture(scope="module")
def sim(ros_env):
    if importlib.util.find_spec("mujoco") is None:
        pytest.skip("mujoco is not installed (make sim-venv)")
    proc = NodeProcess("sim_robot_node", {"image_width": WIDTH, "image_height": HEIGHT, "camera_rate_hz": CAMERA_HZ,
                                          "joint_state_rate_hz": STATE_HZ, "diagnostics_period": 0.5},
                       env=ros_env, remaps={"__ns": NS})
    yield proc
    # SIGTERM, as a process manager stops it: exit code 0, no thread left behind
    if proc.alive():
        proc.proc.send_signal(signal.SIGTERM)
        try:
            proc.proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.proc.kill()
            proc.proc.wait()
        out = proc.output()
        assert proc.proc.returncode == 0, f"exit code {proc.proc.returncode} on SIGTERM:\n{out[-3000:]}"
        assert "SIGTERM: shutting down" in out and LIVE_THREADS_MESSAGE not in out, out[-3000:]


@pytest.fixture()
def client(sim, client):
    c = Client(client)
    assert spin_until(client, lambda: len(c.states) > 0 and len(c.images) > 0, 60), \
        f"no joint_states or image from sim_robot_node within 60 s:\n{sim.output()[-3000:]}"
    return c


def test_camera_frames_and_joint_states_at_their_rates(sim, client):
    assert "configured built-in arm" in sim.output() and "camera 'scene' 160x120 at 10 Hz" in sim.output()
    client.images.clear()
    client.states.clear()
    t0 = time.monotonic()
    client.spin(3.0)
    seconds = time.monotonic() - t0
    images, states = client.images, client.states
    # the rates are on simulated time, which a loaded machine can slow down; never faster than asked
    assert 0.5 * CAMERA_HZ * seconds <= len(images) <= 1.2 * CAMERA_HZ * seconds + 1, len(images)
    assert 0.5 * STATE_HZ * seconds <= len(states) <= 1.2 * STATE_HZ * seconds + 1, len(states)
    for img in images:
        assert (img.width, img.height, img.encoding, img.step) == (WIDTH, HEIGHT, "rgb8", 3 * WIDTH)
        assert img.header.frame_id == "scene"
    rgb = np.frombuffer(images[-1].data, np.uint8).reshape(HEIGHT, WIDTH, 3)
    assert rgb.std() > 20 and len(np.unique(rgb.reshape(-1, 3), axis=0)) > 50  # a picture, not a fill
    stamps = [m.header.stamp.sec + m.header.stamp.nanosec * 1e-9 for m in images]
    assert all(b > a for a, b in zip(stamps, stamps[1:]))
    assert abs(stamps[-1] - time.time()) < 2.0  # ROS time of the render
    s = states[-1]
    assert list(s.name) == JOINTS and len(s.velocity) == len(s.effort) == 7
    np.testing.assert_allclose(s.position, HOME, atol=2e-3)  # the built-in arm starts at home and holds
    d = client.diag_where(lambda d: int(d["frames_rendered"]) > 0)
    assert float(d["physics_rate_target_hz"]) == 500.0 and 200.0 <= float(d["physics_rate_hz"]) < 550.0, d
    assert d["gl_backend"] in ("egl", "osmesa") and float(d["render_ms"]) > 0


def test_a_command_moves_the_joints_to_the_target(client):
    target = [0.5, 0.2, 1.3, -0.4, 0.9, 0.6, 0.035]
    client.command(target)
    t0 = time.monotonic()
    reached = spin_until(client.node, lambda: np.abs(client.position() - target).max() < 0.01, 10.0)
    assert reached, f"not at the target 10 s after the command: {client.position()}"
    assert time.monotonic() - t0 < 5.0
    client.spin(0.5)
    np.testing.assert_allclose(client.position(), target, atol=0.005)
    assert np.abs(client.states[-1].velocity).max() < 0.05


def test_a_command_beyond_the_ranges_is_clamped_and_the_joints_stay_within(client):
    before = int(client.diag_where(lambda d: True)["targets_clamped"])
    command = [4.0, 0.2, 1.3, -0.4, 0.9, -5.0, 0.2]  # joint_1, joint_6 and the gripper beyond their ranges
    clamped = np.clip(command, LOWER, UPPER)
    start = len(client.states)
    client.command(command)
    assert spin_until(client.node, lambda: np.abs(client.position() - clamped).max() < 0.01, 10.0), \
        f"not at the clamped target: {client.position()}"
    client.spin(0.5)
    seen = np.array([m.position for m in client.states[start:]])
    assert (seen >= LOWER - 1e-3).all() and (seen <= UPPER + 1e-3).all()
    d = client.diag_where(lambda d: int(d["targets_clamped"]) >= before + 3)
    assert int(d["commands_refused"]) == 0


def test_bad_commands_are_refused_counted_and_the_arm_holds(sim, client):
    held = client.position()
    before = client.diag_where(lambda d: True)
    bad = [[0.1] * 6, [0.1, 0.2, math.nan, 0.0, 0.0, 0.0, 0.01], [0.0, 0.0, 0.0, 0.0, 0.0, math.inf, 0.01]]
    for values in bad:
        client.command(values)
        client.spin(0.1)
    d = client.diag_where(lambda d: int(d["commands_refused"]) >= int(before["commands_refused"]) + 3)
    assert int(d["commands_refused"]) == int(before["commands_refused"]) + 3
    assert int(d["commands_received"]) == int(before["commands_received"]) + 3
    assert d["last_refusal"] == "not finite: joint_6=inf"
    assert sim.wait_output("refused joint_command (6 values for 7 joints (joint_1, joint_2, joint_3, joint_4, "
                           "joint_5, joint_6, gripper)); holding the last target", 5)
    client.spin(1.0)
    np.testing.assert_allclose(client.position(), held, atol=2e-3)


def test_deactivate_pauses_the_physics_and_activate_resumes_it(client):
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState
    from synflux_ros.tools.harness import call_service, lifecycle_probe
    change = client.node.create_client(ChangeState, f"{NS}/sim_robot_node/change_state")

    def transition(tid):
        r = call_service(client.node, change, ChangeState.Request(transition=Transition(id=tid)), 20,
                         probe=lifecycle_probe())
        assert r.success

    transition(Transition.TRANSITION_DEACTIVATE)
    paused = client.diag_where(lambda d: d["_message"] == "inactive (physics paused)")
    client.spin(0.3)
    client.states.clear()
    client.command([0.0] * 7)  # dropped while inactive
    client.spin(1.0)
    assert not client.states
    d = client.diag_where(lambda d: int(d["commands_while_inactive"]) >= 1)
    assert client.diag_where(lambda later: True)["sim_time_s"] == d["sim_time_s"]  # simulated time stands still
    transition(Transition.TRANSITION_ACTIVATE)
    assert spin_until(client.node, lambda: len(client.states) > 5, 10)
    d = client.diag_where(lambda d: float(d["sim_time_s"]) > float(paused["sim_time_s"]) + 0.2)
    assert d["_message"].startswith("stepping at")


@needs_mujoco
@pytest.mark.parametrize("backend,library", [("egl", "EGL"), ("osmesa", "OSMesa")])
def test_each_headless_backend_renders_frames(ros_env, backend, library):
    if ctypes.util.find_library(library) is None:
        pytest.skip(f"lib{library} is not installed")
    import rclpy
    ns = f"/gl_{backend}"
    client = rclpy.create_node(f"gl_{backend}_client")
    proc = NodeProcess("sim_robot_node", {"image_width": 64, "image_height": 48, "camera": "wrist",
                                          "diagnostics_period": 0.5},
                       env=dict(ros_env, MUJOCO_GL=backend), remaps={"__ns": ns})
    images, diags = [], []
    try:
        client.create_subscription(Image, f"{ns}/image", images.append, qos_profile_sensor_data)
        client.create_subscription(DiagnosticArray, "/diagnostics", lambda m: diags.extend(
            {kv.key: kv.value for kv in st.values} for st in m.status if st.name.startswith(ns)), 10)
        assert spin_until(client, lambda: len(images) >= 3 and diags, 60), proc.output()[-3000:]
    finally:
        client.destroy_node()
        assert proc.stop() == 0, proc.output()[-3000:]
    rgb = np.frombuffer(images[-1].data, np.uint8).reshape(48, 64, 3)
    assert rgb.std() > 5 and diags[-1]["gl_backend"] == backend


@needs_mujoco
@pytest.mark.parametrize("params,needle", [
    ({"physics_rate_hz": 100}, "parameter 'physics_rate_hz': 100: must be a number >= 200"),
    ({"camera": "top"}, "parameter 'camera': camera 'top' is not in the model (its cameras: scene, wrist)"),
    ({"joint_names": ["joint_1", "elbow"]}, "parameter 'joint_names': joint 'elbow' is not in built-in arm"),
    ({"initial_positions": [0.0, 0.1]}, "parameter 'initial_positions': initial positions: 2 values for 7 joints"),
    ({"image_width": 0}, "parameter 'image_width': 0: must be an integer from 1 to 4096"),
    ({"model": "/nonexistent/arm.xml"}, "parameter 'model': '/nonexistent/arm.xml': no such file"),
    ({"camera_rate_hz": 1000.0}, "parameter 'camera_rate_hz': 1000.0 Hz: above physics_rate_hz (500 Hz)"),
    ({"real_time": "often"}, "parameter 'real_time': 'often': must be true or false"),
    ({"publish_clock": 1}, "parameter 'publish_clock': 1: must be true or false"),
    ({"clock_rate_hz": 1000.0}, "parameter 'clock_rate_hz': 1000.0 Hz: above physics_rate_hz (500 Hz)"),
])
def test_a_bad_parameter_fails_at_start_naming_it(ros_env, params, needle):
    proc = NodeProcess("sim_robot_node", params, env=ros_env, remaps={"__ns": "/badsim"})
    try:
        code = proc.proc.wait(60)
    finally:
        proc.stop()
    out = proc.output()
    assert code == 1, out[-3000:]
    assert f"[sim_robot_node] {needle}" in out, out[-3000:]


# ----------------------------------------------------------------------------- launch/sim.launch.py
# Run against test_launch_files.py's stand-in of ROS 2's launch API (launch is not installable here).
from test_launch_files import LAUNCH_DIR, load_launch_file, nodes, parameters_of, run  # noqa: E402
from test_launch_files import stand_in_launch  # noqa: E402,F401  (the fixture)

SIM_LAUNCH = LAUNCH_DIR / "sim.launch.py"


def test_sim_launch_starts_the_arm_and_vla_node_on_its_joints(stand_in_launch):
    from synflux_ros.nodes.sim_robot_node import PARAMS
    from synflux_ros.sim import arm
    launch = load_launch_file(SIM_LAUNCH)
    assert launch.BUILT_IN_JOINTS == list(arm.JOINT_NAMES)
    assert launch.CAMERA_RATE_HZ == next(p.default for p in PARAMS if p.name == "camera_rate_hz")
    started = nodes(run(SIM_LAUNCH))
    assert set(started) == {"sim_robot_node", "vla_node"}
    # defaults: the node's own, but simulated time on /clock, which vla_node follows
    assert parameters_of(started["sim_robot_node"]) == ([], {"publish_clock": True})
    # config: the arm's (joints and limits); the camera's rate, so that vla_node counts frames lost on the way
    assert parameters_of(started["vla_node"]) == ([], {"config": "vla_sim_arm.yaml", "joint_names": JOINTS,
                                                        "camera_rate_hz": 10.0, "use_sim_time": True})
    assert started["vla_node"].namespace == started["sim_robot_node"].namespace == ""


def test_sim_launch_arguments_become_typed_parameters(stand_in_launch, tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("/**:\n  ros__parameters:\n    diagnostics_period: 2.0\n")
    started = nodes(run(SIM_LAUNCH, {
        "model": "/robots/arm.xml", "joint_names": "a, b", "image_width": "448", "image_height": "320",
        "camera_rate_hz": "15", "physics_rate_hz": "1000", "real_time": "false", "initial_positions": "[0, 0.5]",
        "camera": "wrist", "executor": "onnxruntime", "config": "vla_pi0.yaml", "namespace": "arm",
        "params_file": str(params), "use_sim_time": "false"}))
    files, sim = parameters_of(started["sim_robot_node"])
    assert files == [str(params)]
    assert sim == {"model": "/robots/arm.xml", "joint_names": ["a", "b"], "camera": "wrist", "image_width": 448,
                   "image_height": 320, "camera_rate_hz": 15.0, "physics_rate_hz": 1000.0, "real_time": False,
                   "initial_positions": [0.0, 0.5], "publish_clock": False}
    assert type(sim["image_width"]) is int and type(sim["camera_rate_hz"]) is float
    assert parameters_of(started["vla_node"])[1] == {"config": "vla_pi0.yaml", "executor": "onnxruntime",
                                                     "joint_names": ["a", "b"], "camera_rate_hz": 15.0,
                                                     "use_sim_time": False}
    assert started["vla_node"].namespace == started["sim_robot_node"].namespace == "arm"


@pytest.mark.parametrize("arguments,needle", [
    ({"model": "/robots/arm.xml"}, "joint_names: required with model:="),
    ({"image_width": "wide"}, "image_width:='wide': expected an integer"),
    ({"physics_rate_hz": "fast"}, "physics_rate_hz:='fast': expected a number"),
    ({"initial_positions": "[0, up]"}, "initial_positions:='[0, up]': expected numbers"),
])
def test_sim_launch_refuses_bad_arguments_naming_them(stand_in_launch, arguments, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        run(SIM_LAUNCH, arguments)
