"""Weight-only quantization of exported graphs (``synflux-build --weights int8|int4 [--block B]``).

Each large constant ``MatMul`` weight of the decoder graphs becomes block-wise symmetric integers and their
scales, used as ``MatMul(x, DequantizeLinear(Wq, scale, axis=0, block_size=B))``: standard ONNX (opset 21),
which onnxruntime fuses into its ``MatMulNBits`` kernel at load. Weights imported from a GGUF file's
``Q4_0``, ``Q4_1`` or ``Q8_0`` blocks are carried over exactly instead of being quantized again (affine
``Q4_1`` as a DequantizeLinear + Add chain, which the onnxruntime executor rewrites at load,
``backends/onnxruntime/quant.py``). The scheme, what stays unquantized and the GGML block mapping are
described in docs/internals/build.md.
"""
from __future__ import annotations

import hashlib

import numpy as np

WEIGHT_DTYPES = ("float32", "int8", "int4")
BLOCK_SIZES = (16, 32, 64, 128, 256)
DEFAULT_BLOCK = 32
QUANTIZED_KINDS = ("prefill", "decode")
"""The graph kinds whose MatMul weights are quantized (the decoder; the vision encoder and the action
expert stay in fp32)."""
MIN_ELEMENTS = 4096
OPSET = 21
_QMAX = {"int8": 127, "int4": 7}


class QuantizeError(ValueError):
    """Unsupported weight dtype or block size."""


def check_weights(dtype: str, block: int) -> None:
    if dtype not in WEIGHT_DTYPES:
        raise QuantizeError(f"--weights {dtype!r} is not supported (choices: {', '.join(WEIGHT_DTYPES)})")
    if dtype != "float32" and block not in BLOCK_SIZES:
        raise QuantizeError(f"--block {block} is not supported (choices: {', '.join(map(str, BLOCK_SIZES))})")


def weights_info(dtype: str, block: int, carried: dict | None = None) -> dict:
    """The manifest's record of the weight format (merged into its ``weights`` entry); ``carried``: how
    many weights of each GGML type were carried over (docs/internals/build.md)."""
    if dtype == "float32":
        return {"dtype": dtype}
    info = {"dtype": dtype, "block": int(block), "scheme": "symmetric"}
    if carried:
        info.update(scheme="symmetric+ggml", ggml_carried=dict(sorted(carried.items())))
    return info


class GGMLBlocks:
    """The blocks of a GGUF import (``gguf_import.BLOCKS_FILE``), looked up by the bytes of dequantized rows."""

    def __init__(self, path: str):
        import json

        from safetensors import safe_open
        self.path = path
        with safe_open(path, framework="numpy") as fh:
            self.types = json.loads((fh.metadata() or {}).get("types", "{}"))
            self.tensors = {name: {k: fh.get_tensor(f"{name}.ggml_{k}") for k in ("q", "d", "m")
                                   if f"{name}.ggml_{k}" in fh.keys()} for name in self.types}
        self._index: dict[bytes, tuple[str, int]] | None = None

    @staticmethod
    def dequantize(t: dict, type_name: str) -> np.ndarray:
        """[rows, cols] float32, bitwise llama.cpp's reference dequantization."""
        q, d = t["q"], t["d"]
        rows, cols = q.shape
        qf = q.astype(np.float32)
        if type_name == "Q4_0":
            qf = (q.astype(np.int8) - np.int8(8)).astype(np.float32)
        x = d.reshape(rows, -1, 1) * qf.reshape(rows, -1, 32)
        if type_name == "Q4_1":
            x = x + t["m"].reshape(rows, -1, 1)
        return x.reshape(rows, cols)

    def _rows(self) -> dict[bytes, tuple[str, int]]:
        if self._index is None:
            index = {}
            for name, t in self.tensors.items():
                for r, row in enumerate(self.dequantize(t, self.types[name])):
                    index.setdefault(hashlib.blake2b(row.tobytes(), digest_size=16).digest(), (name, r))
            self._index = index
        return self._index

    def lookup(self, w: np.ndarray):
        """``w [K, N]`` -> (GGML type, q [K, N], d [K/32, N], m [K/32, N] or None) when every column of ``w``
        is a row of a carried tensor of one type; else None."""
        index = self._rows()
        cols = np.ascontiguousarray(w.T)
        hits = [index.get(hashlib.blake2b(c.tobytes(), digest_size=16).digest()) for c in cols]
        if any(h is None for h in hits) or len({self.types[h[0]] for h in hits}) != 1:
            return None
        type_name = self.types[hits[0][0]]
        parts = {k: np.stack([self.tensors[name][k][r] for name, r in hits], axis=1)
                 for k in self.tensors[hits[0][0]]}  # [K, N] and [K/32, N]
        return type_name, parts["q"], parts["d"], parts.get("m")


def load_ggml_blocks(hf_dir: str | None) -> GGMLBlocks | None:
    """The blocks shipped with a GGUF import in ``hf_dir``, or None."""
    import os

    from .gguf_import import BLOCKS_FILE
    path = os.path.join(hf_dir, BLOCKS_FILE) if hf_dir else ""
    return GGMLBlocks(path) if path and os.path.isfile(path) else None


# ------------------------------------------------------------------------------------------- numpy
def quantize_blocks(w: np.ndarray, dtype: str, block: int) -> tuple[np.ndarray, np.ndarray]:
    """``w [K, N]`` float -> (``q [K, N]`` int8 holding values in ``[-qmax, qmax]``, ``scale [K/B, N]`` float32)."""
    qmax = _QMAX[dtype]
    w = np.asarray(w, np.float32)
    k, n = w.shape
    if k % block:
        raise QuantizeError(f"K={k} is not a multiple of the block size {block}")
    blocks = w.reshape(k // block, block, n)
    scale = np.abs(blocks).max(axis=1) / np.float32(qmax)
    scale = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(blocks / scale[:, None, :]), -qmax, qmax).astype(np.int8)
    return q.reshape(k, n), scale


def dequantize_blocks(q: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    """Inverse of :func:`quantize_blocks` (what ``DequantizeLinear(axis=0, block_size=B)`` computes)."""
    k, n = q.shape
    return (q.reshape(k // block, block, n).astype(np.float32) * scale[:, None, :]).reshape(k, n)


def pack_int4(q: np.ndarray) -> bytes:
    """Signed 4-bit values (int8 array) as ONNX ``INT4`` raw data: two per byte, the first in the low nibble."""
    flat = (q.reshape(-1).astype(np.int8) & 0x0F).astype(np.uint8)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return (flat[0::2] | (flat[1::2] << 4)).tobytes()


def unpack_int4(raw: bytes, count: int) -> np.ndarray:
    b = np.frombuffer(raw, np.uint8)
    out = np.empty(b.size * 2, np.int8)
    out[0::2] = (b & 0x0F).astype(np.int8)
    out[1::2] = (b >> 4).astype(np.int8)
    out = np.where(out > 7, out - 16, out).astype(np.int8)
    return out[:count]


# -------------------------------------------------------------------------------------------- ONNX
def _quantized_tensors(name: str, w: np.ndarray, dtype: str, block: int, carry: GGMLBlocks | None = None):
    """(quantized weight, scale, minimum or None, GGML type carried or "") for ``w``: the GGUF blocks where
    :class:`GGMLBlocks` holds them and ``dtype`` can express them (docs/internals/build.md), else quantized here."""
    from onnx import TensorProto, helper, numpy_helper

    found = carry.lookup(w) if carry is not None and block == 32 else None
    if found is not None:
        type_name, q, d, m = found
        if type_name == "Q8_0" or (type_name == "Q4_0" and dtype == "int8"):
            q = q.astype(np.int8) - (np.int8(8) if type_name == "Q4_0" else np.int8(0))
            return numpy_helper.from_array(q.astype(np.int8), name + "_q"), numpy_helper.from_array(d, name + "_scale"), \
                None, type_name
        if type_name == "Q4_0":
            q4 = q.astype(np.int8) - np.int8(8)
            return helper.make_tensor(name + "_q", TensorProto.INT4, list(q.shape), pack_int4(q4), raw=True), \
                numpy_helper.from_array(d, name + "_scale"), None, type_name
        if type_name == "Q4_1":  # affine: 4-bit values in UINT4 (int4) or UINT8 (int8) storage, + the minima
            k, n = q.shape
            qt = helper.make_tensor(name + "_q", TensorProto.UINT4, list(q.shape), pack_int4(q), raw=True) \
                if dtype == "int4" else numpy_helper.from_array(q.astype(np.uint8), name + "_q")
            return qt, numpy_helper.from_array(d, name + "_scale"), \
                numpy_helper.from_array(np.ascontiguousarray(m.reshape(k // 32, 1, n)), name + "_min"), type_name
    q, scale = quantize_blocks(w, dtype, block)
    if dtype == "int8":
        qt = numpy_helper.from_array(q, name + "_q")
    else:
        qt = helper.make_tensor(name + "_q", TensorProto.INT4, list(q.shape), pack_int4(q), raw=True)
    return qt, numpy_helper.from_array(scale, name + "_scale"), None, ""


def quantize_model(model, dtype: str, block: int, cache: dict | None = None,
                   carry: GGMLBlocks | None = None) -> dict:
    """Rewrite ``model`` (an ``onnx.ModelProto`` with its weights in memory) in place: each eligible
    constant MatMul weight becomes ``DequantizeLinear(Wq, scale, axis=0, block_size=block)`` (or the
    affine form of a carried Q4_1 weight, see docs/internals/build.md); the model is converted to opset 21.
    ``cache`` (content hash -> quantized tensors) saves quantizing the same weight again for the next graph;
    ``carry``: GGUF blocks to carry over. Returns ``{"tensors": n, "fp32_bytes": ..., "quantized_bytes":
    ..., "carried": {GGML type: n}}``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    check_weights(dtype, block)
    stats = {"tensors": 0, "fp32_bytes": 0, "quantized_bytes": 0, "carried": {}}
    if dtype == "float32":
        return stats
    cache = {} if cache is None else cache
    _to_opset(model, OPSET)  # first: DequantizeLinear's block_size does not exist before opset 21
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    consumers: dict[str, list[tuple[object, int]]] = {}
    for node in g.node:
        for i, name in enumerate(node.input):
            if name in inits:
                consumers.setdefault(name, []).append((node, i))
    outputs = {o.name for o in g.output}
    new_nodes: dict[str, list] = {}  # weight name -> the nodes computing it (DequantizeLinear, ...)
    for name, uses in consumers.items():
        t = inits[name]
        if t.data_type != TensorProto.FLOAT or len(t.dims) != 2 or name in outputs:
            continue
        k, n = int(t.dims[0]), int(t.dims[1])
        if k * n < MIN_ELEMENTS or k % block or not all(nd.op_type == "MatMul" and i == 1 for nd, i in uses):
            continue
        w = numpy_helper.to_array(t)
        key = (hashlib.sha256(w.tobytes()).digest(), w.shape)
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = _quantized_tensors("w", w, dtype, block, carry)
        tensors = []
        for proto, suffix in zip(hit[:3], ("_q", "_scale", "_min")):
            if proto is not None:
                tensors.append(onnx.TensorProto())
                tensors[-1].CopyFrom(proto)
                tensors[-1].name = name + suffix
        g.initializer.remove(t)
        g.initializer.extend(tensors)
        qt, st = tensors[:2]
        if len(tensors) == 2:
            new_nodes[name] = [helper.make_node("DequantizeLinear", [qt.name, st.name], [name],
                                                name=name + "_dequantize", axis=0, block_size=block)]
        else:  # affine (carried Q4_1): DequantizeLinear, then the minimum of each block added
            g.initializer.extend([numpy_helper.from_array(np.array([k // block, block, n], np.int64), name + "_blocks"),
                                  numpy_helper.from_array(np.array([k, n], np.int64), name + "_shape")])
            new_nodes[name] = [
                helper.make_node("DequantizeLinear", [qt.name, st.name], [name + "_dq"], name=name + "_dequantize",
                                 axis=0, block_size=block),
                helper.make_node("Reshape", [name + "_dq", name + "_blocks"], [name + "_dq_blocks"],
                                 name=name + "_to_blocks"),
                helper.make_node("Add", [name + "_dq_blocks", tensors[2].name], [name + "_affine"],
                                 name=name + "_add_min"),
                helper.make_node("Reshape", [name + "_affine", name + "_shape"], [name], name=name + "_from_blocks")]
        if hit[3]:
            stats["carried"][hit[3]] = stats["carried"].get(hit[3], 0) + 1
        stats["tensors"] += 1
        stats["fp32_bytes"] += w.nbytes
        stats["quantized_bytes"] += sum(len(x.raw_data) for x in tensors)
    if new_nodes:
        # each DequantizeLinear right before its first consumer (the node list stays topologically sorted)
        nodes = list(g.node)
        placed = set()
        out = []
        for node in nodes:
            for inp in node.input:
                if inp in new_nodes and inp not in placed:
                    out.extend(new_nodes[inp])
                    placed.add(inp)
            out.append(node)
        del g.node[:]
        g.node.extend(out)
    return stats


def _to_opset(model, opset: int) -> None:
    """Convert the default domain of ``model`` (in place) to ``opset`` with onnx's version converter."""
    from onnx import version_converter

    current = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if current == opset:
        return
    # The converter works on the serialised model (2 GB protobuf limit) and needs no weight data: it runs
    # on the graph with the large initializers emptied, which are put back by name afterwards.
    stash = {}
    for t in model.graph.initializer:
        if t.HasField("raw_data") and len(t.raw_data) > 4096:
            stash[t.name] = t.raw_data
            t.raw_data = b""
    try:
        converted = version_converter.convert_version(model, opset)
    finally:
        for t in model.graph.initializer:
            if t.name in stash:
                t.raw_data = stash[t.name]
    missing = set(stash) - {t.name for t in converted.graph.initializer}
    if missing:
        raise QuantizeError(f"opset conversion lost initializers {sorted(missing)[:5]}")
    for t in converted.graph.initializer:
        if t.name in stash:
            t.raw_data = stash[t.name]
    model.CopyFrom(converted)
    if model.ir_version < 10:  # INT4 and DequantizeLinear-21 need IR 10
        model.ir_version = 10


def dequantize_model(model) -> int:
    """The reference of a quantized graph (in place): each ``DequantizeLinear(Wq, scale, axis=0,
    block_size=B)`` of constants is replaced by its fp32 result as an initializer, so ``MatMul`` reads the
    dequantized weights. ``model`` must hold its weights in memory. Returns how many were replaced."""
    from onnx import TensorProto, numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    done = 0
    for node in list(g.node):
        if node.op_type != "DequantizeLinear" or len(node.input) != 2 or not all(i in inits for i in node.input):
            continue
        attrs = {a.name: a for a in node.attribute}
        qt, st = inits[node.input[0]], inits[node.input[1]]
        block = attrs["block_size"].i
        k, n = int(qt.dims[0]), int(qt.dims[1])
        if qt.data_type == TensorProto.INT4:
            q = unpack_int4(qt.raw_data, k * n).reshape(k, n)
        elif qt.data_type == TensorProto.UINT4:
            q = unpack_int4(qt.raw_data, k * n).reshape(k, n).view(np.uint8) & np.uint8(0x0F)
        else:
            q = numpy_helper.to_array(qt)
        w = dequantize_blocks(q, numpy_helper.to_array(st), block)
        g.node.remove(node)
        g.initializer.remove(qt)
        g.initializer.remove(st)
        g.initializer.append(numpy_helper.from_array(w, node.output[0]))
        done += 1
    return done
