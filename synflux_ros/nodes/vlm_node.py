"""VLM node: multi-turn chat service with a KV cache per session.

Services ``chat`` (synflux_ros/srv/Chat) and ``end_session`` (synflux_ros/srv/EndSession); publishes
``/diagnostics``. A refused request answers ``success: false`` with the reason in ``error``; the node
keeps serving.

Concurrency: both services share one mutually exclusive callback group, because the model runs one
turn at a time on the accelerator; diagnostics run on their own group so they keep flowing during a
long generation.
"""
from __future__ import annotations

import threading
import traceback

from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.lifecycle import Node as LifecycleNode
from rclpy.lifecycle import State, TransitionCallbackReturn
from diagnostic_msgs.msg import DiagnosticArray

from ..models.config import ConfigError
from ..runtime.image import ImageError, decode_raw
from ..runtime.session import RequestError
from ..runtime.vlm_runtime import ChatRequest, VLMRuntime
from ..srv import Chat, EndSession
from .common import ERROR, OK, Param, ParameterError, declare, diagnostic_array, load_node_config, median, read, \
    run_lifecycle_node

PARAMS = [
    Param("config", "vlm_demo.yaml", "model YAML: a path, or a file name in the package's config directory"),
    Param("executor", "", "backend overriding the config's executor.backend (empty = keep)"),
    Param("graph_dir", "", "compiled graph directory overriding the config's executor.graph_dir (empty = keep)"),
    Param("diagnostics_period", 1.0, "seconds between /diagnostics messages"),
    Param("autostart", True, "configure and activate at start-up (no lifecycle manager needed)"),
]


class VLMNode(LifecycleNode):
    def __init__(self, **kwargs):
        super().__init__("vlm_node", **kwargs)
        declare(self, PARAMS)
        self.last_error = ""
        self.runtime: VLMRuntime | None = None
        self._services, self._timer, self._diag = [], None, None
        self._active = False
        self._lock = threading.Lock()
        self._ttft, self._tok_per_s = [], []
        self._last_refusal = ""

    def on_configure(self, state: State) -> TransitionCallbackReturn:
        try:
            p = read(self, PARAMS)
            if p["diagnostics_period"] <= 0:
                raise ParameterError(f"[{self.get_name()}] parameter 'diagnostics_period': must be > 0, "
                                     f"got {p['diagnostics_period']!r}")
            cfg = load_node_config(self, "vlm", p["config"], p["executor"], p["graph_dir"])
            try:
                self.runtime = VLMRuntime(cfg)
            except (ConfigError, ImportError, ValueError) as exc:
                raise ParameterError(f"[{self.get_name()}] cannot load model {cfg.name!r} with executor "
                                     f"{cfg.executor.backend!r}: {exc}") from None
        except ParameterError as exc:
            self.last_error = str(exc)
            self.get_logger().error(self.last_error)
            return TransitionCallbackReturn.FAILURE
        except Exception as exc:  # anything else while loading: report it, do not crash the process
            self.last_error = f"[{self.get_name()}] configure failed: {type(exc).__name__}: {exc}"
            self.get_logger().error(self.last_error)
            return TransitionCallbackReturn.FAILURE
        self.cfg = cfg
        group = MutuallyExclusiveCallbackGroup()
        self._services = [self.create_service(Chat, "chat", self._on_chat, callback_group=group),
                          self.create_service(EndSession, "end_session", self._on_end, callback_group=group)]
        self._diag = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self._timer = self.create_timer(p["diagnostics_period"], self._publish_diagnostics,
                                        callback_group=MutuallyExclusiveCallbackGroup())
        s = cfg.session
        self.get_logger().info(
            f"configured {cfg.name!r} on {cfg.executor.backend!r}: {s.max_sessions} sessions of "
            f"{cfg.llm.max_seq_len} tokens (eviction {s.eviction}), "
            f"{self.runtime.executor.device_bytes / 2**20:.1f} MiB device memory")
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: State) -> TransitionCallbackReturn:
        self._active = True
        return super().on_activate(state)

    def on_deactivate(self, state: State) -> TransitionCallbackReturn:
        self._active = False
        return super().on_deactivate(state)

    def on_cleanup(self, state: State) -> TransitionCallbackReturn:
        self.release_resources()
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: State) -> TransitionCallbackReturn:
        self.release_resources()
        return TransitionCallbackReturn.SUCCESS

    def release_resources(self) -> None:
        self._active = False
        for srv in self._services:
            self.destroy_service(srv)
        self._services = []
        if self._timer is not None:
            self.destroy_timer(self._timer)
            self._timer = None
        if self._diag is not None:
            self.destroy_publisher(self._diag)
            self._diag = None
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None

    # ---------------------------------------------------------------- services
    def _refuse(self, response, why: str):
        response.success = False
        response.error = why
        self._last_refusal = why
        self.get_logger().warning(f"request refused: {why}")
        return response

    def _on_chat(self, request, response):
        if not self._active:
            return self._refuse(response, "node is not active")
        try:
            images = []
            for i, im in enumerate(request.images):
                try:
                    images.append(decode_raw(im.encoding, im.height, im.width, im.step, im.data, im.is_bigendian))
                except ImageError as exc:
                    raise RequestError(f"images[{i}]: {exc}") from None
            result = self.runtime.chat(ChatRequest(
                session_id=request.session_id, prompt=request.prompt, images=images, reset=request.reset,
                max_new_tokens=int(request.max_new_tokens), temperature=float(request.temperature),
                top_p=float(request.top_p)))
        except RequestError as exc:
            return self._refuse(response, str(exc))
        except Exception as exc:  # keep serving; the caller learns what happened
            self.get_logger().error(f"chat failed: {exc}\n{traceback.format_exc()}")
            return self._refuse(response, f"internal error: {type(exc).__name__}: {exc}")
        if result.evicted_session:
            self.get_logger().info(f"session {result.evicted_session!r} evicted (least recently used) for "
                                   f"{request.session_id!r}")
        response.success = True
        response.reply = result.reply
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
            del self._ttft[:-100], self._tok_per_s[:-100]
        return response

    def _on_end(self, request, response):
        if not self._active:
            return self._refuse(response, "node is not active")
        try:
            self.runtime.end_session(request.session_id)
        except RequestError as exc:
            return self._refuse(response, str(exc))
        response.success = True
        return response

    # ---------------------------------------------------------------- diagnostics
    def _publish_diagnostics(self):
        rt = self.runtime
        if rt is None:
            return
        with self._lock:
            ttft, tps = median(self._ttft), median(self._tok_per_s)
        values = {"backend": self.cfg.executor.backend, "model": self.cfg.name,
                  "sessions_open": len(rt.sessions), "sessions_max": rt.pool.num_slots,
                  "sessions_evicted": rt.sessions.evicted, "turns_served": rt.turns_served,
                  "requests_refused": rt.requests_refused, "ttft_median_ms": ttft, "decode_tokens_per_s": tps,
                  "device_memory_mib": rt.executor.device_bytes / 2**20, "last_refusal": self._last_refusal}
        level = OK if self._active else ERROR
        self._diag.publish(diagnostic_array(self, f"{self.get_name()}: chat", f"synflux/{values['backend']}", level,
                                            "active" if self._active else "inactive", values))


def main(args=None) -> int:
    return run_lifecycle_node(VLMNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
