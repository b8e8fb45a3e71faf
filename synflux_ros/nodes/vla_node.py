"""VLA node: camera frames + instruction -> action chunks.

Subscribes ``image`` (sensor_msgs/Image, sensor-data QoS; or ``image/compressed`` with
``image_transport:=compressed``) and ``instruction`` (std_msgs/String, reliable + transient local);
publishes ``action_chunk`` (synflux_ros/msg/ActionChunk), optionally ``joint_trajectory``
(trajectory_msgs/JointTrajectory) and ``/diagnostics``.

Lifecycle: configure loads the model (executor, graphs, KV slots); activate starts the pipeline
threads; deactivate stops them; cleanup frees the device memory. With ``autostart`` (default) the node
configures and activates itself, so ``ros2 run`` and plain launch files work without a lifecycle manager.

Concurrency: the image and instruction callbacks only decode and enqueue (mutually exclusive group);
the pipeline's three stage threads do the work and publish from the last stage; diagnostics run on a
timer in their own group.
"""
from __future__ import annotations

import array
import threading
import time
from collections import deque

import rclpy
from builtin_interfaces.msg import Duration
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.lifecycle import Node as LifecycleNode
from rclpy.lifecycle import State, TransitionCallbackReturn
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image
from std_msgs.msg import String
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from ..models.config import ConfigError
from ..msg import ActionChunk
from ..runtime.image import ImageError, decode_compressed, decode_raw
from ..runtime.vla_runtime import Frame, VLAPipeline, VLARuntime
from .common import ERROR, OK, WARN, Param, ParameterError, declare, diagnostic_array, load_node_config, \
    median, read, run_lifecycle_node

PARAMS = [
    Param("config", "vla_demo_orin.yaml", "model YAML: a path, or a file name in the package's config directory"),
    Param("executor", "", "backend overriding the config's executor.backend (empty = keep)"),
    Param("graph_dir", "", "compiled graph directory overriding the config's executor.graph_dir (empty = keep)"),
    Param("default_instruction", "", "instruction used until one arrives on 'instruction' (empty = config's)"),
    Param("image_transport", "raw", "subscribe 'image' (raw) or 'image/compressed'", ("raw", "compressed")),
    Param("publish_joint_trajectory", False, "also publish each chunk as trajectory_msgs/JointTrajectory"),
    Param("joint_names", [""], "joint names for joint_trajectory; their count must equal the action dimension"),
    Param("diagnostics_period", 1.0, "seconds between /diagnostics messages"),
    Param("autostart", True, "configure and activate at start-up (no lifecycle manager needed)"),
]

INSTRUCTION_QOS = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)


class VLANode(LifecycleNode):
    def __init__(self, **kwargs):
        super().__init__("vla_node", **kwargs)
        declare(self, PARAMS)
        self.last_error = ""
        self.runtime: VLARuntime | None = None
        self.pipeline: VLAPipeline | None = None
        self._lock = threading.Lock()
        self._seq = 0
        self._counts = dict(received=0, rejected=0, dropped=0, failed=0, published=0, inactive=0,
                            instructions_rejected=0)
        self._latencies = deque(maxlen=200)
        self._published_times = deque(maxlen=200)
        self._last_input_error = ""
        self._subs, self._pubs, self._timer = [], {}, None
        self._active = False

    # ---------------------------------------------------------------- lifecycle
    def on_configure(self, state: State) -> TransitionCallbackReturn:
        try:
            p = read(self, PARAMS)
            cfg = load_node_config(self, "vla", p["config"], p["executor"], p["graph_dir"])
            if p["diagnostics_period"] <= 0:
                raise ParameterError(f"[{self.get_name()}] parameter 'diagnostics_period': must be > 0, "
                                     f"got {p['diagnostics_period']!r}")
            joints = [j for j in p["joint_names"] if j]
            if p["publish_joint_trajectory"] and len(joints) != cfg.action.action_dim:
                raise ParameterError(f"[{self.get_name()}] parameter 'joint_names': {len(joints)} names "
                                     f"{joints} for action_dim {cfg.action.action_dim}")
            try:
                runtime = VLARuntime(cfg)
            except (ConfigError, ImportError, ValueError) as exc:
                raise ParameterError(f"[{self.get_name()}] cannot load model {cfg.name!r} with executor "
                                     f"{cfg.executor.backend!r}: {exc}") from None
            if p["default_instruction"]:
                try:
                    runtime.set_instruction(p["default_instruction"])
                except ValueError as exc:
                    runtime.close()
                    raise ParameterError(f"[{self.get_name()}] parameter 'default_instruction': {exc}") from None
        except ParameterError as exc:
            self.last_error = str(exc)
            self.get_logger().error(self.last_error)
            return TransitionCallbackReturn.FAILURE
        except Exception as exc:  # anything else while loading: report it, do not crash the process
            self.last_error = f"[{self.get_name()}] configure failed: {type(exc).__name__}: {exc}"
            self.get_logger().error(self.last_error)
            return TransitionCallbackReturn.FAILURE
        self.params, self.cfg, self.runtime, self.joint_names = p, cfg, runtime, joints
        self.pipeline = VLAPipeline(runtime, self._on_result, self._on_error)
        self._pubs["chunk"] = self.create_lifecycle_publisher(ActionChunk, "action_chunk", 10)
        if p["publish_joint_trajectory"]:
            self._pubs["traj"] = self.create_lifecycle_publisher(JointTrajectory, "joint_trajectory", 10)
        self._pubs["diag"] = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        inputs = MutuallyExclusiveCallbackGroup()
        if p["image_transport"] == "compressed":
            self._subs.append(self.create_subscription(CompressedImage, "image/compressed", self._on_compressed,
                                                       qos_profile_sensor_data, callback_group=inputs))
        else:
            self._subs.append(self.create_subscription(Image, "image", self._on_image, qos_profile_sensor_data,
                                                       callback_group=inputs))
        self._subs.append(self.create_subscription(String, "instruction", self._on_instruction, INSTRUCTION_QOS,
                                                   callback_group=inputs))
        self._timer = self.create_timer(p["diagnostics_period"], self._publish_diagnostics,
                                        callback_group=MutuallyExclusiveCallbackGroup())
        self.get_logger().info(
            f"configured {cfg.name!r} ({cfg.action.head_type}, horizon {cfg.action.action_horizon} x "
            f"{cfg.action.action_dim}) on {cfg.executor.backend!r}, "
            f"{runtime.executor.device_bytes / 2**20:.1f} MiB device memory, "
            f"instruction {runtime.instruction!r}")
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: State) -> TransitionCallbackReturn:
        self.pipeline.start()
        self._active = True
        return super().on_activate(state)

    def on_deactivate(self, state: State) -> TransitionCallbackReturn:
        self._active = False
        self.pipeline.stop()
        return super().on_deactivate(state)

    def on_cleanup(self, state: State) -> TransitionCallbackReturn:
        self.release_resources()
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: State) -> TransitionCallbackReturn:
        self.release_resources()
        return TransitionCallbackReturn.SUCCESS

    def release_resources(self) -> None:
        self._active = False
        if self.pipeline is not None:
            self.pipeline.stop()
            self.pipeline = None
        for s in self._subs:
            self.destroy_subscription(s)
        self._subs = []
        if self._timer is not None:
            self.destroy_timer(self._timer)
            self._timer = None
        for pub in self._pubs.values():
            self.destroy_publisher(pub)
        self._pubs = {}
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None

    # ---------------------------------------------------------------- inputs
    def _count(self, key: str, n: int = 1):
        with self._lock:
            self._counts[key] += n

    def _reject(self, what: str, exc: Exception):
        self._count("rejected")
        self._last_input_error = f"{what}: {exc}"
        self.get_logger().warning(f"rejected {what}: {exc}", throttle_duration_sec=2.0)

    def _submit(self, header, decode):
        t_receipt = time.perf_counter()
        self._count("received")
        if not self._active:
            self._count("inactive")
            return
        try:
            rgb = decode()
        except ImageError as exc:
            self._reject("image", exc)
            return
        with self._lock:
            seq = self._seq
            self._seq += 1
        if not self.pipeline.submit(Frame(seq, rgb, t_receipt, meta=header)):
            self._count("dropped")

    def _on_image(self, msg: Image):
        self._submit(msg.header, lambda: decode_raw(msg.encoding, msg.height, msg.width, msg.step, msg.data,
                                                    msg.is_bigendian))

    def _on_compressed(self, msg: CompressedImage):
        self._submit(msg.header, lambda: decode_compressed(msg.format, msg.data))

    def _on_instruction(self, msg: String):
        try:
            self.runtime.set_instruction(msg.data)
        except ValueError as exc:
            self._count("instructions_rejected")
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
        msg.preprocess_ms = float(t.get("preprocess_ms", 0.0))
        msg.backbone_ms = float(t.get("backbone_ms", 0.0))
        msg.head_ms = float(t.get("head_ms", 0.0))
        latency = (time.perf_counter() - frame.t_receipt) * 1e3
        msg.latency_ms = float(latency)
        self._pubs["chunk"].publish(msg)
        if "traj" in self._pubs:
            self._pubs["traj"].publish(self._trajectory(frame))
        with self._lock:
            self._counts["published"] += 1
            self._latencies.append(latency)
            self._published_times.append(time.monotonic())

    def _trajectory(self, frame: Frame) -> JointTrajectory:
        traj = JointTrajectory()
        traj.header = frame.meta
        traj.joint_names = list(self.joint_names)
        period = self.cfg.action.step_period
        for i, row in enumerate(frame.actions):
            t = (i + 1) * period
            sec = int(t)
            traj.points.append(JointTrajectoryPoint(
                positions=row.astype(float).tolist(),
                time_from_start=Duration(sec=sec, nanosec=int(round((t - sec) * 1e9)))))
        return traj

    def _on_error(self, frame: Frame, stage: str, exc: Exception):
        self._count("failed")
        self._last_input_error = f"frame {frame.seq} failed in {stage}: {exc}"
        self.get_logger().error(self._last_input_error, throttle_duration_sec=2.0)

    # ---------------------------------------------------------------- diagnostics
    def diagnostics_values(self) -> dict:
        with self._lock:
            counts = dict(self._counts)
            lat = list(self._latencies)
            times = list(self._published_times)
        rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0
        values = {"backend": self.cfg.executor.backend, "model": self.cfg.name, "instruction":
                  self.runtime.instruction, "frames_received": counts["received"], "frames_published":
                  counts["published"], "frames_dropped": counts["dropped"], "frames_rejected": counts["rejected"],
                  "frames_failed": counts["failed"], "frames_while_inactive": counts["inactive"],
                  "instructions_rejected": counts["instructions_rejected"], "publish_rate_hz": rate,
                  "latency_median_ms": median(lat)}
        for st in self.pipeline.pipeline.stats if self.pipeline else []:
            values[f"stage_{st.name}_median_ms"] = median(st.recent_ms)
        values["device_memory_mib"] = self.runtime.executor.device_bytes / 2**20
        values["last_error"] = self._last_input_error
        return values

    def _publish_diagnostics(self):
        if self.runtime is None:
            return
        values = self.diagnostics_values()
        problems = values["frames_failed"] or values["frames_rejected"]
        level = ERROR if not self._active else (WARN if problems else OK)
        message = "inactive" if not self._active else (
            f"{values['publish_rate_hz']:.1f} Hz, {values['frames_rejected']} rejected, "
            f"{values['frames_failed']} failed" if problems else f"{values['publish_rate_hz']:.1f} Hz")
        self._pubs["diag"].publish(diagnostic_array(self, f"{self.get_name()}: pipeline",
                                                    f"synflux/{values['backend']}", level, message, values))


def main(args=None) -> int:
    return run_lifecycle_node(VLANode, args)


if __name__ == "__main__":
    raise SystemExit(main())
