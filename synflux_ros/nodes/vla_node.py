"""VLA node: camera frames + instruction -> action chunks.

Subscribes ``image`` (or one ``<camera>/image`` per camera; ``.../compressed`` with
``image_transport:=compressed``), ``instruction`` and, for a model that takes the robot state,
``joint_states``; publishes ``action_chunk``, optionally ``joint_trajectory``, and ``/diagnostics``. The
callbacks only decode and enqueue; the pipeline's stage threads run the model and publish. Topics and QoS:
docs/ros-interfaces.md; threads and lifecycle: docs/internals/nodes.md.
"""
from __future__ import annotations

import array
import threading
import time

from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import String

from ..msg import ActionChunk
from ..model.image import ImageError, decode_compressed, decode_raw
from ..execution.robot_state import CameraImages, NoFreshState, RobotStateBuffer
from ..runtimes.ledger import FrameLedger
from ..runtimes.vla import Frame, VLAPipeline
from .dds_workarounds import DedicatedSubscription
from .diagnostics import median
from .lifecycle import SynfluxNode, destroy_entities
from .params import COMMON_PARAMS, Param
from .ros_compat import fastdds_profile_variables, subscription_event_callbacks
from .sharing import SHARING_PARAMS, VLA_SHARING_PARAMS
from .stamps import stamp_seconds
from .vla_commands import ChunkCommands
from .process import run_lifecycle_node

PARAMS = [
    Param("config", "vla_demo_orin.yaml", "model YAML: a path, or a file name in the package's config directory"),
    *COMMON_PARAMS,
    Param("default_instruction", "", "instruction used until one arrives on 'instruction' (empty = config's)"),
    Param("image_transport", "raw", "subscribe 'image' (raw) or 'image/compressed' (per camera with several)",
          ("raw", "compressed")),
    Param("publish_joint_trajectory", False, "also publish the plan as trajectory_msgs/JointTrajectory on each "
                                              "chunk (through the limits, while enabled)"),
    Param("publish_joint_command", True, "publish std_msgs/Float64MultiArray joint_command at "
                                         "execution.control_rate_hz while enabled (with execution joints)"),
    Param("camera_rate_hz", 0.0, "the camera's frame rate in Hz: frames lost before the node are counted against "
                                 "it (0 = not stated: estimated from the stamps of the frames that arrive)"),
    Param("joint_names", [""], "commanded joints in action order, overriding the config's execution.joints; "
                               "their count must equal the action dimension"),
    *SHARING_PARAMS,
    *VLA_SHARING_PARAMS,
]

# A transient-local subscription does not match volatile publishers (the `ros2 topic pub` default) and a
# volatile one gets no history from latched publishers: the node subscribes with both. A latched
# publisher matches both, so its messages can arrive twice; an unchanged instruction is not re-applied.
JOINT_STATE_QOS = QoSProfile(depth=50, reliability=ReliabilityPolicy.BEST_EFFORT,
                             durability=DurabilityPolicy.VOLATILE)
INSTRUCTION_QOS = (
    QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.VOLATILE),
    QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL),
)


PIPELINE_STOP_TIMEOUT_S = 5.0
"""How long stopping waits for the stages to finish their current device calls."""
TRANSPORT_HINT = (f"large frames need shared memory: start the camera driver with "
                  f"{' or '.join(fastdds_profile_variables())} set to the profile the nodes use "
                  f"(share/synflux_ros/config/fastdds_shm.xml); see docs/ros-interfaces.md")


class VLANode(ChunkCommands, SynfluxNode):
    """Lifecycle node serving a VLA model: camera frames + instruction in, action chunks out."""

    MODE = "vla"
    ROLE = "control"
    PARAMS = PARAMS

    def __init__(self, **kwargs):
        super().__init__("vla_node", **kwargs)
        self.pipeline: VLAPipeline | None = None
        self._lock = threading.Lock()  # the frame sequence
        self._seq = 0
        self.ledger = FrameLedger(transport_hint=TRANSPORT_HINT)  # kept over cleanups: the counts go on
        self._states: RobotStateBuffer | None = None
        self._cameras: CameraImages | None = None
        self._state_age_ms = float("nan")
        self._last_input_error = ""
        self._subs, self._pubs = [], {}
        self._state_reader: DedicatedSubscription | None = None
        self._busy_pipelines = []  # pipelines whose stage threads outlived stop()

    # ---------------------------------------------------------------- lifecycle hooks
    def setup(self, p: dict, cfg) -> str:
        rate = p["camera_rate_hz"]
        if not isinstance(rate, (int, float)) or not 0.0 <= rate < 10000.0 or rate != rate:
            raise self.fail("camera_rate_hz", f"must be a rate in Hz >= 0 (0 = not stated), got {rate!r}")
        self.ledger.camera_rate = float(rate)
        self.ledger.activate(time.monotonic())
        joints = [j for j in p["joint_names"] if j]
        if joints:
            if len(joints) != cfg.action.published_dim:
                raise self.fail("joint_names", f"{len(joints)} names {joints} for {cfg.action.published_dim} "
                                               f"action values per step (action.output_dim, else action_dim)")
            try:
                cfg = cfg.with_overrides(execution={"joints": joints})
            except ValueError as exc:
                raise self.fail("joint_names", str(exc)) from None
        joints = list(cfg.execution.joints)
        if p["publish_joint_trajectory"] and not joints:
            raise self.fail("publish_joint_trajectory", "needs the commanded joints: set joint_names or the "
                                                        "config's execution.joints")
        self.runtime = self.load_runtime(cfg)
        if p["default_instruction"]:
            try:
                self.runtime.set_instruction(p["default_instruction"])
            except ValueError as exc:
                raise self.fail("default_instruction", str(exc)) from None
        self.cfg, self.joint_names = cfg, joints
        devices = self.runtime.stage_devices  # a remote runtime reports the server's stages too
        self._stage_devices = (devices["vision"], devices["backbone"], devices["head"])
        self.pipeline = VLAPipeline(self.runtime, self._on_result, self._on_error, arbiter=self.share.arbiter)
        self._pubs["chunk"] = self.create_lifecycle_publisher(ActionChunk, "action_chunk", 10)
        if joints:
            self._setup_execution(p, cfg)
        inputs = MutuallyExclusiveCallbackGroup()
        compressed = p["image_transport"] == "compressed"
        suffix = "image/compressed" if compressed else "image"
        cameras = cfg.vision.cameras
        if len(cameras) > 1:
            self._cameras = CameraImages(cameras, cfg.vision.camera_max_skew, topic="{}/" + suffix)
        for i, name in enumerate(cameras or [None]):
            topic = f"{name}/{suffix}" if name else suffix
            callback = self._on_image if i == 0 else self._other_camera(name)
            self._subs.append(self.create_subscription(CompressedImage if compressed else Image, topic, callback,
                                                       qos_profile_sensor_data, callback_group=inputs))
        if cfg.action.state_dim:
            self._states = RobotStateBuffer(cfg.action)
        if cfg.action.state_dim or joints:  # hundreds of Hz on a robot: an executor of its own
            self._state_reader = DedicatedSubscription(self, JointState, "joint_states", self._on_joint_state,
                                                       JOINT_STATE_QOS, "joint_states")
        quiet = subscription_event_callbacks(incompatible_qos=lambda event: None)
        for qos in INSTRUCTION_QOS:
            self._subs.append(self.create_subscription(String, "instruction", self._on_instruction, qos,
                                                       callback_group=inputs, event_callbacks=quiet))
        cams = f", cameras {', '.join(cameras)}" if cameras else ""
        ex = cfg.resolved_execution
        commands = (f", commanding {len(joints)} joints at {ex.control_rate_hz:g} Hz ({ex.mode})" if joints else
                    ", no commands (no execution joints)")
        return (f"{cfg.name!r} ({cfg.action.head_type}, horizon {cfg.action.published_horizon} x "
                f"{cfg.action.published_dim}{cams}) on {cfg.executor.backend!r}, instruction "
                f"{self.runtime.instruction!r}{commands}")

    def _now(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def activate(self) -> None:
        self.ledger.activate(time.monotonic())
        self.pipeline.start()
        self._start_commands()

    def deactivate(self) -> None:
        self._stop_commands()
        self.pipeline.stop()

    def runtime_in_use(self) -> bool:
        return any(p.busy for p in self._busy_pipelines)

    def teardown(self) -> None:
        self._destroy_commands()
        if self.pipeline is not None:
            if not self.pipeline.stop(PIPELINE_STOP_TIMEOUT_S):
                self.get_logger().error(
                    f"a pipeline stage is still in a device call {PIPELINE_STOP_TIMEOUT_S:.0f} s after stop; "
                    "its executor is left in place (freeing it under the call would crash the process)")
                self._busy_pipelines.append(self.pipeline.pipeline)
            self.ledger.retire(self.pipeline.pipeline.counters())
            self.pipeline = None
        if self._state_reader is not None:
            if not self._state_reader.destroy():
                self.get_logger().error("the joint_states callback still runs 5 s after stop")
            self._state_reader = None
        destroy_entities(self, self._subs, self._pubs)

    # ---------------------------------------------------------------- inputs
    def _reject(self, what: str, exc: Exception):
        self.ledger.count("rejected")
        self._last_input_error = f"{what}: {exc}"
        self.get_logger().warning(f"rejected {what}: {exc}", throttle_duration_sec=2.0)

    def _submit(self, header, decode):
        t_receipt = time.perf_counter()
        stamp = stamp_seconds(header.stamp)
        self.ledger.receive(time.monotonic(), self._now(), stamp)
        if not self._active:
            self.ledger.count("inactive")
            return
        if self.controller is not None and self.cfg.execution.request == "threshold" and \
                (self.pipeline.pipeline.counters().in_flight > 0 or not self.controller.wants_chunk(self._now())):
            self.ledger.count("not_needed")
            return
        try:
            rgb = decode()
        except ImageError as exc:
            self._reject("image", exc)
            return
        if self._cameras is not None:
            try:
                rgb = self._cameras.images_for(stamp, rgb)
            except NoFreshState as exc:
                self.ledger.count("no_camera")
                self._last_input_error = f"frame skipped: {exc}"
                self.get_logger().warning(self._last_input_error, throttle_duration_sec=2.0)
                return
        state = None
        if self._states is not None:
            try:
                state, age = self._states.at(stamp)
            except NoFreshState as exc:
                self.ledger.count("no_state")
                self._last_input_error = f"frame skipped: {exc}"
                self.get_logger().warning(self._last_input_error, throttle_duration_sec=2.0)
                return
            self._state_age_ms = age * 1e3
        with self._lock:
            seq = self._seq
            self._seq += 1
        frame = Frame(seq, rgb, t_receipt, meta=header, state=state)
        if self.controller is not None and self.controller.cfg.guides_inference:
            controller = self.controller
            frame.rtc = lambda: controller.rtc_guidance(stamp)  # taken when the head starts: the freshest plan
        self.pipeline.submit(frame)

    def _on_joint_state(self, msg: JointState):
        self.ledger.count("states_received")
        stamp = stamp_seconds(msg.header.stamp)
        try:
            if self.controller is not None:
                self.controller.on_joint_state(stamp, msg.name, msg.position, self._now())
            if self._states is None:
                return
            if stamp == 0.0:
                raise ValueError("header stamp is zero (the state cannot be matched to camera frames)")
            self._states.add(stamp, msg.name, msg.position)
        except ValueError as exc:
            self.ledger.count("states_rejected")
            self._last_input_error = f"joint_states: {exc}"
            self.get_logger().warning(f"joint state rejected: {exc}", throttle_duration_sec=2.0)

    def _decode(self, msg):
        """An Image or CompressedImage message -> HxWx3 uint8 RGB; ImageError says why one is refused."""
        limit = self.cfg.vision.max_input_pixels
        if isinstance(msg, CompressedImage):
            return decode_compressed(msg.format, msg.data, max_pixels=limit)
        return decode_raw(msg.encoding, msg.height, msg.width, msg.step, msg.data, msg.is_bigendian,
                          max_pixels=limit)

    def _other_camera(self, name: str):
        """Callback storing the images of a camera after the first (they are used by its frames)."""
        def store(msg):
            self.ledger.count("camera_images")
            try:
                self._cameras.add(name, stamp_seconds(msg.header.stamp), self._decode(msg))
            except (ImageError, ValueError) as exc:
                self.ledger.count("camera_images_rejected")
                self._last_input_error = f"{name} image: {exc}"
                self.get_logger().warning(f"rejected {name} image: {exc}", throttle_duration_sec=2.0)
        return store

    def _on_image(self, msg):
        self._submit(msg.header, lambda: self._decode(msg))

    def _on_instruction(self, msg: String):
        if self.runtime is None or msg.data.strip() == self.runtime.instruction:
            return
        try:
            self.runtime.set_instruction(msg.data)
        except ValueError as exc:
            self.ledger.count("instructions_rejected")
            self._last_input_error = f"instruction: {exc}"
            self.get_logger().error(f"instruction rejected, keeping {self.runtime.instruction!r}: {exc}")
            return
        self.get_logger().info(f"instruction: {self.runtime.instruction!r}")

    # ---------------------------------------------------------------- outputs (pipeline threads)
    def _on_result(self, frame: Frame):
        msg = ActionChunk()
        msg.header = frame.meta
        msg.frame_seq = frame.seq
        horizon, dim = frame.actions.shape
        msg.horizon, msg.action_dim = horizon, dim
        msg.step_period = float(self.cfg.action.step_period)
        msg.actions = array.array("f", frame.actions.astype("float32").tobytes())
        t = frame.timings
        msg.vision_ms = float(t.get("vision_ms", 0.0))
        msg.backbone_ms = float(t.get("backbone_ms", 0.0))
        msg.head_ms = float(t.get("head_ms", 0.0))
        msg.vision_device, msg.backbone_device, msg.head_device = self._stage_devices
        latency = (time.perf_counter() - frame.t_receipt) * 1e3
        msg.latency_ms = float(latency)
        self._pubs["chunk"].publish(msg)
        self.ledger.published(latency, time.monotonic())
        if self.controller is not None:
            self._execute(frame)

    def _on_error(self, frame: Frame, stage: str, exc: Exception):
        self._last_input_error = f"frame {frame.seq} failed in {stage}: {exc}"
        self.get_logger().error(self._last_input_error, throttle_duration_sec=2.0)

    # ---------------------------------------------------------------- diagnostics
    def frame_counts(self) -> dict[str, int]:
        """Every received frame (of the first camera) in exactly one outcome or in flight (FrameLedger)."""
        pipeline = self.pipeline
        return self.ledger.counts(pipeline.pipeline.counters() if pipeline is not None else None)

    def diagnostics(self) -> tuple[int, str, dict]:
        counts = self.frame_counts()
        rate = self.ledger.publish_rate()
        rates = self.ledger.rates()
        values = {"backend": self.cfg.executor.backend, "model": self.cfg.name, "instruction":
                  self.runtime.instruction, "frames_received": counts["received"], "frames_published":
                  counts["published"], "frames_dropped": counts["dropped"], "frames_rejected": counts["rejected"],
                  "frames_failed": counts["failed"], "frames_while_inactive": counts["inactive"],
                  "frames_in_flight": counts["in_flight"], "frames_no_state": counts["no_state"],
                  "instructions_rejected": counts["instructions_rejected"], "publish_rate_hz": rate,
                  **rates, "latency_median_ms": median(self.ledger.latencies())}
        for st in self.pipeline.pipeline.stats if self.pipeline else []:
            values[f"stage_{st.name}_median_ms"] = median(st.recent_ms)
        for stage, device in self.runtime.stage_devices.items():
            values[f"stage_{stage}_device"] = device
        if self._cameras is not None:
            values.update(frames_no_camera=counts["no_camera"], camera_images_received=counts["camera_images"],
                          camera_images_rejected=counts["camera_images_rejected"])
        if self._states is not None:
            values.update(states_received=counts["states_received"], states_rejected=counts["states_rejected"],
                          state_age_ms=self._state_age_ms)
        values["device_memory_mib"] = self.runtime.executor.device_bytes / 2**20
        values.update(self.share.values())
        values["last_error"] = self._last_input_error
        problems = self._execution_diagnostics(values, counts) if self.controller is not None else []
        silence = self.ledger.silence(time.monotonic())
        values["seconds_since_frame"] = silence
        topic = self._subs[0].topic_name if self._subs else "image"
        health = self.ledger.health(counts, rates, silence, topic, problems)
        return health.level, health.message(rate), values



def main(args=None) -> int:
    return run_lifecycle_node(VLANode, args)


if __name__ == "__main__":
    raise SystemExit(main())
