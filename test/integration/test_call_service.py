"""The test clients' service calls survive a lost response.

rmw_fastrtps drops a response when the server has not matched the client's response reader in time (late
discovery under load). These tests stand a server in this process that keeps its first answer back past
the resend period, which is what the client sees of a lost response, and check what call_service does.
"""
from __future__ import annotations

import threading
import time
import uuid

import pytest
import rclpy
from rclpy.executors import SingleThreadedExecutor

from synflux_ros.tools import harness as testing


class SlowFirstServer:
    """A Trigger service whose first answer comes RESEND_S + 1 s late; the message counts the requests."""

    def __init__(self):
        from std_srvs.srv import Trigger
        self.requests: list[str] = []
        self.node = rclpy.create_node(f"slow_first_{uuid.uuid4().hex[:8]}")
        self.name = f"/slow_first_{uuid.uuid4().hex[:8]}"
        self.node.create_service(Trigger, self.name, self._on_trigger)
        self.executor = SingleThreadedExecutor()
        self.executor.add_node(self.node)
        self.thread = threading.Thread(target=self.executor.spin, daemon=True)
        self.thread.start()

    def _on_trigger(self, request, response):
        self.requests.append("request")
        if len(self.requests) == 1:
            time.sleep(testing.RESEND_S + 1.0)
        response.success = True
        response.message = str(len(self.requests))
        return response

    def close(self):
        self.executor.shutdown()
        self.node.destroy_node()


@pytest.fixture()
def server(ros_env):
    s = SlowFirstServer()
    yield s
    s.close()


def test_an_idempotent_request_is_sent_again_until_answered(server, client):
    from std_srvs.srv import Trigger
    cli = client.create_client(Trigger, server.name)
    r = testing.call_service(client, cli, Trigger.Request(), 30, idempotent=True)
    # the first answer was given up on; a request sent again is the one answered (how many went out
    # depends on how soon the server gets to them once it is free)
    assert int(r.message) >= 2 and len(server.requests) >= 2


def test_a_request_that_changes_state_is_sent_once(server, client):
    from std_srvs.srv import Trigger
    cli = client.create_client(Trigger, server.name)
    r = testing.call_service(client, cli, Trigger.Request(), 30)
    assert r.message == "1" and len(server.requests) == 1


def test_a_probe_goes_first_once_per_client(server, client):
    from std_srvs.srv import Trigger
    cli = client.create_client(Trigger, server.name)
    r = testing.call_service(client, cli, Trigger.Request(), 30, probe=Trigger.Request())
    # probe 1 kept back, a probe sent again answered, then the request itself, sent once: the last one
    assert int(r.message) >= 3 and r.message == str(len(server.requests))
    before = len(server.requests)
    r = testing.call_service(client, cli, Trigger.Request(), 30, probe=Trigger.Request())
    assert r.message == str(before + 1) and len(server.requests) == before + 1, "an answered client is not probed again"


def test_no_answer_at_all_is_a_timeout_naming_the_service(client, ros_env):
    from std_srvs.srv import Trigger
    server = rclpy.create_node(f"mute_{uuid.uuid4().hex[:8]}")
    name = f"/mute_{uuid.uuid4().hex[:8]}"
    server.create_service(Trigger, name, lambda req, resp: resp)  # never spun: it never answers
    try:
        cli = client.create_client(Trigger, name)
        with pytest.raises(TimeoutError, match=f"service {name} did not answer within 5"):
            testing.call_service(client, cli, Trigger.Request(), 5, idempotent=True)
    finally:
        server.destroy_node()


def test_lifecycle_probe_is_refused_without_a_transition(start_node, client):
    from lifecycle_msgs.srv import GetState
    from lifecycle_msgs.srv import ChangeState
    start_node("vla_node", {"autostart": False}, namespace="/probe")
    change = client.create_client(ChangeState, "/probe/vla_node/change_state")
    get_state = client.create_client(GetState, "/probe/vla_node/get_state")
    assert not testing.call_service(client, change, testing.lifecycle_probe(), 30).success
    assert testing.call_service(client, get_state, GetState.Request(), 30,
                                idempotent=True).current_state.label == "unconfigured"
