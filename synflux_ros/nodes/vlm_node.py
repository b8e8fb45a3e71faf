"""VLM node: multi-turn chat service with a KV cache per session.

Services ``chat`` and ``end_session``; publishes ``/diagnostics``. A refused request answers
``success: false`` with the reason in ``error`` and the node keeps serving. The model runs one turn at a
time; a cleanup waits for the turn in flight to be answered (docs/internals/nodes.md). With
``executor.backend: remote`` the turns run on a synflux-serve chat endpoint (:mod:`..runtimes.remote_chat`).
With ``planner_period`` > 0 the node is also the VLA's planner: it subscribes ``goal`` and ``image`` and publishes
the next subtask on ``instruction`` (:mod:`.vlm_planner`; docs/ros-interfaces.md, "Planner mode").
"""
from __future__ import annotations

import threading
import traceback

from rclpy.callback_groups import MutuallyExclusiveCallbackGroup

from ..model.image import ImageError, decode_raw
from ..runtimes.remote import RemoteError
from ..runtimes.remote_chat import RemoteVLMRuntime
from ..runtimes.sessions import RequestError
from ..runtimes.vlm import ChatRequest
from ..srv import Chat, EndSession
from .dds_workarounds import ResponseSender
from .diagnostics import OK, median, ros_text
from .lifecycle import SynfluxNode
from .params import COMMON_PARAMS, Param
from .process import run_lifecycle_node
from .sharing import SHARING_PARAMS
from .vlm_planner import PLANNER_PARAMS, PLANNER_SESSION, PlannerMode

PARAMS = [
    Param("config", "vlm_demo.yaml", "model YAML: a path, or a file name in the package's config directory"),
    *COMMON_PARAMS,
    *SHARING_PARAMS,
    *PLANNER_PARAMS,
]


def chat_request(request, images) -> ChatRequest:
    """The runtime's request from a Chat.srv request: the .srv encodes "use the config's value" as
    max_new_tokens 0, temperature < 0 (its default) and top_p <= 0; the runtime takes None for it."""
    temperature = float(request.temperature)
    top_p = float(request.top_p)
    return ChatRequest(
        session_id=request.session_id, prompt=request.prompt, images=images, reset=request.reset,
        system=request.system_prompt or None,
        max_new_tokens=int(request.max_new_tokens) or None,
        temperature=None if temperature < 0 else temperature,
        top_p=None if top_p <= 0 else top_p)


class VLMNode(PlannerMode, SynfluxNode):
    """Lifecycle node serving a VLM as the ``chat`` and ``end_session`` services (and, optionally, the VLA's
    planner)."""

    MODE = "vlm"
    PARAMS = PARAMS

    def __init__(self, **kwargs):
        super().__init__("vlm_node", **kwargs)
        self._chat_services = []
        self._lock = threading.Lock()  # statistics, read by diagnostics
        self._serving = threading.Lock()  # held while a service uses the runtime
        self._ttft, self._tok_per_s, self._network = [], [], []
        self._last_refusal = ""
        self._init_planner()

    def setup(self, p: dict, cfg) -> str:
        if self.share.arbiter is not None and cfg.executor.backend == "remote":
            raise self.fail("accelerator_arbiter", "a remote model runs on the server's accelerator, not this one")
        self.runtime = self.load_runtime(cfg)
        if self.share.arbiter is not None:  # the chat's graph calls wait while a VLA frame is in flight
            self.runtime.executor.set_gate(self.share.arbiter.gate())
        # Created once and kept for the node's life: destroying a service at cleanup could drop the answer
        # of a turn that has just finished; while inactive the services refuse instead.
        if not self._chat_services:
            group = MutuallyExclusiveCallbackGroup()
            self._chat_services = [
                ResponseSender(self, self.create_service(Chat, "chat", self._on_chat, callback_group=group)),
                ResponseSender(self, self.create_service(EndSession, "end_session", self._on_end,
                                                         callback_group=group))]
        planner = self._setup_planner(p, cfg)
        s = cfg.session
        where = f" at {cfg.remote.url}" if cfg.executor.backend == "remote" else ""
        return (f"{cfg.name!r} on {cfg.executor.backend!r}{where}: {s.max_sessions} sessions of "
                f"{cfg.llm.max_seq_len} tokens (eviction {s.eviction}){planner}")

    def activate(self) -> None:
        self._start_planner()

    def teardown(self) -> None:
        # _active is already False: once a turn in flight has finished (a chat turn or a planner question), no
        # request reaches the runtime.
        with self._serving:
            pass
        self._destroy_planner()

    # ---------------------------------------------------------------- services
    def _refuse(self, response, why: str):
        response.success = False
        response.error = ros_text(why)
        self._last_refusal = why
        self.get_logger().warning(f"request refused: {why}")
        return response

    def _on_chat(self, request, response):
        with self._serving:
            if not self._active:
                return self._refuse(response, "node is not active")
            return self._serve_chat(request, response)

    def _serve_chat(self, request, response):
        try:
            self._check_not_planner(request.session_id)
            # The checks that cost nothing come before any image is decoded.
            self.runtime.check_limits(request.session_id, request.prompt, len(request.images),
                                      request.system_prompt or None)
            max_pixels = self.cfg.vision.max_input_pixels if self.cfg.vision is not None else 0
            images = []
            for i, im in enumerate(request.images):
                try:
                    images.append(decode_raw(im.encoding, im.height, im.width, im.step, im.data, im.is_bigendian,
                                             max_pixels=max_pixels))
                except ImageError as exc:
                    raise RequestError(f"images[{i}]: {exc}") from None
            result = self.runtime.chat(chat_request(request, images))
        except RequestError as exc:
            return self._refuse(response, str(exc))
        except RemoteError as exc:  # the server is away or failed the turn: said, counted, and serving goes on
            return self._refuse(response, f"remote: {exc}")
        except Exception as exc:  # keep serving; the caller learns what happened
            self.get_logger().error(f"chat failed: {exc}\n{traceback.format_exc()}")
            return self._refuse(response, f"internal error: {type(exc).__name__}: {exc}")
        if result.evicted_session:
            self.get_logger().info(f"session {result.evicted_session!r} evicted (least recently used) for "
                                   f"{request.session_id!r}")
        response.success = True
        response.reply = ros_text(result.reply)
        response.prompt_tokens = result.prompt_tokens
        response.cached_tokens = result.cached_tokens
        response.generated_tokens = result.generated_tokens
        response.ttft_ms = float(result.ttft_ms)
        response.total_ms = float(result.total_ms)
        with self._lock:
            self._ttft.append(result.ttft_ms)
            decode_s = max((result.total_ms - result.ttft_ms) / 1e3, 1e-9)
            if result.generated_tokens > 1:
                self._tok_per_s.append((result.generated_tokens - 1) / decode_s)
            if result.network_ms is not None:  # a remote turn: its time less the server's
                self._network.append(result.network_ms)
            del self._ttft[:-100], self._tok_per_s[:-100], self._network[:-100]
        return response

    def _check_not_planner(self, session_id: str) -> None:
        if self.planner_on and session_id == PLANNER_SESSION:
            raise RequestError(f"session_id {PLANNER_SESSION!r} is the planner's while the planner is on "
                               f"(planner_period > 0): use another")

    def _on_end(self, request, response):
        with self._serving:
            if not self._active:
                return self._refuse(response, "node is not active")
            try:
                self._check_not_planner(request.session_id)
                self.runtime.end_session(request.session_id)
            except RequestError as exc:
                return self._refuse(response, str(exc))
        response.success = True
        return response

    # ---------------------------------------------------------------- diagnostics
    def diagnostics(self) -> tuple[int, str, dict]:
        rt = self.runtime
        with self._lock:
            ttft, tps = median(self._ttft), median(self._tok_per_s)
        devices = rt.devices
        values = {"backend": self.cfg.executor.backend, "model": self.cfg.name,
                  "sessions_open": len(rt.sessions), "sessions_max": rt.max_sessions,
                  "sessions_evicted": rt.sessions.evicted, "turns_served": rt.turns_served,
                  "requests_refused": rt.requests_refused, "ttft_median_ms": ttft, "decode_tokens_per_s": tps,
                  "device_memory_mib": rt.executor.device_bytes / 2**20, "last_refusal": self._last_refusal,
                  "responses_resent": sum(r.resent for r in self._chat_services),
                  "responses_lost": sum(r.lost for r in self._chat_services),
                  "vision_device": devices["vision"], "llm_device": devices["llm"]}
        values.update(self.share.values())
        if isinstance(rt, RemoteVLMRuntime):
            with self._lock:
                values.update(turns_failed=rt.turns_failed, network_median_ms=median(self._network))
        if self.planner_on:
            values.update(self._planner_diagnostics())
        return OK, f"{len(rt.sessions)}/{rt.max_sessions} sessions", values


def main(args=None) -> int:
    return run_lifecycle_node(VLMNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
