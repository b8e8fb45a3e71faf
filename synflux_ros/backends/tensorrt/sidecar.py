"""The description of one build of a graph set's TensorRT engines, ``tensorrt/<device tag>/tensorrt.json``:
written by ``synflux-build --backend tensorrt`` (:mod:`synflux_ros.backends.tensorrt.build`), read by the
tensorrt executor. One schema for both sides (run time: standard library only); the JSON layout is
``synflux-tensorrt/1`` (docs/internals/build.md)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from .. import sidecar as common
from .plan import FORMAT, SIDECAR


class SidecarError(common.SidecarError):
    """A sidecar that cannot be read or is not a ``synflux-tensorrt/1`` description."""


def _get(data: dict, name: str, kind, default=..., where: str = "", optional: bool = False):
    return common.field(data, name, kind, default, where, optional, SidecarError)


@dataclass(frozen=True)
class EngineEntry:
    """One built engine."""
    file: str
    """The engine file, relative to the sidecar's directory."""
    onnx: str
    """The ONNX file it was built from, relative to the graph set."""
    kind: str
    profiles: tuple[str, ...]
    """The graph each optimization profile serves, in the engine's profile order."""
    key: str = ""
    """The engine key (:func:`~synflux_ros.backends.tensorrt.plan.engine_key`): unchanged, it is kept."""
    dla: bool = False
    bytes: int = 0
    seconds: float | None = None
    """How long TensorRT took to build it."""
    dla_fallback_layers: tuple[tuple[str, ...], ...] = ()
    """The layers of a DLA engine that run on the GPU."""

    @classmethod
    def from_json(cls, name: str, data) -> "EngineEntry":
        where = f"engine {name!r}"
        if not isinstance(data, dict):
            raise SidecarError(f"{where}: expected an object, got {data!r}")
        profiles = _get(data, "profiles", list, where=where)
        if not all(isinstance(p, str) for p in profiles):
            raise SidecarError(f"{where}: field 'profiles' must be a list of graph names, got {profiles!r}")
        fallback = _get(data, "dla_fallback_layers", list, [], where)
        if not all(isinstance(x, list) and all(isinstance(s, str) for s in x) for x in fallback):
            raise SidecarError(f"{where}: field 'dla_fallback_layers' must be a list of [layer, reason] lists, "
                               f"got {fallback!r}")
        size = _get(data, "bytes", int, 0, where)
        if size < 0:
            raise SidecarError(f"{where}: field 'bytes' must be >= 0, got {size}")
        return cls(file=_get(data, "file", str, where=where), onnx=_get(data, "onnx", str, "", where),
                   kind=_get(data, "kind", str, "", where), profiles=tuple(profiles),
                   key=_get(data, "key", str, "", where), dla=_get(data, "dla", bool, False, where), bytes=size,
                   seconds=_get(data, "seconds", float, None, where, optional=True),
                   dla_fallback_layers=tuple(tuple(x) for x in fallback))

    def to_json(self) -> dict:
        return common.with_optional({
            "file": self.file, "onnx": self.onnx, "key": self.key, "kind": self.kind, "profiles": list(self.profiles),
            "dla": self.dla, "bytes": self.bytes, "dla_fallback_layers": [list(x) for x in self.dla_fallback_layers]},
            seconds=self.seconds)


@dataclass(frozen=True)
class Sidecar:
    """The engines of one device and precision, and what they were built with."""
    tensorrt: str
    """The TensorRT version that built them (the executor needs the same)."""
    sm: str
    """The compute capability they were built for."""
    precision: str
    module: str = "tensorrt"
    dla_core: int | None = None
    flags: dict = field(default_factory=dict)
    """The build options the engine keys cover (:meth:`TensorRTOptions.flags`)."""
    graph_keys: dict[str, str] = field(default_factory=dict)
    """The manifest key of each graph when the engines were built: another one means the set was rebuilt."""
    engines: dict[str, EngineEntry] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data) -> "Sidecar":
        """The sidecar from its JSON; :class:`SidecarError`, naming the field, when it is another format or a
        field is missing or of the wrong type."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise SidecarError(f"not a {FORMAT} file")
        graph_keys = _get(data, "graph_keys", dict, {})
        if not all(isinstance(v, str) for v in graph_keys.values()):
            raise SidecarError(f"field 'graph_keys' must map graph names to keys, got {graph_keys!r}")
        engines = _get(data, "engines", dict, {})
        dla_core = _get(data, "dla_core", int, None, optional=True)
        if dla_core is not None and dla_core < 0:
            raise SidecarError(f"field 'dla_core' must be >= 0 or null, got {dla_core}")
        return cls(tensorrt=_get(data, "tensorrt", str), sm=_get(data, "sm", str),
                   precision=_get(data, "precision", str, "fp32"), module=_get(data, "module", str, "tensorrt"),
                   dla_core=dla_core, flags=_get(data, "flags", dict, {}), graph_keys=dict(graph_keys),
                   engines={str(n): EngineEntry.from_json(n, e) for n, e in engines.items()})

    def to_json(self) -> dict:
        return {"format": FORMAT, "tensorrt": self.tensorrt, "module": self.module, "sm": self.sm,
                "dla_core": self.dla_core, "precision": self.precision, "flags": self.flags,
                "graph_keys": self.graph_keys, "engines": {n: e.to_json() for n, e in self.engines.items()}}


def sidecar_path(engine_dir: str) -> str:
    return os.path.join(engine_dir, SIDECAR)


def read(engine_dir: str) -> Sidecar:
    """The sidecar in ``engine_dir``: ``FileNotFoundError`` when there is none, :class:`SidecarError` when it is
    unreadable or not a ``synflux-tensorrt/1`` description."""
    return Sidecar.from_json(common.load(sidecar_path(engine_dir), SidecarError))


def write(engine_dir: str, sidecar: Sidecar) -> dict:
    """Write ``sidecar`` atomically (keys sorted, as the engine build has always written it); returns the JSON."""
    data = sidecar.to_json()
    common.write(sidecar_path(engine_dir), data, sort_keys=True)
    return data
