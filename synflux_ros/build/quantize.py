"""Weight-only quantization of exported graphs (``synflux-build --weights int8|int4 [--block B]``).

Each large constant ``MatMul`` weight ``W [K, N]`` (``x @ W``: the decoder's fused QKV, o, gate-up and
down projections and the LM head) of the decoder graphs (``prefill_<p>``, ``decode_<d>``) is replaced by
block-wise quantized integers and their scales, and the graph computes

    MatMul(x, DequantizeLinear(Wq, scale, axis=0, block_size=B))

which is standard ONNX (``DequantizeLinear`` with ``block_size`` is opset 21; a quantized graph set is
converted to opset 21). The graphs stay portable; onnxruntime (>= 1.20, level ``extended`` or ``all``)
fuses each ``DequantizeLinear`` + ``MatMul`` into its ``com.microsoft.MatMulNBits`` kernel when it loads
them.

Quantization is **symmetric** per block of ``B`` consecutive rows of the input axis (K) and one output
column, round-to-nearest, computed in numpy from the fp32 weights:

    scale = max(|w|) / qmax      q = clip(round(w / scale), -qmax, qmax)      w ~ q * scale

with ``qmax = 127`` for ``int8`` (ONNX ``INT8``) and ``qmax = 7`` for ``int4`` (ONNX ``INT4``, two values
per byte, low nibble first); no zero points. The error of one weight is at most ``scale / 2``, i.e.
``max(|w| in its block) / (2 * qmax)``. A block of zeros gets scale 1.

Not quantized: norms, biases, the embedding table (read by ``Gather``), weights whose K is not a multiple
of ``B``, weights smaller than :data:`MIN_ELEMENTS` and initializers that any non-MatMul node also reads.
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


def weights_info(dtype: str, block: int) -> dict:
    """The manifest's record of the weight format (merged into its ``weights`` entry)."""
    return {"dtype": dtype} if dtype == "float32" else {"dtype": dtype, "block": int(block),
                                                        "scheme": "symmetric"}


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
def _quantized_tensors(name: str, w: np.ndarray, dtype: str, block: int):
    from onnx import TensorProto, helper, numpy_helper

    q, scale = quantize_blocks(w, dtype, block)
    if dtype == "int8":
        qt = numpy_helper.from_array(q, name + "_q")
    else:
        qt = helper.make_tensor(name + "_q", TensorProto.INT4, list(q.shape), pack_int4(q), raw=True)
    return qt, numpy_helper.from_array(scale, name + "_scale")


def quantize_model(model, dtype: str, block: int, cache: dict | None = None) -> dict:
    """Rewrite ``model`` (an ``onnx.ModelProto`` with its weights in memory) in place: each eligible
    constant MatMul weight becomes ``DequantizeLinear(Wq, scale, axis=0, block_size=block)``; the model is
    converted to opset 21. ``cache`` (content hash -> quantized tensors) saves quantizing the same weight
    again for the next graph. Returns ``{"tensors": n, "fp32_bytes": ..., "quantized_bytes": ...}``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    check_weights(dtype, block)
    stats = {"tensors": 0, "fp32_bytes": 0, "quantized_bytes": 0}
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
    new_nodes: dict[str, object] = {}  # weight name -> its DequantizeLinear node
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
            hit = cache[key] = _quantized_tensors("w", w, dtype, block)
        qt, st = onnx.TensorProto(), onnx.TensorProto()
        qt.CopyFrom(hit[0])
        st.CopyFrom(hit[1])
        qt.name, st.name = name + "_q", name + "_scale"
        g.initializer.remove(t)
        g.initializer.extend([qt, st])
        new_nodes[name] = helper.make_node("DequantizeLinear", [qt.name, st.name], [name],
                                           name=name + "_dequantize", axis=0, block_size=block)
        stats["tensors"] += 1
        stats["fp32_bytes"] += w.nbytes
        stats["quantized_bytes"] += len(qt.raw_data) + len(st.raw_data)
    if new_nodes:
        # each DequantizeLinear right before its first consumer (the node list stays topologically sorted)
        nodes = list(g.node)
        placed = set()
        out = []
        for node in nodes:
            for inp in node.input:
                if inp in new_nodes and inp not in placed:
                    out.append(new_nodes[inp])
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
        else:
            q = numpy_helper.to_array(qt)
        w = dequantize_blocks(q, numpy_helper.to_array(st), block)
        g.node.remove(node)
        g.initializer.remove(qt)
        g.initializer.remove(st)
        g.initializer.append(numpy_helper.from_array(w, node.output[0]))
        done += 1
    return done
