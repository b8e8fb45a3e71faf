"""synflux-build --from-gguf F --weights int4|int8: the file's Q4_0 / Q4_1 / Q8_0 blocks are carried into the
graphs exactly (no second quantization), and the onnxruntime executor runs the affine Q4_1 weights as
MatMulNBits. Tiny GGUF files are written with gguf.GGUFWriter (see test_gguf_import.py)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("torch")
pytest.importorskip("transformers")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from synflux_ros.backends.onnxruntime import quant as ort_quant  # noqa: E402
from synflux_ros.buildtool import export as build_tool  # noqa: E402
from synflux_ros.buildtool import gguf_import, quantize  # noqa: E402
from synflux_ros.graphset import reader as graphset  # noqa: E402
from synflux_ros.core.config import load_config  # noqa: E402
from synflux_ros.core.kv_cache import KVCachePool  # noqa: E402
from synflux_ros.model.backbone import LLMBackbone  # noqa: E402
from synflux_ros.runtimes.base import create_executor  # noqa: E402

from gguf_files import base_yaml, write_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
# Layer 0 all carried types; layer 1 mixes Q4_0 and Q4_1 inside the fused QKV (quantized again) and has
# a type that is not carried (Q5_0); the tied embedding (the LM head) is Q8_0.
TYPES = {"token_embd.weight": Q.Q8_0,
         "blk.0.attn_q.weight": Q.Q4_1, "blk.0.attn_k.weight": Q.Q4_1, "blk.0.attn_v.weight": Q.Q4_1,
         "blk.0.attn_output.weight": Q.Q4_0, "blk.0.ffn_gate.weight": Q.Q4_1, "blk.0.ffn_up.weight": Q.Q4_1,
         "blk.0.ffn_down.weight": Q.Q8_0,
         "blk.1.attn_q.weight": Q.Q4_0, "blk.1.attn_k.weight": Q.Q4_1, "blk.1.attn_v.weight": Q.Q4_0,
         "blk.1.attn_output.weight": Q.Q4_1, "blk.1.ffn_gate.weight": Q.Q5_0, "blk.1.ffn_up.weight": Q.Q5_0,
         "blk.1.ffn_down.weight": Q.Q4_0}
# Every decoder weight of a carried type, Q/K/V and gate/up of one type each: the whole int4 set is exact.
ALL_CARRIED = {**TYPES, "blk.1.attn_k.weight": Q.Q4_0, "blk.1.ffn_gate.weight": Q.Q4_1,
               "blk.1.ffn_up.weight": Q.Q4_1}
EXACT = {"matmulnbits_accuracy_level": 0}


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    d = tmp_path_factory.mktemp("carry")
    path = write_gguf(d / "tiny.gguf", "llama", seed=5, types=TYPES, tied=True)
    out = {}
    for weights in ("float32", "int4", "int8"):
        out[weights] = str(d / weights)
        args = ["--config", base_yaml(d), "--out", out[weights], "--from-gguf", path]
        if weights != "float32":
            args += ["--weights", weights, "--block", "32"]
        assert build_tool.main(args) == 0
    exact = write_gguf(d / "exact.gguf", "llama", seed=6, types=ALL_CARRIED, tied=True)
    for weights in ("float32", "int4", "int8"):
        out[f"exact_{weights}"] = str(d / f"exact_{weights}")
        args = ["--config", base_yaml(d), "--out", out[f"exact_{weights}"], "--from-gguf", exact]
        assert build_tool.main(args + (["--weights", weights] if weights != "float32" else [])) == 0
    out["gguf"] = path
    return out


def _logits(graph_dir, ids, steps, options=None):
    cfg = load_config(os.path.join(graph_dir, "config.yaml"))
    if options:
        cfg = cfg.with_overrides(executor={"options": options})
    ex = create_executor(cfg)
    pool = KVCachePool(ex, 1, cfg.llm.kv_shape, cfg.llm.kv_dtype)
    ex.freeze()
    llm, slot = LLMBackbone(cfg, ex), pool.tensor(0)
    try:
        out = [llm.prefill(slot, 0, llm.embed(ids))]
        for i in range(steps):
            out.append(llm.decode(slot, len(ids) + i, int(ids[i % len(ids)])))
        return np.stack(out)
    finally:
        ex.close()


def test_blocks_dequantize_bitwise_as_llama_cpp(tmp_path):
    rng = np.random.default_rng(0)
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        data = (rng.standard_normal((6, 96)) * 0.1).astype(np.float32)
        data[2, :32] = 0.25  # a block of one value (Q4_1: scale 0)
        raw = gguf.quants.quantize(data, qtype)
        blocks = gguf_import.ggml_blocks(raw, qtype.name, 6, 96)
        want = gguf.quants.dequantize(raw, qtype).reshape(6, 96)
        got = quantize.GGMLBlocks.dequantize(blocks, qtype.name)
        assert got.dtype == np.float32 and np.array_equal(got, want), qtype.name
        assert blocks["d"].shape == (6, 3) and ("m" in blocks) == (qtype == Q.Q4_1)


def test_the_files_blocks_are_carried_over(sets):
    """Every weight whose columns are rows of one carried type keeps the file's integers and scales; the
    others are quantized again. The manifest says how many of each."""
    int4 = graphset.read_manifest(sets["int4"])["weights"]
    int8 = graphset.read_manifest(sets["int8"])["weights"]
    # int4: layer 0 qkv/gate-up (Q4_1), o (Q4_0), down (Q8_0 as int8); layer 1 o (Q4_1), down (Q4_0); the
    # head (Q8_0); layer 1's mixed QKV and Q5_0 gate-up are quantized again
    assert int4["scheme"] == "symmetric+ggml" and int4["ggml_carried"] == {"Q4_0": 2, "Q4_1": 3, "Q8_0": 2}
    # int8 holds them all too: Q4_1's 4-bit values in 8-bit storage, with the minima added
    assert int8["ggml_carried"] == {"Q4_0": 2, "Q4_1": 3, "Q8_0": 2}
    m = onnx.load(os.path.join(sets["int4"], "decode_64.onnx"), load_external_data=False)
    inits = {t.name: t.data_type for t in m.graph.initializer}
    kinds = sorted(inits[n.input[0]] for n in m.graph.node if n.op_type == "DequantizeLinear")
    P = onnx.TensorProto
    assert kinds.count(P.UINT4) == 3 and kinds.count(P.INT8) == 2 and kinds.count(P.INT4) == 4, kinds
    assert sum(n.op_type == "Add" and n.name.endswith("_add_min") for n in m.graph.node) == 3
    m8 = onnx.load(os.path.join(sets["int8"], "decode_64.onnx"), load_external_data=False)
    inits8 = {t.name: t for t in m8.graph.initializer}
    kinds8 = sorted(inits8[n.input[0]].data_type for n in m8.graph.node if n.op_type == "DequantizeLinear")
    assert kinds8.count(P.UINT8) == 3 and kinds8.count(P.INT8) == 6, kinds8


def test_dequantized_graphs_hold_the_files_values_bitwise(sets, tmp_path):
    """Replacing every DequantizeLinear of a carried int4 graph by its float result gives, for the carried
    weights, bitwise the float32 graph set's weights (the file's dequantized values)."""
    import onnx.numpy_helper as nh
    from onnx.reference import ReferenceEvaluator

    fp = onnx.load(os.path.join(sets["float32"], "decode_64.onnx"))
    q = onnx.load(os.path.join(sets["int4"], "decode_64.onnx"))
    quantize.dequantize_model(q)
    fp_w = {t.name: nh.to_array(t) for t in fp.graph.initializer if len(t.dims) == 2}
    q_inits = {t.name: nh.to_array(t) for t in q.graph.initializer}
    # the affine ones: the float result of Reshape(Add(Reshape(dq), m)) computed by the ONNX reference
    same = 0
    for node in q.graph.node:
        if node.op_type == "Reshape" and node.name.endswith("_from_blocks"):
            add = next(n for n in q.graph.node if n.output[0] == node.input[0])
            r1 = next(n for n in q.graph.node if n.output[0] == add.input[0])
            sub = onnx.helper.make_graph(
                [r1, add, node], "w", [], [onnx.helper.make_tensor_value_info(node.output[0], 1, None)],
                [onnx.numpy_helper.from_array(q_inits[x], x) for x in (r1.input[0], r1.input[1], add.input[1],
                                                                      node.input[1])])
            w = ReferenceEvaluator(onnx.helper.make_model(sub)).run(None, {})[0]
            assert np.array_equal(w, fp_w[node.output[0]]), node.output[0]
            same += 1
    assert same == 3


def test_carried_int4_logits_equal_fp32(sets):
    """Through the onnxruntime executor (MatMulNBits at accuracy level 0: float activations) an int4 set all
    of whose weights were carried computes what the float32 set of the same file computes; with ORT's
    default accuracy level (activations quantized to int8 per block) it stays close."""
    assert graphset.read_manifest(sets["exact_int4"])["weights"]["ggml_carried"] == {"Q4_0": 3, "Q4_1": 4,
                                                                                   "Q8_0": 2}
    ids = np.random.default_rng(2).integers(0, 300, 10)
    fp = _logits(sets["exact_float32"], ids, 5)
    scale = float(np.abs(fp).max())
    assert scale > 1e-2
    exact = float(np.abs(_logits(sets["exact_int4"], ids, 5, EXACT) - fp).max())
    assert exact <= 1e-4 * max(scale, 1.0), (exact, scale)
    # int8 holds the same blocks (Q4_0 as int8, Q4_1 as 4-bit values in uint8): the same logits
    assert graphset.read_manifest(sets["exact_int8"])["weights"]["ggml_carried"] == {"Q4_0": 3, "Q4_1": 4,
                                                                                   "Q8_0": 2}
    exact8 = float(np.abs(_logits(sets["exact_int8"], ids, 5, EXACT) - fp).max())
    assert exact8 <= 1e-4 * max(scale, 1.0), (exact8, scale)
    default = float(np.abs(_logits(sets["exact_int4"], ids, 5) - fp).max())
    assert default <= 0.05 * scale, (default, scale)


def test_affine_rewrite_equals_the_float_product():
    """ort_quant turns MatMul(x, d*q + m) into MatMulNBits(x, q, d) + (x @ P) @ (m + 8d): equal to the float
    product, including a block whose scale is 0."""
    rng = np.random.default_rng(1)
    K, N, B = 96, 40, 32
    q = rng.integers(0, 16, (K, N)).astype(np.uint8)
    d = rng.uniform(1e-3, 2e-2, (K // B, N)).astype(np.float32)
    d[1, 3] = 0.0
    m = rng.uniform(-0.1, 0.0, (K // B, N)).astype(np.float32)
    w = (d[:, None, :] * q.reshape(K // B, B, N).astype(np.float32) + m[:, None, :]).reshape(K, N)
    packed, scales, offsets = ort_quant.matmulnbits_tensors(q, d, m, B)
    p = ort_quant.block_sums(K, B)
    x = rng.standard_normal((3, K)).astype(np.float32)
    H = onnx.helper
    nodes = [H.make_node("MatMulNBits", ["x", "B", "s"], ["a"], domain="com.microsoft", K=K, N=N, bits=4,
                         block_size=B, accuracy_level=0),
             H.make_node("MatMul", ["x", "P"], ["xs"]), H.make_node("MatMul", ["xs", "o"], ["b"]),
             H.make_node("Add", ["a", "b"], ["y"])]
    g = H.make_graph(nodes, "g", [H.make_tensor_value_info("x", 1, [3, K])], [H.make_tensor_value_info("y", 1, None)],
                     [onnx.numpy_helper.from_array(a, n) for a, n in ((packed, "B"), (scales, "s"), (p, "P"),
                                                                      (offsets, "o"))])
    model = H.make_model(g, opset_imports=[H.make_opsetid("", 21), H.make_opsetid("com.microsoft", 1)])
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x @ w, atol=2e-6)


def test_the_executor_runs_affine_weights_as_matmulnbits(sets, tmp_path):
    """The optimised set ORT saves shows the graph it runs: every affine chain is gone (one MatMulNBits per
    carried Q4_1 weight), the graph file is unchanged, and the tensors made for them are shared by the
    bucket graphs."""
    cache = str(tmp_path / "ort")
    cfg = load_config(os.path.join(sets["int4"], "config.yaml"))
    before = os.stat(os.path.join(sets["int4"], "decode_64.onnx")).st_mtime_ns
    ex = create_executor(cfg.with_overrides(executor={"options": {"optimized_model_dir": cache}}))
    ex.close()
    for weights in ("int4", "int8"):  # int8: the same 4-bit values in uint8 storage
        ex = create_executor(load_config(os.path.join(sets[weights], "config.yaml")))
        try:
            made = ex._affine._made
            assert len([k for k in made if k[0] != "block_sums"]) == 3  # 3 affine weights, for all graphs at once
        finally:
            ex.close()
    (sub,) = os.listdir(cache)
    m = onnx.load(os.path.join(cache, sub, "decode_64.onnx"), load_external_data=False)
    ops = [n.op_type for n in m.graph.node]
    assert "DequantizeLinear" not in ops and not any(n.name.endswith("_add_min") for n in m.graph.node), ops
    assert sum(n.name.endswith("/affine_nbits") for n in m.graph.node) == 3
    assert os.stat(os.path.join(sets["int4"], "decode_64.onnx")).st_mtime_ns == before
    assert json.load(open(os.path.join(sets["int4"], "manifest.json")))["weights"]["dtype"] == "int4"


def test_fused_kernels_keep_the_carried_weights(sets):
    """The fusions option (ort_fusions) rewrites the carried int4 graphs too: the fused set keeps the
    weight format (so the affine Q4_1 weights are still rewritten to MatMulNBits at load) and computes what
    the float32 set computes."""
    pytest.importorskip("onnxscript")
    ids = np.random.default_rng(2).integers(0, 300, 10)
    fp = _logits(sets["exact_float32"], ids, 5)
    cfg = load_config(os.path.join(sets["exact_int4"], "config.yaml"))
    ex = create_executor(cfg.with_overrides(executor={"options": {"fusions": True, **EXACT}}))
    try:
        assert ex._from_cache and "ort_fused" in ex._load_dir
        assert graphset.weight_format(ex._manifest)["ggml_carried"] == {"Q4_0": 3, "Q4_1": 4, "Q8_0": 2}
        assert len([k for k in ex._affine._made if k[0] != "block_sums"]) == 4
        fused = onnx.load(os.path.join(ex._load_dir, "decode_64.onnx"), load_external_data=False)
        assert any(n.op_type == "GroupQueryAttention" for n in fused.graph.node)
    finally:
        ex.close()
    got = _logits(sets["exact_int4"], ids, 5, {"fusions": True, **EXACT})
    scale = float(np.abs(fp).max())
    assert float(np.abs(got - fp).max()) <= 1e-4 * max(scale, 1.0)


def all_carried(arch: str, layers: int) -> dict:
    """Every matrix of a tiny ``arch`` file in a carried type, each fused group (q/k/v, gate/up) in one."""
    groups = ([("attn_qkv",), ("attn_output",), ("ffn_up",), ("ffn_down",)] if arch == "phi3" else
              [("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",)])
    kinds = (Q.Q4_0, Q.Q4_1, Q.Q8_0)
    types = {"token_embd.weight": Q.Q8_0}
    for i in range(layers):
        for j, group in enumerate(groups):
            types.update({f"blk.{i}.{name}.weight": kinds[(i + j) % 3] for name in group})
    return types


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "gemma3", "phi3"])
def test_int4_and_int8_sets_of_each_family_compute_what_its_float32_set_does(tmp_path, arch):
    """Each family's own tensors (Qwen2's q/k/v biases, Gemma's sandwich and q/k norms, stored as 1 + w) stay
    float32 beside the carried blocks of its matrices, Phi-3's fused q/k/v and gate/up blocks are found in the
    split projections: the int4 and int8 sets of a file whose matrices are all Q4_0 / Q4_1 / Q8_0 give the
    float32 set's logits (accuracy level 0), every matrix carried."""
    layers = 2  # of each family (Gemma 3's sixth, global, layer is test_gguf_import's concern, not the blocks')
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, seed=7, types=all_carried(arch, layers), tied=True,
                      layers=layers)
    sets = {}
    for weights in ("float32", "int4", "int8"):
        sets[weights] = str(tmp_path / weights)
        args = ["--config", base_yaml(tmp_path), "--out", sets[weights], "--from-gguf", path]
        assert build_tool.main(args + (["--weights", weights] if weights != "float32" else [])) == 0
    assert load_config(os.path.join(sets["int4"], "config.yaml")).llm.architecture == \
        {"phi3": "llama"}.get(arch, arch)  # Phi-3 runs as Llama's decoder
    ids = np.random.default_rng(3).integers(0, 300, 10)
    fp = _logits(sets["float32"], ids, 5)
    scale = float(np.abs(fp).max())
    for weights in ("int4", "int8"):
        info = graphset.read_manifest(sets[weights])["weights"]
        assert info["ggml_carried"], weights
        diff = float(np.abs(_logits(sets[weights], ids, 5, EXACT) - fp).max())
        assert diff <= 1e-4 * max(scale, 1.0), (weights, diff, scale)
