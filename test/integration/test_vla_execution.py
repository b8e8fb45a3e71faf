"""vla_node's command streams as a process over DDS: joint_command only while enabled, always within the
limits, held by the watchdog when chunks or joint states stop; joint_trajectory ahead of the clock."""
from __future__ import annotations

import time

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Float64MultiArray
from std_srvs.srv import SetBool
from trajectory_msgs.msg import JointTrajectory

from synflux_ros.tools.harness import call_service, rgb_image, spin_until

JOINTS = [f"joint_{i}" for i in range(7)]
LO, HI = -0.3, 0.4
VMAX = 1.5
RATE = 100.0
NS = "/arm"


class Robot:
    """The robot side: camera and joint states in, commands and diagnostics out."""

    def __init__(self, node):
        self.node = node
        self.image_pub = node.create_publisher(Image, f"{NS}/image", qos_profile_sensor_data)
        self.state_pub = node.create_publisher(JointState, f"{NS}/joint_states", 50)
        self.commands, self.trajs, self.diags = [], [], []
        node.create_subscription(Float64MultiArray, f"{NS}/joint_command",
                                 lambda m: self.commands.append((time.monotonic(), np.array(m.data))), 200)
        node.create_subscription(JointTrajectory, f"{NS}/joint_trajectory", self.trajs.append, 50)
        node.create_subscription(DiagnosticArray, "/diagnostics", self._diag, 50)
        self.enable_client = node.create_client(SetBool, f"{NS}/vla_node/enable")
        self.seq = 0

    def _diag(self, msg):
        for st in msg.status:
            if st.name.startswith(f"{NS}/vla_node:"):
                self.diags.append({kv.key: kv.value for kv in st.values})

    def now_ns(self) -> int:
        return self.node.get_clock().now().nanoseconds

    def run(self, seconds: float, images=True, states=True):
        """Publish camera frames (20 Hz) and joint states (100 Hz) stamped now, spinning in between."""
        end = time.monotonic() + seconds
        next_image = next_state = 0.0
        while time.monotonic() < end:
            t = time.monotonic()
            stamp = self.now_ns()
            if states and t >= next_state:
                msg = JointState(name=list(JOINTS), position=[0.0] * 7)
                msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(stamp, 10**9)
                self.state_pub.publish(msg)
                next_state = t + 0.01
            if images and t >= next_image:
                self.image_pub.publish(rgb_image(448, 448, self.seq, stamp))
                self.seq += 1
                next_image = t + 0.05
            import rclpy
            rclpy.spin_once(self.node, timeout_sec=0.002)

    def enable(self, on: bool):
        return call_service(self.node, self.enable_client, SetBool.Request(data=on), timeout=20.0, idempotent=True)


@pytest.fixture()
def robot(start_node, client, make_config):
    config = make_config("vla_demo_orin.yaml", execution={
        "joints": JOINTS, "control_rate_hz": RATE, "chunk_timeout": 0.4, "state_timeout": 0.3,
        "limits": {"position_min": [LO] * 7, "position_max": [HI] * 7, "max_velocity": [VMAX] * 7}})
    start_node("vla_node", {"config": config, "executor": "mock", "diagnostics_period": 0.2,
                            "publish_joint_trajectory": True}, namespace=NS)
    r = Robot(client)
    assert spin_until(client, lambda: r.image_pub.get_subscription_count() > 0, 30), "vla_node did not subscribe"
    assert r.enable_client.wait_for_service(timeout_sec=30), "no ~/enable service"
    return r


def within_limits(commands):
    cmds = np.array([c for _, c in commands])
    assert cmds.shape[1] == 7
    assert np.all(cmds >= LO - 1e-9) and np.all(cmds <= HI + 1e-9), (cmds.min(), cmds.max())
    steps = np.abs(np.diff(cmds, axis=0))
    # consecutive messages may skip a tick (DDS best effort is not used, but a tick can be late): the bound is
    # per tick, so a pair of messages can differ by at most the ticks between them
    gaps = np.maximum(1, np.round(np.diff([t for t, _ in commands]) * RATE))
    assert np.all(steps <= (VMAX / RATE) * (gaps[:, None] + 1) + 1e-9)
    return cmds


def test_commands_flow_only_while_enabled_and_within_the_limits(robot):
    robot.run(2.0)
    assert not robot.commands, "joint_command published before ~/enable"
    assert spin_until(robot.node, lambda: any(d.get("command_state") == "disabled" for d in robot.diags), 5)
    resp = robot.enable(True)
    assert resp.success, resp.message
    robot.run(3.0)
    assert len(robot.commands) > 100, len(robot.commands)
    cmds = within_limits(robot.commands)
    assert np.ptp(cmds, axis=0).max() > 0.05, "the arm was never commanded to move"
    d = robot.diags[-1]
    assert d["commands_enabled"] == "True" and int(d["chunks_accepted"]) > 10
    # the mock's actions span [-1, 1]: the limits had to intervene
    assert int(d["position_limit"]) > 0
    assert {"jerk_limit", "jerk_unmet", "braking", "braking_unmet", "relative_target_unmet"} <= set(d)
    assert robot.trajs, "no joint_trajectory while enabled"
    for traj in robot.trajs[-5:]:
        assert list(traj.joint_names) == JOINTS
        assert all(p.time_from_start.sec > 0 or p.time_from_start.nanosec > 0 for p in traj.points)
        assert all(LO - 1e-9 <= v <= HI + 1e-9 for p in traj.points for v in p.positions)
    robot.enable(False)
    robot.run(0.3)
    n = len(robot.commands)
    robot.run(1.0)
    assert len(robot.commands) == n, "joint_command kept flowing after disable"


def test_the_watchdog_holds_when_frames_or_joint_states_stop(robot):
    robot.run(1.0)
    assert robot.enable(True).success
    robot.run(1.5)
    robot.commands.clear()
    robot.run(1.5, images=False)  # no frames: no fresh chunk after chunk_timeout (0.4 s)
    t_last_chunk = robot.commands[0][0]
    held = [c for t, c in robot.commands if t > t_last_chunk + 0.7]
    assert len(held) > 30 and all(np.array_equal(c, held[0]) for c in held), "commands not held"
    assert spin_until(robot.node, lambda: "chunk_timeout" in robot.diags[-1].get("command_reason", ""), 5), \
        robot.diags[-1]
    robot.run(1.0)
    assert robot.diags[-1]["command_state"] == "running", robot.diags[-1]
    robot.commands.clear()
    robot.run(1.5, states=False)  # joint states stop: stale after state_timeout (0.3 s)
    held = [c for t, c in robot.commands if t > robot.commands[0][0] + 0.6]
    assert len(held) > 30 and all(np.array_equal(c, held[0]) for c in held)
    assert "joint state is" in robot.diags[-1]["command_reason"], robot.diags[-1]
    assert int(robot.diags[-1]["hold_stale_state"]) >= 1


def test_enable_is_refused_without_a_joint_state(robot):
    robot.run(0.5, states=False)
    resp = robot.enable(True)
    assert not resp.success and "no joint state" in resp.message
    robot.run(0.5)
    assert not robot.commands


@pytest.mark.parametrize("mode", ["rtc", "temporal_ensemble"])
def test_merge_modes_run_in_the_node(start_node, client, make_config, mode):
    config = make_config("vla_demo_orin.yaml", execution={
        "joints": JOINTS, "mode": mode, "request": "threshold", "chunk_size_threshold": 0.75,
        "limits": {"position_min": [LO] * 7, "position_max": [HI] * 7, "max_velocity": [VMAX] * 7}})
    start_node("vla_node", {"config": config, "executor": "mock", "diagnostics_period": 0.2}, namespace=NS)
    r = Robot(client)
    assert spin_until(client, lambda: r.image_pub.get_subscription_count() > 0, 30)
    assert r.enable_client.wait_for_service(timeout_sec=30)
    r.run(0.5)
    assert r.enable(True).success
    r.run(3.0)
    within_limits(r.commands)
    d = r.diags[-1]
    assert d["execution_mode"] == mode and int(d["chunks_accepted"]) >= 5, d
    assert int(d["frames_failed"]) == 0 and d["last_error"] == "", d
    assert int(d["frames_not_needed"]) > 0, d  # threshold: frames not needed while the plan is long enough
