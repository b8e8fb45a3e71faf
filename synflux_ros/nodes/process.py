"""The node process: start-up, SIGINT/SIGTERM, ordered shutdown (:func:`run_lifecycle_node`).

Both signals mean "stop, clean up, exit with 0", also while the model is still loading
(:class:`ShutdownSignals`); a thread still alive after cleanup is reported on stderr
(:func:`report_live_threads`).
"""
from __future__ import annotations

import faulthandler
import signal
import sys
import threading
import time
from typing import Any, Callable

import rclpy
from rclpy.executors import ExternalShutdownException
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.signals import SignalHandlerOptions

from .dds_workarounds import NodeExecutor, linger_after_responses, spin_once

GIL_SWITCH_INTERVAL_S = 0.0005
"""The interpreter's thread switch interval in a node process (Python's default is 5 ms): the pipeline
stages hand the GIL to each other while devices work, and each hand-off can wait up to one interval."""

SPIN_SLICE_S = 0.1
"""Longest wait of the main thread in the executor; it bounds the delay between a signal and shutdown."""
DRAIN_S = 0.2
"""After a signal, how long the executor still starts callbacks that are ready: a service request that had
arrived but not yet started (a loaded machine) is served and answered, not left without a response."""

LIVE_THREADS_MESSAGE = "threads still alive after shutdown"


class ShutdownRequested(BaseException):
    """SIGINT or SIGTERM arrived while the node was starting up or loading its model.

    Raised in the main thread by :class:`ShutdownSignals`. Like KeyboardInterrupt it derives from
    BaseException, so the ``except Exception`` clauses of loaders let it through and the load is abandoned.
    """


class ShutdownSignals:
    """SIGINT and SIGTERM handling of a node process: both mean "stop, clean up, exit with 0".

    Installed instead of rclpy's handlers, which shut the ROS context down at once under a running callback.
    While :attr:`interruptible` (start-up and model loading in the main thread) the first signal raises
    :class:`ShutdownRequested` and the load is abandoned; otherwise it is recorded in :attr:`received`, which
    the main thread checks every ``SPIN_SLICE_S`` before it shuts down in order. A second signal is ignored,
    so it cannot cut that cleanup short.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received = ""  # name of the first signal, "" while none arrived
        self.interruptible = False
        self.on_signal: list[Callable[[], None]] = []  # run in the handler, before anything else stops
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
        for stop in self.on_signal:  # commands stop at the signal, not after the drain and the teardown
            try:
                stop()
            except Exception as exc:  # noqa: BLE001 - the ordered shutdown below still runs
                print(f"on signal: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        if self.interruptible:
            self.interruptible = False
            raise ShutdownRequested(self.received)


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
    executor starts, for :data:`DRAIN_S`, the callbacks that are ready (requests that arrived before the
    signal), the running callbacks finish, a service response sent in the last
    :data:`~.dds_workarounds.RESPONSE_LINGER_S` gets that long to arrive, the node's resources are released
    (pipeline threads joined, device memory freed), the node and then the ROS context are shut down, and any
    thread still alive after that is reported on stderr.
    """
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    if signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:  # kill -USR1: every thread's stack on stderr
        faulthandler.register(signal.SIGUSR1, all_threads=True)
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
        signals.on_signal.append(node.halt_commands)
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
                    spin_once(executor, SPIN_SLICE_S)
                drain = time.monotonic() + DRAIN_S
                while time.monotonic() < drain and rclpy.ok():  # the callbacks started here finish below
                    spin_once(executor, 0.02)
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
        linger_after_responses()  # a response just sent reaches its client before the node goes
        if node is not None:
            node.release_resources()
            node.destroy_node()
        rclpy.try_shutdown()
        signals.restore()
    report_live_threads(name)
    return code
