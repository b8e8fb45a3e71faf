"""The robot side of ``bench.colocation``, over DDS: camera frames, joint states and two busy chat sessions for
vla_node and vlm_node started as processes, and what comes back (chunk latencies, chat tokens, both nodes'
``/diagnostics``), phase by phase."""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from ..core.sharing import parse_scheduling
from .tick_floor import FloorProbe

CAMERA_HZ = 10.0
STATE_HZ = 100.0
PROMPTS = ["Describe a robot arm picking up a red block, step by step.",
           "List five things a kitchen robot should never do, and why."]


class Load:
    """The bench's side of the robot: camera frames, joint states, two chat sessions, and what comes back."""

    def __init__(self, node, joints_state, image_side: int, camera_hz: float = CAMERA_HZ):
        from sensor_msgs.msg import Image
        from rclpy.qos import qos_profile_sensor_data

        from ..msg import ActionChunk
        from ..srv import Chat
        from .harness import JointStateStream, rgb_image, watch_diagnostics
        self.node = node
        self.camera_on = self.chat_on = False
        self.chunks: list[tuple[float, float, float]] = []  # (monotonic time, latency ms, the stages' ms)
        self.turns: list[tuple[float, int, float]] = []  # (monotonic time answered, tokens generated, seconds)
        self.refusals: list[str] = []
        self.diag = {"vla": None, "vlm": None, "planner": None}
        self.diag_at = {"vla": 0.0, "vlm": 0.0, "planner": 0.0}
        self._frames = [rgb_image(image_side, image_side, i) for i in range(4)]
        self._seq = 0
        self._image = node.create_publisher(Image, "/coloc/image", qos_profile_sensor_data)
        node.create_subscription(ActionChunk, "/coloc/action_chunk", lambda m: self.chunks.append(
            (time.monotonic(), m.latency_ms, m.vision_ms + m.backbone_ms + m.head_ms)), 100)
        self._chat = node.create_client(Chat, "/coloc/chat")
        self._Chat = Chat
        self._pending = [None, None]
        node.create_timer(1.0 / camera_hz, self._frame)
        self.states = JointStateStream(node, "/coloc/joint_states", joints_state, STATE_HZ).start()
        for key, name in (("vla", "vla_node"), ("vlm", "vlm_node"), ("planner", "planner")):
            watch_diagnostics(node, f"/coloc/{name}:", lambda v, k=key: self._on_diag(k, v))

    def _on_diag(self, key, values):
        self.diag[key], self.diag_at[key] = values, time.monotonic()

    def _frame(self):
        if not self.camera_on:
            return
        msg = self._frames[self._seq % len(self._frames)]
        self._seq += 1
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(time.time_ns(), 10**9)
        self._image.publish(msg)

    def pump_chat(self):
        """Keep one turn in flight per session while the chat is on."""
        for i, future in enumerate(self._pending):
            if future is not None and future.done():
                r = future.result()
                if r.success:
                    self.turns.append((time.monotonic(), r.generated_tokens, r.total_ms * 1e-3))
                else:
                    self.refusals.append(r.error)
                self._pending[i] = future = None
            if future is None and self.chat_on:
                req = self._Chat.Request(session_id=f"bench{i}", prompt=PROMPTS[i], reset=True)
                self._pending[i] = self._chat.call_async(req)

    def stop(self):
        self.states.stop()


def _spin(node, ex, load: Load, seconds: float, until=None):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        load.pump_chat()
        if until is not None and until():
            return True
        ex.spin_once(timeout_sec=0.01)
    return until() if until is not None else True


def floor_probe(vla_params: dict) -> FloorProbe:
    """A bare tick on the command thread's cores at its policy, one real-time priority below it (so that it
    never delays the command thread it is compared with)."""
    sched = parse_scheduling(vla_params.get("command_scheduling", "normal"))
    if sched.policy in ("fifo", "rr") and sched.priority > 1:
        sched = replace(sched, priority=sched.priority - 1)
    return FloorProbe(str(sched), str(vla_params.get("command_cpus") or vla_params.get("cpus") or ""))


def phase(node, ex, load: Load, name: str, camera: bool, chat: bool, seconds: float, warmup: float,
          floor: FloorProbe | None = None) -> dict:
    """One phase's figures: the load on for ``warmup`` + ``seconds``, figures from the last ``seconds``; with
    ``floor``, that probe's figures over the same seconds (``floor_*``, ``steal_share``)."""
    load.camera_on, load.chat_on = camera, chat
    _spin(node, ex, load, warmup)
    start_diag = dict(load.diag["vla"] or {})
    if floor is not None:
        floor.run_for(seconds)
    t0 = time.monotonic()
    _spin(node, ex, load, seconds)
    t1 = time.monotonic()
    _spin(node, ex, load, 3.0, lambda: load.diag_at["vla"] > t1 and load.diag_at["vlm"] > t1)  # a fresh report
    end_diag = dict(load.diag["vla"] or {})
    vlm_diag = dict(load.diag["vlm"] or {})
    load.camera_on = load.chat_on = False
    _spin(node, ex, load, 60.0, lambda: all(f is None for f in load._pending))  # the turns in flight end
    lat = np.array([ms for t, ms, _ in load.chunks if t0 <= t <= t1])
    stages = np.array([ms for t, _, ms in load.chunks if t0 <= t <= t1])
    turns = [(n, s) for t, n, s in load.turns if t0 <= t <= t1]
    # tokens per second of the turns' own time (each turn's total, as the node timed it): a phase holds a dozen
    # turns, whose count alone would move the rate by a twelfth
    out = {"phase": name, "chunks": int(lat.size), "turns": len(turns),
           "chat_tok_s": sum(n for n, _ in turns) / sum(s for _, s in turns) if turns else 0.0}
    if lat.size:
        out.update(vla_p50_ms=float(np.percentile(lat, 50)), vla_p99_ms=float(np.percentile(lat, 99)),
                   vla_max_ms=float(lat.max()), stages_p50_ms=float(np.percentile(stages, 50)),
                   stages_p99_ms=float(np.percentile(stages, 99)))
    if end_diag:
        out.update(late_p99_ms=float(end_diag.get("control_late_p99_ms", "nan")),
                   late_max_ms=float(end_diag.get("control_recent_max_late_ms", "nan")),
                   ticks_skipped=int(end_diag.get("control_ticks_skipped", 0))
                   - int(start_diag.get("control_ticks_skipped", 0)),
                   commands_enabled=end_diag.get("commands_enabled"),
                   vla_cpu_wait_share=float(end_diag.get("cpu_wait_share", "nan")),
                   vla_arbiter_wait_ms=float(end_diag.get("arbiter_wait_ms", 0.0)),
                   vla_warnings=end_diag.get("sharing_warnings", ""))
    if floor is not None:
        f = floor.result()
        out.update(floor_late_p99_ms=f["late_p99_ms"], floor_late_max_ms=f["late_max_ms"],
                   floor_ticks_skipped=f["ticks_skipped"], steal_share=f["steal_share"], floor_warning=f["warning"])
    if vlm_diag:
        out.update(vlm_cpu_wait_share=float(vlm_diag.get("cpu_wait_share", "nan")),
                   vlm_arbiter_wait_ms=float(vlm_diag.get("arbiter_wait_ms", 0.0)))
    return out


PLANNER_GOAL = "put the red block in the bowl"


def run_setting(vla_params: dict, vlm_params: dict, vla_cfg: str, joints: list[str], state_joints: list[str],
                side: int, vlm_cfg: str, seconds: float, warmup: float, planner_cfg: str | None = None,
                vla_remaps: dict | None = None, camera_hz: float = CAMERA_HZ) -> list[dict]:
    """Both nodes started with their parameters; the figures of the phases VLA alone, chat alone, both, and
    with ``planner_cfg`` (a VLM with vision) both with a second vlm_node planning for the VLA once a second
    (started with the others, given its goal when its phase starts; the chat's settings). ``vla_remaps``: the
    VLA's topic remaps (a model with named cameras subscribes ``<camera>/image``); ``camera_hz``: the frame rate.
    A :func:`floor_probe` runs through every phase."""
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    from std_msgs.msg import String
    from std_srvs.srv import SetBool

    from .harness import NodeProcess, client_node, ros_env, wait_configured
    env = ros_env()
    vla = NodeProcess("vla_node", {"config": vla_cfg, "joint_names": joints, "diagnostics_period": 0.5,
                                   **vla_params}, env=env, remaps={"__ns": "/coloc", **(vla_remaps or {})})
    vlm = NodeProcess("vlm_node", {"config": vlm_cfg, "diagnostics_period": 0.5, **vlm_params}, env=env,
                      remaps={"__ns": "/coloc"})
    procs = [vla, vlm]
    if planner_cfg:
        procs.append(NodeProcess("vlm_node", {"config": planner_cfg, "diagnostics_period": 0.5, "planner_period": 1.0,
                                              "planner_max_new_tokens": 12, **vlm_params}, env=env,
                                 node_name="planner", remaps={"__ns": "/coloc", "chat": "planner/chat",
                                                              "end_session": "planner/end_session"}))
    try:
        if not wait_configured(procs, 180):
            raise RuntimeError("the nodes did not configure:\n" + "\n".join(p.output()[-3000:] for p in procs))
        with client_node("bench_colocation", env) as node:
            ex = SingleThreadedExecutor()
            ex.add_node(node)
            load = Load(node, state_joints, side, camera_hz)
            try:
                enable = node.create_client(SetBool, "/coloc/vla_node/enable")
                _spin(node, ex, load, 2.0)
                load.camera_on = True
                _spin(node, ex, load, 3.0)
                if not enable.wait_for_service(timeout_sec=20):
                    raise RuntimeError("no /coloc/vla_node/enable service")
                for _ in range(10):  # enabling twice is harmless: resent until answered (a first response may be lost)
                    future = enable.call_async(SetBool.Request(data=True))
                    if _spin(node, ex, load, 2.0, future.done):
                        break
                if not future.done() or not future.result().success:
                    raise RuntimeError(f"enable failed: {future.result().message if future.done() else 'no answer'}")
                load.camera_on = False
                floor = floor_probe(vla_params)
                rows = [phase(node, ex, load, "vla alone", True, False, seconds, warmup, floor),
                        phase(node, ex, load, "chat alone", False, True, seconds, warmup, floor),
                        phase(node, ex, load, "both", True, True, seconds, warmup, floor)]
                if planner_cfg:
                    goal = node.create_publisher(String, "/coloc/goal", QoSProfile(
                        depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL))
                    goal.publish(String(data=PLANNER_GOAL))
                    rows.append(phase(node, ex, load, "both+planner", True, True, seconds, warmup, floor))
                    d = load.diag.get("planner") or {}
                    rows[-1].update(planner_requests=int(d.get("planner_requests", 0)),
                                    planner_published=int(d.get("planner_published", 0)),
                                    planner_unchanged=int(d.get("planner_unchanged", 0)),
                                    vla_instruction=(load.diag["vla"] or {}).get("instruction", ""))
                if load.refusals:
                    print(f"    chat refusals: {sorted(set(load.refusals))[:3]}")
            finally:
                load.stop()
                ex.shutdown()
    finally:
        for p in procs:
            p.stop()
    return rows


