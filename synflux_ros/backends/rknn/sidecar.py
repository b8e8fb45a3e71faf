"""The description of a graph set's compiled RKNN graphs for one target, ``<graph set>/rknn/<target>/rknn.json``:
written by ``synflux-build --backend rknn`` (:mod:`synflux_ros.backends.rknn.build`), read by the rknn executor.
One schema for both sides (run time: standard library only); the JSON layout is ``synflux-rknn/1``."""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

from .. import sidecar as common

FILE = "rknn.json"
FORMAT = "synflux-rknn/1"
ROOT = "rknn"
"""The graph set's subdirectory holding one directory per target."""
DTYPES = ("fp16", "int8")
"""Data types of a compiled graph."""


class SidecarError(common.SidecarError):
    """A sidecar that cannot be read or is not a ``synflux-rknn/1`` description for its target."""


def target_dir(graph_dir: str, target: str) -> str:
    """``<graph_dir>/rknn/<target>``: the compiled graphs of ``target`` and their sidecar."""
    return os.path.join(graph_dir, ROOT, target)


def sidecar_path(graph_dir: str, target: str) -> str:
    return os.path.join(target_dir(graph_dir, target), FILE)


def compiled_targets(graph_dir: str) -> list[str]:
    """The targets ``graph_dir`` has a sidecar for."""
    root = os.path.join(graph_dir, ROOT)
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(d for d in names if os.path.isfile(os.path.join(root, d, FILE)))


@dataclass(frozen=True)
class Quantization:
    """How an int8 graph was quantized: rknn-toolkit2's choices and the calibration set it was compiled with."""
    dtype: str = "w8a8"
    algorithm: str = "normal"
    method: str = "channel"
    dataset: str = ""
    """The toolkit's dataset.txt, relative to the target directory (the simulator quantizes again with it)."""
    samples: int = 0
    calib_sha256: str = ""
    calib_source: str = ""


@dataclass(frozen=True)
class GraphEntry:
    """One compiled graph."""
    file: str
    """The ``.rknn`` file, relative to the target directory."""
    source: str
    """The ONNX file it was compiled from, relative to the graph set (the simulator builds the graph from it)."""
    key: str
    """The compile key (ONNX, target, toolkit, dtype, quantization, compiler): unchanged, the graph is kept."""
    onnx_key: str
    """The manifest key of the ONNX graph when it was compiled: another one means the set was rebuilt since."""
    inputs: tuple[tuple[str, tuple[int, ...]], ...]
    """The model inputs in compile order, with their shapes (KV views nothing reads are left out)."""
    outputs: tuple[str, ...]
    dtype: str = "fp16"
    quantization: Quantization | None = None
    seconds: float | None = None
    """How long the toolkit took to compile it."""

    @classmethod
    def from_json(cls, name: str, data) -> "GraphEntry":
        if not isinstance(data, dict):
            raise SidecarError(f"graph {name!r}: expected an object, got {data!r}")
        try:
            quant = data.get("quantization")
            known = {f.name for f in dataclasses.fields(Quantization)}
            return cls(file=str(data.get("file", "")), source=str(data.get("source", "")),
                       key=str(data.get("key", "")), onnx_key=str(data.get("onnx_key", "")),
                       inputs=tuple((str(n), tuple(int(d) for d in s)) for n, s in data.get("inputs", [])),
                       outputs=tuple(str(o) for o in data.get("outputs", [])), dtype=str(data.get("dtype", "fp16")),
                       quantization=Quantization(**{k: v for k, v in quant.items() if k in known}) if quant else None,
                       seconds=data.get("seconds"))
        except (TypeError, ValueError, AttributeError) as exc:
            raise SidecarError(f"graph {name!r}: {exc}") from None

    def to_json(self) -> dict:
        q = self.quantization
        return common.with_optional({
            "file": self.file, "source": self.source, "dtype": self.dtype, "key": self.key, "onnx_key": self.onnx_key,
            "inputs": [[n, list(s)] for n, s in self.inputs], "outputs": list(self.outputs)},
            quantization=None if q is None else dataclasses.asdict(q), seconds=self.seconds)


@dataclass(frozen=True)
class Sidecar:
    """The compiled graphs of one target."""
    target: str
    toolkit: str
    """The rknn-toolkit2 version that compiled them."""
    graphs: dict[str, GraphEntry] = field(default_factory=dict)
    quantize: str = "fp16"
    """The canonical ``--quantize`` value (``fp16``, ``int8:vision_encoder``, ...)."""
    config_hash: str = ""
    written: str = ""

    @property
    def dtype(self) -> str:
        """int8 when any graph is."""
        return "int8" if any(e.dtype == "int8" for e in self.graphs.values()) else "fp16"

    @classmethod
    def from_json(cls, data, target: str) -> "Sidecar":
        """The sidecar of ``target`` from its JSON; :class:`SidecarError` when it is another format or target or
        says a dtype this version does not run."""
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("target") != target:
            raise SidecarError(f"not a {FORMAT} description for {target}")
        if data.get("dtype", "fp16") not in DTYPES:
            raise SidecarError(f"dtype {data.get('dtype')!r} is not supported ({', '.join(DTYPES)})")
        graphs = data.get("graphs") or {}
        if not isinstance(graphs, dict):
            raise SidecarError(f"'graphs' must be an object, got {graphs!r}")
        return cls(target=target, toolkit=str(data.get("toolkit", "")),
                   graphs={str(n): GraphEntry.from_json(n, e) for n, e in graphs.items()},
                   quantize=str(data.get("quantize") or "fp16"), config_hash=str(data.get("config_hash", "")),
                   written=str(data.get("written", "")))

    def to_json(self) -> dict:
        return {"format": FORMAT, "target": self.target, "toolkit": self.toolkit, "dtype": self.dtype,
                "quantize": self.quantize, "config_hash": self.config_hash, "written": self.written,
                "graphs": {n: e.to_json() for n, e in self.graphs.items()}}


def read(graph_dir: str, target: str) -> Sidecar:
    """The sidecar of ``target`` in ``graph_dir``: ``FileNotFoundError`` when there is none, :class:`SidecarError`
    when it is unreadable or not a description of ``target``."""
    return Sidecar.from_json(common.load(sidecar_path(graph_dir, target), SidecarError), target)


def write(graph_dir: str, sidecar: Sidecar) -> dict:
    """Write ``sidecar`` (atomically, stamped with the time) and return the JSON written."""
    data = dataclasses.replace(sidecar, written=time.strftime("%Y-%m-%dT%H:%M:%S")).to_json()
    common.write(sidecar_path(graph_dir, sidecar.target), data)
    return data
