"""Helpers to run the installed node executables as processes and talk to them with rclpy.

Used by the integration tests, ``make demo`` and ``make bench``. DDS traffic stays on this machine
(``ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST``; ``ROS_LOCALHOST_ONLY=1`` on Humble). The ROS domain is the
caller's ``ROS_DOMAIN_ID`` when it is set (a test runner such as ament_cmake_ros's run_test_isolated.py sets a
free one), else one chosen per run.
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import numpy as np
import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.executors import SingleThreadedExecutor
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import Image, JointState

from ..msg import ActionChunk
from ..nodes import ros_compat
from ..nodes.params import PACKAGE, share_dir


def executable(name: str) -> str:
    """Path of an installed node executable (lib/synflux_ros/<name>)."""
    for prefix in [p for p in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep) if p] + [sys.prefix]:
        path = os.path.join(prefix, "lib", PACKAGE, name)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{name} is not installed under lib/{PACKAGE} (run `make install`)")


def config_path(name: str) -> str:
    share = share_dir()
    if share is None:
        raise FileNotFoundError(f"{PACKAGE} share directory not found (run `make install`)")
    return os.path.join(share, "config", name)


def choose_domain_id() -> str:
    """The ROS domain to use: ``ROS_DOMAIN_ID`` from the environment when it is set, else a random one.

    A runner that sets ``ROS_DOMAIN_ID`` has chosen the domain on purpose (an isolated test domain, or
    the user's own); replacing it could put the nodes on the domain of a live system.
    """
    current = os.environ.get("ROS_DOMAIN_ID", "").strip()
    return current if current else str(random.randint(1, 101))


def ros_env(domain_id: int | None = None, log_dir: str | None = None) -> dict:
    """Environment for node processes: loopback-only DDS, the shared-memory profile, and the domain
    ``domain_id`` if given, else the one of :func:`choose_domain_id` (the caller's ``ROS_DOMAIN_ID`` if set)."""
    env = dict(os.environ)
    env.setdefault("AMENT_PREFIX_PATH", sys.prefix)
    env.update(ros_compat.localhost_only_env(env))
    env["ROS_DOMAIN_ID"] = str(domain_id) if domain_id is not None else choose_domain_id()
    env.setdefault("RMW_IMPLEMENTATION", "rmw_fastrtps_cpp")
    profile = os.path.join(share_dir() or "", "config", "fastdds_shm.xml")
    if os.path.isfile(profile):
        ros_compat.set_fastdds_profile(env, profile)  # under the variable the installed Fast DDS reads
    env["ROS_LOG_DIR"] = log_dir or tempfile.mkdtemp(prefix="synflux_roslog_")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def use_env(env: dict) -> None:
    """Apply the DDS-relevant variables of ``env`` to this process (before rclpy.init)."""
    for key in ros_compat.DDS_VARIABLES:
        if key in env:
            os.environ[key] = env[key]


@contextlib.contextmanager
def client_node(name: str, env: dict):
    """An rclpy node of this process on the DDS set-up of ``env`` (rclpy initialised and shut down here)."""
    use_env(env)
    rclpy.init()
    node = rclpy.create_node(name)
    try:
        yield node
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


def _param_arg(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_param_arg(v) for v in value) + "]"
    if isinstance(value, str):
        return "'" + value + "'" if value == "" or value.lower() in ("true", "false") else value
    return str(value)


class NodeProcess:
    """One node executable started with ``--ros-args`` parameters and remaps; output goes to a file."""

    def __init__(self, name: str, params: dict | None = None, env: dict | None = None,
                 remaps: dict | None = None, node_name: str | None = None, launcher: tuple = ()):
        self.name = name
        # launcher: a Python script run in front of the executable (given its path and arguments)
        cmd = [sys.executable, *launcher, executable(name), "--ros-args"]
        if node_name:
            cmd += ["-r", f"__node:={node_name}"]
        for k, v in (remaps or {}).items():
            cmd += ["-r", f"{k}:={v}"]
        for k, v in (params or {}).items():
            cmd += ["-p", f"{k}:={_param_arg(v)}"]
        self.cmd = cmd
        self.env = env or ros_env()
        self._log = tempfile.NamedTemporaryFile(prefix=f"{name}_", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        self._interrupted = False

    def output(self) -> str:
        with open(self._log.name, encoding="utf-8", errors="replace") as fh:
            return fh.read()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_output(self, text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output():
                return True
            if not self.alive():
                return text in self.output()
            time.sleep(0.05)
        return False

    def interrupt(self) -> None:
        """SIGINT, as Ctrl-C or `ros2 launch` would send, once, without waiting for the exit."""
        if self.alive() and not self._interrupted:
            self._interrupted = True
            self.proc.send_signal(signal.SIGINT)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGINT (:meth:`interrupt`), then wait; returns the exit code. A node still running after ``timeout``
        gets SIGUSR1 (it writes its threads' stacks to its output) and then SIGKILL."""
        if self.alive():
            self.interrupt()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGUSR1)  # the node's threads' stacks into its output, then kill
                try:
                    self.proc.wait(2.0)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def stop_all(procs) -> list[int]:
    """Stop several node processes at once: every one gets SIGINT before any is waited for, so their shutdowns
    (drain, response linger, release) overlap. Returns each process's exit code, by position."""
    for p in procs:
        p.interrupt()
    return [p.stop() for p in procs]


def rgb_image(height: int, width: int, seq: int = 0, stamp_ns: int | None = None, frame_id: str = "camera",
              encoding: str = "rgb8") -> Image:
    """A synthetic camera frame (moving gradient) as sensor_msgs/Image."""
    ch = {"rgb8": 3, "bgr8": 3, "rgba8": 4, "bgra8": 4, "mono8": 1}[encoding]
    y = np.arange(height, dtype=np.uint16)[:, None]
    x = np.arange(width, dtype=np.uint16)[None, :]
    base = ((x + y + 7 * seq) % 256).astype(np.uint8)
    data = np.repeat(base[:, :, None], ch, axis=2)
    data[..., 0] = (base + 85 * (seq % 3)).astype(np.uint8)
    msg = Image()
    if stamp_ns is not None:
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(int(stamp_ns), 10**9)
    msg.header.frame_id = frame_id
    msg.height, msg.width, msg.encoding, msg.is_bigendian = height, width, encoding, 0
    msg.step = width * ch
    msg.data = data.tobytes()
    return msg


def spin_until(node, predicate, timeout: float, executor=None) -> bool:
    """Spin ``node`` until ``predicate()`` is true or ``timeout`` seconds pass."""
    ex = executor or SingleThreadedExecutor()
    own = executor is None
    if own:
        ex.add_node(node)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            ex.spin_once(timeout_sec=0.02)
        return predicate()
    finally:
        if own:
            ex.remove_node(node)


# Fast DDS (rmw_fastrtps) drops a service response when, 100 ms after the request arrived, the server has
# not yet matched the client's response reader ("failed to send response (timeout): client will not
# receive response"). wait_for_service only says that the client has discovered the server; under load the
# server can discover a new client's response reader later than its request writer. A client that has
# been answered once is matched, so only its first request is at risk.
RESEND_S = 2.0
_answered_clients = weakref.WeakSet()


def lifecycle_probe():
    """A ChangeState request every lifecycle node refuses without changing state (an unknown label)."""
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState
    return ChangeState.Request(transition=Transition(label="synflux_no_such_transition"))


def call_service(node, client, request, timeout: float, *, idempotent: bool = False, probe=None):
    """Call a service and wait for the answer (raises TimeoutError after ``timeout`` s in all).

    A response lost to late discovery (see above) is not waited for in vain: an ``idempotent`` request is
    sent again every RESEND_S until answered. For a request that changes state, pass ``probe``, a request
    the server answers without changing anything (:func:`lifecycle_probe`): before this client's first
    request it is sent, and resent, until one is answered; after that the server has matched the client.
    """
    deadline = time.monotonic() + timeout
    if not client.wait_for_service(timeout_sec=timeout):
        raise TimeoutError(f"service {client.srv_name} not available within {timeout} s")
    if probe is not None and client not in _answered_clients:
        if _answer(node, client, probe, deadline, resend=True) is None:
            raise TimeoutError(f"service {client.srv_name} did not answer a probe within {timeout} s")
    response = _answer(node, client, request, deadline, resend=idempotent)
    if response is None:
        raise TimeoutError(f"service {client.srv_name} did not answer within {timeout} s")
    return response


def _answer(node, client, request, deadline: float, resend: bool):
    while True:
        future = client.call_async(request)
        left = deadline - time.monotonic()
        rclpy.spin_until_future_complete(node, future, timeout_sec=max(min(left, RESEND_S) if resend else left, 0))
        if future.done():
            _answered_clients.add(client)
            return future.result()
        client.remove_pending_request(future)
        if not resend or time.monotonic() >= deadline:  # a request that changes state goes out once
            return None


def stream_camera(node, ns: str, rate_hz: float, seconds: float, warmup: int = 10, size: int = 448):
    """Publish ``size``x``size`` rgb8 frames on ``<ns>/image`` at ``rate_hz`` for ``seconds`` (after
    ``warmup`` frames) and collect ``<ns>/action_chunk``. Returns (chunks, receive times on the monotonic
    clock, camera-stamp-to-receipt milliseconds), all counted from the end of the warm-up."""
    chunks, times, wire = [], [], []

    def on_chunk(msg):
        wire.append((time.time_ns() - (msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec)) / 1e6)
        chunks.append(msg)
        times.append(time.monotonic())
    pub = node.create_publisher(Image, f"{ns}/image", qos_profile_sensor_data)
    sub = node.create_subscription(ActionChunk, f"{ns}/action_chunk", on_chunk, 100)
    try:
        if not spin_until(node, lambda: pub.get_subscription_count() > 0, 30):
            raise RuntimeError(f"nothing subscribed to {ns}/image within 30 s")
        frames = [rgb_image(size, size, i) for i in range(8)]
        period = 1.0 / rate_hz
        start = time.monotonic()
        for i in range(int(seconds * rate_hz) + warmup):
            msg = frames[i % len(frames)]
            msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(time.time_ns(), 10**9)
            pub.publish(msg)
            spin_until(node, lambda: False, max(0.0, start + (i + 1) * period - time.monotonic()))
            if i == warmup - 1:
                del chunks[:], times[:], wire[:]
        spin_until(node, lambda: False, 0.5)
    finally:
        node.destroy_publisher(pub)
        node.destroy_subscription(sub)
    return chunks, times, wire


class JointStateStream:
    """JointStates of ``joints`` (positions 0.1, stamped with the wall clock) on ``topic`` at ``rate_hz`` from a
    thread of their own, between :meth:`start` and :meth:`stop`; :attr:`sent` counts them."""

    def __init__(self, node, topic: str, joints, rate_hz: float):
        self.pub = node.create_publisher(JointState, topic, 100)
        self.node, self.joints, self.period = node, list(joints), 1.0 / rate_hz
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            msg = JointState(name=self.joints, position=[0.1] * len(self.joints))
            now = time.time()
            msg.header.stamp.sec, msg.header.stamp.nanosec = int(now), int(now % 1 * 1e9)
            self.pub.publish(msg)
            self.sent += 1
            due += self.period
            time.sleep(max(0.0, due - time.monotonic()))

    def start(self) -> "JointStateStream":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.node.destroy_publisher(self.pub)


def watch_diagnostics(node, name_prefix: str, on_values):
    """Subscribe ``node`` to /diagnostics; ``on_values({key: value})`` for each status whose name starts with
    ``name_prefix`` (a node's fully qualified name). Returns the subscription."""
    def on_array(msg):
        for status in msg.status:
            if status.name.startswith(name_prefix):
                on_values({kv.key: kv.value for kv in status.values})
    return node.create_subscription(DiagnosticArray, "/diagnostics", on_array, 10)


def chunks_one_at_a_time(node, ns: str, images: dict, joints, count: int, warmup: int = 3,
                         timeout: float = 3.0) -> list:
    """Frames to a vla_node under ``ns``, one at a time: a JointState of ``joints`` (positions 0.1), then each
    camera's image (``images``: camera name -> HxWx3 uint8 in config order, on ``<ns>/<camera>/image``; the
    first camera last, as its frame triggers inference), all with one stamp. The next frame goes as soon as
    this one's chunk arrived, or after ``timeout`` s (best-effort messages can be lost), so the node works frame
    after frame as a timed loop of calls does. Frames are 0.1 s apart: one whose state is not in yet takes the
    previous frame's (within ``action.state_max_age``). Returns the ``count`` ActionChunks after the first
    ``warmup``."""
    chunks = []
    sub = node.create_subscription(ActionChunk, f"{ns}/action_chunk", chunks.append, 50)
    pubs = {c: node.create_publisher(Image, f"{ns}/{c}/image", qos_profile_sensor_data) for c in images}
    state_pub = node.create_publisher(JointState, f"{ns}/joint_states", 50)

    def stamp(k: int) -> tuple[int, int]:  # frame k's (sec, nanosec): 100 s + k * 0.1 s
        return 100 + k // 10, (k % 10) * 100_000_000

    def stamped(msg, k: int):
        msg.header.stamp.sec, msg.header.stamp.nanosec = stamp(k)
        return msg

    def is_frame(chunk, k: int) -> bool:
        return (chunk.header.stamp.sec, chunk.header.stamp.nanosec) == stamp(k)

    try:
        for pub in [*pubs.values(), state_pub]:
            if not spin_until(node, lambda: pub.get_subscription_count() > 0, 60.0):
                raise RuntimeError(f"vla_node did not subscribe to {pub.topic_name} within 60 s")
        got, k = [], 0
        state_pub.publish(stamped(JointState(name=list(joints), position=[0.1] * len(joints)), k))
        time.sleep(0.02)  # the first frame's state before it
        while len(got) < count + warmup:
            k += 1
            state_pub.publish(stamped(JointState(name=list(joints), position=[0.1] * len(joints)), k))
            for i, (cam, rgb) in enumerate(list(images.items())[::-1]):
                if i:
                    time.sleep(0.01)  # the other cameras' images before the first camera's
                h, w = rgb.shape[:2]
                pubs[cam].publish(stamped(Image(height=h, width=w, encoding="rgb8", step=3 * w,
                                                data=rgb.tobytes()), k))
            if spin_until(node, lambda: any(is_frame(c, k) for c in chunks), timeout):
                got.append(next(c for c in chunks if is_frame(c, k)))
    finally:
        node.destroy_subscription(sub)
        for pub in [*pubs.values(), state_pub]:
            node.destroy_publisher(pub)
    return got[warmup:]


def chunk_for_frame(node, chunks: list, publish, stamp: int, timeout: float = 20.0, wait: float = 1.0):
    """Call ``publish(stamp)`` (a frame stamped ``stamp`` ns and whatever goes with it) until ``chunks`` (filled
    by a subscription of ``node``) holds the ActionChunk of that frame; best-effort messages can be lost, so
    each retry, after ``wait`` s, uses a stamp 1 us later. Returns the chunk; AssertionError after ``timeout``."""
    def stamp_of(c):
        return c.header.stamp.sec * 10**9 + c.header.stamp.nanosec

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        publish(stamp)
        if spin_until(node, lambda: any(stamp_of(c) == stamp for c in chunks), wait):
            return next(c for c in chunks if stamp_of(c) == stamp)
        stamp += 1000
    raise AssertionError(f"no chunk for the frame stamped {stamp}")


def wait_configured(procs, timeout: float, tail: int = 4000) -> bool:
    """Wait for each started node to log that it is configured and print that line; False, with the end of
    the node's output on stderr, for the first that does not within ``timeout`` seconds."""
    for p in procs:
        if not p.wait_output("configured", timeout):
            print(f"{p.name} did not start:\n{p.output()[-tail:]}", file=sys.stderr)
            return False
        line = next(x for x in p.output().splitlines() if "configured" in x)
        print(f"  {p.name}: {line.split(']: ', 1)[-1]}")
    return True


def run_with_nodes(client_name: str, procs, timeout: float, body) -> int:
    """Start rclpy and a client node, wait until the started nodes ``procs`` are configured, run
    ``body(node)`` (truthy = it went well), then stop everything; 0 when the body went well and every node
    exited cleanly, else 1."""
    import rclpy
    rclpy.init()
    node = rclpy.create_node(client_name)
    ok = False
    try:
        if not wait_configured(procs, timeout):
            return 1
        ok = bool(body(node))
    finally:
        node.destroy_node()
        rclpy.try_shutdown()
        codes = dict(zip((p.name for p in procs), stop_all(procs)))
        print(f"nodes stopped, exit codes {codes}")
    return 0 if ok and all(c == 0 for c in codes.values()) else 1
