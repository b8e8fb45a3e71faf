"""Shared node plumbing: parameter declaration and validation, config lookup, diagnostics, lifecycle main."""
from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Callable

import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import ParameterDescriptor
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.lifecycle import Node as LifecycleNode
from rclpy.lifecycle import State, TransitionCallbackReturn

from ..core.config import ConfigError, ModelConfig, load_config

PACKAGE = "synflux_ros"
GIL_SWITCH_INTERVAL_S = 0.0005


class ParameterError(ValueError):
    """A node parameter has a bad value; the message names the node, the parameter and the value."""


@dataclass(frozen=True)
class Param:
    """One node parameter: name, default, description and, where fixed, the allowed values."""
    name: str
    default: Any
    description: str
    choices: tuple = ()


def declare(node, params: list[Param]) -> None:
    for p in params:
        desc = p.description + (f" (choices: {', '.join(map(str, p.choices))})" if p.choices else "")
        node.declare_parameter(p.name, p.default, ParameterDescriptor(description=desc))


def read(node, params: list[Param]) -> dict[str, Any]:
    """Read declared parameters and check choices; errors name the node and the value."""
    values = {}
    for p in params:
        v = node.get_parameter(p.name).value
        if p.choices and v not in p.choices:
            raise ParameterError(f"[{node.get_name()}] parameter '{p.name}': {v!r} is not allowed "
                                 f"(choices: {', '.join(map(str, p.choices))})")
        values[p.name] = v
    return values


def share_dir() -> str | None:
    """The package's share directory: from the ament index, else next to this interpreter's prefix."""
    try:
        from ament_index_python.packages import get_package_share_directory
        return get_package_share_directory(PACKAGE)
    except (ImportError, LookupError, OSError):
        pass
    local = os.path.join(sys.prefix, "share", PACKAGE)
    return local if os.path.isdir(local) else None


def resolve_config_path(value: str) -> str:
    """An existing path as given, else a bare name in the package's share/config directory."""
    if not value:
        raise FileNotFoundError("no config given (set the 'config' parameter to a YAML file)")
    if os.path.isfile(value):
        return os.path.abspath(value)
    share = share_dir()
    candidates = [os.path.join(share, "config", value)] if share and not os.path.isabs(value) else []
    for c in candidates:
        if os.path.isfile(c):
            return c
    where = f" or in {os.path.join(share, 'config')}" if share else ""
    raise FileNotFoundError(f"config file {value!r} not found (as a path{where})")


def load_node_config(node, mode: str, config: str, executor: str, graph_dir: str) -> ModelConfig:
    """Load the model YAML named by the node's parameters, with executor/graph_dir overrides."""
    name = node.get_name()
    try:
        cfg = load_config(resolve_config_path(config))
    except (FileNotFoundError, ConfigError) as exc:
        raise ParameterError(f"[{name}] parameter 'config' ({config!r}): {exc}") from None
    if cfg.mode != mode:
        raise ParameterError(f"[{name}] parameter 'config' ({config!r}): a {cfg.mode!r} model, this node serves "
                             f"{mode!r} models")
    overrides = {}
    if executor:
        overrides["backend"] = executor
    if graph_dir:
        if not os.path.isdir(graph_dir):
            raise ParameterError(f"[{name}] parameter 'graph_dir': {graph_dir!r} is not a directory")
        overrides["graph_dir"] = os.path.abspath(graph_dir)
    return cfg.with_overrides(executor=overrides) if overrides else cfg


def ros_text(text: str) -> str:
    """``text`` as it can travel in a ROS string. ROS strings end at U+0000, so each is sent as U+2400
    (SYMBOL FOR NULL) instead of cutting the text there."""
    return text.replace("\x00", "\u2400")


def median(values) -> float:
    values = list(values)
    return float(statistics.median(values)) if values else 0.0


def diagnostic_array(node, status_name: str, hardware_id: str, level: int, message: str,
                     values: dict[str, Any]) -> DiagnosticArray:
    arr = DiagnosticArray()
    arr.header.stamp = node.get_clock().now().to_msg()
    st = DiagnosticStatus(level=bytes([level]), name=status_name, message=ros_text(message),
                          hardware_id=hardware_id)
    st.values = [KeyValue(key=k, value=ros_text(f"{v:.3f}" if isinstance(v, float) else str(v)))
                 for k, v in values.items()]
    arr.status = [st]
    return arr


OK, WARN, ERROR = DiagnosticStatus.OK[0], DiagnosticStatus.WARN[0], DiagnosticStatus.ERROR[0]


COMMON_PARAMS = [
    Param("executor", "", "backend overriding the config's executor.backend (empty = keep)"),
    Param("graph_dir", "", "compiled graph directory overriding the config's executor.graph_dir (empty = keep)"),
    Param("diagnostics_period", 1.0, "seconds between /diagnostics messages"),
    Param("autostart", True, "configure and activate at start-up (no lifecycle manager needed)"),
]


class SynfluxNode(LifecycleNode):
    """Lifecycle shared by the model nodes.

    configure: read and validate parameters, load the model config, ``setup()`` (runtime, ROS
    entities), start diagnostics; activate/deactivate: ``activate()``/``deactivate()``;
    cleanup/shutdown: ``teardown()`` then free the runtime's device memory. Subclasses set ``MODE``
    ('vla' or 'vlm') and ``PARAMS`` and implement the hooks.
    """

    MODE = ""
    PARAMS: list[Param] = []

    def __init__(self, node_name: str, **kwargs):
        super().__init__(node_name, **kwargs)
        declare(self, self.PARAMS)
        self.last_error = ""
        self.runtime = None
        self._active = False
        self._timer = None
        self._diag = None

    # hooks -------------------------------------------------------------
    def setup(self, params: dict, cfg: ModelConfig) -> str:
        """Create the runtime and ROS entities; return a one-line summary. Raise ParameterError."""
        raise NotImplementedError

    def activate(self) -> None:
        pass

    def deactivate(self) -> None:
        pass

    def teardown(self) -> None:
        pass

    def diagnostics(self) -> tuple[int, str, dict]:
        """(level, message, values) for /diagnostics."""
        raise NotImplementedError

    # helpers -------------------------------------------------------------
    def fail(self, param: str, problem: str) -> ParameterError:
        return ParameterError(f"[{self.get_name()}] parameter '{param}': {problem}")

    def load_runtime(self, runtime_cls, cfg: ModelConfig):
        try:
            return runtime_cls(cfg)
        except (ConfigError, ImportError, ValueError) as exc:
            raise ParameterError(f"[{self.get_name()}] cannot load model {cfg.name!r} with executor "
                                 f"{cfg.executor.backend!r}: {exc}") from None

    # lifecycle -----------------------------------------------------------
    def on_configure(self, state: State) -> TransitionCallbackReturn:
        self.last_error = ""  # a failed configure must not poison the next attempt
        try:
            p = read(self, self.PARAMS)
            if p["diagnostics_period"] <= 0:
                raise self.fail("diagnostics_period", f"must be > 0, got {p['diagnostics_period']!r}")
            cfg = load_node_config(self, self.MODE, p["config"], p["executor"], p["graph_dir"])
            summary = self.setup(p, cfg)
        except ParameterError as exc:
            self.last_error = str(exc)
        except Exception as exc:  # anything else while loading: report it, do not crash the process
            self.last_error = f"[{self.get_name()}] configure failed: {type(exc).__name__}: {exc}"
        if self.last_error:
            self.get_logger().error(self.last_error)
            self.release_resources()
            return TransitionCallbackReturn.FAILURE
        self.cfg = cfg
        self._diag = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self._timer = self.create_timer(p["diagnostics_period"], self._publish_diagnostics,
                                        callback_group=MutuallyExclusiveCallbackGroup())
        self.get_logger().info(f"configured {summary}, "
                               f"{self.runtime.executor.device_bytes / 2**20:.1f} MiB device memory")
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: State) -> TransitionCallbackReturn:
        self.activate()
        self._active = True
        return super().on_activate(state)

    def on_deactivate(self, state: State) -> TransitionCallbackReturn:
        self._active = False
        self.deactivate()
        return super().on_deactivate(state)

    def on_cleanup(self, state: State) -> TransitionCallbackReturn:
        self.release_resources()
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: State) -> TransitionCallbackReturn:
        self.release_resources()
        return TransitionCallbackReturn.SUCCESS

    def release_resources(self) -> None:
        self._active = False
        self.teardown()
        if self._timer is not None:
            self.destroy_timer(self._timer)
            self._timer = None
        if self._diag is not None:
            self.destroy_publisher(self._diag)
            self._diag = None
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None

    def _publish_diagnostics(self):
        if self.runtime is None:
            return
        level, message, values = self.diagnostics()
        if not self._active:
            level, message = ERROR, "inactive"
        self._diag.publish(diagnostic_array(self, f"{self.get_fully_qualified_name()}: {self.MODE}",
                                            f"synflux/{self.cfg.executor.backend}", level, message, values))


def run_lifecycle_node(factory: Callable[[], Any], args=None) -> int:
    """Create the node, configure + activate it when its ``autostart`` parameter is true, spin.

    Returns the process exit code: 1 when autostart configuration fails (the error has been logged and is
    printed to stderr naming the node and the bad value).
    """
    # Pipeline stages hand the GIL to each other while devices work; the default 5 ms switch interval
    # would add up to 5 ms of wake-up delay per stage hand-off.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    rclpy.init(args=args)
    node = factory()
    code = 0
    executor = MultiThreadedExecutor(num_threads=3)
    executor.add_node(node)
    try:
        if node.get_parameter("autostart").value:
            if node.trigger_configure() != TransitionCallbackReturn.SUCCESS:
                print(f"{node.get_name()}: configuration failed: {node.last_error}", file=sys.stderr, flush=True)
                return 1
            if node.trigger_activate() != TransitionCallbackReturn.SUCCESS:
                print(f"{node.get_name()}: activation failed: {node.last_error}", file=sys.stderr, flush=True)
                return 1
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.release_resources()
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
    return code
