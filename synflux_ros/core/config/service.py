"""The sections of how a model is run and reached: ``executor`` (with ``Placement``), ``pipeline``,
``session``, ``remote`` (a model served by ``synflux-serve``) and ``serve`` (what that server reads of a
request)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .schema import ConfigError, choices_hint, setting


@dataclass(frozen=True, kw_only=True)
class SessionConfig:
    """``session``: how many chat sessions hold a KV slot, and what happens when all are taken."""
    max_sessions: int = setting(4, min=1, doc="KV-cache slots = concurrent chat sessions")
    eviction: str = setting("lru", choices=("lru", "refuse"), doc="when all slots are taken")
    reuse_kv_cache: bool = setting(True, doc="False recomputes the whole history every turn")
    max_images_per_turn: int = setting(4, min=0)
    max_prompt_bytes: int = setting(64 * 1024, min=1, doc="largest prompt in UTF-8 bytes, checked before tokenising")


@dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
    """``executor``: the backend, its graph directory and options, simulated latencies for the mock."""
    backend: str = setting("mock")
    graph_dir: str = setting("", doc="directory of compiled graphs (manifest.json)")
    latency_ms: dict[str, float] = setting(
        default_factory=dict, doc="mock: simulated device latency per graph name or prefix")
    options: dict[str, Any] = setting(default_factory=dict, doc="backend-specific options")
    placement: dict[str, Any] = setting(
        default_factory=dict,
        doc="graph kind -> 'backend[:device]' or {backend, options}: run those graphs on another executor")

    PLACEABLE = ("vision_encoder", "embed", "prefill", "decode", "action_expert")

    def __post_init__(self):
        for kind, where in self.placement.items():
            path = f"executor.placement.{kind}"
            if kind not in self.PLACEABLE:
                raise ConfigError(f"{path}: unknown graph kind{choices_hint(kind, self.PLACEABLE)}")
            placed = Placement.parse(where, path)
            if placed.backend == self.backend and not placed.options:
                raise ConfigError(f"{path}: {where!r} is the default executor; remove the entry")

    def placements(self) -> dict[str, "Placement"]:
        """Graph kind -> where it runs, for the kinds placed away from the default executor."""
        return {kind: Placement.parse(where, f"executor.placement.{kind}") for kind, where in self.placement.items()}


@dataclass(frozen=True)
class Placement:
    """Where a graph kind runs: a backend and its options (``device`` among them)."""
    backend: str
    options: tuple = ()  # sorted (key, value) pairs, so that equal placements share one executor

    @classmethod
    def parse(cls, where, path: str) -> "Placement":
        if isinstance(where, str) and where:
            backend, _, device = where.partition(":")
            return cls(backend, (("device", device),) if device else ())
        if isinstance(where, dict) and isinstance(where.get("backend"), str) and where["backend"]:
            unknown = set(where) - {"backend", "options"}
            if unknown:
                raise ConfigError(f"{path}: unknown field {sorted(unknown)[0]!r} (choices: backend, options)")
            options = where.get("options") or {}
            if not isinstance(options, dict):
                raise ConfigError(f"{path}.options: expected a mapping, got {options!r}")
            return cls(where["backend"], tuple(sorted(options.items())))
        raise ConfigError(f"{path}: expected 'backend[:device]' or {{backend: ..., options: {{...}}}}, "
                          f"got {where!r}")

    def __str__(self) -> str:
        device = dict(self.options).get("device", "")
        return f"{self.backend}:{device}" if device else self.backend


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """``pipeline``: depth of the queues between the VLA stages."""
    queue_depth: int = setting(1, min=1, max=64, doc="frames waiting between two stages")


@dataclass(frozen=True, kw_only=True)
class RemoteConfig:
    """``executor.backend: remote``: the model runs on a ``synflux-serve`` endpoint. A vla config's node sends
    each frame to its policy endpoint (its images fitted to the model's resolution and JPEG-compressed, as
    configured); a vlm config's node sends each chat turn to its chat API."""
    url: str = setting("", doc="the endpoint: ws:// or wss:// for a vla config (ws://gpu-server:8000/), the chat "
                                "API's base http:// or https:// for a vlm config (http://gpu-server:8000/v1)")
    api_key_file: str = setting("", doc="file holding the endpoint's API key (relative: to the config file)")
    ca_file: str = setting("", doc="the CA certificate (PEM) to trust for wss:// and https:// (relative: to the "
                                    "config file); empty = the system's trust store")
    connect_timeout: float = setting(5.0, min=0.01, doc="seconds to open the connection")
    request_timeout: float = setting(2.0, min=0.01, doc="seconds a chunk may take on the wire and the server")
    turn_timeout: float = setting(120.0, min=0.01, doc="vlm: seconds a chat turn may take, from the request to "
                                                         "the reply's last piece")
    compression: str = setting("jpeg", choices=("jpeg", "raw"), doc="how images travel (raw: uint8 arrays)")
    jpeg_quality: int = setting(90, min=1, max=100)
    resize: bool = setting(True, doc="downscale each image to fit the model's resolution before sending (the "
                                      "server letterboxes or stretches it as vision.resize says)")
    backoff_min: float = setting(0.5, min=0.0, doc="seconds before the first reconnection attempt")
    backoff_max: float = setting(10.0, min=0.0, doc="the longest wait between reconnection attempts")

    def __post_init__(self):
        if self.url and not self.url.startswith(("ws://", "wss://", "http://", "https://")):
            raise ConfigError(f"remote.url: {self.url!r} is not a ws://, wss://, http:// or https:// address")
        if self.backoff_max < self.backoff_min:
            raise ConfigError(f"remote.backoff_max: {self.backoff_max} is below remote.backoff_min "
                              f"{self.backoff_min}")


def _key_path(value, path: str) -> tuple[str, ...]:
    """An observation key: a string names a top-level key (it may hold '/', as DROID's keys do), a list of
    strings a path into nested maps (ALOHA's ``[images, cam_high]``)."""
    parts = [value] if isinstance(value, str) else value
    if not isinstance(parts, (list, tuple)) or not parts or not all(isinstance(p, str) and p for p in parts):
        raise ConfigError(f"{path}: expected a key (a string) or a path of keys (a list of strings), got {value!r}")
    return tuple(parts)


PROXY_WS_MAX_BYTES = 16 * 1024 * 1024
"""Ray Serve's HTTP proxy (its uvicorn's ``ws_max_size``, which Serve 2.60 leaves at the default and offers no
option for) closes a websocket whose message is larger with code 1009, before the replica sees it."""


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """How ``synflux-serve`` reads a policy request (openpi's observation dict) and bounds it. Each key is a
    string (a top-level key) or a list of strings (a path into nested maps)."""
    images: dict[str, Any] = setting(default_factory=dict, doc="camera (a vision.cameras name, or 'image' for a "
                                      "one-camera model) -> its observation key; empty = observation/<camera>")
    state: tuple[Any, ...] = setting(("observation/state",), doc="keys whose values, concatenated in order, are the "
                                      "robot state (action.state_joints order)")
    prompt: Any = setting("prompt", doc="key of the instruction; a request without it keeps the last one")
    max_message_bytes: int = setting(15 * 1024 * 1024, min=1024, max=PROXY_WS_MAX_BYTES,
                                      doc="largest request message; at most Ray's proxy's 16 MiB websocket limit, over "
                                          "which the proxy itself closes the connection (code 1009)")

    def __post_init__(self):
        for cam, key in self.images.items():
            _key_path(key, f"serve.images.{cam}")
        for i, key in enumerate(self.state):
            _key_path(key, f"serve.state[{i}]")
        _key_path(self.prompt, "serve.prompt")

    def image_keys(self, cameras: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
        """(camera, key path) per camera of the model, in its order."""
        names = cameras or ("image",)
        unknown = sorted(set(self.images) - set(names))
        if unknown:
            raise ConfigError(f"serve.images: {', '.join(unknown)} is not a camera of the model "
                              f"(cameras: {', '.join(names)})")
        return [(c, _key_path(self.images.get(c, f"observation/{c}"), f"serve.images.{c}")) for c in names]

    @property
    def state_keys(self) -> list[tuple[str, ...]]:
        return [_key_path(k, "serve.state") for k in self.state]

    @property
    def prompt_key(self) -> tuple[str, ...]:
        return _key_path(self.prompt, "serve.prompt")
