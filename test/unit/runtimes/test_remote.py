"""executor.backend remote (synflux_ros.runtimes.remote) against an in-process policy behind a stand-in
connection: requests, chunks equal to the local runtime's, RTC in the model's space, and what happens when the
server is slow, refuses or is away."""
from __future__ import annotations

import time

import numpy as np
import pytest

from synflux_ros.core.config import ConfigError, load_config
from synflux_ros.model.heads.rtc import RTCGuidance
from synflux_ros.runtimes import wire
from synflux_ros.runtimes.remote import RemoteError, RemoteVLARuntime, fit
from synflux_ros.runtimes.vla import VLARuntime
from synflux_ros.serve.policy import RequestError, VLAPolicy
from synflux_ros.tools import harness as testing

STATE = {"state_dim": 8, "state_joints": ["a", "b", "c"],
         "action_norm": {"mode": "mean_std", "mean": [0.2] * 7, "std": [0.5] * 7}}


def local_cfg():
    return load_config(testing.config_path("vla_demo_orin.yaml")).with_overrides(action=STATE)


def remote_cfg(**remote):
    return local_cfg().with_overrides(executor={"backend": "remote"},
                                      remote={"url": "ws://policy:8000/", "compression": "raw", "resize": False,
                                              "backoff_min": 0.05, "backoff_max": 0.2, **remote})


class Server:
    """A stand-in for synflux-serve's connection handling around a real VLAPolicy."""

    def __init__(self):
        self.policy = VLAPolicy(local_cfg())
        self.up, self.delay, self.requests, self.connects = True, 0.0, [], 0

    def connect(self):
        if not self.up:
            raise ConnectionRefusedError(111, "Connection refused")
        self.connects += 1
        return Connection(self)


class Connection:
    def __init__(self, server):
        self.server, self.pending, self.closed, self.seq = server, [wire.pack(server.policy.metadata)], False, 0

    def send(self, data):
        if not self.server.up:
            raise ConnectionResetError("reset by peer")
        obs = wire.unpack(data, 1 << 24)
        self.server.requests.append(obs)
        try:
            self.pending.append(wire.pack(self.server.policy.infer(obs, self.seq)))
            self.seq += 1
        except RequestError as exc:
            self.pending.append(f"request refused: {exc}")

    def recv(self, timeout=None):
        if self.server.delay > (timeout or 0) and len(self.pending) and self.seq:
            time.sleep(timeout)
            raise TimeoutError("timed out")
        return self.pending.pop(0)

    def close(self):
        self.closed = True


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.policy.close()


def frame_image(seed):
    return np.random.default_rng(seed).integers(0, 256, (300, 400, 3), dtype=np.uint8)


def test_chunks_equal_the_local_runtime_s(server):
    remote = RemoteVLARuntime(remote_cfg(), connect=server.connect)
    local = VLARuntime(local_cfg())
    try:
        state = np.zeros(8, np.float32)
        state[:3] = [0.1, -0.2, 0.3]
        for seq in (0, 5):
            got = remote.infer(frame_image(seq), seq=seq, state=state)
            want = local.infer(frame_image(seq), seq=seq, state=state)
            np.testing.assert_allclose(got.actions, want.actions, atol=1e-6)
            np.testing.assert_allclose(got.raw_actions, want.raw_actions, atol=1e-6)
            assert got.timings["network_ms"] >= 0 and got.timings["head_ms"] > 0
        sent = server.requests[-1]
        assert sent["seq"] == 5 and sent["prompt"] == local.instruction
        np.testing.assert_array_equal(sent["observation/state"], np.float32([0.1, -0.2, 0.3]))
        # RTC: the leftover travels in the model's space and guides the server's chunk as it guides the local one
        prev = want.raw_actions[4:]
        rtc = RTCGuidance(prev_chunk=prev, inference_delay=2, execution_horizon=8)
        got = remote.infer(frame_image(9), seq=9, state=state, rtc=lambda: rtc)
        want = local.infer(frame_image(9), seq=9, state=state, rtc=rtc)
        np.testing.assert_allclose(got.actions, want.actions, atol=1e-5)
        assert server.requests[-1]["rtc"]["prev_chunk_model"].shape == prev.shape
        assert remote.stage_devices["network"] == "remote ws://policy:8000/"
    finally:
        remote.close()
        local.close()


def test_jpeg_frames_fitted_to_the_model_s_resolution(server):
    remote = RemoteVLARuntime(remote_cfg(compression="jpeg", resize=True, jpeg_quality=80), connect=server.connect)
    got = remote.infer(frame_image(1), seq=1, state=np.zeros(8, np.float32))
    sent = server.requests[-1]["observation/image"]
    assert isinstance(sent, bytes) and sent[:2] == b"\xff\xd8" and len(sent) < 300 * 400 * 3 // 4
    assert got.actions.shape == (16, 7) and np.all(np.isfinite(got.actions))
    assert fit(frame_image(1), 448, 448).shape == (300, 400, 3)  # smaller than the model: as it is
    assert fit(np.zeros((900, 1600, 3), np.uint8), 448, 448).shape == (252, 448, 3)  # aspect kept


def test_an_unreachable_server_fails_frames_saying_why_and_is_retried_with_backoff(server):
    server.up = False
    remote = RemoteVLARuntime(remote_cfg(), connect=server.connect)  # the node starts regardless
    state = np.zeros(8, np.float32)
    assert remote.failures == 1
    with pytest.raises(RemoteError, match=r"unreachable \(ConnectionRefusedError: .*\); next attempt in"):
        remote.infer(frame_image(0), seq=0, state=state)  # within the backoff: fails at once, with the cause
    time.sleep(0.1)
    with pytest.raises(RemoteError, match="cannot connect to ws://policy:8000/: ConnectionRefusedError"):
        remote.infer(frame_image(0), seq=0, state=state)
    assert remote.failures == 2
    server.up = True
    time.sleep(0.25)
    assert remote.infer(frame_image(0), seq=0, state=state).actions.shape == (16, 7)
    # the server goes away mid-connection
    server.up = False
    with pytest.raises(RemoteError, match="the connection to ws://policy:8000/ failed: ConnectionResetError"):
        remote.infer(frame_image(0), seq=1, state=state)
    server.up = True
    time.sleep(0.25)
    assert remote.infer(frame_image(0), seq=2, state=state).actions.shape == (16, 7)


def test_a_slow_server_times_out_and_a_refusal_is_passed_on(server):
    remote = RemoteVLARuntime(remote_cfg(request_timeout=0.05), connect=server.connect)
    state = np.zeros(8, np.float32)
    remote.infer(frame_image(0), seq=0, state=state)
    server.delay = 1.0
    try:
        with pytest.raises(RemoteError, match=r"no reply from ws://policy:8000/ within 0.05 s"):
            remote.infer(frame_image(0), seq=1, state=state)
    finally:
        server.delay = 0.0
    time.sleep(0.25)
    remote.set_instruction("x" * 1500)  # within the node's limit; too many tokens for the model
    with pytest.raises(RemoteError, match="the server refused the frame: request refused: prompt: instruction"):
        remote.infer(frame_image(0), seq=2, state=state)


def test_the_server_s_model_must_be_the_config_s(server):
    cfg = remote_cfg().with_overrides(action={"action_horizon": 8})
    with pytest.raises(ConfigError, match=r"serves 'vla-demo-orin' with \{'action_horizon': 16, 'action_dim': 7\}, "
                                          r"the config says \{'action_horizon': 8"):
        RemoteVLARuntime(cfg, connect=server.connect)


def test_the_remote_section_is_checked():
    cfg = local_cfg()
    with pytest.raises(ConfigError, match="remote.url: executor.backend remote needs the endpoint's address"):
        cfg.with_overrides(executor={"backend": "remote"})
    with pytest.raises(ConfigError, match="is not a ws://, wss://, http:// or https:// address"):
        cfg.with_overrides(remote={"url": "ftp://x"})
    with pytest.raises(ConfigError, match=r"a vla config reaches synflux-serve's policy endpoint \(ws:// or wss://\); "
                                          r"got 'http://x/v1'"):
        cfg.with_overrides(executor={"backend": "remote"}, remote={"url": "http://x/v1"})
    with pytest.raises(ConfigError, match="remote.backoff_max"):
        cfg.with_overrides(remote={"backoff_min": 5.0, "backoff_max": 1.0})
    vlm = load_config(testing.config_path("vlm_demo.yaml"))
    with pytest.raises(ConfigError, match=r"a vlm config reaches synflux-serve's chat API's base \(http:// or "
                                          r"https://, e.g. http://gpu-server:8000/v1\); got 'ws://x/'"):
        vlm.with_overrides(executor={"backend": "remote"}, remote={"url": "ws://x/"})
    assert vlm.with_overrides(executor={"backend": "remote"}, remote={"url": "https://x/v1"}).remote.turn_timeout \
        == 120.0
