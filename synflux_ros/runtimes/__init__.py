"""A config turned into a running model (executor, tokenizer, pieces, KV pool), ROS-free:
:class:`~synflux_ros.runtimes.vla.VLARuntime` maps frames to action chunks,
:class:`~synflux_ros.runtimes.vlm.VLMRuntime` serves multi-turn chat, and :func:`open_runtime` opens the one a
config asks for, on this machine or on a server."""
from __future__ import annotations


def runtime_class(cfg) -> type:
    """The runtime that serves ``cfg``: by its ``mode`` (vla, vlm), on this machine or, with
    ``executor.backend: remote``, on a ``synflux-serve`` server. Imported when asked for."""
    remote = cfg.executor.backend == "remote"
    if cfg.mode == "vla":
        if remote:
            from .remote import RemoteVLARuntime
            return RemoteVLARuntime
        from .vla import VLARuntime
        return VLARuntime
    if cfg.mode == "vlm":
        if remote:
            from .remote_chat import RemoteVLMRuntime
            return RemoteVLMRuntime
        from .vlm import VLMRuntime
        return VLMRuntime
    raise ValueError(f"mode {cfg.mode!r}: no runtime serves it (vla or vlm)")


def open_runtime(cfg):
    """The runtime of ``cfg`` (:func:`runtime_class`), loaded: local executor and graphs, or the remote
    connection checked against the config. Raises what loading raises (ConfigError, ImportError, ValueError)."""
    return runtime_class(cfg)(cfg)
