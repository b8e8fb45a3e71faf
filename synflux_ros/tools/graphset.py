"""On-disk format of a graph set (``synflux-graphs/1``), shared by the build tool and the runtimes.

::

    GRAPH_DIR/
      manifest.json   {"format": "synflux-graphs/1", "model": ..., "config_hash": ..., "config": {...},
                       "weights": {"file": "weights.bin", "bytes": N, ...},
                       "tokenizer": "tokenizer.json" or "",
                       "graphs": [GraphMeta.to_dict() + {"file": "<name>.onnx"}, ...]}
      weights.bin     every unique initializer of all graphs, raw little-endian, each one starting at a
                      64-byte-aligned offset
      <name>.onnx     one ONNX graph per GraphMeta; initializers of >= 1 KiB are ONNX external data pointing
                      into weights.bin (location, offset, length), smaller ones stay inline

All bucket graphs of a model (prefill_16, prefill_64, ...) hold the same weight matrices. They are stored
once: :func:`write_weights_and_models` deduplicates initializers by content across all models, so the
weights file holds one copy and every graph references the same byte range. A runtime reads the file
once and hands that one buffer to every graph (see ``synflux_ros.backends.onnxruntime``).

Rebuilding some graphs of a set can append to the existing weights file (``append=True``): tensors it
already holds are reused, so the unchanged graphs keep their files. An ORT-optimised copy of a set (the
onnxruntime backend's ``optimized_model_dir``) is a graph set in this same format whose weights file may
also hold ORT-prepacked copies of weights, referenced by ``prepacked_<n>`` external-data entries.

Input views
-----------
A graph may take a contract input as several ONNX inputs, each a contiguous sub-tensor along its leading
axes: ``past_kv`` [L, 2, KV, S, Dh] is exported as ``past_kv.<l>.<j>`` [KV, S, Dh], one input per layer
and K/V (:data:`VIEW_INPUTS`). The runtime contract (GraphMeta) keeps the one tensor; a runtime binds each
view at its byte offset in that tensor's buffer (:func:`input_views`), so a layer reads its keys and values
where the cache slot holds them. Slicing one big input inside the graph would instead make ONNX Runtime
copy the whole cache every step (Slice and Split copy). Views are standard ONNX inputs that any compiler
takes; a graph set whose graphs take the whole tensor loads as well.

This module needs ``onnx`` only for :func:`write_weights_and_models` (the build side); reading a
manifest or listing a graph's external initializers (:func:`external_initializers`, read straight from
the protobuf encoding) needs nothing beyond the standard library.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass

FORMAT = "synflux-graphs/1"
MANIFEST_FILE = "manifest.json"
WEIGHTS_FILE = "weights.bin"
ALIGNMENT = 64
"""Byte alignment of every tensor in the weights file (enough for any element type and SIMD loads)."""
EXTERNAL_MIN_BYTES = 1024
"""Initializers of at least this many bytes go to the weights file; smaller ones stay in the graph."""

BUILD_HINT = "build it with: synflux-build --config <model.yaml> --out {dir}"


VIEW_INPUTS = {"past_kv": 2}
"""Contract inputs exported as views, and over how many leading axes (see *Input views* above)."""


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
        wpath = os.path.join(graph_dir, wfile)
        if not os.path.isfile(wpath):
            raise GraphSetNotFoundError(f"{wpath} (named by {path}) not found; {_hint(graph_dir)}")
        expected = weights.get("bytes")
        if expected is not None and os.path.getsize(wpath) != int(expected):
            raise GraphSetError(f"{wpath}: {os.path.getsize(wpath)} bytes, the manifest says {expected} "
                                f"(incomplete copy?); {_hint(graph_dir)}")
    return data


def write_manifest(out_dir: str, manifest, weights: dict | None = None, *, model: str = "",
                   config_hash: str = "", config: dict | None = None, tokenizer: str = "", **extra) -> str:
    """Write ``out_dir/manifest.json`` (atomically) and return its path.

    Either ``write_manifest(out_dir, manifest_dict)`` with a complete manifest (``format`` is filled in
    when missing), or ``write_manifest(out_dir, graphs, weights, model=..., ...)`` with the graphs as
    GraphMeta objects or their dicts and the ``weights`` entry returned by
    :func:`write_weights_and_models`; a graph without a ``file`` gets ``<name>.onnx``.
    """
    if isinstance(manifest, dict):
        if weights is not None or extra or model or config_hash or config or tokenizer:
            raise TypeError("write_manifest(out_dir, manifest_dict) takes no further fields")
        data = {"format": FORMAT, **manifest}
    else:
        if weights is None:
            raise TypeError("write_manifest(out_dir, graphs, weights): the weights entry is missing")
        data = {"format": FORMAT, "model": model, "config_hash": config_hash, "config": dict(config or {}),
                "weights": dict(weights), "tokenizer": tokenizer, "graphs": list(manifest), **extra}
    entries = []
    for g in data.get("graphs", []):
        d = dict(g) if isinstance(g, dict) else g.to_dict()
        d["file"] = d.get("file") or f"{d['name']}.onnx"
        entries.append(d)
    data["graphs"] = entries
    if data["format"] != FORMAT:
        raise ValueError(f"manifest format {data['format']!r} is not {FORMAT!r}")
    path = os.path.join(out_dir, MANIFEST_FILE)
    with open(path + ".partial", "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
    os.replace(path + ".partial", path)
    return path


# ------------------------------------------------------------------------------ reading initializers
# A runtime needs, per graph, the name, type, shape and weights-file range of each external initializer,
# to hand it a view of the shared weights buffer. The few fields involved are read straight from the
# protobuf wire format, so runtimes need no ``onnx`` package.

@dataclass(frozen=True)
class ExternalTensor:
    name: str
    data_type: int  # onnx.TensorProto.DataType
    dims: tuple[int, ...]
    location: str
    offset: int
    length: int
    prepacked: bool = False
    """The entry also points at ORT-prepacked copies of the tensor (``prepacked_<n>`` keys, written into an
    ORT-optimised graph set; see ``synflux_ros.backends.onnxruntime``)."""


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


# ---------------------------------------------------------------------------------------------- writing
PREPACKED_ALIGNMENT = 4096
"""Alignment of ORT-prepacked blobs (page-aligned, as ORT writes them, so they can be mapped in place)."""


def _graphs(graph):
    """A graph and all its subgraphs (If/Loop/Scan bodies), depth first."""
    from onnx import AttributeProto

    stack = [graph]
    while stack:
        g = stack.pop()
        yield g
        for node in g.node:
            for attr in node.attribute:
                if attr.type == AttributeProto.GRAPH:
                    stack.append(attr.g)
                elif attr.type == AttributeProto.GRAPHS:
                    stack.extend(attr.graphs)


class _ExternalReader:
    """Reads ranges of the external data files of models loaded without their data."""

    def __init__(self, base_dir: str | None):
        self.base_dir = base_dir
        self._files: dict[str, object] = {}

    def read(self, model_name: str, tensor_name: str, location: str, offset: int, length: int | None) -> bytes:
        if self.base_dir is None:
            raise GraphSetError(
                f"model {model_name!r}: initializer {tensor_name!r} refers to external data ({location}) that is not "
                f"loaded; load the model with its data (onnx.load(..., load_external_data=True)) or pass base_dir")
        if os.path.isabs(location) or ".." in location.replace("\\", "/").split("/"):
            raise GraphSetError(f"model {model_name!r}: initializer {tensor_name!r}: external data location "
                                f"{location!r} must be a relative path inside {self.base_dir}")
        fh = self._files.get(location)
        if fh is None:
            path = os.path.join(self.base_dir, location)
            try:
                fh = self._files[location] = open(path, "rb")
            except OSError as exc:
                raise GraphSetNotFoundError(f"model {model_name!r}: initializer {tensor_name!r}: cannot open "
                                            f"{path} ({exc})") from exc
        fh.seek(offset)
        data = fh.read() if length is None else fh.read(length)
        if length is not None and len(data) != length:
            raise GraphSetError(f"model {model_name!r}: initializer {tensor_name!r}: {location} holds {len(data)} "
                                f"bytes at offset {offset}, expected {length}")
        return data

    def close(self):
        for fh in self._files.values():
            fh.close()
        self._files.clear()


def _digest(data) -> tuple[bytes, int]:
    return hashlib.sha256(data).digest(), len(data)


class _WeightsWriter:
    """Appends byte blobs to the weights file, each once (by content), at aligned offsets."""

    def __init__(self, fh, alignment: int, size: int = 0):
        self.fh = fh
        self.alignment = alignment
        self.size = size
        self.offsets: dict[tuple[bytes, int], int] = {}
        self.tensors = 0
        self.shared = 0

    def index(self, out_dir: str, wpath: str) -> None:
        """Learn the tensors the models in ``out_dir`` already have in the weights file (append mode)."""
        with open(wpath, "rb") as fh:
            for entry in sorted(os.listdir(out_dir)):
                if not entry.endswith(".onnx"):
                    continue
                try:
                    tensors = external_initializers(os.path.join(out_dir, entry))
                except (GraphSetError, OSError):
                    continue
                for t in tensors:
                    if t.location != WEIGHTS_FILE or t.length < 0 or t.offset + t.length > self.size:
                        continue
                    h = hashlib.sha256()
                    fh.seek(t.offset)
                    left = t.length
                    while left:
                        chunk = fh.read(min(left, 1 << 24))
                        if not chunk:
                            break
                        h.update(chunk)
                        left -= len(chunk)
                    key = (h.digest(), t.length)
                    if not left and key not in self.offsets:
                        self.offsets[key] = t.offset
                        self.tensors += 1

    def put(self, data: bytes, alignment: int | None = None, *, tensor: bool = True) -> int:
        key = _digest(data)
        offset = self.offsets.get(key)
        if offset is not None:
            self.shared += tensor
            return offset
        pad = (-self.size) % (alignment or self.alignment)
        if pad:
            self.fh.write(b"\0" * pad)
            self.size += pad
        offset = self.offsets[key] = self.size
        self.fh.write(data)
        self.size += len(data)
        self.tensors += tensor
        return offset


def _raw_bytes(tensor) -> bytes | None:
    """Little-endian raw bytes of an in-memory initializer, or None for types a raw file cannot hold."""
    from onnx import TensorProto, numpy_helper

    if tensor.data_type in (TensorProto.STRING, TensorProto.UNDEFINED):
        return None
    if tensor.HasField("raw_data"):
        return tensor.raw_data  # ONNX defines raw_data as little-endian already
    # Typed fields (float_data, int64_data, ...): numpy_helper knows every type's raw layout.
    return numpy_helper.from_array(numpy_helper.to_array(tensor)).raw_data


_DATA_FIELDS = ("raw_data", "float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")


def _set_external(tensor, location: str, offset: int, length: int, extra=()) -> None:
    from onnx import TensorProto

    for fname in _DATA_FIELDS:
        tensor.ClearField(fname)
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length)), *extra):
        entry = tensor.external_data.add()
        entry.key = key
        entry.value = value
    tensor.data_location = TensorProto.EXTERNAL


def _set_inline(tensor, raw: bytes) -> None:
    del tensor.external_data[:]
    tensor.ClearField("data_location")
    tensor.raw_data = raw


def write_weights_and_models(models, out_dir: str, *, base_dir: str | None = None, append: bool = False,
                             min_external_bytes: int = EXTERNAL_MIN_BYTES, alignment: int = ALIGNMENT) -> dict:
    """Write ``weights.bin`` and one ``<name>.onnx`` per model into ``out_dir``.

    ``models`` maps a graph name to an ``onnx.ModelProto`` (any mapping; its items are visited once, so a
    mapping that loads each model on access keeps one model in memory at a time). Every initializer of at
    least ``min_external_bytes`` (main graph and subgraphs) is deduplicated by content across all models,
    written once to the weights file at an ``alignment``-byte offset, and replaced in the written model by
    an external-data reference (location ``weights.bin``, offset, length). Smaller initializers and string
    tensors stay inline. The models passed in are left as they were.

    Initializers may hold their data in memory or, with ``base_dir``, refer to external data files in
    ``base_dir`` (models loaded with ``load_external_data=False``, e.g. an exporter's output for models
    beyond the 2 GB protobuf limit). ORT-prepacked copies listed with such a tensor (``prepacked_<n>``
    entries, see ``synflux_ros.backends.onnxruntime``) are carried over, deduplicated as well.

    Without ``append`` the weights file is written anew (under a temporary name, renamed when complete),
    so every graph that refers to it must be among ``models``. With ``append`` (rebuilding some graphs of
    a set) the existing file is kept: the tensors that the ``.onnx`` files in ``out_dir`` already have in it
    are reused and new ones appended (on an error the file is cut back to its old size). Tensors only the
    replaced graphs used stay in the file, unreferenced, until a full rebuild.

    Returns ``{"file": "weights.bin", "bytes": <file size>, "unique_tensors": <tensors in the file>,
    "shared_tensors": <references that reuse a tensor already in the file>, "alignment": alignment}``.
    """
    import onnx
    from onnx import TensorProto

    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    for name in models:
        if not name or os.sep in name or (os.altsep and os.altsep in name) or name.startswith("."):
            raise ValueError(f"graph name {name!r} is not usable as a file name")
    os.makedirs(out_dir, exist_ok=True)
    wpath = os.path.join(out_dir, WEIGHTS_FILE)
    append = append and os.path.isfile(wpath)
    tmp = wpath if append else wpath + ".partial"
    old_size = os.path.getsize(wpath) if append else 0
    reader = _ExternalReader(base_dir)
    pending: list[str] = []  # models written under .partial names, renamed once the weights are complete
    done = False
    try:
        with open(tmp, "r+b" if append else "wb") as wf:
            writer = _WeightsWriter(wf, alignment, old_size)
            if append:
                writer.index(out_dir, wpath)
                wf.seek(old_size)
            for name, model in models.items():
                if not isinstance(model, onnx.ModelProto):
                    raise TypeError(f"model {name!r}: expected an onnx.ModelProto, got {type(model).__name__}")
                restore = []  # (tensor, saved state) to undo the in-place edits after serialising
                try:
                    for graph in _graphs(model.graph):
                        for tensor in graph.initializer:
                            _externalize(tensor, name, reader, writer, min_external_bytes, restore, TensorProto)
                    data = model.SerializeToString()
                finally:
                    for tensor, saved in reversed(restore):
                        if isinstance(saved, bytes):
                            _set_inline(tensor, saved)
                        else:
                            tensor.CopyFrom(saved)
                mpath = os.path.join(out_dir, f"{name}.onnx")
                pending.append(mpath)
                with open(mpath + ".partial", "wb") as mf:
                    mf.write(data)
                del data, model
            wf.flush()
            os.fsync(wf.fileno())
        if not append:
            os.replace(tmp, wpath)
        done = True  # the weights file is complete: from here on nothing is rolled back
        for mpath in pending:
            os.replace(mpath + ".partial", mpath)
    finally:
        reader.close()
        for mpath in pending:
            if os.path.exists(mpath + ".partial"):
                os.remove(mpath + ".partial")
        if not done:
            if append:
                with open(wpath, "r+b") as wf:
                    wf.truncate(old_size)
            elif os.path.exists(tmp):
                os.remove(tmp)
    return {"file": WEIGHTS_FILE, "bytes": writer.size, "unique_tensors": writer.tensors,
            "shared_tensors": writer.shared, "alignment": alignment}


def _externalize(tensor, model_name, reader, writer, min_bytes, restore, TensorProto) -> None:
    """Move one initializer's data into the weights file (or inline it), recording how to undo it."""
    prepacked = []
    if tensor.data_location == TensorProto.EXTERNAL:
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        length = int(info["length"]) if info.get("length") else None
        raw = reader.read(model_name, tensor.name, location, int(info.get("offset") or 0), length)
        for key, value in info.items():
            if key.startswith("prepacked") and value:
                blob_key, *blobs = value.split("|")
                moved = []
                for blob in blobs:
                    off, n, checksum = blob.split(";")
                    data = reader.read(model_name, tensor.name, location, int(off), int(n))
                    moved.append(f"{writer.put(data, max(PREPACKED_ALIGNMENT, writer.alignment), tensor=False)}"
                                 f";{n};{checksum}")
                    del data
                prepacked.append((key, "|".join([blob_key, *moved])))
        saved = type(tensor)()
        saved.CopyFrom(tensor)  # no data in it: cheap
        if len(raw) < min_bytes and not prepacked:
            restore.append((tensor, saved))
            _set_inline(tensor, raw)
            return
    else:
        raw = _raw_bytes(tensor)
        if raw is None or len(raw) < min_bytes:
            return
        if tensor.HasField("raw_data"):
            saved = raw  # the bytes object now holds the data; the proto drops its copy below
        else:
            saved = type(tensor)()
            saved.CopyFrom(tensor)
    offset = writer.put(raw)
    restore.append((tensor, saved))
    _set_external(tensor, WEIGHTS_FILE, offset, len(raw), prepacked)
