"""The qnn executor's load-time rewrite (``backends/qnn/weights.py``): a weight read by products in two roles gets
a private transposed copy for the later role, the graph computes the same, and after onnxruntime's basic
optimisations (what the QNN provider is given) no weight is read in two roles."""
from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from synflux_ros.backends.qnn.weights import private_weights  # noqa: E402


def two_role_graph():
    """Forward x @ W (W [8, 16]) and Gemm(x, V, transB) (V [16, 8]); backward W @ dᵀ and d @ V: each weight in two
    roles, as in the vjp guidance's graph; U [16, 16] is read twice in one role."""
    rng = np.random.default_rng(0)
    w, v, u = (rng.standard_normal(s).astype(np.float32) for s in ((8, 16), (16, 8), (16, 16)))
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="fwd_w"),
        helper.make_node("Gemm", ["x", "V"], ["g"], name="fwd_v", transB=1),
        helper.make_node("MatMul", ["h", "U"], ["h2"], name="fwd_u1"),
        helper.make_node("MatMul", ["h2", "U"], ["h3"], name="fwd_u2"),
        helper.make_node("Transpose", ["h3"], ["h3t"], perm=[1, 0]),
        helper.make_node("MatMul", ["W", "h3t"], ["bw_t"], name="bwd_w"),
        helper.make_node("Transpose", ["bw_t"], ["bw"], perm=[1, 0]),
        helper.make_node("MatMul", ["g", "V"], ["bv"], name="bwd_v"),
        helper.make_node("Add", ["bw", "bv"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "two_roles", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 8])],
                              [numpy_helper.from_array(a, n) for a, n in ((w, "W"), (v, "V"), (u, "U"))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def roles(model) -> dict[str, set]:
    weights = {t.name for t in model.graph.initializer if len(t.dims) == 2}
    out: dict[str, set] = {}
    for n in model.graph.node:
        if n.op_type in ("MatMul", "Gemm", "FusedMatMul"):
            for i, name in enumerate(n.input[:2]):
                if name in weights:
                    trans = tuple(a.i for a in n.attribute if a.name in ("transA", "transB"))
                    out.setdefault(name, set()).add((n.op_type, i, trans))
    return out


def test_later_roles_read_a_private_copy_and_the_graph_computes_the_same(tmp_path):
    model = two_role_graph()
    x = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert {k: len(r) for k, r in roles(model).items()} == {"W": 2, "V": 2, "U": 1}

    assert private_weights(model) == ["bwd_w", "bwd_v"]  # U, read twice in one role, is shared as it is
    assert private_weights(model) == []  # rewritten once: each weight now has one role
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = str(tmp_path / "basic.onnx")
    got = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    optimized = onnx.load(str(tmp_path / "basic.onnx"))
    assert all(len(r) == 1 for r in roles(optimized).values()), roles(optimized)
    copies = {t.name: numpy_helper.to_array(t) for t in optimized.graph.initializer if "private_weight" in t.name}
    originals = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert sorted(copies) == ["bwd_v/private_weight", "bwd_w/private_weight"]
    np.testing.assert_array_equal(copies["bwd_w/private_weight"], originals["W"].T)
    np.testing.assert_array_equal(copies["bwd_v/private_weight"], originals["V"].T)

