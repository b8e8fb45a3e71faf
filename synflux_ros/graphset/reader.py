"""Reading the on-disk format of a graph set (``synflux-graphs/1``): manifest, weights file, input views.

The writer is :mod:`synflux_ros.graphset.writer` (it needs ``onnx``), the caches made from a set
:mod:`synflux_ros.graphset.cache`; this module needs only the standard library: a graph's external initializers
are read straight from the protobuf encoding (:func:`external_initializers`). The format (files, manifest
fields, weights stored once, input views): docs/graph-set-format.md.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from ..core.contract import GraphMeta

FORMAT = "synflux-graphs/1"
MANIFEST_FILE = "manifest.json"
WEIGHTS_FILE = "weights.bin"
ALIGNMENT = 64
"""Byte alignment of every tensor in the weights file (enough for any element type and SIMD loads)."""
EXTERNAL_MIN_BYTES = 1024
"""Initializers of at least this many bytes go to the weights file; smaller ones stay in the graph."""

BUILD_HINT = "build it with: synflux-build --config <model.yaml> --out {dir}"


VIEW_INPUTS = {"past_kv": 2}
"""Contract inputs exported as views, and over how many leading axes (docs/graph-set-format.md#input-views)."""

IN_PLACE_SUFFIX = ".in_place"
"""An ONNX output named ``<input>`` + this suffix (``past_kv.3.0.in_place``) is that input updated in place: a
runtime binds it to the input's own memory. Graph files written by synflux-build have none; the onnxruntime
executor's load-time fused graphs do (a KV view its attention kernel appends the new row to,
``backends/onnxruntime/fusions.py``)."""

ROWS_IN_PLACE = {"new_kv": ("past_kv", "cache_position")}
"""Contract outputs that a graph may leave out when it updates every view of an input in place (see
:data:`IN_PLACE_SUFFIX`): ``new_kv`` [L, 2, KV, 1, Dh] is then the row of ``past_kv`` [L, 2, KV, S, Dh] at
``cache_position``, which the run wrote, and the runtime reads it from there."""


def view_name(name: str, index) -> str:
    """ONNX input name of the view ``name[index]`` (``past_kv.3.1``: layer 3, values)."""
    return ".".join([name, *(str(int(i)) for i in index)])


def view_indices(shape, lead: int):
    """All index tuples over the first ``lead`` axes of ``shape``, in memory order."""
    import itertools
    return itertools.product(*(range(int(d)) for d in shape[:lead]))


def input_views(name: str, shape, dtype_size: int, onnx_name: str):
    """Where the ONNX input ``onnx_name`` lies in contract input ``name`` [shape] with elements of
    ``dtype_size`` bytes: ``(byte_offset, view_shape)``, or None if it is not a view of that input.
    A view ``name.i.j...`` takes the sub-tensor at index (i, j, ...) over the leading axes."""
    prefix = name + "."
    if not onnx_name.startswith(prefix):
        return None
    parts = onnx_name[len(prefix):].split(".")
    if not parts or not all(p.isdigit() for p in parts) or len(parts) >= len(shape):
        return None
    index = [int(p) for p in parts]
    if any(i >= int(d) for i, d in zip(index, shape)):
        return None
    rest = tuple(int(d) for d in shape[len(index):])
    flat = 0
    for i, d in zip(index, shape):
        flat = flat * int(d) + i
    return flat * math.prod(rest) * dtype_size, rest


class GraphSetError(ValueError):
    """A graph set on disk is missing, incomplete or not in the expected format."""


class GraphSetNotFoundError(GraphSetError, FileNotFoundError):
    """A file or directory of a graph set does not exist."""


def _hint(graph_dir: str) -> str:
    return BUILD_HINT.format(dir=graph_dir or "<graph_dir>")


def read_manifest(graph_dir: str) -> dict:
    """Read and check ``graph_dir/manifest.json``.

    Raises :class:`GraphSetNotFoundError` when the directory, the manifest or the weights file it names
    is missing, and :class:`GraphSetError` when the manifest is not valid JSON or not in this format.
    Every error names the path and how to (re)build the graph set.
    """
    if not graph_dir:
        raise GraphSetNotFoundError(f"no graph directory given (executor.graph_dir is empty); {_hint('')}")
    if not os.path.isdir(graph_dir):
        raise GraphSetNotFoundError(f"graph directory {graph_dir} does not exist; {_hint(graph_dir)}")
    path = os.path.join(graph_dir, MANIFEST_FILE)
    if not os.path.isfile(path):
        raise GraphSetNotFoundError(f"{path} not found: {graph_dir} is not a built graph set; {_hint(graph_dir)}")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GraphSetError(f"{path}: cannot read the manifest ({exc}); rebuild it: {_hint(graph_dir)}") from exc
    if not isinstance(data, dict):
        raise GraphSetError(f"{path}: the manifest must be a JSON object; rebuild it: {_hint(graph_dir)}")
    fmt = data.get("format")
    if fmt != FORMAT:
        raise GraphSetError(f"{path}: format {fmt!r} is not {FORMAT!r}; rebuild it: {_hint(graph_dir)}")
    graphs = data.get("graphs")
    if not isinstance(graphs, list) or not all(isinstance(g, dict) and "name" in g for g in graphs):
        raise GraphSetError(f"{path}: 'graphs' must be a list of graph entries with a 'name'; "
                            f"rebuild it: {_hint(graph_dir)}")
    weights = data.get("weights") or {}
    if not isinstance(weights, dict):
        raise GraphSetError(f"{path}: 'weights' must be an object; rebuild it: {_hint(graph_dir)}")
    wfile = weights.get("file", "")
    if wfile:
        wpath = member_path(graph_dir, str(wfile), "weights file")
        if not os.path.isfile(wpath):
            raise GraphSetNotFoundError(f"{wpath} (named by {path}) not found; {_hint(graph_dir)}")
        expected = weights.get("bytes")
        if expected is not None and os.path.getsize(wpath) != int(expected):
            raise GraphSetError(f"{wpath}: {os.path.getsize(wpath)} bytes, the manifest says {expected} "
                                f"(incomplete copy?); {_hint(graph_dir)}")
    return data


def weight_format(manifest: dict | None) -> dict:
    """The weight format recorded in a manifest's ``weights`` entry: ``{"dtype": "float32"}`` or, for a
    set built with ``synflux-build --weights int8|int4``, ``{"dtype": "int4", "block": 32, ...}``, with
    ``ggml_carried`` ({GGML type: weights}) where blocks of a GGUF file were carried over."""
    w = (manifest or {}).get("weights") or {}
    fmt = {"dtype": str(w.get("dtype") or "float32")}
    if fmt["dtype"] != "float32":
        fmt["block"] = w.get("block")
        if w.get("ggml_carried"):
            fmt["ggml_carried"] = dict(w["ggml_carried"])
    return fmt


def check_weight_format(graph_dir: str, backend: str, supported=("float32",), manifest: dict | None = None) -> None:
    """Refuse a graph set whose weights are quantized (``--weights int8|int4``) unless ``backend`` runs
    that format (``supported``: weight dtypes). No manifest (e.g. the mock backend) passes."""
    if manifest is None:
        manifest = find_manifest(graph_dir)
    fmt = weight_format(manifest)
    if fmt["dtype"] not in supported:
        raise GraphSetError(
            f"{backend} backend: the graph set in {graph_dir} has {fmt['dtype']} weights (block {fmt.get('block')}, "
            f"built with synflux-build --weights {fmt['dtype']}); this backend runs {', '.join(supported)} graph "
            f"sets only. Use executor onnxruntime for it, or rebuild without --weights "
            f"({BUILD_HINT.format(dir=graph_dir)})")


class ChecksWeightFormat:
    """Executor mixin: at load, refuse a graph set whose weight format the backend (``weight_dtypes``)
    cannot run."""

    def check_weight_format(self) -> None:
        check_weight_format(self.graph_dir, self.name, self.weight_dtypes)


def find_manifest(graph_dir: str) -> dict | None:
    """The checked manifest of ``graph_dir`` (see :func:`read_manifest`), or None when no directory is
    given or it holds no manifest: backends such as the mock run a config's graph set without files."""
    if not graph_dir or not os.path.isfile(os.path.join(graph_dir, MANIFEST_FILE)):
        return None
    return read_manifest(graph_dir)


def member_path(graph_dir: str, name: str, what: str) -> str:
    """``graph_dir/name`` for a file named by the manifest; a name that is absolute or climbs out of the
    directory (``..``) is refused, so a manifest cannot point a runtime at files elsewhere."""
    path = os.path.normpath(os.path.join(graph_dir, name))
    root = os.path.normpath(graph_dir)
    if os.path.isabs(name) or not path.startswith(root + os.sep):
        raise GraphSetError(f"{os.path.join(graph_dir, MANIFEST_FILE)}: {what} {name!r} is not a file inside "
                            f"{graph_dir}; {_hint(graph_dir)}")
    return path


def graph_metas(graph_dir: str, manifest: dict) -> list[GraphMeta]:
    """The GraphMeta of every graph the manifest lists; a malformed entry is named with the missing or
    bad field, and every graph file must lie inside ``graph_dir``."""
    path = os.path.join(graph_dir, MANIFEST_FILE)
    metas = []
    for i, entry in enumerate(manifest.get("graphs", [])):
        try:
            meta = GraphMeta.from_dict(entry)
        except KeyError as exc:
            raise GraphSetError(f"{path}: graphs[{i}] ({entry.get('name')!r}) has no field {exc.args[0]!r}; "
                                f"rebuild it: {_hint(graph_dir)}") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise GraphSetError(f"{path}: graphs[{i}] ({entry.get('name')!r}) is malformed ({exc}); "
                                f"rebuild it: {_hint(graph_dir)}") from None
        if meta.file:
            member_path(graph_dir, meta.file, f"graph {meta.name!r} file")
        metas.append(meta)
    return metas


def tokenizer_file(graph_dir: str, manifest: dict | None) -> str:
    """Path of the ``tokenizer.json`` a graph set ships (built from a checkpoint), or ''."""
    name = (manifest or {}).get("tokenizer") or ""
    return member_path(graph_dir, name, "tokenizer") if name else ""


# ------------------------------------------------------------------------------ reading initializers
# A runtime needs, per graph, the name, type, shape and weights-file range of each external initializer,
# to hand it a view of the shared weights buffer. The few fields involved are read straight from the
# protobuf wire format, so runtimes need no ``onnx`` package.

@dataclass(frozen=True)
class ExternalTensor:
    """An initializer stored in the weights file: its type, shape and byte range."""
    name: str
    data_type: int  # onnx.TensorProto.DataType
    dims: tuple[int, ...]
    location: str
    offset: int
    length: int
    prepacked: bool = False
    """The entry also points at ORT-prepacked copies of the tensor (``prepacked_<n>`` keys, written into an
    ORT-optimised graph set; see ``synflux_ros.backends.onnxruntime.executor``)."""


def _varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("malformed varint")


def _fields(buf, start: int, end: int):
    """(field number, wire type, value) of one message; value is an int, or (start, end) for bytes."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = None, pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = (pos, pos + n), pos + n
        elif wire == 5:
            value, pos = None, pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos > end:
            raise ValueError("truncated protobuf message")
        yield number, wire, value


def _tensor_entry(buf, start: int, end: int) -> ExternalTensor | None:
    name, dtype, dims, location, ext, prepacked = "", 0, [], 0, {}, False
    for number, wire, value in _fields(buf, start, end):
        if number == 1:  # dims: packed or one varint per element
            if wire == 2:
                pos = value[0]
                while pos < value[1]:
                    d, pos = _varint(buf, pos)
                    dims.append(d)
            else:
                dims.append(value)
        elif number == 2:
            dtype = value
        elif number == 8:
            name = bytes(buf[value[0]:value[1]]).decode("utf-8")
        elif number == 13:  # external_data: StringStringEntryProto {key = 1, value = 2}
            k = v = ""
            for n2, _, v2 in _fields(buf, *value):
                if n2 == 1:
                    k = bytes(buf[v2[0]:v2[1]]).decode("utf-8")
                elif n2 == 2:
                    v = bytes(buf[v2[0]:v2[1]]).decode("utf-8")
            ext[k] = v
            prepacked = prepacked or k.startswith("prepacked")
        elif number == 14:
            location = value
    if location != 1 or "location" not in ext:  # TensorProto.EXTERNAL
        return None
    dims = [d - (1 << 64) if d >= 1 << 63 else d for d in dims]
    return ExternalTensor(name, dtype, tuple(dims), ext["location"], int(ext.get("offset", 0)),
                          int(ext["length"]) if "length" in ext else -1, prepacked)


def external_initializers(model_path: str) -> list[ExternalTensor]:
    """External-data initializers of the main graph of an ``.onnx`` file (subgraphs are not listed)."""
    with open(model_path, "rb") as fh:
        buf = memoryview(fh.read())
    try:
        out = []
        for number, wire, value in _fields(buf, 0, len(buf)):
            if number == 7 and wire == 2:  # ModelProto.graph
                for n2, w2, v2 in _fields(buf, *value):
                    if n2 == 5 and w2 == 2:  # GraphProto.initializer
                        t = _tensor_entry(buf, *v2)
                        if t is not None:
                            out.append(t)
        return out
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise GraphSetError(f"{model_path}: not a readable ONNX model ({exc})") from exc
