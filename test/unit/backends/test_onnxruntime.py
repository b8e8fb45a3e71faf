"""ONNX Runtime backend over hand-built graph sets: numerics, in-place IO binding, load-time contract
checks, weights stored and held once."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from synflux_ros.backends import BackendUnavailableError, build_executor, resolve_executor_class  # noqa: E402
from synflux_ros.core.contract import GraphMeta, TensorSpec
from synflux_ros.core.executor import ShapeError  # noqa: E402
from synflux_ros.core.memory import PoolFrozenError  # noqa: E402
from synflux_ros.graphset import reader as graphset, writer as graphset_writer  # noqa: E402

REPO = Path(__file__).resolve().parents[3]

# Tiny "LLM": hidden H = L*2*KV*Dh so one matrix maps a token to all of its new KV entries.
L, KV, DH, S, V = 1, 2, 16, 32, 96
H = L * 2 * KV * DH
BUCKETS = (4, 8)
_ONNX_TYPE = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    return {"w_lm": rng.standard_normal((H, V)).astype(np.float32) * 0.1,
            "w_kv": rng.standard_normal((H, H)).astype(np.float32) * 0.1,
            "b_lm": rng.standard_normal(V).astype(np.float32)}  # 384 bytes: stays inline


def prefill_meta(p, kv_dtype="float32", vocab=V):
    kv = TensorSpec("past_kv", (L, 2, KV, S, DH), kv_dtype, resident=True)
    return GraphMeta(f"prefill_{p}", "prefill",
                     (TensorSpec("inputs_embeds", (1, p, H), "float32"), TensorSpec("num_tokens", (1,), "int64"),
                      TensorSpec("cache_position", (1,), "int64"), kv),
                     (TensorSpec("logits", (1, vocab), "float32"),
                      TensorSpec("new_kv", (L, 2, KV, p, DH), kv_dtype)),
                     group="prefill", file=f"prefill_{p}.onnx", attrs={"bucket": p})


def prefill_model(p, w, kv_dtype="float32"):
    kvt = _ONNX_TYPE[kv_dtype]
    nodes = [
        helper.make_node("ReduceSum", ["inputs_embeds", "axis1"], ["pooled"], keepdims=0),
        helper.make_node("MatMul", ["pooled", "w_lm"], ["lw"]),
        helper.make_node("Cast", ["past_kv"], ["pkf"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["pkf"], ["psum"], keepdims=0),
        helper.make_node("Add", ["num_tokens", "cache_position"], ["npos"]),
        helper.make_node("Cast", ["npos"], ["nposf"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["lw", "psum"], ["t1"]),
        helper.make_node("Add", ["t1", "nposf"], ["t2"]),
        helper.make_node("Add", ["t2", "b_lm"], ["logits"]),
        helper.make_node("MatMul", ["inputs_embeds", "w_kv"], ["kvflat"]),
        helper.make_node("Reshape", ["kvflat", "kvshape"], ["kv5"]),
        helper.make_node("Transpose", ["kv5"], ["kvt"], perm=[1, 2, 3, 0, 4]),
        helper.make_node("Cast", ["kvt"], ["new_kv"], to=kvt),
    ]
    inits = [numpy_helper.from_array(w["w_lm"], "w_lm"), numpy_helper.from_array(w["w_kv"], "w_kv"),
             numpy_helper.from_array(w["b_lm"], "b_lm"), numpy_helper.from_array(np.array([1], np.int64), "axis1"),
             numpy_helper.from_array(np.array([p, L, 2, KV, DH], np.int64), "kvshape")]
    graph = helper.make_graph(
        nodes, f"prefill_{p}",
        [helper.make_tensor_value_info("inputs_embeds", TensorProto.FLOAT, [1, p, H]),
         helper.make_tensor_value_info("num_tokens", TensorProto.INT64, [1]),
         helper.make_tensor_value_info("cache_position", TensorProto.INT64, [1]),
         helper.make_tensor_value_info("past_kv", kvt, [L, 2, KV, S, DH])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, V]),
         helper.make_tensor_value_info("new_kv", kvt, [L, 2, KV, p, DH])],
        inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def reference(w, x, num_tokens, cache_position, past_kv):
    p = x.shape[1]
    logits = x.sum(axis=1) @ w["w_lm"] + past_kv.astype(np.float32).sum() + float(num_tokens + cache_position)
    logits = logits + w["b_lm"]
    new_kv = (x[0] @ w["w_kv"]).reshape(p, L, 2, KV, DH).transpose(1, 2, 3, 0, 4).astype(past_kv.dtype)
    return logits.astype(np.float32), new_kv


def write_graph_set(out, kv_dtype="float32", buckets=BUCKETS, seed=0):
    w = _weights(seed)
    models = {f"prefill_{p}": prefill_model(p, w, kv_dtype) for p in buckets}
    info = graphset_writer.write_weights_and_models(models, str(out))
    metas = [prefill_meta(p, kv_dtype) for p in buckets]
    graphset_writer.write_manifest(str(out), metas, info, model="tiny", config_hash="x")
    return metas, w, info


@pytest.fixture(scope="module")
def gset(tmp_path_factory):
    out = tmp_path_factory.mktemp("graphs")
    metas, w, info = write_graph_set(out)
    return out, metas, w, info


def loaded(graph_dir, metas, **options):
    ex = build_executor("onnxruntime", metas, str(graph_dir), options).load()
    kv = ex.alloc_tensor("kv0", (L, 2, KV, S, DH), metas[0].input("past_kv").dtype)
    ex.freeze()
    return ex, kv


def feeds(p, n, cp, kv, seed=1):
    x = np.random.default_rng(seed).standard_normal((1, p, H)).astype(np.float32)
    return {"inputs_embeds": x, "num_tokens": np.array([n], np.int64), "cache_position": np.array([cp], np.int64),
            "past_kv": kv}


# ------------------------------------------------------------------------------------------ running
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_loads_through_the_registry_and_matches_numpy(tmp_path, kv_dtype):
    metas, w, _ = write_graph_set(tmp_path, kv_dtype)
    ex, kv = loaded(tmp_path, metas)
    assert type(ex).__name__ == "OnnxRuntimeExecutor" and ex.name == "onnxruntime"
    past = np.random.default_rng(3).standard_normal(kv.shape).astype(kv_dtype)
    ex.write(kv, (slice(None),), past)
    for p in BUCKETS:
        f = feeds(p, p - 1, 5, kv, seed=p)
        out = ex.run(f"prefill_{p}", f)
        ref_logits, ref_kv = reference(w, f["inputs_embeds"], p - 1, 5, past)
        tol = 1e-5 if kv_dtype == "float32" else 2e-3
        np.testing.assert_allclose(out["logits"], ref_logits, rtol=tol, atol=tol * 10)
        np.testing.assert_allclose(out["new_kv"].astype(np.float32), ref_kv.astype(np.float32), rtol=tol, atol=tol)
        assert out["new_kv"].dtype == np.dtype(kv_dtype)
    # both buckets use the one copy of the two large matrices; the small bias stays in the graph
    assert ex.shared_initializers("prefill_4") == ex.shared_initializers("prefill_8") == 2
    ex.close()


def test_outputs_land_in_the_bound_buffers(gset):
    out_dir, metas, w, _ = gset
    ex, kv = loaded(out_dir, metas)
    for p in BUCKETS:
        res = ex.run(f"prefill_{p}", feeds(p, 2, 0, kv))
        g = ex._handles[f"prefill_{p}"]
        assert g.verified
        values = g.binding.get_outputs()
        for spec, value in zip(ex.graphs[f"prefill_{p}"].outputs, values):
            staging = ex._staging[("prefill", spec.name)]
            assert value.data_ptr() == staging.ptr
            np.testing.assert_array_equal(ex._d2h(staging, spec.shape, spec.dtype), res[spec.name])
    # the two buckets share the group's staging buffers (sized by the larger one)
    assert ex._handles["prefill_4"].bound["inputs_embeds"] == ex._handles["prefill_8"].bound["inputs_embeds"]
    ex.close()


def test_resident_kv_slot_is_bound_in_place(gset):
    out_dir, metas, w, _ = gset
    ex, kv = loaded(out_dir, metas)
    f = feeds(4, 4, 0, kv)
    before = ex.run("prefill_4", f)["logits"]
    assert ex._handles["prefill_4"].bound["past_kv"] == kv.handle.ptr  # the slot itself, no staging copy
    ex.write(kv, (0, 1, 0, slice(0, 3)), np.full((3, DH), 0.5, np.float32))  # 24 entries of 0.5
    after = ex.run("prefill_4", f)["logits"]
    np.testing.assert_allclose(after - before, np.full_like(before, 24.0), rtol=1e-5)
    np.testing.assert_array_equal(ex.read(kv)[0, 1, 0, :3], 0.5)
    ex.close()


def test_steady_state_allocates_nothing(gset):
    out_dir, metas, w, _ = gset
    ex, kv = loaded(out_dir, metas)
    kv2 = None
    with pytest.raises(PoolFrozenError):
        kv2 = ex.alloc_tensor("kv1", kv.shape, kv.dtype)
    assert kv2 is None
    n_alloc, nbytes = ex.pool.num_allocations, ex.device_bytes
    bound = {}
    for i in range(20):
        p = BUCKETS[i % 2]
        ex.run(f"prefill_{p}", feeds(p, 1 + i % p, i, kv, seed=i))
        if i >= 2:
            assert {n: dict(ex._handles[n].bound) for n in ex.graphs} == bound  # no rebinding either
        bound = {n: dict(ex._handles[n].bound) for n in ex.graphs}
    assert (ex.pool.num_allocations, ex.device_bytes) == (n_alloc, nbytes)
    ex.close()


def test_a_second_kv_slot_is_rebound(tmp_path):
    metas, w, _ = write_graph_set(tmp_path)
    ex = build_executor("onnxruntime", metas, str(tmp_path)).load()
    a = ex.alloc_tensor("a", (L, 2, KV, S, DH), "float32")
    b = ex.alloc_tensor("b", (L, 2, KV, S, DH), "float32")
    ex.freeze()
    ex.write(b, (slice(None),), np.ones(b.shape, np.float32))
    f = feeds(4, 4, 0, a)
    la = ex.run("prefill_4", f)["logits"]
    lb = ex.run("prefill_4", {**f, "past_kv": b})["logits"]
    np.testing.assert_allclose(lb - la, np.full_like(la, float(np.prod(b.shape))), rtol=1e-5)
    assert ex._handles["prefill_4"].bound["past_kv"] == b.handle.ptr
    ex.close()


# ------------------------------------------------------------------------------------------ load errors
def test_a_graph_set_for_other_shapes_fails_at_load(gset):
    out_dir, metas, w, _ = gset
    wrong = [prefill_meta(4, vocab=V + 4), metas[1]]
    ex = build_executor("onnxruntime", wrong, str(out_dir))
    with pytest.raises(ShapeError, match=r"prefill_4.*output 'logits'.*float32\[1, 96\].*float32\[1, 100\]"
                                         r".*synflux-build"):
        ex.load()
    assert not ex.loaded
    half = [prefill_meta(4, kv_dtype="float16"), metas[1]]
    with pytest.raises(ShapeError, match=r"prefill_4.*input 'past_kv'.*float32.*float16"):
        build_executor("onnxruntime", half, str(out_dir)).load()
    m = metas[0]
    renamed = GraphMeta(m.name, m.kind, m.inputs[:-1] + (TensorSpec("kv", m.inputs[-1].shape, "float32", True),),
                        m.outputs, m.group, m.file)
    with pytest.raises(ShapeError, match=r"prefill_4.*missing \['kv'\], unexpected \['past_kv'\]"):
        build_executor("onnxruntime", [renamed], str(out_dir)).load()


def test_missing_files_name_the_path_and_the_build_command(tmp_path, gset):
    _, metas, _, _ = gset
    with pytest.raises(graphset.GraphSetNotFoundError, match=r"manifest\.json not found.*synflux-build --config"):
        build_executor("onnxruntime", metas, str(tmp_path)).load()
    with pytest.raises(graphset.GraphSetNotFoundError, match=r"does not exist.*synflux-build"):
        build_executor("onnxruntime", metas, str(tmp_path / "nope")).load()
    with pytest.raises(graphset.GraphSetNotFoundError, match=r"graph_dir is empty.*synflux-build"):
        build_executor("onnxruntime", metas, "").load()
    write_graph_set(tmp_path)
    os.remove(tmp_path / "prefill_8.onnx")
    with pytest.raises(FileNotFoundError, match=r"prefill_8.*prefill_8\.onnx not found.*synflux-build --config"):
        build_executor("onnxruntime", metas, str(tmp_path)).load()
    os.remove(tmp_path / "weights.bin")
    with pytest.raises(FileNotFoundError, match=r"weights\.bin.*not found"):
        build_executor("onnxruntime", metas, str(tmp_path)).load()


def test_bad_manifest_and_options(tmp_path, gset):
    out_dir, metas, _, _ = gset
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other/9", "graphs": []}))
    with pytest.raises(graphset.GraphSetError, match=r"format 'other/9'.*synflux-build"):
        build_executor("onnxruntime", metas, str(tmp_path)).load()
    with pytest.raises(ValueError, match=r"'NoSuchExecutionProvider' is not available.*available: .*CPU"):
        build_executor("onnxruntime", metas, str(out_dir), {"providers": ["NoSuchExecutionProvider"]})
    with pytest.raises(ValueError, match=r"executor\.options\.share_weight: unknown field .*did you mean "
                                         r"'share_weights'"):
        build_executor("onnxruntime", metas, str(out_dir), {"share_weight": False})
    with pytest.raises(ValueError, match=r"executor\.options\.graph_optimization_level: 'max'.*choices: disable, basic, "
                                         r"extended, all"):
        build_executor("onnxruntime", metas, str(out_dir), {"graph_optimization_level": "max"})
    with pytest.raises(ValueError, match=r"executor\.options\.intra_op_num_threads: -1 is below the minimum 0"):
        build_executor("onnxruntime", metas, str(out_dir), {"intra_op_num_threads": -1})
    with pytest.raises(ValueError, match=r"executor\.options\.thread_pool: 'global' is not allowed \(choices: session, "
                                         r"shared\)"):
        build_executor("onnxruntime", metas, str(out_dir), {"thread_pool": "global"})
    with pytest.raises(ValueError, match=r"thread_pool: shared always spins.*remove allow_spinning: false"):
        build_executor("onnxruntime", metas, str(out_dir), {"thread_pool": "shared", "allow_spinning": False})
    # the factory passes the mock's latency_ms to every backend; it is not an error here
    build_executor("onnxruntime", metas, str(out_dir), {"latency_ms": {"prefill": 1.0}})


_SHARED_POOL_CHECK = textwrap.dedent("""
    import json, sys
    import numpy as np
    import test_onnxruntime as t
    from synflux_ros.graphset import reader as graphset
    out_dir = sys.argv[1]
    metas = graphset.graph_metas(out_dir, graphset.read_manifest(out_dir))
    result = {}
    ex, kv = t.loaded(out_dir, metas, thread_pool="shared", intra_op_num_threads=2)
    f = t.feeds(8, 7, 3, kv)
    ref_logits, ref_kv = t.reference(t._weights(), f["inputs_embeds"], 7, 3, np.zeros(kv.shape, np.float32))
    out = ex.run("prefill_8", f)
    result["logits_err"] = float(np.abs(out["logits"] - ref_logits).max())
    result["kv_err"] = float(np.abs(out["new_kv"] - ref_kv).max())
    ex2, kv2 = t.loaded(out_dir, metas, thread_pool="shared", intra_op_num_threads=2)
    result["second_equal"] = bool(np.array_equal(ex2.run("prefill_8", t.feeds(8, 7, 3, kv2))["logits"], out["logits"]))
    for name, options in (("resize", {"thread_pool": "shared", "intra_op_num_threads": 1}), ("own_pool", {})):
        try:
            t.loaded(out_dir, metas, **options)
            result[name] = "loaded"
        except ValueError as exc:
            result[name] = str(exc)
    print(json.dumps(result))
""")


def test_a_shared_thread_pool_serves_every_executor_of_the_process(gset):
    """thread_pool: shared (one onnxruntime pool for the whole process) computes what per-session pools do, is
    shared by a second executor, and refuses an executor with other thread counts or a pool of its own. In a
    process of its own: the pool outlives every executor."""
    out_dir, _, _, _ = gset
    proc = subprocess.run([sys.executable, "-c", _SHARED_POOL_CHECK, str(out_dir)], capture_output=True, text=True,
                          cwd=str(Path(__file__).parent), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["logits_err"] < 1e-4 and r["kv_err"] < 1e-5, r
    assert r["second_equal"]
    assert "shared thread pool of 2 intra-op" in r["resize"] and "cannot resize it" in r["resize"], r
    assert "set thread_pool: shared here too" in r["own_pool"], r


def test_registry_entry(monkeypatch):
    from synflux_ros.backends import EXECUTORS

    assert resolve_executor_class("onnxruntime").name == "onnxruntime"
    monkeypatch.setitem(EXECUTORS, "onnxruntime", EXECUTORS["onnxruntime"].__class__(
        EXECUTORS["onnxruntime"].target, requires=("onnxruntime_missing_pkg",),
        install_hint=EXECUTORS["onnxruntime"].install_hint))
    with pytest.raises(BackendUnavailableError, match="onnxruntime-gpu"):
        resolve_executor_class("onnxruntime")


@pytest.mark.parametrize("options", [
    {"share_weights": False},
    {"prepack": ["prefill_8"]},
    {"graph_optimization_level": "disable", "intra_op_num_threads": 1, "inter_op_num_threads": 1},
    {"mmap_weights": True},
])
def test_option_variants_give_the_same_results(gset, options):
    out_dir, metas, w, _ = gset
    ex, kv = loaded(out_dir, metas, **options)
    f = feeds(8, 7, 3, kv)
    ref_logits, ref_kv = reference(w, f["inputs_embeds"], 7, 3, np.zeros(kv.shape, np.float32))
    out = ex.run("prefill_8", f)
    np.testing.assert_allclose(out["logits"], ref_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["new_kv"], ref_kv, rtol=1e-5, atol=1e-6)
    assert ex.shared_initializers("prefill_8") == (0 if options.get("share_weights") is False else 2)
    ex.close()


def test_optimized_model_dir_is_built_once_and_reused(tmp_path, gset):
    out_dir, metas, w, _ = gset
    cache = tmp_path / "ort_cache"
    ex, kv = loaded(out_dir, metas, optimized_model_dir=str(cache))
    f = feeds(4, 3, 1, kv)
    first = ex.run("prefill_4", f)
    ex.close()
    (sub,) = [d for d in cache.iterdir() if d.is_dir()]
    assert sub.name.startswith("tiny-")
    manifest = graphset.read_manifest(str(sub))
    assert manifest["ort_optimized"]["onnxruntime"] == ort.__version__
    # the optimised set is deduplicated again: about one copy of the two matrices
    one_copy = w["w_lm"].nbytes + w["w_kv"].nbytes
    assert one_copy <= os.path.getsize(sub / "weights.bin") < one_copy + 4096
    stamp = os.stat(sub / "prefill_4.onnx").st_mtime_ns
    ex2, kv2 = loaded(out_dir, metas, optimized_model_dir=str(cache))
    assert ex2._from_cache and ex2.graph_path(ex2.graphs["prefill_4"]).startswith(str(sub))
    second = ex2.run("prefill_4", {**f, "past_kv": kv2})
    assert os.stat(sub / "prefill_4.onnx").st_mtime_ns == stamp
    for k in first:
        np.testing.assert_allclose(second[k], first[k], rtol=1e-6, atol=1e-6)
    ex2.close()


# ------------------------------------------------------------------------------------------ the format
def test_weights_are_written_once_aligned_and_models_are_left_intact(tmp_path):
    w = _weights()
    models = {f"prefill_{p}": prefill_model(p, w) for p in (2, 4, 8)}
    before = {k: m.SerializeToString() for k, m in models.items()}
    info = graphset_writer.write_weights_and_models(models, str(tmp_path))
    one_copy = w["w_lm"].nbytes + w["w_kv"].nbytes
    assert info["file"] == "weights.bin" and info["unique_tensors"] == 2 and info["shared_tensors"] == 4
    assert info["bytes"] == os.path.getsize(tmp_path / "weights.bin")
    assert one_copy <= info["bytes"] < one_copy + 64
    assert {k: m.SerializeToString() for k, m in models.items()} == before  # caller's models untouched
    offsets = set()
    for name in models:
        ext = graphset.external_initializers(str(tmp_path / f"{name}.onnx"))
        assert sorted(t.name for t in ext) == ["w_kv", "w_lm"]
        for t in ext:
            assert t.location == "weights.bin" and t.offset % 64 == 0
            offsets.add((t.name, t.offset))
        # the wire-format reader agrees with onnx, and the data round-trips
        m = onnx.load(str(tmp_path / f"{name}.onnx"))
        for t in m.graph.initializer:
            if t.name in w:
                np.testing.assert_array_equal(numpy_helper.to_array(t), w[t.name])
        inline = [t.name for t in onnx.load(str(tmp_path / f"{name}.onnx"), load_external_data=False).graph.initializer
                  if t.data_location != TensorProto.EXTERNAL]
        assert "b_lm" in inline
    assert len(offsets) == 2  # every model points at the same two ranges


def test_typed_field_initializers_and_other_dtypes(tmp_path):
    big_f16 = np.arange(1024, dtype=np.float16)
    typed = helper.make_tensor("w", TensorProto.FLOAT, [512], np.linspace(0, 1, 512).tolist())  # float_data
    i64 = numpy_helper.from_array(np.arange(256, dtype=np.int64), "idx")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"]), helper.make_node("Cast", ["h"], ["hf"], to=TensorProto.FLOAT),
         helper.make_node("Gather", ["hf", "idx"], ["z"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [512]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [256])],
        [typed, numpy_helper.from_array(big_f16, "h"), i64])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    info = graphset_writer.write_weights_and_models({"g": model}, str(tmp_path))
    assert info["unique_tensors"] == 3 and list(model.graph.initializer[0].float_data)  # restored
    metas = [GraphMeta("g", "embed", (TensorSpec("x", (512,), "float32"),),
                       (TensorSpec("y", (512,), "float32"), TensorSpec("z", (256,), "float32")), file="g.onnx")]
    graphset_writer.write_manifest(str(tmp_path), metas, info)
    ex = build_executor("onnxruntime", metas, str(tmp_path)).load()
    x = np.ones(512, np.float32)
    out = ex.run("g", {"x": x})
    np.testing.assert_allclose(out["y"], x + np.linspace(0, 1, 512, dtype=np.float32), rtol=1e-6)
    np.testing.assert_array_equal(out["z"], big_f16[:256].astype(np.float32))
    assert ex.shared_initializers("g") == 3
    ex.close()


def test_models_with_external_data_files_and_prepacked_blobs(tmp_path):
    w = _weights()
    src = tmp_path / "export"
    src.mkdir()
    for p in (4, 8):  # an exporter's output: each model with its own external data file
        onnx.save(prefill_model(p, w), str(src / f"prefill_{p}.onnx"), save_as_external_data=True,
                  all_tensors_to_one_file=True, location=f"prefill_{p}.data", size_threshold=1024)
    models = {f"prefill_{p}": onnx.load(str(src / f"prefill_{p}.onnx"), load_external_data=False) for p in (4, 8)}
    with pytest.raises(graphset.GraphSetError, match=r"w_\w+.*not loaded.*load_external_data=True"):
        graphset_writer.write_weights_and_models(models, str(tmp_path / "a"))
    # pretend ORT saved a prepacked copy of w_kv next to it in each file (same bytes in both)
    blob = np.arange(3000, dtype=np.uint8).tobytes()
    for name, model in models.items():
        with open(src / f"{name}.data", "ab") as fh:
            start = fh.tell()
            fh.write(blob)
        (t,) = [t for t in model.graph.initializer if t.name == "w_kv"]
        e = t.external_data.add()
        e.key, e.value = "prepacked_0", f"MatMul+123|{start};{len(blob)};0"
    out = tmp_path / "b"
    info = graphset_writer.write_weights_and_models(models, str(out), base_dir=str(src))
    assert info["unique_tensors"] == 2 and info["shared_tensors"] == 2
    data = (out / "weights.bin").read_bytes()
    ranges = set()
    for name in models:
        m = onnx.load(str(out / f"{name}.onnx"), load_external_data=False)
        (t,) = [t for t in m.graph.initializer if t.name == "w_kv"]
        entry = {e.key: e.value for e in t.external_data}["prepacked_0"]
        key, blob_range = entry.split("|")
        off, n, checksum = blob_range.split(";")
        assert key == "MatMul+123" and checksum == "0" and int(off) % graphset_writer.PREPACKED_ALIGNMENT == 0
        assert data[int(off):int(off) + int(n)] == blob
        ranges.add(blob_range)
    assert len(ranges) == 1 and len(data) < w["w_lm"].nbytes + w["w_kv"].nbytes + len(blob) + 8192
    metas = [prefill_meta(p) for p in (4, 8)]
    graphset_writer.write_manifest(str(out), metas, info)
    ex, kv = loaded(out, metas)
    f = feeds(8, 8, 0, kv)
    np.testing.assert_allclose(ex.run("prefill_8", f)["logits"],
                               reference(w, f["inputs_embeds"], 8, 0, np.zeros(kv.shape, np.float32))[0], rtol=1e-5)
    ex.close()


def test_append_reuses_what_the_weights_file_holds(tmp_path):
    metas, w, info = write_graph_set(tmp_path)
    size = info["bytes"]
    before = (tmp_path / "prefill_4.onnx").read_bytes()
    # rebuild prefill_8 only, with a new w_kv: w_lm is found in the file, w_kv appended
    w2 = dict(w, w_kv=w["w_kv"] + 1.0)
    info2 = graphset_writer.write_weights_and_models({"prefill_8": prefill_model(8, w2)}, str(tmp_path), append=True)
    assert info2["bytes"] == os.path.getsize(tmp_path / "weights.bin")
    assert size + w["w_kv"].nbytes <= info2["bytes"] < size + w["w_kv"].nbytes + 64
    assert info2["shared_tensors"] == 1 and info2["unique_tensors"] == 3
    assert (tmp_path / "prefill_4.onnx").read_bytes() == before
    # a failing append leaves the set as it was
    with pytest.raises(TypeError, match="prefill_9"):
        graphset_writer.write_weights_and_models({"prefill_4": prefill_model(4, dict(w, w_lm=w["w_lm"] * 2)),
                                           "prefill_9": "not a model"}, str(tmp_path), append=True)
    assert os.path.getsize(tmp_path / "weights.bin") == info2["bytes"]
    assert (tmp_path / "prefill_4.onnx").read_bytes() == before
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".partial")]
    # the manifest as one dict, as the build tool writes it
    graphset_writer.write_manifest(str(tmp_path), {"model": "tiny", "weights": info2, "graphs": [m.to_dict() for m in metas]})
    assert graphset.read_manifest(str(tmp_path))["format"] == graphset.FORMAT
    ex, kv = loaded(tmp_path, metas)
    for p, weights in ((4, w), (8, w2)):
        f = feeds(p, p, 0, kv)
        np.testing.assert_allclose(ex.run(f"prefill_{p}", f)["new_kv"],
                                   reference(weights, f["inputs_embeds"], p, 0, np.zeros(kv.shape, np.float32))[1],
                                   rtol=1e-5, atol=1e-5)
    ex.close()


# ------------------------------------------------------------------------------------------ memory
_MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from synflux_ros.backends import build_executor
    from synflux_ros.core.executor import GraphMeta, TensorSpec

    def status(key, path="/proc/self/status"):
        for line in open(path):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    graph_dir, hidden = sys.argv[1], int(sys.argv[2])
    buckets, options = json.loads(sys.argv[3]), json.loads(sys.argv[4])
    metas = [GraphMeta(f"prefill_{p}", "prefill", (TensorSpec("x", (1, p, hidden), "float32"),),
                       (TensorSpec("y", (1, p, hidden), "float32"),), group="prefill", file=f"prefill_{p}.onnx")
             for p in buckets]
    ex = build_executor("onnxruntime", metas, graph_dir, options)
    base, pss = status("VmRSS"), status("Pss", "/proc/self/smaps_rollup")
    ex.load()
    ex.freeze()
    for p in buckets:
        ex.run(f"prefill_{p}", {"x": np.ones((1, p, hidden), np.float32)})
    print(json.dumps({"base": base, "rss": status("VmRSS"), "hwm": status("VmHWM"), "staging": ex.device_bytes,
                      "pss_growth": status("Pss", "/proc/self/smaps_rollup") - pss}))
""")


@pytest.fixture(scope="module")
def big_graph_set(tmp_path_factory):
    """Four prefill buckets over one 64 MiB weight matrix."""
    out = tmp_path_factory.mktemp("big")
    hidden, buckets = 4096, [1, 2, 4, 8]
    weight = np.random.default_rng(0).standard_normal((hidden, hidden), dtype=np.float32)
    models = {}
    for p in buckets:
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])], f"prefill_{p}",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, p, hidden])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, p, hidden])],
            [numpy_helper.from_array(weight, "w")])
        models[f"prefill_{p}"] = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    info = graphset_writer.write_weights_and_models(models, str(out))
    del models
    graphset_writer.write_manifest(str(out), [], info)
    assert info["bytes"] == weight.nbytes and info["shared_tensors"] == len(buckets) - 1
    return out, hidden, buckets, weight.nbytes


def _measure(graph_set, options, key="hwm"):
    out, hidden, buckets, _ = graph_set
    script = out / "measure.py"
    script.write_text(_MEMORY_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(script), str(out), str(hidden), json.dumps(buckets),
                           json.dumps(options)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    if key == "pss":
        return r["pss_growth"] - r["staging"]
    return r["hwm"] - r["base"] - r["staging"]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (Linux) to read RSS")
def test_bucket_graphs_hold_one_copy_of_the_weights(big_graph_set):
    weight_bytes = big_graph_set[3]
    shared = _measure(big_graph_set, {})
    assert shared < 1.5 * weight_bytes, f"peak RSS growth {shared / 2**20:.0f} MiB for a 64 MiB weight"
    # the measurement can tell: with a copy per session the growth is several weights
    unshared = _measure(big_graph_set, {"share_weights": False})
    assert unshared > shared + weight_bytes, (shared, unshared)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs /proc/self/smaps_rollup (Linux)")
def test_saved_prepacked_weights_are_one_physical_copy(big_graph_set, tmp_path):
    """optimized_model_dir + prepack: ORT maps the one prepacked copy of each weight from the optimised set's
    weights file in every session. RSS counts each mapping; PSS (proportional set size) counts the pages once."""
    weight_bytes = big_graph_set[3]
    options = {"optimized_model_dir": str(tmp_path / "ort"), "prepack": True}
    _measure(big_graph_set, options, "pss")  # builds the optimised set
    (sub,) = [d for d in (tmp_path / "ort").iterdir() if d.is_dir()]
    ext = graphset.external_initializers(str(sub / "prefill_8.onnx"))
    assert [t.prepacked for t in ext] == [True]
    # raw weight + one prepacked copy shared by the four graphs
    assert os.path.getsize(sub / "weights.bin") < 2.2 * weight_bytes
    pss = _measure(big_graph_set, options, "pss")
    assert pss < 1.5 * weight_bytes, f"PSS growth {pss / 2**20:.0f} MiB"


# ------------------------------------------------------------------------------------------ input views
VL = 2  # layers of the view test's cache


def views_graph_set(out, view_names=None, view_shape=(KV, S, DH)):
    """A graph whose contract input past_kv [VL, 2, KV, S, DH] is exported as one input per layer and K/V
    (as synflux-build exports the decoders): output sums[i] = sum of view i + x."""
    names = view_names or [graphset.view_name("past_kv", idx)
                           for idx in graphset.view_indices((VL, 2, KV, S, DH), 2)]
    nodes, sums = [], []
    for n in names:
        nodes.append(helper.make_node("ReduceSum", [n], [n + "_sum"], keepdims=0, noop_with_empty_axes=0))
        nodes.append(helper.make_node("Unsqueeze", [n + "_sum", "axis0"], [n + "_s1"]))
        sums.append(n + "_s1")
    nodes += [helper.make_node("Concat", sums, ["cat"], axis=0), helper.make_node("Add", ["cat", "x"], ["sums"])]
    graph = helper.make_graph(
        nodes, "views",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])]
        + [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(view_shape)) for n in names],
        [helper.make_tensor_value_info("sums", TensorProto.FLOAT, [len(names)])],
        [numpy_helper.from_array(np.array([0], np.int64), "axis0")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    info = graphset_writer.write_weights_and_models({"views": model}, str(out))
    meta = GraphMeta("views", "decode", (TensorSpec("x", (1,), "float32"),
                                         TensorSpec("past_kv", (VL, 2, KV, S, DH), "float32", resident=True)),
                     (TensorSpec("sums", (len(names),), "float32"),), file="views.onnx")
    graphset_writer.write_manifest(str(out), [meta], info, model="views", config_hash="x")
    return [meta]


def test_input_views_are_bound_in_place_at_their_offsets(tmp_path):
    metas = views_graph_set(tmp_path)
    ex = build_executor("onnxruntime", metas, str(tmp_path), {}).load()
    slots = [ex.alloc_tensor(f"kv{i}", (VL, 2, KV, S, DH), "float32") for i in range(2)]
    ex.freeze()
    rng = np.random.default_rng(0)
    for _ in range(2):
        for slot in slots:  # a new slot pointer rebinds every view
            past = rng.standard_normal(slot.shape).astype(np.float32)
            ex.write(slot, (slice(None),), past)
            out = ex.run("views", {"x": np.array([0.5], np.float32), "past_kv": slot})["sums"]
            want = past.reshape(VL * 2, -1).sum(axis=1) + 0.5
            np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-3)
    ex.close()


@pytest.mark.parametrize("names,shape,error", [
    (["past_kv.0.0", "past_kv.2.0"], (KV, S, DH), r"unexpected \['past_kv\.2\.0'\]"),
    (["past_kv.0.0", "past_kv.0.x"], (KV, S, DH), r"unexpected \['past_kv\.0\.x'\]"),
    (["past_kv.0.0"], (KV, S - 1, DH), r"'past_kv\.0\.0' \(a view of 'past_kv'\) is float32\[2, 31, 16\].*"
                                       r"float32\[2, 32, 16\] in the graph contract"),
])
def test_bad_input_views_are_named(tmp_path, names, shape, error):
    metas = views_graph_set(tmp_path, names, shape)
    with pytest.raises(ShapeError, match=error):
        build_executor("onnxruntime", metas, str(tmp_path), {}).load()
