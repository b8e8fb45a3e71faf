"""Simulated robot node: a MuJoCo arm that follows ``joint_command`` and publishes ``joint_states`` and ``image``.

A stand-in for a ros2_control arm with a camera, for closed-loop runs of ``vla_node`` without hardware. The
physics (position servos at ``physics_rate_hz``) steps in a thread of its own and the camera renders headless
in another; the ROS callbacks only store the newest target. Parameters, topics and rendering backends:
docs/simulation.md.
"""
from __future__ import annotations

import math
import os
import threading
import time

from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray
from rcl_interfaces.msg import ParameterDescriptor
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.clock import Clock as RosClock, ClockType
from rclpy.lifecycle import State, TransitionCallbackReturn
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from rosgraph_msgs.msg import Clock
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Float64MultiArray

from ..sim.gl import NoBackend, select_backend
from ..sim.loop import SimLoop, Tick
from ..sim.robot import MIN_PHYSICS_RATE_HZ, SimError, SimRobot
from .diagnostics import ERROR, OK, WARN, diagnostic_array
from .lifecycle import ManagedNode, destroy_entities
from .params import Param, ParameterError
from .process import run_lifecycle_node
from .stamps import to_stamp

MAX_IMAGE_SIDE = 4096

PARAMS = [
    Param("model", "", "MJCF file of the robot and its scene (empty = the built-in 6-joint arm with a gripper)"),
    Param("joint_names", [], "commanded joints in joint_command order (empty = the built-in arm's joint_1 .. "
                             "joint_6, gripper; for a user's model, every joint with a position actuator)"),
    Param("initial_positions", [], "one start position per joint, also the first target (empty = the model's "
                                   "keyframe 'home', else its qpos0, within the joint ranges)"),
    Param("physics_rate_hz", 500.0, f"physics steps (and servo updates) per simulated second, at least "
                                    f"{MIN_PHYSICS_RATE_HZ:.0f}"),
    Param("real_time", True, "keep simulated time on the wall clock (false: step as fast as the CPU allows)"),
    Param("publish_clock", False, "publish simulated time on /clock and stamp joint_states and images with it "
                                  "(run every node of the loop with use_sim_time:=true); false: stamps on this "
                                  "node's clock"),
    Param("clock_rate_hz", 250.0, "/clock messages per simulated second (publish_clock)"),
    Param("joint_state_rate_hz", 100.0, "joint_states messages per simulated second"),
    Param("camera", "scene", "MJCF camera to render (the built-in arm has scene and wrist)"),
    Param("camera_rate_hz", 10.0, "image messages per simulated second (0 = no camera, nothing rendered)"),
    Param("image_width", 224, f"image width in pixels (1 .. {MAX_IMAGE_SIDE})"),
    Param("image_height", 224, f"image height in pixels (1 .. {MAX_IMAGE_SIDE})"),
    Param("diagnostics_period", 1.0, "seconds between /diagnostics messages"),
    Param("autostart", True, "configure and activate at start-up (no lifecycle manager needed)"),
]

# What forward_command_controller subscribes with (the system default: reliable, volatile, depth 10), and what
# joint_state_broadcaster publishes with.
COMMAND_QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
JOINT_STATE_QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
CLOCK_QOS = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE)
"""Only the newest time matters; a reliable publisher matches rclpy's and rclcpp's best-effort /clock readers."""

SIM_FIELDS = {"model": "model", "joint_names": "joint_names", "physics_rate": "physics_rate_hz",
              "initial_positions": "initial_positions", "camera": "camera", "image_size": "image_width"}
"""The node parameter behind each setting a :class:`SimError` names."""


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class SimRobotNode(ManagedNode):
    """Lifecycle node around :class:`SimLoop`: configure loads the model and starts the camera thread (so a
    bad parameter or a missing OpenGL fails at start), activate starts the physics, deactivate pauses it."""

    def __init__(self, **kwargs):
        super().__init__("sim_robot_node", **kwargs)
        for p in PARAMS:  # dynamic typing: 500 and 500.0 are both a rate; the checks below say what is wrong
            self.declare_parameter(p.name, p.default, ParameterDescriptor(description=p.description,
                                                                         dynamic_typing=True))
        self.last_error = ""
        self.robot: SimRobot | None = None
        self.loop: SimLoop | None = None
        self.frames = None
        self.gl_backend = ""
        self._p: dict = {}
        self._lock = threading.Lock()
        self._counts = dict(joint_states=0, images=0, inactive_commands=0)
        self._last_diag = (time.monotonic(), 0)  # (time, images) at the last /diagnostics
        self._pubs, self._subs = {}, []

    # ---------------------------------------------------------------- parameters
    def fail(self, param: str, problem: str) -> ParameterError:
        return ParameterError(f"[{self.get_name()}] parameter '{param}': {problem}")

    def read_params(self) -> dict:
        v = {p.name: self.get_parameter(p.name).value for p in PARAMS}

        def rate(name, low, low_ok=False):
            x = v[name]
            if not _number(x) or x < low or (x == low and not low_ok):
                raise self.fail(name, f"{x!r}: must be a number {'>=' if low_ok else '>'} {low:g}")
            return float(x)

        if not isinstance(v["model"], str):
            raise self.fail("model", f"{v['model']!r}: must be a path to an MJCF file ('' = the built-in arm)")
        if v["model"] and not os.path.isfile(v["model"]):
            raise self.fail("model", f"{v['model']!r}: no such file")
        names = v["joint_names"] or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise self.fail("joint_names", f"{names!r}: must be a list of joint names")
        v["joint_names"] = [n for n in names if n.strip()]
        start = v["initial_positions"] or []
        if not isinstance(start, list) or not all(_number(x) for x in start):
            raise self.fail("initial_positions", f"{start!r}: must be a list of finite numbers, one per joint")
        v["initial_positions"] = [float(x) for x in start]
        physics = rate("physics_rate_hz", MIN_PHYSICS_RATE_HZ, low_ok=True)
        for name in ("joint_state_rate_hz", "camera_rate_hz", "clock_rate_hz"):
            rate(name, 0.0, low_ok=name == "camera_rate_hz")
            if v[name] > physics:
                raise self.fail(name, f"{v[name]!r} Hz: above physics_rate_hz ({physics:g} Hz)")
            v[name] = float(v[name])
        v["physics_rate_hz"] = physics
        rate("diagnostics_period", 0.0)
        for name in ("image_width", "image_height"):
            x = v[name]
            if not isinstance(x, int) or isinstance(x, bool) or not 1 <= x <= MAX_IMAGE_SIDE:
                raise self.fail(name, f"{x!r}: must be an integer from 1 to {MAX_IMAGE_SIDE}")
        for name in ("real_time", "autostart", "publish_clock"):
            if not isinstance(v[name], bool):
                raise self.fail(name, f"{v[name]!r}: must be true or false")
        if not isinstance(v["camera"], str) or (v["camera_rate_hz"] > 0 and not v["camera"]):
            raise self.fail("camera", f"{v['camera']!r}: must name a camera of the model (or set camera_rate_hz "
                                      "to 0)")
        return v

    # ---------------------------------------------------------------- lifecycle
    def on_configure(self, state: State) -> TransitionCallbackReturn:
        ok = self.try_configure(self._configure)
        return TransitionCallbackReturn.SUCCESS if ok else TransitionCallbackReturn.FAILURE

    def _configure(self) -> None:
        p = self._p = self.read_params()
        camera = p["camera_rate_hz"] > 0
        try:
            if camera:
                self.gl_backend = select_backend()
            self.robot = SimRobot(p["model"], p["joint_names"], p["physics_rate_hz"], p["initial_positions"],
                                  render=camera)
            if camera:
                from ..sim.camera import FrameRenderer
                self.frames = FrameRenderer(self.robot.mujoco, self.robot.model, p["camera"], p["image_width"],
                                            p["image_height"], self._on_frame)
                self.frames.start()
        except NoBackend as exc:
            raise self.fail("camera_rate_hz", f"{p['camera_rate_hz']:g} Hz needs a headless OpenGL: {exc}") from None
        except SimError as exc:
            raise self.fail(SIM_FIELDS.get(exc.field, "model"), str(exc)) from None
        ticks = [Tick(p["joint_state_rate_hz"], self._publish_joint_state)]
        if camera:
            ticks.append(Tick(p["camera_rate_hz"], self._request_frame))
        if p["publish_clock"]:
            ticks.insert(0, Tick(p["clock_rate_hz"], self._publish_clock))  # before the messages it stamps
            self._pubs["clock"] = self.create_publisher(Clock, "/clock", CLOCK_QOS)
        self.loop = SimLoop(self.robot, real_time=p["real_time"], ticks=ticks)
        self._pubs["joint_states"] = self.create_lifecycle_publisher(JointState, "joint_states", JOINT_STATE_QOS)
        if camera:
            self._pubs["image"] = self.create_lifecycle_publisher(Image, "image", qos_profile_sensor_data)
        self._subs.append(self.create_subscription(Float64MultiArray, "joint_command", self._on_command,
                                                   COMMAND_QOS, callback_group=MutuallyExclusiveCallbackGroup()))
        self._diag = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self._timer = self.create_timer(p["diagnostics_period"], self._publish_diagnostics,
                                        callback_group=MutuallyExclusiveCallbackGroup(),
                                        clock=RosClock(clock_type=ClockType.STEADY_TIME))
        r = self.robot
        cam = (f"camera {p['camera']!r} {p['image_width']}x{p['image_height']} at {p['camera_rate_hz']:g} Hz "
               f"({self.gl_backend})") if camera else "no camera"
        self.get_logger().info(
            f"configured {r.source}: joints {', '.join(r.joint_names)}, physics {p['physics_rate_hz']:g} Hz"
            f"{' in real time' if p['real_time'] else ' as fast as possible'}"
            f"{', simulated time on /clock' if p['publish_clock'] else ''}, joint_states at "
            f"{p['joint_state_rate_hz']:g} Hz, {cam}")

    def on_activate(self, state: State) -> TransitionCallbackReturn:
        result = super().on_activate(state)  # the publishers first: the physics publishes from its first step
        self._active = True
        self.loop.start()
        return result

    def stop_work(self) -> None:
        self.loop.stop()

    def release_resources(self) -> None:
        """Stop the physics and camera threads, then remove the node's ROS entities."""
        self._active = False
        if self.loop is not None and not self.loop.stop():
            self.get_logger().error("the physics thread did not stop within 5 s")
        if self.frames is not None and not self.frames.stop():
            self.get_logger().error("the camera thread did not stop within 5 s")
        self.loop = self.frames = None
        destroy_entities(self, self._subs, self._pubs)
        self.destroy_diagnostics()
        self.robot = None

    # ---------------------------------------------------------------- ROS side of the threads
    def _on_command(self, msg: Float64MultiArray) -> None:
        loop = self.loop
        if loop is None or not self._active:
            with self._lock:
                self._counts["inactive_commands"] += 1
            return
        reason = loop.command(msg.data)
        if reason:
            self.get_logger().warning(f"refused joint_command ({reason}); holding the last target",
                                      throttle_duration_sec=2.0)

    def _publish_joint_state(self, robot: SimRobot) -> None:
        msg = JointState(name=robot.joint_names, position=robot.positions().tolist(),
                         velocity=robot.velocities().tolist(), effort=robot.efforts().tolist())
        msg.header.stamp = self._stamp(robot)
        self._pubs["joint_states"].publish(msg)
        self._counts["joint_states"] += 1  # only the physics thread writes it

    def _request_frame(self, robot: SimRobot) -> None:
        self.frames.request(robot.qpos(), self._stamp(robot))

    def _stamp(self, robot: SimRobot) -> Time:
        """Simulated time with publish_clock (what /clock says), else this node's clock."""
        if not self._p["publish_clock"]:
            return self.get_clock().now().to_msg()
        return to_stamp(robot.time)

    def _publish_clock(self, robot: SimRobot) -> None:
        pub = self._pubs.get("clock")
        if pub is not None:
            pub.publish(Clock(clock=self._stamp(robot)))

    def _on_frame(self, rgb, stamp, render_s: float) -> None:
        h, w = rgb.shape[:2]
        msg = Image(height=h, width=w, encoding="rgb8", is_bigendian=0, step=3 * w, data=rgb.tobytes())
        msg.header.stamp = stamp  # the moment the frame shows, as a camera stamps its exposure
        msg.header.frame_id = self._p["camera"]
        pub = self._pubs.get("image")
        if pub is not None and self._active:
            pub.publish(msg)
            self._counts["images"] += 1  # only the camera thread writes it

    def _publish_diagnostics(self) -> None:
        loop, frames, p = self.loop, self.frames, self._p
        if loop is None or self._diag is None:
            return
        rate, factor = loop.rates()
        now = time.monotonic()
        t0, images0 = self._last_diag
        images = self._counts["images"]
        self._last_diag = (now, images)
        c = loop.counters()
        values = {
            "physics_rate_hz": rate, "physics_rate_target_hz": p["physics_rate_hz"], "real_time_factor": factor,
            "real_time": p["real_time"], "sim_time_s": self.robot.time if self.robot else 0.0,
            "publish_clock": p["publish_clock"],
            "lag_resets": loop.lag_resets, "commands_received": c["commands"] + c["refused"],
            "commands_refused": c["refused"], "commands_while_inactive": self._counts["inactive_commands"],
            "targets_clamped": c["clamped"], "last_refusal": c["last_refusal"],
            "joint_states_published": self._counts["joint_states"],
            "images_published": images, "image_rate_hz": (images - images0) / (now - t0) if now > t0 else 0.0,
        }
        if frames is not None:
            values.update(frames_rendered=frames.frames, frames_skipped=frames.skipped,
                          render_failures=frames.failures, render_ms=frames.render_s * 1e3,
                          gl_backend=self.gl_backend)
        level, message = OK, f"stepping at {rate:.0f} Hz"
        if loop.error:
            level, message = ERROR, f"physics stopped: {loop.error}"
        elif not self._active:
            level, message = ERROR, "inactive (physics paused)"
        elif p["real_time"] and loop.running and 0 < rate < 0.9 * p["physics_rate_hz"]:
            level, message = WARN, (f"physics at {rate:.0f} Hz, below the {p['physics_rate_hz']:g} Hz asked for: "
                                    "the CPU cannot keep up in real time")
        elif frames is not None and frames.failures:
            level, message = WARN, f"{frames.failures} frames failed to render: {frames.last_error}"
        self._diag.publish(diagnostic_array(self, f"{self.get_fully_qualified_name()}: sim_robot",
                                            f"mujoco/{self.gl_backend or 'no camera'}", level, message, values))


def main(args=None) -> int:
    return run_lifecycle_node(SimRobotNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
