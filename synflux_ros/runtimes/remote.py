"""A VLA served by ``synflux-serve`` (``executor.backend: remote``): the node keeps its pipeline, accounting,
diagnostics and chunk executor; the model runs on the server, reached over openpi's websocket protocol.

Two stages: ``encode`` (on the robot: each camera image fitted to the model's resolution, JPEG-compressed or
sent raw, as ``remote`` says) and ``network`` (the request, the server's inference and the reply; its time is
the round trip less the server's inference, which the server's stage times report). A frame carries its
sequence number, so the server seeds the noise as the local runtime does, and the Real-Time Chunking leftover in
the model's action space; the reply carries the chunk in both spaces.

The connection is opened on the first frame (and at load, to check the server's model against the config);
a failed request closes it, and frames that come before the next attempt (backoff doubling from
``remote.backoff_min`` to ``remote.backoff_max``) fail at once, saying the server is unreachable and when the
next attempt is.
"""
from __future__ import annotations

import io
import ssl
import threading
import time
from typing import Callable

import numpy as np

from ..core.config import ConfigError, ModelConfig
from ..model.image import check_image_size
from . import wire
from .vla import Frame, StagedVLA, instruction_text

MAX_REPLY_BYTES = 1 << 24


class RemoteError(RuntimeError):
    """The server could not be reached or did not answer in time; the text says which and what follows."""


class NoDevice:
    """What stands where a local runtime has its executor: no device memory on the robot."""
    device_bytes = 0

    def close(self) -> None:
        pass


def fit(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """``image`` downscaled (bilinear, aspect kept) to fit ``height`` x ``width``; as it is when it fits."""
    h, w = image.shape[:2]
    scale = min(height / h, width / w)
    if scale >= 1.0:
        return image
    from PIL import Image
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return np.asarray(Image.fromarray(image).resize(size, Image.BILINEAR))


def jpeg(image: np.ndarray, quality: int) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def read_key(cfg: ModelConfig) -> str:
    """The endpoint's API key from ``remote.api_key_file`` (relative to the config file); "" without one."""
    if not cfg.remote.api_key_file:
        return ""
    path = cfg.relative_to_source(cfg.remote.api_key_file)
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"remote.api_key_file: cannot read {path!r} ({exc.strerror})") from None


def tls_context(cfg: ModelConfig) -> ssl.SSLContext | None:
    """The TLS context of a ``wss://`` or ``https://`` endpoint: the system's trust store, or ``remote.ca_file``
    alone (a fleet's own CA, a server's self-signed certificate); None for plain ``ws://`` and ``http://``."""
    if not cfg.remote.url.startswith(("wss://", "https://")):
        return None
    if not cfg.remote.ca_file:
        return ssl.create_default_context()
    path = cfg.relative_to_source(cfg.remote.ca_file)
    try:
        return ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"remote.ca_file: cannot load {path!r} as PEM certificates ({exc})") from None


def put(obs: dict, path: tuple[str, ...], value) -> None:
    """``value`` at a key path of the observation (nested maps made as needed)."""
    for key in path[:-1]:
        obs = obs.setdefault(key, {})
    obs[path[-1]] = value


class RemoteVLARuntime(StagedVLA):
    """The :class:`~synflux_ros.runtimes.vla.VLARuntime` interface the node uses, over a policy endpoint."""

    mode = "vla"

    def __init__(self, cfg: ModelConfig, connect: Callable | None = None):
        if cfg.mode != "vla" or cfg.executor.backend != "remote":
            raise ConfigError("RemoteVLARuntime needs a vla config with executor.backend remote")
        self.cfg, self.remote = cfg, cfg.remote
        self.executor = NoDevice()
        self._connect_fn = connect
        self._key = read_key(cfg)
        self._tls = tls_context(cfg)
        self.horizon, self.action_dim = cfg.action.published_horizon, cfg.action.published_dim
        self._ws = None
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self._backoff = 0.0
        self._cause = ""  # why the last attempt failed, said while the next one waits
        self.failures = 0
        self.metadata: dict = {}
        if cfg.action.state_dim and len(cfg.serve.state_keys) != 1:
            raise ConfigError("serve.state: executor.backend remote sends the robot state under one key")
        self._instruction = ""
        self.set_instruction(cfg.default_instruction)
        try:
            self._ensure_connected()
        except RemoteError:
            pass  # the node starts; frames fail, saying why, until the server is there

    # ---------------------------------------------------------------- instruction
    @property
    def instruction(self) -> str:
        return self._instruction

    def set_instruction(self, text: str) -> None:
        """Checked as the local runtime checks it, but for the token count, which the server checks."""
        self._instruction = instruction_text(text)

    # ---------------------------------------------------------------- connection
    def _open(self):
        if self._connect_fn is not None:
            return self._connect_fn()
        from websockets.sync.client import connect
        headers = {"Authorization": f"Api-Key {self._key}"} if self._key else None
        return connect(self.remote.url, compression=None, max_size=MAX_REPLY_BYTES, additional_headers=headers,
                       open_timeout=self.remote.connect_timeout, close_timeout=1.0, ssl=self._tls)

    def _ensure_connected(self):
        if self._ws is not None:
            return self._ws
        now = time.monotonic()
        if now < self._retry_at:
            raise RemoteError(f"the server at {self.remote.url} is unreachable ({self._cause}); next attempt in "
                              f"{self._retry_at - now:.1f} s")
        try:
            ws = self._open()
            meta = wire.unpack(ws.recv(timeout=self.remote.connect_timeout), 1 << 20)
        except Exception as exc:  # refused, timed out, TLS, HTTP 403 (key), a malformed frame
            self._failed(f"{type(exc).__name__}: {exc}")
            raise RemoteError(f"cannot connect to {self.remote.url}: {self._cause}; next attempt in "
                              f"{self._backoff:.1f} s") from None
        self._check_metadata(meta, ws)
        self._ws, self.metadata, self._backoff = ws, meta, 0.0
        return ws

    def _check_metadata(self, meta, ws) -> None:
        want = {"action_horizon": self.horizon, "action_dim": self.action_dim}
        meta = meta if isinstance(meta, dict) else {}
        got = {k: meta.get(k) for k in want}
        if got != want:
            ws.close()
            raise ConfigError(f"remote.url: {self.remote.url} serves {meta.get('model')!r} with {got}, the config "
                              f"says {want}")

    def _failed(self, cause: str) -> None:
        self.failures += 1
        self._cause = cause
        self._backoff = min(self.remote.backoff_max, max(self.remote.backoff_min, self._backoff * 2))
        self._retry_at = time.monotonic() + self._backoff
        self._drop()

    def _drop(self) -> None:
        """Close the connection, whatever state it is in."""
        if self._ws is not None:
            try:
                self._ws.close()
            except Exception:
                pass
            self._ws = None

    def close(self) -> None:
        with self._lock:
            self._drop()

    # ---------------------------------------------------------------- stages
    def stage_encode(self, frame: Frame) -> Frame:
        t0 = time.perf_counter()
        vis, remote = self.cfg.vision, self.remote
        obs = {}
        for (cam, path), img in zip(self.cfg.serve.image_keys(vis.cameras), self.camera_images(frame.image)):
            check_image_size(img.shape[1], img.shape[0], vis.max_input_pixels)
            if remote.resize:
                img = fit(img, *vis.resolution)
            put(obs, path, jpeg(img, remote.jpeg_quality) if remote.compression == "jpeg" else
                np.ascontiguousarray(img))
        frame.image = None
        if frame.state is not None:
            put(obs, self.cfg.serve.state_keys[0],
                np.asarray(frame.state[:len(self.cfg.action.state_joints) or None], np.float32))
        put(obs, self.cfg.serve.prompt_key, self._instruction)
        obs["seq"] = int(frame.seq)
        frame.instruction = self._instruction
        frame.pixels = obs  # the request, for the next stage
        frame.timings["encode_ms"] = (time.perf_counter() - t0) * 1e3
        return frame

    def stage_network(self, frame: Frame) -> Frame:
        t0 = time.perf_counter()
        obs, frame.pixels = frame.pixels, None
        rtc = frame.rtc() if callable(frame.rtc) else frame.rtc
        if rtc is not None:
            obs["rtc"] = {"prev_chunk_model": np.asarray(rtc.prev_chunk, np.float32),
                          "inference_delay": int(rtc.inference_delay),
                          "execution_horizon": int(rtc.execution_horizon)}
        with self._lock:
            ws = self._ensure_connected()
            try:
                ws.send(wire.pack(obs))
                reply = ws.recv(timeout=self.remote.request_timeout)
            except TimeoutError:
                self._failed(f"no reply within {self.remote.request_timeout:g} s")
                raise RemoteError(f"no reply from {self.remote.url} within {self.remote.request_timeout:g} s "
                                  f"(remote.request_timeout); reconnecting in {self._backoff:.1f} s") from None
            except Exception as exc:
                self._failed(f"{type(exc).__name__}: {exc}")
                raise RemoteError(f"the connection to {self.remote.url} failed: {type(exc).__name__}: {exc}; "
                                  f"reconnecting in {self._backoff:.1f} s") from None
            if isinstance(reply, str):  # the server refused the request and closes the connection
                self._drop()
                raise RemoteError(f"the server refused the frame: {reply}")
        result = wire.unpack(reply, MAX_REPLY_BYTES)
        actions = np.asarray(result["actions"], np.float32)
        if actions.shape != (self.horizon, self.action_dim) or not np.all(np.isfinite(actions)):
            raise RemoteError(f"the server sent actions of shape {list(actions.shape)} (want "
                              f"{[self.horizon, self.action_dim]}) or with NaN/Inf")
        frame.actions = actions
        model = result.get("model_actions")
        frame.raw_actions = None if model is None else np.asarray(model, np.float32)
        server = result.get("policy_timing", {})
        for stage in ("vision", "backbone", "head"):
            if f"{stage}_ms" in server:
                frame.timings[f"{stage}_ms"] = float(server[f"{stage}_ms"])
        rtt = (time.perf_counter() - t0) * 1e3
        frame.timings["network_ms"] = max(0.0, rtt - float(result.get("server_timing", {}).get("infer_ms", 0.0)))
        return frame

    def release(self, frame: Frame) -> None:
        frame.pixels = None

    @property
    def stage_devices(self) -> dict[str, str]:
        where = f"remote {self.remote.url}"
        return {"encode": "cpu", "network": where, "vision": where, "backbone": where, "head": where}

    @property
    def stages(self) -> list[tuple[str, Callable]]:
        return [("encode", self.stage_encode), ("network", self.stage_network)]
