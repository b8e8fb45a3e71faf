"""The work-arounds of nodes/dds_workarounds.py, each against the rclpy behaviour it works around.

ResponseSender: rmw_fastrtps drops a response whose client's response reader is not matched within 100 ms;
rclpy reports that as the RuntimeWarning "failed to send response (timeout): ...". These tests drive
ResponseSender with a service stand-in that fails the way rclpy does; the node-level behaviour (a fresh
client calling a node that has just started) runs over DDS in test_vlm_node.py.

NodeExecutor: rclpy's MultiThreadedExecutor destroys its guard condition before it joins its worker pool;
NodeExecutor joins the pool (rclpy's private ``_executor``) first. The test fails when an rclpy release
moves that pool, which would otherwise turn the work-around off without a sign.
"""
from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("rclpy", reason="the node helpers need rclpy (run `make test`, which sets up .venv)")

import rclpy  # noqa: E402
from rclpy.context import Context  # noqa: E402
from rclpy.executors import MultiThreadedExecutor  # noqa: E402

from synflux_ros.nodes.dds_workarounds import (  # noqa: E402
    NodeExecutor, ResponseSender, linger_after_responses, spin_once)

TIMEOUT_WARNING = ("failed to send response (timeout): client will not receive response, at "
                   "/project/src/rmw_response.cpp:164")


class Logger:
    def __init__(self):
        self.lines = []

    def info(self, msg):
        self.lines.append(("info", msg))

    def error(self, msg):
        self.lines.append(("error", msg))


class FakeNode:
    def __init__(self):
        self.logger = Logger()

    def get_logger(self):
        return self.logger


class FlakyService:
    """Undeliverable for the first ``failures`` sends, as rclpy reports it (a warning, no exception)."""
    srv_name = "/robot/chat"

    def __init__(self, failures: int):
        self.failures, self.delivered, self.calls = failures, [], 0

    def send_response(self, response, header):
        self.calls += 1
        if self.calls <= self.failures:
            warnings.warn(TIMEOUT_WARNING, RuntimeWarning, stacklevel=2)
            return
        self.delivered.append((response, header))


def test_a_response_is_sent_again_until_delivered():
    node, srv = FakeNode(), FlakyService(failures=3)
    sender = ResponseSender(node, srv, resend_s=5.0)
    srv.send_response("reply", "hdr")  # what the executor calls after the callback
    assert srv.delivered == [("reply", "hdr")] and srv.calls == 4
    assert (sender.resent, sender.lost) == (1, 0)
    assert any("attempt 4" in msg for level, msg in node.logger.lines if level == "info")


def test_a_response_delivered_at_once_is_sent_once():
    node, srv = FakeNode(), FlakyService(failures=0)
    sender = ResponseSender(node, srv)
    srv.send_response("reply", "hdr")
    assert srv.calls == 1 and (sender.resent, sender.lost) == (0, 0) and node.logger.lines == []


def test_the_process_lingers_after_a_response_before_the_node_goes():
    node, srv = FakeNode(), FlakyService(failures=0)
    ResponseSender(node, srv)
    srv.send_response("reply", "hdr")
    t0 = time.monotonic()
    slept = linger_after_responses(0.3)  # right after the response: most of the 0.3 s
    assert 0.2 < slept <= 0.3 and time.monotonic() - t0 >= slept
    assert linger_after_responses(0.3) == 0.0  # 0.3 s have passed: no wait


def test_an_entity_destroyed_under_the_wait_set_costs_one_wait():
    from rclpy.exceptions import InvalidHandle

    class Executor:
        calls = 0

        def spin_once(self, timeout_sec):
            self.calls += 1
            if self.calls == 1:
                raise InvalidHandle("cannot use Destroyable because destruction was requested")

    ex = Executor()
    spin_once(ex, 0.01)  # what rclpy raised when cleanup destroyed a publisher: not out of the spin loop
    spin_once(ex, 0.01)
    assert ex.calls == 2

    class Broken:
        def spin_once(self, timeout_sec):
            raise RuntimeError("something else")

    with pytest.raises(RuntimeError, match="something else"):
        spin_once(Broken(), 0.01)


def test_an_undeliverable_response_is_counted_and_logged_as_lost():
    node, srv = FakeNode(), FlakyService(failures=10**6)
    sender = ResponseSender(node, srv, resend_s=0.3)
    srv.send_response("reply", "hdr")
    assert srv.delivered == [] and srv.calls >= 2
    assert (sender.resent, sender.lost) == (0, 1)
    errors = [msg for level, msg in node.logger.lines if level == "error"]
    assert len(errors) == 1 and "/robot/chat: response lost" in errors[0]


def test_failures_are_told_apart_per_thread_and_other_warnings_still_show():
    # a send failing in one executor thread must not make another thread's send look failed
    node = FakeNode()
    flaky, fine = FlakyService(failures=2), FlakyService(failures=0)
    a, b = ResponseSender(node, flaky), ResponseSender(node, fine)
    t = threading.Thread(target=flaky.send_response, args=("r1", "h1"))
    t.start()
    fine.send_response("r2", "h2")
    t.join()
    assert (a.resent, b.resent, a.lost, b.lost) == (1, 0, 0, 0) and fine.calls == 1
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.warn("something else", RuntimeWarning)
    assert [str(w.message) for w in seen] == ["something else"]


def guard_alive_while_a_callback_runs(executor_cls) -> bool:
    """Shut an executor down while its worker pool still runs a callback; True when the executor's guard
    condition was still there when the callback finished."""
    context = Context()
    rclpy.init(context=context)
    try:
        ex = executor_cls(num_threads=2, context=context)
        assert isinstance(ex._executor, ThreadPoolExecutor)  # the pool NodeExecutor joins
        seen = []
        ex._executor.submit(lambda: (time.sleep(0.2), seen.append(ex._guard is not None)))
        time.sleep(0.05)
        ex.shutdown()
        return seen == [True]
    finally:
        rclpy.shutdown(context=context)


def test_node_executor_finishes_running_callbacks_before_tearing_down():
    assert guard_alive_while_a_callback_runs(NodeExecutor)
    # the rclpy behaviour it works around: a plain MultiThreadedExecutor destroys the guard first
    assert not guard_alive_while_a_callback_runs(MultiThreadedExecutor)
