"""`make sim`: the MuJoCo arm and vla_node in a closed loop, as launch/sim.launch.py starts them.

Starts ``sim_robot_node`` and ``vla_node`` as processes on one DDS domain: the arm's camera frames and joint states
go to vla_node, its ``joint_command`` back to the arm. Enables the commands through vla_node's ``~/enable``
service where it has one, runs for ``--seconds`` and prints what happened: frames, chunks, commands (taken,
refused, clamped by the arm) and how each joint moved. Exits with 1 when no command reached the arm, saying why.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Float64MultiArray, String

from ..msg import ActionChunk
from ..sim import arm
from .harness import NodeProcess, call_service, ros_env, run_with_nodes, spin_until, use_env

START_TIMEOUT_S = 90.0
ENABLE_TIMEOUT_S = 15.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="how long the loop runs once enabled")
    ap.add_argument("--config", default="vla_sim_arm.yaml", help="vla_node's model config (default: the demo "
                                                                 "model with the arm's joints and limits)")
    ap.add_argument("--executor", default="", help="vla_node's backend (default: the config's)")
    ap.add_argument("--graph-dir", default="", help="vla_node's graph set (default: the config's)")
    ap.add_argument("--instruction", default="put the red block on the green pad")
    ap.add_argument("--model", default="", help="MJCF of the robot (default: the built-in arm)")
    ap.add_argument("--joints", default="", help="commanded joints, comma-separated (default: the built-in arm's)")
    ap.add_argument("--camera", default="scene", help="camera of the model that feeds vla_node")
    ap.add_argument("--image-size", type=int, nargs=2, default=(224, 224), metavar=("WIDTH", "HEIGHT"))
    ap.add_argument("--camera-rate", type=float, default=10.0, help="frames per second")
    args = ap.parse_args(argv)

    joints = [j for j in args.joints.split(",") if j] or list(arm.JOINT_NAMES)
    env = ros_env()
    use_env(env)
    print(f"starting sim_robot_node ({args.model or 'built-in arm'}, camera {args.camera!r} "
          f"{args.image_size[0]}x{args.image_size[1]} at {args.camera_rate:g} Hz) and vla_node ({args.config}"
          f"{', ' + args.executor if args.executor else ''}), ROS_DOMAIN_ID={env['ROS_DOMAIN_ID']}")
    sim = NodeProcess("sim_robot_node", {"model": args.model, "joint_names": joints, "camera": args.camera,
                                         "image_width": args.image_size[0], "image_height": args.image_size[1],
                                         "camera_rate_hz": args.camera_rate, "publish_clock": True}, env=env)
    vla_params = {"config": args.config, "executor": args.executor, "joint_names": joints,
                  "camera_rate_hz": args.camera_rate, "use_sim_time": True}  # on the simulation's clock
    if args.graph_dir:
        vla_params["graph_dir"] = args.graph_dir
    vla = NodeProcess("vla_node", vla_params, env=env)
    procs = [sim, vla]
    return run_with_nodes("synflux_sim_loop", procs, START_TIMEOUT_S,
                          lambda node: Loop(node, joints, args.model == "").run(args.seconds, args.instruction))


class Loop:
    """What the client sees of the loop: frames, chunks, commands, joint states and both nodes' diagnostics."""

    def __init__(self, node, joints, built_in: bool):
        self.node, self.joints, self.built_in = node, joints, built_in
        self.frames, self.chunks, self.commands, self.states = 0, [], [], []
        self.diags: dict[str, dict] = {}
        latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.instruction = node.create_publisher(String, "instruction", latched)
        node.create_subscription(Image, "image", self._on_frame, qos_profile_sensor_data)
        node.create_subscription(ActionChunk, "action_chunk", self.chunks.append, 50)
        node.create_subscription(Float64MultiArray, "joint_command", self.commands.append, 100)
        node.create_subscription(JointState, "joint_states", self._on_state, 200)
        node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, 20)

    def _on_frame(self, msg):
        self.frames += 1

    def _on_state(self, msg):
        self.states.append((time.monotonic(), np.array(msg.position)))

    def _on_diag(self, msg):
        for st in msg.status:
            for kind in ("sim_robot", "vla"):
                if st.name.endswith(f": {kind}"):
                    self.diags[kind] = {kv.key: kv.value for kv in st.values} | {"_message": st.message}

    def spin(self, seconds: float):
        spin_until(self.node, lambda: False, seconds)

    def enable(self) -> str:
        """Call vla_node's ~/enable until it answers success; "" when enabled, else why not."""
        from std_srvs.srv import SetBool
        client = self.node.create_client(SetBool, "/vla_node/enable")
        if not client.wait_for_service(timeout_sec=ENABLE_TIMEOUT_S):
            return ("vla_node offers no ~/enable service: this vla_node does not stream joint_command (it needs "
                    "the chunk executor with execution joints)")
        deadline, message = time.monotonic() + ENABLE_TIMEOUT_S, ""
        while time.monotonic() < deadline:
            r = call_service(self.node, client, SetBool.Request(data=True), ENABLE_TIMEOUT_S, idempotent=True)
            if r.success:
                print(f"vla_node ~/enable: {r.message}")
                return ""
            message = r.message
            self.spin(1.0)  # e.g. no joint state yet
        return f"vla_node refused ~/enable for {ENABLE_TIMEOUT_S:.0f} s: {message}"

    def run(self, seconds: float, instruction: str) -> bool:
        spin_until(self.node, lambda: self.instruction.get_subscription_count() > 0, 20)
        self.instruction.publish(String(data=instruction))
        spin_until(self.node, lambda: self.frames > 0 and self.states, 30)
        why_not = self.enable()
        if why_not:
            print(why_not)
        start_state = self.states[-1][1] if self.states else None
        t0, frames0, chunks0, commands0 = time.monotonic(), self.frames, len(self.chunks), len(self.commands)
        print(f"\n== closed loop for {seconds:g} s, instruction {instruction!r} ==")
        print(f"{'t s':>5} {'frames':>7} {'chunks':>7} {'commands':>9}  joint positions ({', '.join(self.joints)})")
        while time.monotonic() - t0 < seconds:
            self.spin(min(2.0, seconds - (time.monotonic() - t0)))
            pos = " ".join(f"{v:+.2f}" for v in self.states[-1][1]) if self.states else "-"
            print(f"{time.monotonic() - t0:5.1f} {self.frames - frames0:7d} {len(self.chunks) - chunks0:7d} "
                  f"{len(self.commands) - commands0:9d}  {pos}")
        self.spin(1.2)  # one more round of diagnostics
        return self.report(time.monotonic() - t0, frames0, chunks0, commands0, start_state, why_not)

    def report(self, elapsed, frames0, chunks0, commands0, start_state, why_not) -> bool:
        frames, chunks = self.frames - frames0, self.chunks[chunks0:]
        commands = self.commands[commands0:]
        sim, vla = self.diags.get("sim_robot", {}), self.diags.get("vla", {})
        print("\n== what happened ==")
        print(f"camera frames  {frames} ({frames / elapsed:.1f} Hz), rendered in {sim.get('render_ms', '?')} ms "
              f"({sim.get('gl_backend', '?')})")
        lat = f", median latency {np.median([c.latency_ms for c in chunks]):.1f} ms" if chunks else ""
        print(f"action chunks  {len(chunks)} ({len(chunks) / elapsed:.1f} Hz){lat}")
        print(f"joint_command  {len(commands)} ({len(commands) / elapsed:.1f} Hz) seen; the arm took "
              f"{sim.get('commands_received', '?')} in all, refused {sim.get('commands_refused', '?')} "
              f"({sim.get('last_refusal') or 'none'}), clamped {sim.get('targets_clamped', '?')} values to the joint "
              "ranges")
        print(f"physics        {sim.get('physics_rate_hz', '?')} Hz (real-time factor "
              f"{sim.get('real_time_factor', '?')}, lag resets {sim.get('lag_resets', '?')})")
        if vla:
            print(f"vla_node       {vla.get('_message', '')}")
            if vla.get("last_chunk_error"):
                print(f"               last refused: {vla['last_chunk_error']}")
        moved = self.motion(start_state)
        if not commands:
            print(f"\nNo joint_command arrived from vla_node in {elapsed:.0f} s: the loop is not closed. "
                  f"{why_not or 'vla_node was enabled but published no command (see its /diagnostics above).'}")
            return False
        if not moved:
            print("\nCommands arrived but no joint moved by more than 0.01.")
        return True

    def motion(self, start) -> bool:
        """Print how each joint moved over the run; True when any moved by more than 0.01."""
        if start is None or not self.states:
            print("no joint states received")
            return False
        seen = np.array([p for _, p in self.states if len(p) == len(self.joints)])
        end = self.states[-1][1]
        print(f"\n{'joint':<10} {'start':>7} {'end':>7} {'min':>7} {'max':>7}  range")
        for i, name in enumerate(self.joints):
            lo, hi = (arm.JOINTS[name][:2] if self.built_in and name in arm.JOINTS else (None, None))
            within = "" if lo is None else ("within" if lo - 1e-3 <= seen[:, i].min() and seen[:, i].max() <= hi + 1e-3
                                            else "OUTSIDE")
            span = "" if lo is None else f"{lo:+.2f} .. {hi:+.2f} {within}"
            print(f"{name:<10} {start[i]:+7.3f} {end[i]:+7.3f} {seen[:, i].min():+7.3f} {seen[:, i].max():+7.3f}  "
                  f"{span}")
        return bool(np.abs(seen - start).max() > 0.01)


if __name__ == "__main__":
    raise SystemExit(main())
