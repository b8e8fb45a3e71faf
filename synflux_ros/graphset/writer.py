"""Writing graph sets (format in :mod:`synflux_ros.graphset.reader`): the manifest and the shared weights file.

Used by ``synflux-build`` and by executors that write a compiled copy of a graph set beside it (the
onnxruntime executor's ``optimized_model_dir``). Needs the ``onnx`` package, imported on first use, so
importing this module costs nothing on a robot that only reads graph sets.
"""
from __future__ import annotations

import hashlib
import json
import os

from .reader import (
    ALIGNMENT, EXTERNAL_MIN_BYTES, FORMAT, MANIFEST_FILE, WEIGHTS_FILE, GraphSetError, GraphSetNotFoundError,
    external_initializers)

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
    entries, see ``synflux_ros.backends.onnxruntime.executor``) are carried over, deduplicated as well.

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
