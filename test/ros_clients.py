"""Clients the node tests drive over DDS: ``Harness`` (camera in, action chunks out, vla_node) and
``ChatClient`` (the chat and end_session services, vlm_node)."""
from __future__ import annotations

import time

from diagnostic_msgs.msg import DiagnosticArray
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import String
from trajectory_msgs.msg import JointTrajectory

from synflux_ros.msg import ActionChunk
from synflux_ros.srv import Chat, EndSession
from synflux_ros.tools.harness import call_service, spin_until

JOINTS = [f"joint_{i}" for i in range(7)]
LATCHED = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
TIMEOUT = 60.0  # a safety net against a hang, not a speed requirement (the tests share 2 cores)


class Harness:
    """Client side of one vla_node under namespace ``ns``."""

    def __init__(self, node, ns: str, compressed: bool = False, state_joints=(), camera: str = "", others=()):
        """``state_joints``: the node takes the robot state; each published frame is preceded by a JointState
        of these joints with the frame's stamp (positions from :meth:`state_of`). ``camera``: frames go to
        ``<camera>/image`` (the first camera of a model with several) instead of ``image``; ``others``: the
        model's other cameras, each of which gets the frame's image (stamped 1 ms earlier) before it."""
        self.node = node
        self.state_joints = list(state_joints)
        self.state_pub = node.create_publisher(JointState, f"{ns}/joint_states", 50) if state_joints else None
        self.chunks, self.trajs, self.diags = [], [], []
        cam = f"{ns}/{camera}" if camera else ns
        kind, topic = (CompressedImage, f"{cam}/image/compressed") if compressed else (Image, f"{cam}/image")
        self.image_pub = node.create_publisher(kind, topic, qos_profile_sensor_data)
        self.other_pubs = [node.create_publisher(kind, f"{ns}/{name}/image{'/compressed' if compressed else ''}",
                                                 qos_profile_sensor_data) for name in others]
        self.instr_pub = node.create_publisher(String, f"{ns}/instruction", LATCHED)
        node.create_subscription(ActionChunk, f"{ns}/action_chunk", self.chunks.append, 50)
        node.create_subscription(JointTrajectory, f"{ns}/joint_trajectory", self.trajs.append, 50)
        node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, 50)
        self.ns = ns

    def _on_diag(self, msg):
        for st in msg.status:
            if st.name.startswith(f"{self.ns}/vla_node:"):
                self.diags.append({kv.key: kv.value for kv in st.values})

    def wait_connected(self, timeout=20.0):
        assert spin_until(self.node, lambda: self.image_pub.get_subscription_count() > 0, timeout), \
            "vla_node never subscribed to the image topic"
        assert spin_until(self.node, lambda: all(p.get_subscription_count() for p in self.other_pubs), timeout), \
            "vla_node never subscribed to every camera's image topic"
        if self.state_pub is not None:
            assert spin_until(self.node, lambda: self.state_pub.get_subscription_count() > 0, timeout), \
                "vla_node never subscribed to the joint_states topic"

    @staticmethod
    def state_of(seq: int) -> list[float]:
        return [0.1 * ((seq + i) % 5) for i in range(8)]

    def publish_state(self, stamp_ns: int, positions, names=None):
        msg = JointState(name=list(self.state_joints if names is None else names), position=list(positions))
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(stamp_ns, 10**9)
        self.state_pub.publish(msg)

    def publish_until_chunks(self, n: int, make_msg, timeout=30.0, period=0.05):
        """Publish frames until ``n`` more chunks arrived; returns the stamps published."""
        target = len(self.chunks) + n
        stamps, seq, deadline = [], 0, time.monotonic() + timeout
        while len(self.chunks) < target and time.monotonic() < deadline:
            stamp = 1_000_000_000 * (100 + seq) + 12345
            if self.state_pub is not None:
                self.publish_state(stamp - 5_000_000, self.state_of(seq)[:len(self.state_joints)])
            for pub in self.other_pubs:
                pub.publish(make_msg(seq, stamp - 1_000_000))
            self.image_pub.publish(make_msg(seq, stamp))
            stamps.append(stamp)
            seq += 1
            spin_until(self.node, lambda: len(self.chunks) >= target, period)
        assert len(self.chunks) >= target, f"only {len(self.chunks)} chunks after {seq} frames"
        return stamps

    def publish_until_diag(self, msg, predicate, timeout=15.0):
        """Best-effort delivery: re-send ``msg`` until the node's diagnostics satisfy ``predicate``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.image_pub.publish(msg)
            if spin_until(self.node, lambda: any(predicate(d) for d in self.diags), 0.3):
                return [d for d in self.diags if predicate(d)][-1]
        raise AssertionError(f"no diagnostics matching; last: {self.diags[-1:]}")

    def publish_states_until_diag(self, states, predicate, timeout=30.0, names=None):
        """Best-effort delivery of joint states: ``wait_connected`` sees the node's reader matched from the
        publisher's side, but the reader may not have matched this publisher yet, and states sent before that
        are lost. Re-send ``states`` ((stamp_ns, positions) pairs, in order) until the node's diagnostics
        satisfy ``predicate``; returns the matching diagnostics."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for stamp, positions in states:
                self.publish_state(stamp, positions, names)
            if spin_until(self.node, lambda: any(predicate(d) for d in self.diags), 0.3):
                return [d for d in self.diags if predicate(d)][-1]
        raise AssertionError(f"no diagnostics matching after re-sending {len(states)} joint states; last: "
                             f"{self.diags[-1:]}")

    def diag_where(self, predicate, timeout=10.0):
        found = []

        def check():
            found[:] = [d for d in self.diags if predicate(d)]
            return bool(found)
        assert spin_until(self.node, check, timeout), f"no diagnostics matching; last: {self.diags[-1:]}"
        return found[-1]


def stamp_ns(header) -> int:
    return header.stamp.sec * 10**9 + header.stamp.nanosec


class ChatClient:
    def __init__(self, node, ns: str, timeout: float = TIMEOUT):
        self.node, self.timeout = node, timeout
        self.chat_cli = node.create_client(Chat, f"{ns}/chat")
        self.end_cli = node.create_client(EndSession, f"{ns}/end_session")

    def chat(self, session_id: str, prompt: str, **kw):
        req = Chat.Request(session_id=session_id, prompt=prompt, **kw)
        return call_service(self.node, self.chat_cli, req, self.timeout)

    def end(self, session_id: str):
        return call_service(self.node, self.end_cli, EndSession.Request(session_id=session_id), self.timeout)


def ok(resp):
    assert resp.success, resp.error
    return resp
