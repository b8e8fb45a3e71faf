"""The MuJoCo arm and vla_node as processes over DDS, seen from their command stream (``bench.control``).

``sim_robot_node`` renders the camera and publishes joint states; its frames reach ``vla_node`` through a relay
in this process, so that they can be stopped without touching either node. :func:`measure` enables the
commands, runs the loop, stops the frames and returns: gaps in ``joint_command`` (stalls), the lag between a
joint's commanded and measured position, and when the first held command came after the chunk timeout.
"""
from __future__ import annotations

import os
import time

import numpy as np
import yaml
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Float64MultiArray
from std_srvs.srv import SetBool

from ..msg import ActionChunk
from ..sim import arm
from .harness import NodeProcess, call_service, client_node, config_path, ros_env, spin_until

START_TIMEOUT_S = 90.0
ENABLE_TIMEOUT_S = 30.0
GRID_S = 0.002
MAX_LAG_S = 0.4
MOVING = 0.05
"""A joint whose commands span less than this (rad or m) is left out of the tracking delay."""
CHUNK_TIMEOUT_S = 0.2
"""The watchdog's timeout in the loop: shorter than a chunk of the arm's config lasts, so that the chunk
timeout, not the plan running out, is what holds."""


class _Recorder:
    def __init__(self, node, joints):
        self.node, self.joints = node, list(joints)
        self.relay = True
        self.relayed = 0
        self.commands, self.states, self.chunks = [], [], []
        self._image = node.create_publisher(Image, "image", qos_profile_sensor_data)
        node.create_subscription(Image, "sim_image", self._on_image, qos_profile_sensor_data)
        node.create_subscription(Float64MultiArray, "joint_command",
                                 lambda m: self.commands.append((time.monotonic(), np.array(m.data))), 1000)
        node.create_subscription(JointState, "joint_states", self._on_state, 1000)
        node.create_subscription(ActionChunk, "action_chunk", lambda m: self.chunks.append(time.monotonic()), 50)
        self.diag: dict[str, str] = {}
        node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, 20)

    def _on_diag(self, msg):
        for st in msg.status:
            if st.name.endswith(": vla"):
                self.diag = {kv.key: kv.value for kv in st.values}

    def _on_image(self, msg):
        if self.relay:
            self._image.publish(msg)
            self.relayed += 1

    def _on_state(self, msg):
        index = {n: i for i, n in enumerate(msg.name)}
        if all(j in index for j in self.joints):
            self.states.append((time.monotonic(), np.array([msg.position[index[j]] for j in self.joints])))

    def spin(self, seconds: float) -> None:
        spin_until(self.node, lambda: False, seconds)


def stalls(times: np.ndarray, period: float) -> tuple[int, float]:
    """(gaps longer than two periods, the largest gap in seconds) between consecutive message times."""
    gaps = np.diff(times)
    return (int(np.count_nonzero(gaps > 2 * period)), float(gaps.max())) if len(gaps) else (0, 0.0)


def tracking_delay(cmd_t, cmd, state_t, state, lo: float, hi: float) -> tuple[float, int]:
    """Mean over the moving joints of the lag (s) that best aligns the measured position with the command
    (least squares over lags 0 .. MAX_LAG_S), on a uniform grid over [lo, hi]; (nan, 0) without one."""
    grid = np.arange(lo + MAX_LAG_S, hi, GRID_S)
    lags = np.arange(0.0, MAX_LAG_S, GRID_S)
    found = []
    for j in range(cmd.shape[1]):
        if np.ptp(cmd[:, j]) < MOVING:
            continue
        measured = np.interp(grid, state_t, state[:, j])
        err = [np.mean((measured - np.interp(grid - lag, cmd_t, cmd[:, j])) ** 2) for lag in lags]
        found.append(lags[int(np.argmin(err))])
    return (float(np.mean(found)), len(found)) if found else (float("nan"), 0)


def first_hold(cmd_t, cmd, after: float) -> float | None:
    """Time of the command from which every command repeats it exactly to the end of the stream (the
    watchdog's hold), if that comes after ``after``; None when the stream never settles so."""
    changed = [i for i in range(1, len(cmd)) if not np.array_equal(cmd[i], cmd[i - 1])]
    start = (changed[-1] if changed else 0) + 1  # the first repetition of the final command
    if start >= len(cmd) or cmd_t[start] <= after:
        return None
    return float(cmd_t[start])


def measure(seconds: float, work: str, config: str = "vla_sim_arm.yaml", executor: str = "mock",
            camera_rate_hz: float = 15.0) -> dict:
    """Run the loop for ``seconds`` once enabled, then stop the frames; the figures as a dict. ``config``
    (a name in the package's config directory) is written to ``work`` with the chunk timeout of
    :data:`CHUNK_TIMEOUT_S`."""
    with open(config_path(config), encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    execution = raw.setdefault("execution", {})
    execution["chunk_timeout"] = timeout = CHUNK_TIMEOUT_S
    rate = float(execution.get("control_rate_hz", 100.0))
    config = os.path.join(work, "control-loop-" + os.path.basename(config))
    with open(config, "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh)
    joints = list(arm.JOINT_NAMES)
    env = ros_env()
    sim = NodeProcess("sim_robot_node", {"joint_names": joints, "image_width": 224, "image_height": 224,
                                         "camera_rate_hz": camera_rate_hz, "joint_state_rate_hz": 100.0},
                      env=env, remaps={"image": "sim_image"})
    vla = NodeProcess("vla_node", {"config": config, "executor": executor, "joint_names": joints}, env=env)
    procs = [sim, vla]
    try:
        for p in procs:
            if not p.wait_output("configured", START_TIMEOUT_S):
                raise RuntimeError(f"{p.name} did not start: {p.output()[-1500:]}")
        with client_node("bench_control_loop", env) as node:
            rec = _Recorder(node, joints)
            client = node.create_client(SetBool, "/vla_node/enable")
            if not client.wait_for_service(timeout_sec=ENABLE_TIMEOUT_S):
                raise RuntimeError("vla_node offers no ~/enable service")
            spin_until(node, lambda: rec.relayed > 0 and len(rec.states) > 10, 30)
            deadline, message = time.monotonic() + ENABLE_TIMEOUT_S, ""
            while True:
                r = call_service(node, client, SetBool.Request(data=True), ENABLE_TIMEOUT_S, idempotent=True)
                if r.success:
                    break
                message = r.message
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vla_node refused ~/enable: {message}")
                rec.spin(0.5)
            t_enabled = time.monotonic()
            rec.spin(seconds)
            rec.relay, t_stopped = False, time.monotonic()
            rec.spin(timeout + 0.5)
            rec.diag = {}
            spin_until(node, lambda: bool(rec.diag), 5.0)  # a round of diagnostics from after the hold
    finally:
        for p in procs:
            p.stop()
    if len(rec.commands) < 10 or len(rec.states) < 10:
        raise RuntimeError(f"{len(rec.commands)} commands and {len(rec.states)} joint states: the loop did not run")
    cmd_t = np.array([t for t, _ in rec.commands])
    cmd = np.stack([c for _, c in rec.commands])
    st_t = np.array([t for t, _ in rec.states])
    st = np.stack([s for _, s in rec.states])
    running = (cmd_t >= t_enabled + 0.5) & (cmd_t <= t_stopped)
    n_stalls, largest = stalls(cmd_t[running], 1.0 / rate)
    delay, moving = tracking_delay(cmd_t, cmd, st_t, st, t_enabled + 0.5, t_stopped)
    last_chunk = max(rec.chunks) if rec.chunks else None
    held = None if last_chunk is None else first_hold(cmd_t, cmd, last_chunk)
    return {"seconds": t_stopped - t_enabled, "commands": int(running.sum()), "control_rate_hz": rate,
            "stalls": n_stalls, "largest_gap_ms": largest * 1e3, "tracking_delay_ms": delay * 1e3,
            "tracked_joints": moving, "chunks": len(rec.chunks), "chunk_timeout_s": timeout,
            "hold_after_timeout_ms": None if held is None else (held - last_chunk - timeout) * 1e3,
            "hold_reason": rec.diag.get("command_reason", "?"),
            "hold_reaction_ms": float(rec.diag.get("hold_reaction_ms", "nan")),
            "node_ticks": int(float(rec.diag.get("control_ticks", "0"))),
            "node_ticks_late": int(float(rec.diag.get("control_ticks_late", "0"))),
            "node_max_late_ms": float(rec.diag.get("control_max_late_ms", "nan")),
            "holds": {k: rec.diag.get(k, "?") for k in ("hold_chunk_timeout", "hold_ran_out")}}
