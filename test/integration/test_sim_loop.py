"""The robot in the loop: sim_robot_node (MuJoCo arm, headless camera) and vla_node over real DDS. The arm
moves only within the configured limits while commands are enabled, stands still once disabled, and holds
where it was when vla_node stops."""
from __future__ import annotations

import time

import numpy as np
import pytest
import yaml
from sensor_msgs.msg import JointState
from std_msgs.msg import Float64MultiArray
from std_srvs.srv import SetBool

from synflux_ros.tools.harness import call_service, config_path, spin_until

pytest.importorskip("mujoco", reason="mujoco is not installed (make sim-venv)")

with open(config_path("vla_sim_arm.yaml"), encoding="utf-8") as _fh:
    EXECUTION = yaml.safe_load(_fh)["execution"]
LO = np.array(EXECUTION["limits"]["position_min"])
HI = np.array(EXECUTION["limits"]["position_max"])
TRACKING_TOLERANCE = 0.05  # servo overshoot past a commanded limit (rad / m)


class Loop:
    def __init__(self, node, ns):
        self.node = node
        self.commands, self.states = [], []
        node.create_subscription(Float64MultiArray, f"{ns}/joint_command",
                                 lambda m: self.commands.append((time.monotonic(), np.array(m.data))), 500)
        node.create_subscription(JointState, f"{ns}/joint_states",
                                 lambda m: self.states.append((time.monotonic(), np.array(m.position))), 500)
        self.enable_client = node.create_client(SetBool, f"{ns}/vla_node/enable")

    def spin(self, seconds):
        spin_until(self.node, lambda: False, seconds)

    def enable(self, on, timeout=60.0):
        deadline = time.monotonic() + timeout
        while True:
            resp = call_service(self.node, self.enable_client, SetBool.Request(data=on), timeout=30.0,
                                idempotent=True)
            if resp.success or time.monotonic() > deadline:
                return resp
            self.spin(0.5)

    def positions_since(self, t0):
        return np.array([q for t, q in self.states if t >= t0])


@pytest.mark.parametrize("backend", ["mock", "onnxruntime"])
def test_the_arm_follows_within_the_limits_stops_when_disabled_and_holds_when_the_node_stops(
        backend, start_node, client, demo_graphs):
    ns = f"/loop_{backend}"
    start_node("sim_robot_node", {"image_width": 224, "image_height": 224, "camera_rate_hz": 15.0,
                                  "joint_state_rate_hz": 100.0}, namespace=ns)
    params = {"config": "vla_sim_arm.yaml", "executor": backend}
    if backend == "onnxruntime":
        params["graph_dir"] = str(demo_graphs["vla_demo_orin"])
    vla = start_node("vla_node", params, namespace=ns)
    loop = Loop(client, ns)
    assert loop.enable_client.wait_for_service(timeout_sec=60), f"no enable service:\n{vla.output()[-3000:]}"
    assert spin_until(client, lambda: len(loop.states) > 10, 60), "no joint_states from the sim"
    loop.spin(1.0)
    assert not loop.commands, "commands before ~/enable"
    resp = loop.enable(True)
    assert resp.success, resp.message
    t_enabled = time.monotonic()
    loop.spin(6.0)
    cmds = np.array([c for t, c in loop.commands])
    assert len(cmds) > 200, f"{len(cmds)} commands in 6 s:\n{vla.output()[-3000:]}"
    assert np.all(cmds >= LO - 1e-9) and np.all(cmds <= HI + 1e-9)
    moved = loop.positions_since(t_enabled)
    assert np.all(moved >= LO - TRACKING_TOLERANCE) and np.all(moved <= HI + TRACKING_TOLERANCE)
    assert np.ptp(moved[:, :6], axis=0).max() > 0.05, "the arm did not move"

    assert loop.enable(False).success
    loop.spin(0.5)
    n, t_off = len(loop.commands), time.monotonic()
    loop.spin(2.0)
    assert len(loop.commands) == n, "commands after disable"
    still = loop.positions_since(t_off + 0.5)  # the servos settle on the last command, then stand still
    assert np.ptp(still[:, :6], axis=0).max() < 0.01

    assert loop.enable(True).success
    loop.spin(2.0)
    vla.stop()
    t_stop = time.monotonic()
    loop.spin(0.3)  # what was sent before the exit arrives
    n = len(loop.commands)
    loop.spin(2.2)
    assert len(loop.commands) == n
    held = loop.positions_since(t_stop + 0.7)
    assert len(held) > 50 and np.ptp(held[:, :6], axis=0).max() < 0.01, "the arm drifted after vla_node stopped"
