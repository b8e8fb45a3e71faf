"""Every place where the nodes work around a behaviour of rclpy or of the DDS middleware under it.

Each work-around lives here, so that an rclpy or rmw upgrade has one module to check:

* :class:`ResponseSender`: rmw_fastrtps sends a service response only once the server has matched the
  client's response reader, and waits 100 ms for that. When the wait runs out, rclpy's
  ``Service.send_response`` neither raises nor returns a status: it emits the RuntimeWarning "failed to send
  response (timeout)" and the response is gone. A client that calls right after it discovered a node that
  has just started (or one busy loading a model) hits this: the request arrived, the answer never does.
  The sender wraps ``send_response`` and sends again until the reader is matched, for up to
  :data:`RESPONSE_RESEND_S`.
* :func:`_ensure_send_failure_hook`: that warning is the only sign of the failure, so a
  ``warnings.showwarning`` hook counts it per thread (rclpy emits it in the sending thread) and keeps it
  off stderr.
* :func:`linger_after_responses`: a reliable writer destroyed right after it wrote a sample takes the sample
  with it when the reader has not acknowledged it yet (rmw_fastrtps has no writer linger), so a response
  written just before the node is destroyed may not reach its client. The process waits
  :data:`RESPONSE_LINGER_S` after the last response before it destroys the node.
* :func:`spin_once`: a lifecycle transition running in an executor thread (cleanup) destroys publishers while
  the main thread builds the next wait set from them; rclpy then raises ``InvalidHandle`` ("destruction was
  requested") out of ``spin_once`` and the node process died. The wait set is built again on the next call.
* :class:`NodeExecutor`: ``MultiThreadedExecutor.shutdown`` destroys the executor's guard condition before
  it joins its worker threads, so a callback already handed to a worker takes its message and then fails
  on the destroyed guard condition. It joins rclpy's private worker pool (``_executor``) first.
* :class:`DedicatedSubscription`: ``MultiThreadedExecutor`` builds its wait set again in Python two or three
  times per message and its threads pass the interpreter lock back and forth, more so with the node's short
  switch interval; a high-rate stream such as ``joint_states`` costs the node a large share of a core and loses
  messages (figures: docs/robustness.md, ``bench.nodes``). A high-rate input gets a node and a
  single-threaded executor of its own.
"""
from __future__ import annotations

import threading
import time
import warnings

import rclpy
from rclpy.exceptions import InvalidHandle
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor, SingleThreadedExecutor

from .ros_compat import executor_shutdown

RESPONSE_RESEND_S = 5.0
"""How long a service response is sent again while the client's response reader is not matched."""
RESPONSE_LINGER_S = 0.3
"""How long the process keeps a node after its last service response, for the response to reach the client."""
_last_response = [float("-inf")]  # time.monotonic() of the last response a ResponseSender sent
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
                _last_response[0] = time.monotonic()
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


def linger_after_responses(linger_s: float = RESPONSE_LINGER_S) -> float:
    """Sleep until ``linger_s`` has passed since the last response a :class:`ResponseSender` sent (no wait
    when none was sent that recently); returns the seconds slept. Called before the node is destroyed."""
    wait = _last_response[0] + linger_s - time.monotonic()
    if wait <= 0:
        return 0.0
    time.sleep(wait)
    return wait


def spin_once(executor, timeout_sec: float) -> None:
    """``executor.spin_once``, where an entity destroyed while the wait set was being built (by a transition in
    another thread) costs that one wait: rclpy builds the wait set again on the next call."""
    try:
        executor.spin_once(timeout_sec=timeout_sec)
    except InvalidHandle:
        pass


class NodeExecutor(MultiThreadedExecutor):
    """MultiThreadedExecutor whose shutdown first finishes the callbacks already handed to its threads.

    ``MultiThreadedExecutor.shutdown`` destroys the executor's guard condition and then joins its threads;
    a callback still queued at that moment takes its message (an image, a chat request) and then fails on
    the destroyed guard condition before it runs, so the message is lost and the failure printed at exit.
    Joining the threads first lets each such callback run while the node is still whole.
    """

    def shutdown(self, timeout_sec: float | None = None, *, wait_for_threads: bool = True) -> bool:
        # wait_for_threads is rclpy 7.1.12's argument (kept so that a newer rclpy may pass it); older ones,
        # Humble's and Jazzy's 7.1.6 among them, have none and always wait (ros_compat.executor_shutdown)
        pool = getattr(self, "_executor", None)  # the thread pool of rclpy's MultiThreadedExecutor (private)
        if wait_for_threads and pool is not None:
            pool.shutdown(wait=True)
        return executor_shutdown(MultiThreadedExecutor, self, timeout_sec, wait_for_threads)


class DedicatedSubscription:
    """A subscription of ``owner``'s to ``topic`` (resolved as ``owner`` resolves it: namespace and remappings)
    served by a hidden node (``_<owner>_<suffix>``: no parameter services, no rosout) and a
    ``SingleThreadedExecutor`` in a thread of their own. The callback runs in that thread, concurrently with
    ``owner``'s callbacks, as it would in a ``MultiThreadedExecutor``'s thread. :meth:`destroy` stops the
    thread (after a callback in progress) and destroys the node."""

    def __init__(self, owner, msg_type, topic: str, callback, qos, suffix: str):
        self._node = rclpy.create_node(f"_{owner.get_name()}_{suffix}", namespace=owner.get_namespace(),
                                       context=owner.context, use_global_arguments=False,
                                       start_parameter_services=False, enable_rosout=False)
        self._node.create_subscription(msg_type, owner.resolve_topic_name(topic), callback, qos)
        self._executor = SingleThreadedExecutor(context=owner.context)
        self._executor.add_node(self._node)
        self._thread = threading.Thread(target=self._spin, name=f"{owner.get_name()}.{suffix}", daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        try:
            self._executor.spin()
        except ExternalShutdownException:
            pass  # the context was shut down (rclpy.shutdown at exit)

    def destroy(self, timeout: float = 5.0) -> bool:
        """Stop serving the subscription; False when the callback still runs after ``timeout`` s (the node is
        left to the process's exit then)."""
        self._executor.shutdown(timeout_sec=timeout)
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self._node.destroy_node()
        return True
