"""Shared node plumbing: parameter declaration and validation, config lookup, diagnostics, and the
lifecycle main (start-up, SIGINT/SIGTERM handling, ordered shutdown)."""
from __future__ import annotations

import os
import signal
import statistics
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import ParameterDescriptor
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor
from rclpy.lifecycle import Node as LifecycleNode
from rclpy.lifecycle import State, TransitionCallbackReturn
from rclpy.signals import SignalHandlerOptions

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


def subscribe_diagnostics(node, callback: Callable[[str, dict[str, str]], None], depth: int = 10):
    """The reading side of :func:`diagnostic_array`: subscribe ``node`` to ``/diagnostics`` and call
    ``callback(status name, {key: value})`` for each status received (values as sent: strings). Returns the
    subscription (destroy it with ``node.destroy_subscription``)."""
    def on_array(msg: DiagnosticArray):
        for st in msg.status:
            callback(st.name, {kv.key: kv.value for kv in st.values})
    return node.create_subscription(DiagnosticArray, "/diagnostics", on_array, depth)


OK, WARN, ERROR = DiagnosticStatus.OK[0], DiagnosticStatus.WARN[0], DiagnosticStatus.ERROR[0]


COMMON_PARAMS = [
    Param("executor", "", "backend overriding the config's executor.backend (empty = keep)"),
    Param("graph_dir", "", "compiled graph directory overriding the config's executor.graph_dir (empty = keep)"),
    Param("diagnostics_period", 1.0, "seconds between /diagnostics messages"),
    Param("autostart", True, "configure and activate at start-up (no lifecycle manager needed)"),
]


# ------------------------------------------------------------------ service responses
# rmw_fastrtps sends a response only once the server has matched the client's response reader, and waits
# 100 ms for that; rclpy then reports "failed to send response (timeout)" as a RuntimeWarning and the
# response is gone. A client that calls right after it discovered a node that has just started (or a
# node busy loading a model) hits this: the request arrived, the answer never does. The model nodes'
# services therefore send again until the client's reader is matched, for up to RESPONSE_RESEND_S.
RESPONSE_RESEND_S = 5.0
_SEND_TIMEOUT = "failed to send response (timeout)"
_send_failures = threading.local()


def _ensure_send_failure_hook() -> None:
    """Count rclpy's send-timeout warnings per thread (they are emitted in the sending thread). Checked on
    every send: ``warnings.catch_warnings`` elsewhere restores the previous hook and filters when it exits."""
    if getattr(warnings.showwarning, "synflux_send_hook", False):
        return
    warnings.filterwarnings("always", message=r"failed to send response \(timeout\)", category=RuntimeWarning)
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if category is RuntimeWarning and str(message).startswith(_SEND_TIMEOUT):
            _send_failures.count = getattr(_send_failures, "count", 0) + 1
            return
        shown(message, category, filename, lineno, file, line)
    showwarning.synflux_send_hook = True
    warnings.showwarning = showwarning


class ResponseSender:
    """Wraps a service's ``send_response`` (called by the executor after the callback) so that a response
    the middleware could not deliver yet is sent again; counts what was resent and what was lost."""

    def __init__(self, node, service, resend_s: float = RESPONSE_RESEND_S):
        self.node, self.service, self.resend_s = node, service, resend_s
        resolve = getattr(node, "resolve_service_name", None)
        self.name = resolve(service.srv_name) if resolve is not None else service.srv_name
        self.resent = 0  # responses that needed more than one attempt
        self.lost = 0  # responses still undeliverable after resend_s (the client is gone or never matched)
        self._send = service.send_response
        service.send_response = self.send

    def send(self, response, header) -> None:
        deadline = time.monotonic() + self.resend_s
        attempts = 0
        while True:
            _ensure_send_failure_hook()
            before = getattr(_send_failures, "count", 0)
            self._send(response, header)
            attempts += 1
            if getattr(_send_failures, "count", 0) == before:
                if attempts > 1:
                    self.resent += 1
                    self.node.get_logger().info(f"{self.name}: response delivered on attempt "
                                                f"{attempts} (the client's reader was not yet matched)")
                return
            if time.monotonic() >= deadline:
                self.lost += 1
                self.node.get_logger().error(
                    f"{self.name}: response lost: the client's response reader was not matched "
                    f"within {self.resend_s:.0f} s ({attempts} attempts); the client has gone or cannot be "
                    f"reached")
                return
            time.sleep(0.05)



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
            self.get_logger().info(f"loading {cfg.name!r} on {cfg.executor.backend!r}")
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
            if self.runtime_in_use():
                self.get_logger().error("the model is still in use by a device call; its memory is freed at "
                                        "process exit instead")
            else:
                self.runtime.close()
            self.runtime = None

    def runtime_in_use(self) -> bool:
        """A thread is still inside the runtime (e.g. a device call that outlived a stop)."""
        return False

    def _publish_diagnostics(self):
        if self.runtime is None:
            return
        level, message, values = self.diagnostics()
        if not self._active:
            level, message = ERROR, "inactive"
        self._diag.publish(diagnostic_array(self, f"{self.get_fully_qualified_name()}: {self.MODE}",
                                            f"synflux/{self.cfg.executor.backend}", level, message, values))


class ShutdownRequested(BaseException):
    """SIGINT or SIGTERM arrived while the node was starting up or loading its model.

    Raised in the main thread by :class:`ShutdownSignals`. Like KeyboardInterrupt it derives from
    BaseException, so the ``except Exception`` clauses of loaders let it through and the load is abandoned.
    """


class ShutdownSignals:
    """SIGINT and SIGTERM handling of a node process: both mean "stop, clean up, exit with 0".

    By default ``rclpy.init`` installs handlers for both signals that shut the ROS context down at once,
    under whatever is running: a pipeline stage publishing its chunk or a service answering a request then
    fails on an invalid context. The node instead initialises rclpy without them and installs these:

    * while :attr:`interruptible` (start-up and model loading, which run in the main thread and can take
      seconds) the first signal raises :class:`ShutdownRequested` there and the load is abandoned;
    * otherwise it is recorded in :attr:`received`; the main thread spins in slices of
      ``SPIN_SLICE_S``, sees it and shuts down in order: callbacks finished, pipeline drained and its
      threads joined, device memory freed, entities destroyed, then the ROS context.

    A second signal is ignored, so it cannot cut that cleanup short.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received = ""  # name of the first signal, "" while none arrived
        self.interruptible = False
        self._previous: dict = {}

    def install(self) -> bool:
        """Install the handlers; False where that is impossible (Python runs signal handlers in the main
        thread only), in which case rclpy's own handlers should be used."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.received:
            return
        self.received = signal.Signals(signum).name
        if self.interruptible:
            self.interruptible = False
            raise ShutdownRequested(self.received)


class NodeExecutor(MultiThreadedExecutor):
    """MultiThreadedExecutor whose shutdown first finishes the callbacks already handed to its threads.

    ``MultiThreadedExecutor.shutdown`` destroys the executor's guard condition and then joins its threads;
    a callback still queued at that moment takes its message (an image, a chat request) and then fails on
    the destroyed guard condition before it runs, so the message is lost and the failure printed at exit.
    Joining the threads first lets each such callback run while the node is still whole.
    """

    def shutdown(self, timeout_sec: float | None = None, *, wait_for_threads: bool = True) -> bool:
        pool = getattr(self, "_executor", None)  # the thread pool of rclpy's MultiThreadedExecutor
        if wait_for_threads and pool is not None:
            pool.shutdown(wait=True)
        return super().shutdown(timeout_sec, wait_for_threads=wait_for_threads)


SPIN_SLICE_S = 0.1
"""Longest wait of the main thread in the executor; it bounds the delay between a signal and shutdown."""

LIVE_THREADS_MESSAGE = "threads still alive after shutdown"


def live_threads() -> list[threading.Thread]:
    """Python threads other than the main thread that are still running."""
    main = threading.main_thread()
    return [t for t in threading.enumerate() if t is not main and t.is_alive()]


def report_live_threads(name: str) -> list[threading.Thread]:
    """Print to stderr every thread that outlived the node's cleanup (pipeline stages, executor workers,
    anything a backend started); the process should end with the main thread alone."""
    alive = live_threads()
    if alive:
        listed = ", ".join(f"{t.name} ({'daemon' if t.daemon else 'non-daemon'})" for t in alive)
        print(f"{name}: {len(alive)} {LIVE_THREADS_MESSAGE}: {listed}", file=sys.stderr, flush=True)
    return alive


def run_lifecycle_node(factory: Callable[[], Any], args=None) -> int:
    """Create the node, configure + activate it when its ``autostart`` parameter is true, spin.

    Returns the process exit code: 1 when autostart configuration fails (the error is logged once,
    naming the node and the bad value); 0 after SIGINT or SIGTERM, also when one arrives
    while the model is loading (the load is abandoned; see :class:`ShutdownSignals`). On the way out the
    executor's running callbacks finish, the node's resources are released (pipeline threads joined,
    device memory freed), the node and then the ROS context are shut down, and any thread still alive
    after that is reported on stderr.
    """
    # Pipeline stages hand the GIL to each other while devices work; the default 5 ms switch interval
    # would add up to 5 ms of wake-up delay per stage hand-off.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    signals = ShutdownSignals()
    own_handlers = signals.install()
    signals.interruptible = own_handlers
    node = executor = None
    name = getattr(factory, "__name__", "node")
    code, phase, abandoned = 0, "start-up", ""
    try:
        rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO if own_handlers else None)
        node = factory()
        name = node.get_name()
        executor = NodeExecutor(num_threads=3)
        executor.add_node(node)
        if node.get_parameter("autostart").value:
            phase = "model load"
            configured = node.trigger_configure() == TransitionCallbackReturn.SUCCESS
            signals.interruptible = False
            if not configured and not signals.received:
                code = 1  # on_configure has logged the error, naming the node and the bad value
            elif configured and not signals.received and \
                    node.trigger_activate() != TransitionCallbackReturn.SUCCESS:
                print(f"{name}: activation failed: {node.last_error}", file=sys.stderr, flush=True)
                code = 1
        signals.interruptible = False
        if code == 0:
            if own_handlers:
                while not signals.received and rclpy.ok():
                    executor.spin_once(timeout_sec=SPIN_SLICE_S)
            else:
                executor.spin()
    except ShutdownRequested:
        abandoned = f" ({phase} abandoned)"
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        signals.interruptible = False
        if signals.received and node is not None:
            node.get_logger().info(f"{signals.received}: shutting down{abandoned}")
        if executor is not None:
            executor.shutdown()  # callbacks in progress finish before what they use is torn down
        if node is not None:
            node.release_resources()
            node.destroy_node()
        rclpy.try_shutdown()
        signals.restore()
    report_live_threads(name)
    return code
