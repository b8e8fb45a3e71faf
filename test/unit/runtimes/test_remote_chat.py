"""The remote chat runtime (vlm_node's executor.backend remote) against a chat endpoint on loopback that answers
as told: what it sends, how it reads a streamed reply, and what a refusal, a failure or a silent server leave
behind (the session as it was). synflux-serve's real endpoint: test/integration/test_serve_chat.py."""
from __future__ import annotations

import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from synflux_ros.core.config import ConfigError, load_config
from synflux_ros.runtimes.remote import RemoteError
from synflux_ros.runtimes.remote_chat import Conversations, RemoteVLMRuntime
from synflux_ros.runtimes.sessions import RequestError
from synflux_ros.runtimes.vlm import ChatRequest
from synflux_ros.tools import harness as testing

MODEL = "vlm-demo"


class Endpoint:
    """An HTTP server on loopback: ``GET /v1/models`` lists ``models``; each ``POST /v1/chat/completions`` is
    recorded (headers, body) and answered by ``reply(body)`` -> (status, bytes), or not at all (None)."""

    def __init__(self, cert: tuple[str, str] | None = None):
        """``cert``: (certificate, key) files: serve https."""
        self.models = [MODEL]
        self.models_status = 200
        self.requests: list[tuple[dict, dict]] = []
        self.reply = lambda body: (200, stream(["Hello", " there"], 12, 0))
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, data, kind="application/json"):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(outer.models_status,
                           json.dumps({"object": "list", "data": [{"id": m} for m in outer.models]}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((dict(self.headers), body))
                answer = outer.reply(body)
                if answer is None:  # silent: hold the connection until the client gives up
                    outer.release.wait(10)
                    return
                if answer == "stall":  # an error status whose body never comes
                    self.send_response(500)
                    self.send_header("Content-Length", "100")
                    self.end_headers()
                    outer.release.wait(10)
                    return
                if answer == "trickle":  # a streamed reply whose pieces come slowly, without end
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for _ in range(20):
                        self.wfile.write(b'data: {"choices": [{"index": 0, "delta": {"content": "."}}]}\n\n')
                        self.wfile.flush()
                        if outer.release.wait(0.3):
                            break
                    return
                status, data = answer
                self._send(status, data, "text/event-stream" if status == 200 else "application/json")

        self.release = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.scheme = "http"
        if cert is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*cert)
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
            self.scheme = "https"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def stream(pieces, prompt_tokens, cached, finish="stop", server_ms=5.0, done=True) -> bytes:
    def sse(obj):
        return f"data: {json.dumps(obj)}\n\n"
    out = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    out += "".join(sse({"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]}) for p in pieces)
    out += sse({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    out += sse({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(pieces),
                                         "prompt_tokens_details": {"cached_tokens": cached}},
                "server_timing": {"ttft_ms": 1.0, "total_ms": server_ms}})
    return (out + ("data: [DONE]\n\n" if done else "")).encode()


@pytest.fixture
def endpoint():
    e = Endpoint()
    yield e
    e.close()


def runtime_for(url: str, tmp_path, **remote) -> RemoteVLMRuntime:
    key = tmp_path / "key"
    key.write_text("0123456789abcdef0123\n")
    cfg = load_config(testing.config_path("vlm_demo.yaml")).with_overrides(
        executor={"backend": "remote"}, session={"max_sessions": 2, "eviction": "lru"},
        remote={"url": url, "api_key_file": str(key), "compression": "raw", "turn_timeout": 1.0, **remote})
    return RemoteVLMRuntime(cfg)


def test_a_session_s_conversation_travels_whole_with_its_id(endpoint, tmp_path):
    rt = runtime_for(endpoint.url, tmp_path)
    img = np.random.default_rng(0).integers(0, 256, (24, 32, 3), np.uint8)
    first = rt.chat(ChatRequest("s1", "What is this?", [img], system="Be brief.", max_new_tokens=5))
    assert first.reply == "Hello there" and (first.prompt_tokens, first.cached_tokens) == (12, 0)
    assert first.generated_tokens == 2 and first.stopped_by_eos and first.network_ms is not None
    endpoint.reply = lambda body: (200, stream(["Fine"], 20, 15, finish="length"))
    second = rt.chat(ChatRequest("s1", "And now?", temperature=0.5))
    assert (second.prompt_tokens, second.cached_tokens, second.stopped_by_eos) == (5, 15, False)
    headers, body = endpoint.requests[-1]
    assert headers["x-session-id"] == "s1" and headers["Authorization"] == "Bearer 0123456789abcdef0123"
    assert body["model"] == MODEL and body["stream"] and body["temperature"] == 0.5 and "max_tokens" not in body
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "user"] and body["messages"][2]["content"] == "Hello there"
    image = body["messages"][1]["content"][0]["image_url"]["url"]
    assert image.startswith("data:image/png;base64,")  # raw: lossless
    assert endpoint.requests[0][1]["max_tokens"] == 5
    assert rt.turns_served == 2 and len(rt.sessions) == 1


def test_refusals_and_failures_leave_the_session_as_it_was(endpoint, tmp_path):
    rt = runtime_for(endpoint.url, tmp_path)
    rt.chat(ChatRequest("s", "hello"))
    refusal = {"error": {"message": "prompt contains the special token '<x>'", "type": "invalid_request_error"}}
    endpoint.reply = lambda body: (400, json.dumps(refusal).encode())
    with pytest.raises(RequestError, match=r"the server refused the turn \(400\): prompt contains the special"):
        rt.chat(ChatRequest("s", "<x>"))
    endpoint.reply = lambda body: (200, b"data: " + json.dumps(refusal).encode() + b"\n\n")  # refused mid-stream
    with pytest.raises(RequestError, match="the server refused the turn: prompt contains"):
        rt.chat(ChatRequest("s", "<x>"))
    failure = {"error": {"message": "inference failed: boom", "type": "server_error"}}
    endpoint.reply = lambda body: (500, json.dumps(failure).encode())
    with pytest.raises(RemoteError, match=r"failed the turn \(500\): inference failed: boom"):
        rt.chat(ChatRequest("s", "again"))
    endpoint.reply = lambda body: (200, stream(["cut"], 3, 0, done=False))
    with pytest.raises(RemoteError, match=r"ended before its \[DONE\] event"):
        rt.chat(ChatRequest("s", "again"))
    endpoint.reply = lambda body: (200, b"data: {not json\n\n")
    with pytest.raises(RemoteError, match="broke off"):
        rt.chat(ChatRequest("s", "again"))
    endpoint.reply = lambda body: None
    with pytest.raises(RemoteError, match=r"no answer from http://127.0.0.1:\d+/v1 within 1 s"):
        rt.chat(ChatRequest("s", "again"))
    endpoint.reply = lambda body: "trickle"  # a piece every 0.3 s: each within the timeout, the turn not
    with pytest.raises(RemoteError, match=r"within 1 s \(remote.turn_timeout\)"):
        rt.chat(ChatRequest("s", "again"))
    assert (rt.requests_refused, rt.turns_failed, rt.turns_served) == (2, 5, 1)
    endpoint.reply = lambda body: (200, stream(["ok"], 4, 9))
    rt.chat(ChatRequest("s", "last"))
    assert [m["role"] for m in endpoint.requests[-1][1]["messages"]] == ["user", "assistant", "user"]


def test_a_refused_turn_is_refused_before_anything_is_sent(endpoint, tmp_path):
    rt = runtime_for(endpoint.url, tmp_path)
    for req, needle in ((ChatRequest("s", "x" * 70000), "session.max_prompt_bytes"),
                        (ChatRequest("", "hi"), "session_id is empty"),
                        (ChatRequest("s", "hi", [np.zeros((4, 4), np.uint8)]), "expected an HxWx3 uint8 RGB array")):
        with pytest.raises(RequestError, match=needle):
            rt.chat(req)
    rt.chat(ChatRequest("s", "hi", system="Be brief."))
    with pytest.raises(RequestError, match="applies when a session starts or resets"):
        rt.chat(ChatRequest("s", "hi", system="Be verbose."))
    assert len(endpoint.requests) == 1 and rt.requests_refused == 4
    rt.chat(ChatRequest("s", "hi", system="Be verbose.", reset=True))  # a reset starts it again
    assert [m["role"] for m in endpoint.requests[-1][1]["messages"]] == ["system", "user"]
    assert endpoint.requests[-1][1]["messages"][0]["content"] == "Be verbose."


def test_sessions_are_bounded_as_configured():
    lru = Conversations(2, "lru")
    for sid in ("a", "b"):
        lru.open(sid)
    lru.open("a")  # a is now the most recent
    assert lru.open("c") == (lru.get("c"), "b") and lru.evicted == 1 and len(lru) == 2
    refuse = Conversations(1, "refuse")
    refuse.open("a")
    with pytest.raises(RequestError, match="all 1 session slots are in use"):
        refuse.check_room()
    refuse.end("a")
    with pytest.raises(RequestError, match="unknown session 'a'"):
        refuse.end("a")


def test_the_served_model_must_be_the_config_s(endpoint, tmp_path):
    endpoint.models = ["another-model"]
    with pytest.raises(ConfigError, match=r"serves \['another-model'\], the config's model is 'vlm-demo'"):
        runtime_for(endpoint.url, tmp_path)
    rt = runtime_for("http://127.0.0.1:9/v1", tmp_path)  # nothing there: the node starts, turns fail saying why
    with pytest.raises(RemoteError, match="cannot reach the server at http://127.0.0.1:9/v1"):
        rt.chat(ChatRequest("s", "hi"))
    assert rt.turns_failed == 1 and len(rt.sessions) == 0


def test_https_with_the_server_s_own_certificate(tmp_path):
    """remote.ca_file makes the node trust a server's self-signed certificate; without it the system's trust
    store refuses the server and the turn fails saying so."""
    from tls_certs import self_signed
    cert = self_signed(tmp_path)
    endpoint = Endpoint(cert)
    try:
        rt = runtime_for(endpoint.url, tmp_path, ca_file=cert[0])
        assert rt.chat(ChatRequest("s", "hello")).reply == "Hello there"
        untrusting = runtime_for(endpoint.url, tmp_path)
        with pytest.raises(RemoteError, match="CERTIFICATE_VERIFY_FAILED"):
            untrusting.chat(ChatRequest("s", "hello"))
        with pytest.raises(ConfigError, match="remote.ca_file: cannot load"):
            runtime_for(endpoint.url, tmp_path, ca_file=str(tmp_path / "missing.pem"))
    finally:
        endpoint.close()


@pytest.mark.parametrize("answer,needle", [
    ("stall", r"broke off: TimeoutError"),  # a 500 whose body stalls
    ((200, b"data: 5\n\n"), "an event that is not an object"),
    ((200, b'data: {"error": "text"}\n\n'), "failed the turn: text"),
    ((200, b'data: {"choices": 3}\n\ndata: [DONE]\n\n'), "broke off: TypeError"),
    ((200, b'data: {"choices": [], "usage": {"prompt_tokens": "many"}}\n\ndata: [DONE]\n\n'),
     "malformed usage or server_timing"),
])
def test_a_broken_reply_fails_the_turn_as_a_remote_error(endpoint, tmp_path, answer, needle):
    rt = runtime_for(endpoint.url, tmp_path)
    endpoint.reply = lambda body: answer
    with pytest.raises(RemoteError, match=needle):
        rt.chat(ChatRequest("s", "hello"))
    assert rt.turns_failed == 1 and len(rt.sessions) == 0 and rt._conn is None  # counted, nothing kept open


def test_a_server_still_deploying_does_not_stop_the_node(endpoint, tmp_path):
    endpoint.models_status = 503  # Ray's proxy before the application is up
    rt = runtime_for(endpoint.url, tmp_path)
    assert rt.chat(ChatRequest("s", "hello")).reply == "Hello there"
    endpoint.models_status = 401
    with pytest.raises(ConfigError, match=r"answered 401: .* \(remote.api_key_file\)"):
        runtime_for(endpoint.url, tmp_path)
