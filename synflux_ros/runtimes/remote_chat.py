"""A VLM served by ``synflux-serve`` (``executor.backend: remote`` in a vlm config): ``vlm_node`` keeps its Chat
service, its sessions and their limits, its accounting and diagnostics; the model runs on the server, reached
over OpenAI's chat completions API (``remote.url`` is the API's base, ``http(s)://host:port/v1``).

The API is stateless: the node keeps each session's conversation (system prompt, turns, images) and sends it
whole, with the session's id as ``x-session-id``, so that Ray routes the turn to the replica holding the
session's KV cache and that replica prefills only the new turn (a replica that never saw the session rebuilds it
from the conversation and answers the same). Images travel as ``data:`` URLs, PNG (``remote.compression: raw``,
lossless) or JPEG. The reply is streamed; the time to its first piece is the turn's time to first token as the
robot sees it, and the network's share is the turn's time less the server's (the ``server_timing`` the
endpoint adds to the final event).

A turn the server refuses is refused with the server's reason; a turn that cannot reach the server, or is not
answered within ``remote.turn_timeout``, fails with the reason (:class:`~.remote.RemoteError`) and leaves the
session as it was. Either way the node keeps serving, and the next turn opens a new connection.
"""
from __future__ import annotations

import base64
import http.client
import io
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import numpy as np

from ..core.config import ConfigError, ModelConfig
from .remote import NoDevice, RemoteError, jpeg, read_key, tls_context
from .sessions import RequestError
from .vlm import ChatRequest, ChatResult, check_turn, checked_images

MAX_REPLY_BYTES = 1 << 24


def png(image: np.ndarray) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class Conversation:
    """What the node holds of one session: its system prompt and its turns as OpenAI messages."""
    system: str = ""
    messages: list = field(default_factory=list)
    turns: int = 0


class Conversations:
    """Sessions by id, at most ``limit``; the least recently used is evicted, or a new one refused, as
    ``session.eviction`` says (as the local runtime's KV slots are)."""

    def __init__(self, limit: int, eviction: str):
        self.limit, self.eviction = limit, eviction
        self._items: OrderedDict[str, Conversation] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, sid: str) -> bool:
        return sid in self._items

    def get(self, sid: str) -> Conversation | None:
        return self._items.get(sid)

    def check_room(self) -> None:
        """Refuse a new session when all are taken and ``session.eviction`` is refuse."""
        if len(self._items) >= self.limit and self.eviction == "refuse":
            raise RequestError(f"all {self.limit} session slots are in use; end a session (end_session) or wait")

    def open(self, sid: str) -> tuple[Conversation, str | None]:
        """The session's conversation (made when new), and the id of a session evicted to make room."""
        conv = self._items.get(sid)
        if conv is not None:
            self._items.move_to_end(sid)
            return conv, None
        evicted = None
        if len(self._items) >= self.limit:
            self.check_room()
            evicted, _ = self._items.popitem(last=False)
            self.evicted += 1
        conv = self._items[sid] = Conversation()
        return conv, evicted

    def end(self, sid: str) -> None:
        if self._items.pop(sid, None) is None:
            raise RequestError(f"unknown session {sid!r}")


class RemoteVLMRuntime:
    """The :class:`~synflux_ros.runtimes.vlm.VLMRuntime` interface ``vlm_node`` uses, over a chat endpoint."""

    mode = "vlm"

    def __init__(self, cfg: ModelConfig):
        if cfg.mode != "vlm" or cfg.executor.backend != "remote":
            raise ConfigError("RemoteVLMRuntime needs a vlm config with executor.backend remote")
        self.cfg, self.remote = cfg, cfg.remote
        parts = urlsplit(self.remote.url)
        self._secure = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port or (443 if self._secure else 80)
        self._base = parts.path.rstrip("/")
        self._key = read_key(cfg)
        self._tls = tls_context(cfg)
        self.executor = NoDevice()
        self.sessions = Conversations(cfg.session.max_sessions, cfg.session.eviction)
        self._conn: http.client.HTTPConnection | None = None  # the turn's own, closed after it
        self._sock = self._resp = None
        self._lock = threading.Lock()  # one turn at a time, as the local runtime
        self.turns_served = self.requests_refused = self.turns_failed = 0
        try:
            self._check_model()
        except RemoteError:
            pass  # the node starts; turns fail, saying why, until the server is there

    @property
    def max_sessions(self) -> int:
        return self.sessions.limit

    @property
    def devices(self) -> dict[str, str]:
        where = f"remote {self.remote.url}"
        return {"vision": where if self.cfg.vision is not None else "", "llm": where}

    def close(self) -> None:
        with self._lock:
            self._drop()

    # ---------------------------------------------------------------- the wire
    def _headers(self, session_id: str | None = None) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream, application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        if session_id:
            headers["x-session-id"] = session_id
        return headers

    def _drop(self) -> None:
        """Close the turn's response and connection, whatever state they are in."""
        if self._resp is not None:
            self._resp.close()
            self._resp = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._sock = None

    def _request(self, method: str, path: str, body: bytes | None, headers: dict, timeout: float):
        """The response of one request on a connection of its own (its status read, its body not); a failure
        raises :class:`RemoteError` saying what happened."""
        self._drop()
        try:
            if self._secure:
                conn = http.client.HTTPSConnection(self._host, self._port, timeout=self.remote.connect_timeout,
                                                   context=self._tls)
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=self.remote.connect_timeout)
            self._conn = conn
            conn.connect()
            self._sock = conn.sock  # the reply's reads go on it after http.client lets go of it (HTTP/1.0)
            self._sock.settimeout(timeout)
            conn.request(method, self._base + path, body=body, headers=headers)
            self._resp = conn.getresponse()
            return self._resp
        except (OSError, http.client.HTTPException) as exc:
            connected = self._sock is not None
            self._drop()
            if isinstance(exc, TimeoutError):
                limit = f"{timeout:g} s" if connected else f"{self.remote.connect_timeout:g} s (remote.connect_timeout)"
                raise RemoteError(f"no answer from {self.remote.url} within {limit}") from None
            raise RemoteError(f"cannot reach the server at {self.remote.url}: {type(exc).__name__}: {exc}") from None

    def _check_model(self) -> None:
        """The served model must be the config's (``GET /v1/models``)."""
        with self._lock:
            resp = self._request("GET", "/models", None, self._headers(), self.remote.connect_timeout)
            data = self._json_body(resp)
            self._drop()
        if resp.status in (401, 403):
            raise ConfigError(f"remote.url: {self.remote.url}/models answered {resp.status}: {_error_text(data)} "
                              f"(remote.api_key_file)")
        if resp.status != 200:  # a server still deploying (Ray's proxy: 404, 503): the node starts regardless
            raise RemoteError(f"{self.remote.url}/models answered {resp.status}: {_error_text(data)}")
        ids = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)] if isinstance(data, dict) else []
        if self.cfg.name not in ids:
            raise ConfigError(f"remote.url: {self.remote.url} serves {ids}, the config's model is {self.cfg.name!r}")

    def _json_body(self, resp) -> object:
        try:
            raw = resp.read(MAX_REPLY_BYTES + 1)
        except (OSError, http.client.HTTPException) as exc:
            self._drop()
            raise RemoteError(f"the reply from {self.remote.url} broke off: {type(exc).__name__}: {exc}") from None
        if len(raw) > MAX_REPLY_BYTES:
            self._drop()
            raise RemoteError(f"the server at {self.remote.url} sent more than {MAX_REPLY_BYTES} bytes")
        try:
            return json.loads(raw)
        except ValueError:
            return {"error": {"message": raw[:200].decode("utf-8", "replace")}}

    # ---------------------------------------------------------------- chat
    def check_limits(self, session_id: str, prompt: str, num_images: int, system: str | None = None) -> None:
        """The checks that cost nothing, as the local runtime runs them (the server checks special tokens)."""
        check_turn(self.cfg, (), session_id, prompt, num_images, system)

    def end_session(self, session_id: str) -> None:
        """Forget the session's conversation; the server's replica evicts its cache in its own time."""
        with self._lock:
            self.sessions.end(session_id)

    def chat(self, req: ChatRequest) -> ChatResult:
        """One turn: the session's conversation and the new message to the server, the reply streamed back."""
        try:
            images = checked_images(self.cfg, req)
        except RequestError:
            self.requests_refused += 1
            raise
        with self._lock:
            try:
                return self._turn(req, images)
            except RequestError:
                self.requests_refused += 1
                raise
            except RemoteError:
                self.turns_failed += 1
                raise

    def _message(self, text: str, images: list) -> dict:
        if not images:
            return {"role": "user", "content": text}
        raw = self.remote.compression == "raw"
        parts = []
        for img in images:
            data = png(img) if raw else jpeg(img, self.remote.jpeg_quality)
            url = f"data:image/{'png' if raw else 'jpeg'};base64," + base64.b64encode(data).decode("ascii")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        return {"role": "user", "content": parts + [{"type": "text", "text": text}]}

    def _turn(self, req: ChatRequest, images: list) -> ChatResult:
        t0 = time.perf_counter()
        existing = self.sessions.get(req.session_id)
        if existing is not None and existing.turns and not req.reset and req.system and \
                req.system != existing.system:
            raise RequestError("system prompt: it applies when a session starts or resets; this session already "
                               "has one (send reset to start it again with another)")
        fresh = existing is None or req.reset or not existing.turns
        if existing is None:
            self.sessions.check_room()
        system = (req.system or "") if fresh else existing.system
        history = [] if fresh else existing.messages
        message = self._message(req.prompt, images)
        messages = ([{"role": "system", "content": system}] if system else []) + history + [message]
        body = {"model": self.cfg.name, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}}
        for name, value in (("max_tokens", req.max_new_tokens), ("temperature", req.temperature),
                            ("top_p", req.top_p)):
            if value is not None:
                body[name] = value
        sent = time.perf_counter()  # the network's share is counted from here: encoding the images is not
        resp = self._request("POST", "/chat/completions", json.dumps(body).encode("utf-8"),
                             self._headers(req.session_id), self.remote.turn_timeout)
        if resp.status != 200:
            data = self._json_body(resp)
            self._drop()
            if 400 <= resp.status < 500:
                raise RequestError(f"the server refused the turn ({resp.status}): {_error_text(data)}")
            raise RemoteError(f"the server at {self.remote.url} failed the turn ({resp.status}): {_error_text(data)}")
        reply, ttft, final = self._read_stream(resp, t0)
        self._drop()
        now = time.perf_counter()
        total = (now - t0) * 1e3
        try:
            usage = final.get("usage") or {}
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
            prompt, generated = int(usage.get("prompt_tokens", 0)) - cached, int(usage.get("completion_tokens", 0))
            server = final.get("server_timing") or {}
            network = max(0.0, (now - sent) * 1e3 - float(server["total_ms"])) if "total_ms" in server else None
        except (TypeError, ValueError, AttributeError) as exc:
            raise RemoteError(f"the reply from {self.remote.url} has a malformed usage or server_timing: "
                              f"{type(exc).__name__}: {exc}") from None
        # the session holds the turn only once it is answered: a failed turn leaves it as it was
        conv, evicted = self.sessions.open(req.session_id)
        conv.system, conv.messages = system, history + [message, {"role": "assistant", "content": reply}]
        conv.turns = 1 if fresh else conv.turns + 1
        self.turns_served += 1
        return ChatResult(reply=reply, prompt_tokens=prompt, cached_tokens=cached, generated_tokens=generated,
                          ttft_ms=ttft if ttft is not None else total, total_ms=total,
                          stopped_by_eos=final.get("finish_reason") == "stop", evicted_session=evicted,
                          network_ms=network)

    def _read_stream(self, resp, t0: float) -> tuple[str, float | None, dict]:
        """The streamed reply's text, the time to its first piece (ms), and what the last events said (the
        finish reason, the usage, the server's timing)."""
        pieces, ttft, final, size = [], None, {}, 0
        deadline = t0 + self.remote.turn_timeout
        try:
            while True:
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TimeoutError
                self._sock.settimeout(left)  # the whole turn, not each piece, is bounded
                line = resp.readline(MAX_REPLY_BYTES)
                size += len(line)
                if not line or size > MAX_REPLY_BYTES:
                    self._drop()
                    raise RemoteError(f"the reply from {self.remote.url} ended before its [DONE] event")
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if not isinstance(event, dict):
                    raise ValueError(f"an event that is not an object: {data[:80]!r}")
                if "error" in event:  # the runtime refused or failed the turn after the stream began
                    self._drop()
                    if isinstance(event["error"], dict) and event["error"].get("type") == "invalid_request_error":
                        raise RequestError(f"the server refused the turn: {_error_text(event)}")
                    raise RemoteError(f"the server at {self.remote.url} failed the turn: {_error_text(event)}")
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        pieces.append(text)
                        if ttft is None:
                            ttft = (time.perf_counter() - t0) * 1e3
                    if choice.get("finish_reason"):
                        final["finish_reason"] = choice["finish_reason"]
                for key in ("usage", "server_timing"):
                    if event.get(key):
                        final[key] = event[key]
        except RequestError:
            raise
        except (OSError, http.client.HTTPException, ValueError, TypeError, AttributeError) as exc:  # a bad event
            self._drop()
            if isinstance(exc, TimeoutError):
                raise RemoteError(f"no answer from {self.remote.url} within {self.remote.turn_timeout:g} s "
                                  f"(remote.turn_timeout)") from None
            raise RemoteError(f"the reply from {self.remote.url} broke off: {type(exc).__name__}: {exc}") from None
        return "".join(pieces), ttft, final


def _error_text(data) -> str:
    """An OpenAI error body's message (``{"error": {"message": ...}}``), or what came instead, shortened."""
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", error))[:500]
    return str(error if isinstance(error, str) else data)[:200]
