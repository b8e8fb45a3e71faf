"""The Ray Serve application of ``synflux-serve``: one deployment per model config, whose replicas each hold
a runtime on the configured backend; Ray's proxy takes the connections.

VLA configs speak openpi's websocket policy protocol at ``/`` (the metadata frame on connect, then one msgpack
observation in and one msgpack result out per message; a failed request is a text frame saying why followed
by a close with code 1011, as openpi's server reports errors), ``GET /healthz`` answers ``OK``, ``GET /status``
the replica's counters. VLM configs speak OpenAI's chat API: ``POST /v1/chat/completions`` (streamed as
server-sent events on request) and ``GET /v1/models``; a request's ``x-session-id`` header routes it to the
replica holding that session (Ray Serve's consistent-hash router), so each turn reuses its KV cache. With an
API key configured, a request must send ``Authorization: Api-Key <key>`` (openpi-client's header) or
``Authorization: Bearer <key>`` (OpenAI's); the key is compared in constant time.

:func:`build_app` is Ray's application builder (``import_path: synflux_ros.serve.app:build_app``), so a Serve
config file written by ``synflux-serve --write-config`` runs under ``serve run`` and ``serve deploy`` too.
"""
# No "from __future__ import annotations": FastAPI reads the handlers' annotations as objects (WebSocket).

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import hmac
import ipaddress
import json
import logging
import os
import socket
import time
from collections import Counter

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.websockets import WebSocketDisconnect

from ..backends import executor_table
from ..core.config import ConfigError, ModelConfig, choices_hint, load_config, options_from_dict, setting
from ..runtimes.sessions import RequestError as ChatRefused
from ..runtimes.vlm import VLMRuntime
from ..runtimes import wire
from . import chat
from .policy import RequestError, VLAPolicy

logger = logging.getLogger("synflux_ros.serve")


def _replica_grpc_on_loopback() -> None:
    """Ray Serve 2.60's replicas open an inter-deployment gRPC port on ``[::]`` whatever Ray's node address
    (``ray/serve/_private/replica.py``, ``add_port_to_grpc_server(self._server, "[::]:0")``). Where the node
    address is loopback (a Ray of synflux-serve's own, cli.LOCAL_RAY_ENV) it is bound to 127.0.0.1 instead, as
    Ray's own gRPC servers are; in a cluster it stays as Ray opens it. Runs in each replica process when it
    imports this module, before the replica starts that server; a Ray without that function is left alone."""
    try:
        from ray.serve._private import replica
        from ray.util import get_node_ip_address
    except ImportError:
        return
    add_port = getattr(replica, "add_port_to_grpc_server", None)
    if add_port is None or getattr(add_port, "synflux_loopback", False):
        return

    def add_port_on_loopback(server, address):
        if address.startswith("[::]:"):
            try:
                loopback = ipaddress.ip_address(get_node_ip_address()).is_loopback
            except (ValueError, RuntimeError):
                loopback = False
            if loopback:
                address = "127.0.0.1:" + address[len("[::]:"):]
        return add_port(server, address)
    add_port_on_loopback.synflux_loopback = True
    replica.add_port_to_grpc_server = add_port_on_loopback


_replica_grpc_on_loopback()

INTERNAL_ERROR = 1011  # openpi's close code after its error frame
POLICY_VIOLATION = 1008  # a connection without the API key
MESSAGE_TOO_BIG = 1009  # Ray's proxy closes a websocket whose message is over PROXY_WS_MAX_BYTES
REASON_BYTES = 120  # a close frame's reason is at most 123 bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class AppArgs:
    """The application's arguments (the ``args`` of its entry in a Serve config file)."""
    config: str = setting(doc="model config YAML (a path on every node of the cluster)")
    graph_dir: str = setting("", doc="graph set directory; empty = the config's executor.graph_dir")
    backend: str = setting("", doc="backend; empty = the config's executor.backend")
    api_key_file: str = setting("", doc="file holding the API key; empty = no key asked for")
    session_affinity: bool = setting(True, doc="vlm: route x-session-id to the replica holding the session (off: "
                                                "Ray's default router, for comparison)")


def load_app_config(args: AppArgs) -> ModelConfig:
    """The model config with the application's overrides, as every replica loads it."""
    cfg = load_config(args.config)
    overrides = {}
    if args.graph_dir:
        overrides["graph_dir"] = os.path.abspath(args.graph_dir)
    if args.backend:
        overrides["backend"] = args.backend
    return cfg.with_overrides(executor=overrides) if overrides else cfg


def read_api_key(path: str) -> str:
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as fh:
            key = fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"api_key_file: cannot read {path!r} ({exc.strerror})") from None
    if len(key) < 16:
        raise ConfigError(f"api_key_file: {path!r} holds a key of {len(key)} characters; use at least 16")
    return key


def authorised(headers, key: str) -> bool:
    """``Authorization: Api-Key <key>`` or ``Bearer <key>``, compared in constant time; anything goes without
    a key."""
    if not key:
        return True
    scheme, _, given = headers.get("authorization", "").partition(" ")
    ok = hmac.compare_digest(given.encode("utf-8", "replace"), key.encode())
    return ok and scheme in ("Api-Key", "Bearer")


def _reason(text: str) -> str:
    raw = text.encode("utf-8")[:REASON_BYTES]
    return raw.decode("utf-8", "ignore")


class _Replica:
    """What every replica reads at start (its arguments, the config of its mode, the key) and keeps (its
    counters and name); the routes stay on each deployment, whose FastAPI app they belong to."""

    def __init__(self, args: dict, mode: str):
        self.args = options_from_dict(AppArgs, args, "args.")
        self.cfg = load_app_config(self.args)
        if self.cfg.mode != mode:
            raise ConfigError(f"{self.args.config}: a {self.cfg.mode} config, this deployment serves {mode} ones")
        self.key = read_api_key(self.args.api_key_file)
        self.counts: Counter = Counter()
        self.replica = f"{socket.gethostname()}:{os.getpid()}"
        self.max_bytes = self.cfg.serve.max_message_bytes

    def unauthorised(self, scheme: str) -> JSONResponse:
        """401 in OpenAI's error shape (the policy side's HTTP routes answer the same way)."""
        self.counts["requests_unauthorised"] += 1
        return JSONResponse(chat.APIError(f"a valid 'Authorization: {scheme} ...' header is required", status=401,
                                          kind="authentication_error", code="invalid_api_key").body(),
                            status_code=401)

    def status_response(self, **extra) -> JSONResponse:
        return JSONResponse({"model": self.cfg.name, "backend": self.cfg.executor.backend,
                             "replica": self.replica, **extra, **dict(self.counts)})


vla_api = FastAPI(title="synflux-serve VLA (openpi websocket protocol)")


@serve.deployment(name="vla_policy", max_ongoing_requests=16, ray_actor_options={"num_cpus": 1})
@serve.ingress(vla_api)
class VLADeployment(_Replica):
    """A replica: one :class:`VLAPolicy`; each websocket connection is one robot, its frames numbered from 0."""

    def __init__(self, args: dict):
        super().__init__(args, "vla")
        self.policy = VLAPolicy(self.cfg)
        # one thread computes every request (they run one at a time anyway): its caches stay warm between
        # requests, where the event loop's default pool would hand each request to whichever thread is idle
        self._infer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="policy")

    @vla_api.get("/healthz")
    def healthz(self):
        return PlainTextResponse("OK\n")

    @vla_api.get("/status")
    def status(self, request: Request):
        if not authorised(request.headers, self.key):
            return self.unauthorised("Api-Key")
        return self.status_response()

    @vla_api.websocket("/")
    async def policy(self, ws: WebSocket):
        if not authorised(ws.headers, self.key):
            self.counts["connections_refused"] += 1
            logger.warning("refused a connection from %s: no valid API key", ws.client)
            await ws.close(code=POLICY_VIOLATION, reason="a valid 'Authorization: Api-Key ...' header is required")
            return
        await ws.accept()
        self.counts["connections"] += 1
        await ws.send_bytes(wire.pack({**self.policy.metadata, "replica": self.replica}))
        seq, prev_total = 0, None
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                if msg.get("code") == MESSAGE_TOO_BIG:  # Ray's proxy closed it, naming the size and its limit
                    self.counts["requests_too_big"] += 1
                    logger.warning("%s sent a message over the proxy's limit: %s", ws.client, msg.get("reason", ""))
                return
            start = time.monotonic()
            try:
                if msg.get("bytes") is None:
                    raise RequestError("expected a binary msgpack message, got a text frame")
                obs = wire.unpack(msg["bytes"], self.max_bytes)
                t0 = time.monotonic()
                context = contextvars.copy_context()  # Ray Serve's request context, as asyncio.to_thread passes it
                result = await asyncio.get_running_loop().run_in_executor(
                    self._infer, context.run, self.policy.infer, obs, seq)
                infer_ms = (time.monotonic() - t0) * 1e3
            except (wire.WireError, RequestError) as exc:
                self.counts["requests_refused"] += 1
                await self._fail(ws, f"request refused: {exc}")
                return
            except Exception as exc:  # the connection ends as openpi's does; the replica keeps serving
                self.counts["requests_failed"] += 1
                logger.exception("inference failed")
                await self._fail(ws, f"inference failed: {type(exc).__name__}: {exc}")
                return
            result["server_timing"] = {"infer_ms": infer_ms}
            if prev_total is not None:
                result["server_timing"]["prev_total_ms"] = prev_total
            try:
                await ws.send_bytes(wire.pack(result))
            except (WebSocketDisconnect, RuntimeError):
                return
            self.counts["requests"] += 1
            seq += 1
            prev_total = (time.monotonic() - start) * 1e3

    async def _fail(self, ws: WebSocket, text: str):
        try:
            await ws.send_text(text)
            await ws.close(code=INTERNAL_ERROR, reason=_reason(text))
        except (WebSocketDisconnect, RuntimeError):
            pass

    def __del__(self):
        pool = getattr(self, "_infer", None)
        if pool is not None:
            pool.shutdown(wait=True)  # the request in its call finishes before the runtime closes
        policy = getattr(self, "policy", None)
        if policy is not None:
            policy.close()


chat_api = FastAPI(title="synflux-serve VLM (OpenAI chat completions)")
SESSION_HEADER = "x-session-id"  # Ray Serve's session-affinity header (RAY_SERVE_SESSION_ID_HEADER_KEY)
AFFINITY = {"request_router_class": "ray.serve.experimental.consistent_hash_router:ConsistentHashRouter"}


@serve.deployment(name="vlm_chat", max_ongoing_requests=16, ray_actor_options={"num_cpus": 1},
                  request_router_config=AFFINITY)
@serve.ingress(chat_api)
class VLMDeployment(_Replica):
    """A replica: one :class:`VLMRuntime` whose sessions are keyed by the ``x-session-id`` header; a request
    without one is a conversation of its own, ended after its reply."""

    def __init__(self, args: dict):
        super().__init__(args, "vlm")
        self.runtime = VLMRuntime(self.cfg)
        self.max_pixels = self.cfg.vision.max_input_pixels if self.cfg.vision is not None else 1

    def _error(self, exc: chat.APIError) -> JSONResponse:
        self.counts["requests_refused"] += 1
        return JSONResponse(exc.body(), status_code=exc.status)

    @chat_api.get("/healthz")
    def healthz(self):
        return PlainTextResponse("OK\n")

    @chat_api.get("/status")
    def status(self, request: Request):
        if not authorised(request.headers, self.key):
            return self.unauthorised("Bearer")
        return self.status_response(sessions=len(self.runtime.sessions))

    @chat_api.get("/v1/models")
    def models(self, request: Request):
        if not authorised(request.headers, self.key):
            return self.unauthorised("Bearer")
        return JSONResponse({"object": "list", "data": [{"id": self.cfg.name, "object": "model", "created": 0,
                                                          "owned_by": "synflux"}]})

    @chat_api.post("/v1/chat/completions")
    async def completions(self, request: Request):
        if not authorised(request.headers, self.key):
            return self.unauthorised("Bearer")
        sid = request.headers.get(SESSION_HEADER) or ""
        oneshot = not sid
        if oneshot:
            sid = f"oneshot-{os.urandom(8).hex()}"
        try:
            declared = request.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > self.max_bytes:  # refused before the body is read
                raise chat.APIError(f"the request has {int(declared)} bytes, over the limit of {self.max_bytes} "
                                    f"(serve.max_message_bytes)", status=413)
            raw = await request.body()
            if len(raw) > self.max_bytes:
                raise chat.APIError(f"the request has {len(raw)} bytes, over the limit of {self.max_bytes} "
                                    f"(serve.max_message_bytes)", status=413)
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise chat.APIError(f"the body is not JSON: {exc}") from None
            except RecursionError:
                raise chat.APIError("the body is not JSON this server reads: nested deeper than the parser's "
                                    "limit") from None
            req, stream, include_usage = chat.parse(body, sid, self.cfg.name, self.max_pixels)
            if stream:  # what the runtime would refuse is refused before the 200 and the first event
                self.runtime.sampling_params(req)
                self.runtime.check_limits(req.session_id, req.prompt, len(req.images), req.system)
        except chat.APIError as exc:
            return self._error(exc)
        except ChatRefused as exc:
            return self._error(chat.APIError(str(exc)))
        if stream:
            return StreamingResponse(self._stream(req, include_usage, oneshot), media_type="text/event-stream")
        try:
            result = await asyncio.to_thread(self.runtime.chat, req)
        except ChatRefused as exc:
            return self._error(chat.APIError(str(exc)))
        except Exception as exc:  # the replica keeps serving
            logger.exception("chat failed")
            self.counts["requests_failed"] += 1
            return JSONResponse(chat.APIError(f"inference failed: {type(exc).__name__}: {exc}", status=500,
                                              kind="server_error").body(), status_code=500)
        finally:
            if oneshot:
                self._end(sid)
        self.counts["requests"] += 1
        return JSONResponse(chat.completion(result, self.cfg.name))

    def _end(self, sid: str):
        try:
            self.runtime.end_session(sid)
        except ChatRefused:
            pass

    async def _stream(self, req, include_usage: bool, oneshot: bool):
        """Server-sent events: the role, a content delta per decoded piece, the finish, the usage, [DONE]."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        chunks = chat.Chunks(self.cfg.name, self.runtime.tokenizer.decode, self.runtime.tokenizer.eos_ids)

        def on_token(tok):
            loop.call_soon_threadsafe(queue.put_nowait, ("token", tok))

        def run():
            try:
                return self.runtime.chat(req, on_token)
            finally:
                if oneshot:
                    self._end(req.session_id)

        task = asyncio.ensure_future(asyncio.to_thread(run))
        task.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, ("done", None)))

        def sse(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        yield sse(chunks.event({"role": "assistant", "content": ""}))
        while True:
            kind, tok = await queue.get()
            if kind == "done":
                break
            delta = chunks.text(tok)
            if delta:
                yield sse(chunks.event({"content": delta}))
        try:
            result = task.result()
        except ChatRefused as exc:
            self.counts["requests_refused"] += 1
            yield sse(chat.APIError(str(exc)).body())
            yield "data: [DONE]\n\n"
            return
        except Exception as exc:
            logger.exception("chat failed")
            self.counts["requests_failed"] += 1
            yield sse(chat.APIError(f"inference failed: {type(exc).__name__}: {exc}", status=500,
                                    kind="server_error").body())
            yield "data: [DONE]\n\n"
            return
        self.counts["requests"] += 1
        rest = chunks.rest(result.reply)
        if rest:
            yield sse(chunks.event({"content": rest}))
        yield sse(chunks.event({}, chat.finish_reason(result)))
        if include_usage:
            yield sse({**chunks.event({}), "choices": [], "usage": chat.usage(result),
                       "server_timing": chat.server_timing(result)})
        yield "data: [DONE]\n\n"


def build_app(args: dict):
    """Ray's application builder (``serve run`` / ``serve deploy`` call it with the file's ``args``; the
    file's ``deployments`` entry then sets the deployment's options)."""
    return application(args)


def application(args: dict, deployment: dict | None = None):
    """The application of ``args`` (:class:`AppArgs`) with the deployment options ``deployment``
    (``num_replicas`` or ``autoscaling_config``, ``ray_actor_options``, ...) as a Serve config file's
    ``deployments`` entry gives them. The config is checked here, before any replica starts."""
    parsed = options_from_dict(AppArgs, args, "args.")
    cfg = load_app_config(parsed)
    read_api_key(parsed.api_key_file)
    if cfg.executor.backend not in executor_table():  # its packages need only be on the replicas' nodes
        raise ConfigError(f"executor.backend: unknown backend {cfg.executor.backend!r}"
                          f"{choices_hint(cfg.executor.backend, sorted(executor_table()))}")
    options = {k: v for k, v in (deployment or {}).items() if k != "name"}
    if cfg.mode == "vlm" and not parsed.session_affinity:
        options["request_router_config"] = RequestRouterConfig()  # Ray's default: power of two choices
    cls = VLADeployment if cfg.mode == "vla" else VLMDeployment
    return cls.options(**options).bind(dataclasses.asdict(parsed))
