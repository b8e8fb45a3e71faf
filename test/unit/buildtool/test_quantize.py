"""Weight-only quantized graph sets (synflux-build --weights int8|int4 --block B): the numpy quantizer,
the exported graphs (DequantizeLinear with block_size, opset 21, weights once), onnxruntime running them
(fused into MatMulNBits) and computing what the dequantized weights compute, greedy agreement with fp32,
and the backends that refuse them."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from synflux_ros.buildtool import export as build_tool  # noqa: E402
from synflux_ros.buildtool import quantize  # noqa: E402
from synflux_ros.graphset import reader as graphset, writer as graphset_writer  # noqa: E402
from synflux_ros.core.config import load_config  # noqa: E402
from synflux_ros.graphset.reader import GraphSetError  # noqa: E402
from synflux_ros.core.kv_cache import KVCachePool  # noqa: E402
from synflux_ros.model.backbone import LLMBackbone  # noqa: E402
from synflux_ros.runtimes.base import create_executor  # noqa: E402

VOCAB = 512
EXACT = {"matmulnbits_accuracy_level": 0}  # fp32 activations: the dequantized weights' result


def _yaml(tmp_path) -> str:
    import yaml
    raw = {"name": "quant", "mode": "vlm",
           "vision": {"resolution": [64, 64], "tile_size": [64, 64], "tokens_per_tile": 4},
           "llm": {"num_layers": 2, "hidden_dim": 128, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32,
                   "vocab_size": VOCAB, "prefill_buckets": [16], "decode_buckets": [64], "max_seq_len": 64},
           "text": {"max_new_tokens": 8}, "session": {"max_sessions": 1}}
    path = tmp_path / "quant.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """The same random model built in float32, int8 and int4 (block 32)."""
    cfg = _yaml(tmp_path_factory.mktemp("cfg"))
    out = {}
    for dtype in ("float32", "int8", "int4"):
        d = str(tmp_path_factory.mktemp(dtype))
        assert build_tool.main(["--config", cfg, "--out", d, "--weights", dtype, "--threads", "1"]) == 0
        out[dtype] = d
    out["yaml"] = cfg
    return out


def backbone(graph_dir: str, options: dict | None = None):
    cfg = load_config(os.path.join(graph_dir, "config.yaml"))
    opts = {**cfg.executor.options, "intra_op_num_threads": 1, **(options or {})}
    cfg = cfg.with_overrides(executor={"graph_dir": os.path.abspath(graph_dir), "options": opts})
    ex = create_executor(cfg)
    pool = KVCachePool(ex, 1, cfg.llm.kv_shape, cfg.llm.kv_dtype)
    ex.freeze()
    return ex, LLMBackbone(cfg, ex), pool.tensor(0)


def _model(graph_dir, name, data=True):
    return onnx.load(os.path.join(graph_dir, f"{name}.onnx"), load_external_data=data)


# ------------------------------------------------------------------------------------------------ numpy
@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("block", [32, 64, 128])
def test_round_trip_error_within_half_a_step_per_block(dtype, block):
    rng = np.random.default_rng(block)
    w = (rng.standard_normal((256, 96)) * rng.uniform(0.01, 3, (1, 96))).astype(np.float32)
    w[:block, 0] = 0.0  # an all-zero block
    q, scale = quantize.quantize_blocks(w, dtype, block)
    qmax = {"int8": 127, "int4": 7}[dtype]
    assert q.dtype == np.int8 and scale.shape == (256 // block, 96) and np.abs(q).max() <= qmax
    back = quantize.dequantize_blocks(q, scale, block)
    step = np.repeat(scale, block, axis=0)
    assert np.all(np.abs(back - w) <= step / 2 * (1 + 1e-5) + 1e-12)
    blockmax = np.repeat(np.abs(w).reshape(-1, block, 96).max(axis=1), block, axis=0)
    assert np.all(np.abs(back - w) <= blockmax / (2 * qmax) * (1 + 1e-5) + 1e-12)
    assert np.all(back[:block, 0] == 0)
    if dtype == "int4":
        assert np.array_equal(quantize.unpack_int4(quantize.pack_int4(q), q.size).reshape(q.shape), q)


def test_bad_dtype_or_block_is_refused(tmp_path, capsys):
    cfg = _yaml(tmp_path)
    assert build_tool.main(["--config", cfg, "--out", str(tmp_path / "x"), "--weights", "int4", "--block", "48"]) == 2
    assert "--block 48" in capsys.readouterr().err
    with pytest.raises(build_tool.BuildError,
                       match="--weights int8: --backend 'tensorrt' compiles float32 graph sets only"):
        build_tool.build(load_config(cfg), str(tmp_path / "y"), backend="tensorrt", weights="int8")


# ------------------------------------------------------------------------------------------------ export
def _quantized_names(graph):
    return {n.output[0]: n for n in graph.node if n.op_type == "DequantizeLinear"}


@pytest.mark.parametrize("dtype,bits", [("int8", 8), ("int4", 4)])
def test_exported_set_is_dequantizelinear_opset21_weights_once(sets, dtype, bits):
    d = sets[dtype]
    manifest = json.load(open(os.path.join(d, "manifest.json")))
    assert manifest["weights"]["dtype"] == dtype and manifest["weights"]["block"] == 32
    assert graphset.weight_format(manifest) == {"dtype": dtype, "block": 32}
    fp32 = _model(sets["float32"], "decode_64")
    fp32_inits = {t.name: t for t in fp32.graph.initializer}
    expected_saving = 0
    for name in ("prefill_16", "decode_64"):
        m = _model(d, name)
        assert next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) == 21
        dq = _quantized_names(m.graph)
        # 2 layers x (qkv, o, gate-up, down) + the head
        assert len(dq) == 9, sorted(dq)
        inits = {t.name: t for t in m.graph.initializer}
        for out, node in dq.items():
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attrs == {"axis": 0, "block_size": 32}
            assert out not in inits  # no fp32 copy of a quantized weight
            qt = inits[node.input[0]]
            assert qt.data_type == (onnx.TensorProto.INT8 if bits == 8 else onnx.TensorProto.INT4)
            consumers = [n.op_type for n in m.graph.node if out in n.input]
            assert consumers and set(consumers) == {"MatMul"}
            if name == "decode_64":
                k, n = qt.dims
                assert tuple(fp32_inits[out].dims) == (k, n)
                expected_saving += k * n * 4 - (k * n * bits // 8 + (k // 32) * n * 4)
        onnx.checker.check_model(m)
    # weights.bin: the fp32 set's, less the quantized weights' saving (alignment padding aside)
    got = os.path.getsize(os.path.join(d, "weights.bin"))
    want = os.path.getsize(os.path.join(sets["float32"], "weights.bin")) - expected_saving
    assert abs(got - want) <= 64 * 40, (got, want)
    # every graph refers to the one shared file; the decoder's quantized tensors are stored once
    assert manifest["weights"]["shared_tensors"] > 0


def test_unchanged_quantized_set_is_skipped_and_key_has_the_format(sets, capsys):
    d = sets["int4"]
    assert build_tool.main(["--config", sets["yaml"], "--out", d, "--weights", "int4", "--threads", "1"]) == 0
    assert "all graphs up to date" in capsys.readouterr().out
    keys = {w: {g["name"]: g["key"] for g in json.load(open(os.path.join(sets[w], "manifest.json")))["graphs"]}
            for w in ("float32", "int8", "int4")}
    assert keys["int8"]["vision_encoder"] == keys["int4"]["vision_encoder"] == keys["float32"]["vision_encoder"]
    assert len({keys[w]["decode_64"] for w in keys}) == 3


# ------------------------------------------------------------------------------------------------ onnxruntime
def _dequantized_copy(src: str, dst: str) -> str:
    """The quantized set ``src`` with every DequantizeLinear folded into fp32 weights."""
    shutil.copytree(src, dst)
    models = {}
    for entry in sorted(os.listdir(src)):
        if entry.endswith(".onnx"):
            m = onnx.load(os.path.join(src, entry), load_external_data=True)
            quantize.dequantize_model(m)
            models[entry[:-5]] = m
    info = graphset_writer.write_weights_and_models(models, dst)
    manifest = graphset.read_manifest(src)
    manifest["weights"] = {**info, "dtype": "float32"}
    graphset_writer.write_manifest(dst, manifest)
    return dst


def _run(graph_dir, ids, steps, options=None, forced=None):
    ex, llm, slot = backbone(graph_dir, options)
    try:
        logits = [llm.prefill(slot, 0, llm.embed(ids))]
        pos = len(ids)
        for i in range(steps):
            tok = int(np.argmax(logits[-1])) if forced is None else int(forced[i])
            logits.append(llm.decode(slot, pos, tok))
            pos += 1
        return np.stack(logits)
    finally:
        ex.close()


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_logits_equal_the_dequantized_weights(sets, dtype, tmp_path):
    ref_dir = _dequantized_copy(sets[dtype], str(tmp_path / "dq"))
    ids = np.random.default_rng(1).integers(0, VOCAB, 12)
    ref = _run(ref_dir, ids, 6)
    toks = ref[:-1].argmax(-1)[1:]  # drive both with the same tokens
    got = _run(sets[dtype], ids, 6, EXACT, forced=np.concatenate([[ref[0].argmax()], toks]))
    ref = _run(ref_dir, ids, 6, forced=np.concatenate([[ref[0].argmax()], toks]))
    scale = float(np.abs(ref).max())
    diff = float(np.abs(got - ref).max())
    assert diff <= 1e-4 * max(scale, 1.0), (diff, scale)


def test_greedy_int8_agrees_with_fp32(sets, capsys):
    ids = np.random.default_rng(3).integers(0, VOCAB, 12)
    steps = 32
    fp32 = _run(sets["float32"], ids, steps)
    fp_tokens = fp32.argmax(-1)
    int8 = _run(sets["int8"], ids, steps, forced=fp_tokens)  # teacher-forced on fp32's tokens
    agree = float(np.mean(int8.argmax(-1) == fp_tokens))
    free = _run(sets["int8"], ids, steps).argmax(-1)
    prefix = int(np.argmax(free != fp_tokens)) if np.any(free != fp_tokens) else len(free)
    int4 = _run(sets["int4"], ids, steps, forced=fp_tokens)
    agree4 = float(np.mean(int4.argmax(-1) == fp_tokens))
    with capsys.disabled():
        print(f"\n  int8 vs fp32 greedy: {agree:.0%} of {len(fp_tokens)} tokens agree (teacher-forced), "
              f"free-running identical for the first {prefix}; int4: {agree4:.0%} teacher-forced")
    assert agree >= 0.8


def test_quantized_sets_prepack_by_default(sets):
    """MatMulNBits is fast only from prepacked weights: a quantized set prepacks unless told otherwise."""
    ex, _, _ = backbone(sets["int4"])
    try:
        assert ex._prepack is True
    finally:
        ex.close()
    ex, _, _ = backbone(sets["float32"])
    try:
        assert ex._prepack is False
    finally:
        ex.close()


def test_onnxruntime_fuses_into_matmulnbits(sets, tmp_path):
    """ORT's optimiser turns every DequantizeLinear + MatMul into com.microsoft.MatMulNBits; the cached
    optimised set shows the graph ORT runs."""
    cache = str(tmp_path / "ort")
    for dtype, bits in (("int8", 8), ("int4", 4)):
        ex, llm, slot = backbone(sets[dtype], {"optimized_model_dir": cache, "matmulnbits_accuracy_level": 4})
        llm.decode(slot, 0, 1)
        ex.close()
        (sub,) = [os.path.join(cache, s) for s in os.listdir(cache) if sets[dtype] in
                  json.load(open(os.path.join(cache, s, "manifest.json")))["ort_optimized"]["source"]]
        m = onnx.load(os.path.join(sub, "decode_64.onnx"), load_external_data=False)
        ops = [n.op_type for n in m.graph.node]
        nbits = [n for n in m.graph.node if n.op_type == "MatMulNBits"]
        assert len(nbits) == 9 and "DequantizeLinear" not in ops, ops
        for n in nbits:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            assert attrs["bits"] == bits and attrs["block_size"] == 32 and attrs["accuracy_level"] == 4


def test_other_backends_refuse_a_quantized_set(sets):
    d = sets["int4"]
    metas = graphset.graph_metas(d, graphset.read_manifest(d))
    from synflux_ros.core.executor import Executor
    with pytest.raises(GraphSetError, match=r"int4 weights .*runs float32 graph sets only"):
        graphset.check_weight_format(d, "openvino")
    graphset.check_weight_format(sets["float32"], "openvino")  # fp32 passes
    assert Executor.weight_dtypes == ("float32",)
    from synflux_ros.backends.qnn.executor import QNNExecutor
    assert QNNExecutor.weight_dtypes == ("float32",)
    try:
        from synflux_ros.backends.openvino.executor import OpenVINOExecutor
        ex = OpenVINOExecutor(metas, d, {})
    except Exception:  # openvino not installed here
        return
    with pytest.raises(GraphSetError, match="openvino backend: .* int4 weights"):
        ex.load()
