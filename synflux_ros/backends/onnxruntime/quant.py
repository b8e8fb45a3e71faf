"""Load-time rewrite of affine 4-bit weights into onnxruntime's ``com.microsoft.MatMulNBits``.

A weight carried over from a llama.cpp ``Q4_1`` tensor (``synflux-build --from-gguf F --weights int4``
or ``int8``, see :mod:`synflux_ros.buildtool.quantize`) is stored in standard ONNX as

    W = Reshape(Add(Reshape(DequantizeLinear(Wq [K, N] uint4, d [K/B, N], axis=0, block_size=B),
                            [K/B, B, N]), m [K/B, 1, N]), [K, N])        (W = d * q + m per block)

(``Wq`` uint8 holding 0..15 with ``--weights int8``; a uint8 chain with larger values is left as it is)

and read by ``MatMul(x, W)``. ONNX Runtime's optimiser fuses ``DequantizeLinear`` + ``MatMul`` only, so
this chain would dequantize the whole weight on every call. :func:`AffineWeights.rewrite` computes the
same product as

    MatMulNBits(x, q, d)  +  (x @ P) @ (m + 8 d)

``MatMulNBits`` without zero points computes ``x @ (d * (q - 8))``; ``P [K, K/B]`` sums ``x`` over each
block, so the second term adds ``sum over the block of x`` times ``m + 8 d`` per block and column: together
``x @ (d * q + m)``, up to float rounding. (MatMulNBits' float zero points, ``-m / d``, would express it in
one node, but ONNX Runtime runs them on a much slower path.) The graph file is not changed: the rewritten
model is handed to ONNX Runtime as bytes and the new tensors as shared initializers, made once per weight for
all graphs of the set.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

UINT8, UINT4, FLOAT = 2, 21, 1  # onnx.TensorProto data types


@dataclass
class _Chain:
    """One affine weight: the nodes computing it and its initializers."""
    output: str          # the weight the MatMuls read
    nodes: list          # DequantizeLinear, Reshape, Add, Reshape
    q: str
    scale: str
    minimum: str
    block: int
    k: int
    n: int
    bytes: bool = False  # the 4-bit values in UINT8 storage


def _find_chains(graph) -> list[_Chain]:
    inits = {t.name: t for t in graph.initializer}
    producer = {o: node for node in graph.node for o in node.output}
    chains = []
    for r2 in graph.node:
        if r2.op_type != "Reshape":
            continue
        add = producer.get(r2.input[0])
        if add is None or add.op_type != "Add" or add.input[1] not in inits:
            continue
        r1 = producer.get(add.input[0])
        if r1 is None or r1.op_type != "Reshape":
            continue
        dq = producer.get(r1.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or len(dq.input) != 2 or \
                not all(i in inits for i in dq.input):
            continue
        q = inits[dq.input[0]]
        attrs = {a.name: a.i for a in dq.attribute}
        if q.data_type not in (UINT4, UINT8) or len(q.dims) != 2 or attrs.get("axis", 1) != 0 or not attrs.get("block_size"):
            continue
        k, n = int(q.dims[0]), int(q.dims[1])
        chains.append(_Chain(r2.output[0], [dq, r1, add, r2], dq.input[0], dq.input[1], add.input[1],
                             int(attrs["block_size"]), k, n, q.data_type == UINT8))
    return chains


def unpack_uint4(raw: np.ndarray, count: int) -> np.ndarray:
    """ONNX UINT4 raw data (two values a byte, the first in the low nibble) -> uint8 values 0..15."""
    raw = np.asarray(raw, np.uint8).reshape(-1)
    out = np.empty(raw.size * 2, np.uint8)
    out[0::2] = raw & 0x0F
    out[1::2] = raw >> 4
    return out[:count]


def matmulnbits_tensors(q: np.ndarray, d: np.ndarray, m: np.ndarray, block: int):
    """``q [K, N]`` (0..15), ``d`` and ``m [K/B, N]`` -> MatMulNBits' ``B [N, K/B, B/2]`` uint8 and
    ``scales [N*K/B]`` (it computes ``d * (q - 8)``), and the block offsets ``m + 8 d`` [K/B, N]."""
    k, n = q.shape
    d = np.asarray(d, np.float32).reshape(k // block, n)
    m = np.asarray(m, np.float32).reshape(k // block, n)
    qt = np.ascontiguousarray(q.T).reshape(n, k // block, block)
    packed = (qt[..., 0::2] | (qt[..., 1::2] << 4)).astype(np.uint8)
    return packed, np.ascontiguousarray(d.T).reshape(-1), (m + np.float32(8) * d).astype(np.float32)


def block_sums(k: int, block: int) -> np.ndarray:
    """``P [K, K/B]``: ``x @ P`` sums ``x`` over each block of ``B`` consecutive values."""
    p = np.zeros((k, k // block), np.float32)
    p[np.arange(k), np.arange(k) // block] = 1.0
    return p


class AffineWeights:
    """The MatMulNBits tensors of each affine weight of a graph set, made once and shared by its graphs.

    ``read(tensor)`` returns the bytes of an external initializer (``graphset.ExternalTensor``) as a uint8
    array; ``make_value(array)`` wraps a numpy array for ``SessionOptions.add_initializer``; ``location``:
    the weights file beside the graphs, which the new initializers name (ONNX Runtime checks that it exists
    but reads nothing of it for an initializer it is handed)."""

    def __init__(self, read, make_value, location: str):
        self._location = location
        self._read = read
        self._make_value = make_value
        self._made: dict[tuple, tuple] = {}

    def _bytes(self, name: str, externals: dict, inits: dict) -> tuple[tuple, np.ndarray]:
        """(cache key, uint8 bytes) of an initializer: from the weights file, or held in the model."""
        t = externals.get(name)
        if t is not None:
            return (t.location, t.offset, t.length), self._read(t)
        data = np.frombuffer(inits[name].raw_data, np.uint8)
        return ("inline", hashlib.sha256(data.tobytes()).hexdigest()), data

    def rewrite(self, model, externals: dict, accuracy_level: int) -> dict:
        """Rewrite ``model`` (without its external data) in place; returns ``{initializer name: value}`` to
        add to the session. ``externals``: the model's external initializers by name."""
        from onnx import TensorProto, helper

        graph = model.graph
        chains = _find_chains(graph)
        if not chains:
            return {}
        inits = {t.name: t for t in graph.initializer}
        location = self._location
        consumers: dict[str, list] = {}
        for node in graph.node:
            for i, name in enumerate(node.input):
                consumers.setdefault(name, []).append((node, i))
        added: dict[str, object] = {}
        drop_nodes, drop_inits = [], set()
        for c in chains:
            uses = consumers.get(c.output, [])
            if not uses or not all(node.op_type == "MatMul" and i == 1 for node, i in uses):
                continue  # read by something other than a MatMul: left as it is
            raw = [self._bytes(x, externals, inits) for x in (c.q, c.scale, c.minimum)]
            key = tuple(k for k, _ in raw)
            made = self._made.get(key)
            if made is None:
                q = (raw[0][1][:c.k * c.n] if c.bytes else unpack_uint4(raw[0][1], c.k * c.n)).reshape(c.k, c.n)
                if c.bytes and int(q.max(initial=0)) > 15:
                    continue  # 8-bit values: not this affine 4-bit form, left for ORT as it is
                d, m = raw[1][1].view(np.float32), raw[2][1].view(np.float32)
                arrays = matmulnbits_tensors(q, d, m, c.block)
                made = self._made[key] = (arrays, [self._make_value(a) for a in arrays])
            arrays, values = made
            sums = ("block_sums", c.k, c.block)
            if sums not in self._made:
                p = block_sums(c.k, c.block)
                self._made[sums] = ((p,), [self._make_value(p)])
            names = [f"{c.output}/nbits_{s}" for s in ("B", "scales", "offsets")]
            p_name = f"block_sums_{c.k}_{c.block}"
            for name, array, value in zip([*names, p_name], [*arrays, *self._made[sums][0]],
                                          [*values, *self._made[sums][1]]):
                if name in added:
                    continue
                t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape)
                t.data_location = TensorProto.EXTERNAL  # supplied by add_initializer, never read from a file
                for k, v in (("location", location), ("offset", "0"), ("length", str(array.nbytes))):
                    entry = t.external_data.add()
                    entry.key, entry.value = k, v
                graph.initializer.append(t)
                added[name] = value
            for node, _ in uses:
                base = (node.name or c.output) + "/affine"
                x, out = node.input[0], node.output[0]
                new_nodes = [
                    helper.make_node("MatMulNBits", [x, names[0], names[1]], [base + "_q"], name=base + "_nbits",
                                     domain="com.microsoft", K=c.k, N=c.n, bits=4, block_size=c.block,
                                     accuracy_level=accuracy_level),
                    helper.make_node("MatMul", [x, p_name], [base + "_sums"], name=base + "_block_sums"),
                    helper.make_node("MatMul", [base + "_sums", names[2]], [base + "_m"], name=base + "_offsets"),
                    helper.make_node("Add", [base + "_q", base + "_m"], [out], name=base + "_add")]
                at = list(graph.node).index(node)
                graph.node.remove(node)
                for j, nn in enumerate(new_nodes):
                    graph.node.insert(at + j, nn)
            drop_nodes += c.nodes
            drop_inits |= {c.q, c.scale, c.minimum, *c.nodes[1].input[1:], *c.nodes[3].input[1:]}
        for node in drop_nodes:
            graph.node.remove(node)
        gone = {o for node in drop_nodes for o in node.output}
        for vi in [vi for vi in graph.value_info if vi.name in gone]:
            graph.value_info.remove(vi)
        still_read = {i for node in graph.node for i in node.input}
        for t in [t for t in graph.initializer if t.name in drop_inits and t.name not in still_read]:
            graph.initializer.remove(t)
        if added and not any(o.domain == "com.microsoft" for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
        return added
