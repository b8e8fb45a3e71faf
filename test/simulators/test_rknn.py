"""RKNN backend: synflux-build --backend rknn compiles the demo graph sets for rk3588 with rknn-toolkit2, the
rknn executor runs them in the toolkit's simulator (a worker under .venv-rknn exchanging tensors through
shared memory) and synflux-validate compares them with onnxruntime in reduced precision; the board code path
(RKNNLite) runs against a stand-in of rknnlite; load-time and compile-time errors; int8 quantization
(--quantize, --calib: values, calibration checks, cache keys, the vision encoder in int8 on the simulator).

The simulator tests need the RKNN venv (`make rknn-venv`, a prerequisite of `make test`) and skip without it.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="onnxruntime is the reference these tests compare against")
pytest.importorskip("torch", reason="synflux-build needs torch (make test installs it)")
onnx = pytest.importorskip("onnx")

from synflux_ros.backends import BackendUnavailableError, build_executor, resolve_executor_class  # noqa: E402
from synflux_ros.backends.rknn import executor as rknn_backend  # noqa: E402
from synflux_ros.buildtool.validate import validate  # noqa: E402
from synflux_ros.backends.rknn import build as rknn_build  # noqa: E402
from synflux_ros.backends.rknn.build import RKNNOptions  # noqa: E402
from synflux_ros.buildtool.export import BuildError, build, main as build_main  # noqa: E402
from synflux_ros.graphset import reader as graphset  # noqa: E402
from synflux_ros.core.config import load_config  # noqa: E402
from synflux_ros.core.contract import graph_set  # noqa: E402
from synflux_ros.graphset.reader import GraphSetError, GraphSetNotFoundError  # noqa: E402
from synflux_ros.core.memory import PoolFrozenError  # noqa: E402
from synflux_ros.runtimes.vla import VLARuntime  # noqa: E402
from synflux_ros.runtimes.vlm import ChatRequest, VLMRuntime  # noqa: E402

pytestmark = pytest.mark.simulator

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ("vla_demo_orin", "vlm_demo")
TARGET = "rk3588"
SIMULATOR = next((p for p in rknn_backend.default_simulator_pythons() if os.path.isfile(p)), "")
needs_simulator = pytest.mark.skipif(
    not SIMULATOR, reason=f"no rknn-toolkit2 venv at {' or '.join(rknn_backend.default_simulator_pythons())} "
                          f"(run `make rknn-venv`)")


def config(graph_dir: str, backend: str, **options):
    cfg = load_config(os.path.join(graph_dir, "config.yaml"))
    return cfg.with_overrides(executor={"backend": backend, "options": options, "latency_ms": {}})


def metas(graph_dir: str, *names: str):
    all_metas = graphset.graph_metas(graph_dir, graphset.read_manifest(graph_dir))
    return [m for m in all_metas if not names or m.name in names]


# The demo configs at one prefill bucket and one decode span (the simulator compiles every graph again on
# each load; every config at this size runs through validation and its node in
# test/integration/test_every_config_backends.py).
SHRUNK = {"vla_demo_orin": {"prefill_buckets": [96], "decode_buckets": [160], "max_seq_len": 160},
          "vlm_demo": {"prefill_buckets": [32], "decode_buckets": [256], "max_seq_len": 256}}


@pytest.fixture(scope="module")
def rknn_sets(tmp_path_factory):
    """The two demo configs (SHRUNK) exported and compiled for rk3588 once for the module (random weights)."""
    if not SIMULATOR:
        pytest.skip("no rknn-toolkit2 venv (run `make rknn-venv`)")
    out = {}
    for name in CONFIGS:
        d = tmp_path_factory.mktemp(f"{name}_rknn")
        t0 = time.perf_counter()
        cfg = load_config(str(REPO / "config" / f"{name}.yaml"))
        build(cfg.with_overrides(llm=SHRUNK[name]), str(d), backend="rknn", options=RKNNOptions(target=TARGET))
        print(f"{name}: ONNX export + rknn compile {time.perf_counter() - t0:.1f} s")
        out[name] = str(d)
    return out


# ------------------------------------------------------------------------------------------ registry, options
def test_registry_row_and_errors_without_a_runtime(tmp_path):
    assert resolve_executor_class("rknn") is rknn_backend.RKNNExecutor
    with pytest.raises(BackendUnavailableError, match=r"simulator_python .*does not exist; run `make rknn-venv`"):
        build_executor("rknn", [], str(tmp_path), {"runtime": "simulator", "simulator_python": "/nonexistent/python"})
    with pytest.raises(ValueError, match=r"executor\.options\.targte: unknown field .*did you mean 'target'\?"):
        build_executor("rknn", [], str(tmp_path), {"targte": "rk3588"})
    with pytest.raises(ValueError, match=r"executor\.options\.runtime: 'npu' is not allowed \(choices: auto, board, simulator\)"):
        build_executor("rknn", [], str(tmp_path), {"runtime": "npu"})
    with pytest.raises(ValueError, match=r"executor\.options\.core_mask: '3' is not allowed"):
        build_executor("rknn", [], str(tmp_path), {"runtime": "simulator", "core_mask": "3"})
    if not rknn_backend.board_runtime_available():
        import importlib.util
        if importlib.util.find_spec("rknnlite") is None:
            with pytest.raises(BackendUnavailableError, match="rknn-toolkit-lite2"):
                build_executor("rknn", [], str(tmp_path), {"runtime": "board"})


def test_build_options_are_checked(tmp_path, capsys):
    cfg = load_config(str(REPO / "config" / "vlm_demo.yaml"))
    with pytest.raises(BuildError, match=r"--backend rknn needs --target \(choices: .*rk3588"):
        build(cfg, str(tmp_path), backend="rknn")
    with pytest.raises(BuildError, match=r"RKNNOptions is not an options type of --backend 'onnxruntime' \(it takes none\)"):
        build(cfg, str(tmp_path), backend="onnxruntime", options=RKNNOptions(target="rk3588"))
    assert build_main(["--config", str(REPO / "config" / "vlm_demo.yaml"), "--out", str(tmp_path / "cli"),
                       "--target", "rk3588"]) == 2
    assert "--target is for --backend rknn, not 'onnxruntime'" in capsys.readouterr().err
    with pytest.raises(rknn_build.RKNNBuildError, match=r"--target 'rk9999' is not an RKNN platform"):
        rknn_build.compile_graph_set(str(tmp_path), {"graphs": []}, "rk9999")
    with pytest.raises(BuildError, match=r"--quantize 'int4' is not allowed \(--quantize fp16, int8 "):
        build(cfg, str(tmp_path / "q"), backend="rknn", options=RKNNOptions(target=TARGET, quantize="int4"))
    assert not (tmp_path / "q").exists()  # refused before exporting anything
    with pytest.raises(rknn_build.RKNNBuildError, match=r"--rknn-python /nonexistent: no such file; run `make rknn-venv`"):
        rknn_build.compile_graph_set(str(tmp_path), {"graphs": []}, TARGET, toolkit_python="/nonexistent")


# ------------------------------------------------------------------------------------------ build side
@needs_simulator
def test_compiled_graph_sets_and_skip_unchanged(rknn_sets):
    for name, gdir in rknn_sets.items():
        manifest = graphset.read_manifest(gdir)
        tdir = os.path.join(gdir, "rknn", TARGET)
        side = json.loads(Path(tdir, "rknn.json").read_text())
        assert side["format"] == "synflux-rknn/1" and side["target"] == TARGET and side["dtype"] == "fp16"
        assert side["toolkit"] == "2.5.0"
        assert sorted(side["graphs"]) == sorted(g["name"] for g in manifest["graphs"])
        keys = {g["name"]: g["key"] for g in manifest["graphs"]}
        for graph, entry in side["graphs"].items():
            assert Path(tdir, entry["file"]).stat().st_size > 0
            assert entry["onnx_key"] == keys[graph]
            # a graph that reads its KV views unsliced (decode over the whole cache) is compiled from a copy
            # that passes each view through an Identity, and takes no view that nothing reads (see
            # synflux_ros/buildtool/rknn.py)
            assert entry["source"] in (f"{graph}.onnx", f"{graph}.rknn.onnx")
            fed = [n for n, _ in entry["inputs"]]
            declared = [n for n, _ in rknn_build.model_inputs(metas(gdir, graph)[0])]
            if entry["source"] != f"{graph}.onnx":
                model = onnx.load(os.path.join(gdir, entry["source"]), load_external_data=False)
                weights = {t.name for t in model.graph.initializer}
                assert [i.name for i in model.graph.input if i.name not in weights] == fed
                assert any(n.op_type == "Identity" and n.input[0].startswith("past_kv.") for n in model.graph.node) \
                    or len(fed) < len(declared)
            if name == "vla_demo_orin" and graph.startswith("prefill_"):  # a flow-matching VLA: the last layer's unread
                last = load_config(os.path.join(gdir, "config.yaml")).llm.num_layers - 1
                assert fed == [n for n in declared if not n.startswith(f"past_kv.{last}.")]
        assert load_config(os.path.join(gdir, "config.yaml")).executor.backend == "rknn"
    # a second run compiles nothing: same ONNX keys, target and toolkit version
    gdir = rknn_sets["vlm_demo"]
    tdir = os.path.join(gdir, "rknn", TARGET)
    mtimes = {f: os.stat(os.path.join(tdir, f)).st_mtime_ns for f in os.listdir(tdir) if f.endswith(".rknn")}
    lines = []
    t0 = time.perf_counter()
    rknn_build.compile_graph_set(gdir, graphset.read_manifest(gdir), TARGET, progress=lines.append)
    assert time.perf_counter() - t0 < 30
    assert "0 of 4 graphs to compile" in lines[0], lines
    assert {f: os.stat(os.path.join(tdir, f)).st_mtime_ns for f in mtimes} == mtimes


@needs_simulator
def test_compile_failure_names_the_graph_and_the_node(tmp_path):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [16])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"], name="relu0"),
                               helper.make_node("Unique", ["r"], ["y"], name="my_unique_node")], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
              str(tmp_path / "bad_graph.onnx"))
    manifest = {"format": graphset.FORMAT, "graphs": [
        {"name": "bad_graph", "kind": "vision_encoder", "file": "bad_graph.onnx", "key": "k1",
         "inputs": [{"name": "x", "shape": [4, 4], "dtype": "float32"}],
         "outputs": [{"name": "y", "shape": [16], "dtype": "float32"}]}]}
    with pytest.raises(rknn_build.RKNNBuildError) as info:
        rknn_build.compile_graph_set(str(tmp_path), manifest, TARGET, progress=lambda _: None)
    msg = str(info.value)
    assert "graph 'bad_graph'" in msg and "bad_graph.onnx" in msg and "failed at build" in msg
    assert "Unique('my_unique_node')" in msg  # the toolkit's words, naming operator and node
    assert (tmp_path / "rknn" / TARGET / "compile.log").stat().st_size > 0


# ------------------------------------------------------------------------------------------ simulator
# Validation against onnxruntime (every graph, action chunks, greedy chat tokens, a reused chat turn against
# the same turn recomputed) and both nodes: test/integration/test_every_config_backends.py, every config.


@needs_simulator
def test_vla_infer_in_place_over_shared_memory(rknn_sets):
    gdir = rknn_sets["vla_demo_orin"]
    rt = VLARuntime(config(gdir, "rknn"))
    ex = rt.executor
    worker = ex._worker
    try:
        frames = [np.random.default_rng([7, i]).integers(0, 256, (240, 320, 3), np.uint8) for i in range(2)]
        n_alloc = ex.pool.num_allocations
        first = rt.infer(frames[0], seq=0)
        second = rt.infer(frames[1], seq=1)
        for res in (first, second):
            assert res.actions.shape == (16, 7) and np.all(np.isfinite(res.actions))
        assert ex.pool.num_allocations == n_alloc  # nothing allocated while serving
        # every device buffer (staging and KV slots) is a shared-memory segment; the worker mapped the ones
        # used so far, each once
        buffers = {a.handle.id: a.handle for a in ex.pool._allocs.values()}
        assert all(isinstance(b, rknn_backend.ShmBuffer) for b in buffers.values())
        assert ex._mapped <= set(buffers) and len(ex._mapped) >= 10
        with pytest.raises(PoolFrozenError):
            ex.alloc_tensor("late", (4,), "float32")
        ref = VLARuntime(config(gdir, "onnxruntime"))
        want = ref.infer(frames[1], seq=1).actions
        ref.close()
        cos = float(np.dot(second.actions.ravel(), want.ravel()) /
                    (np.linalg.norm(second.actions) * np.linalg.norm(want)))
        assert cos > 0.99, cos
    finally:
        rt.close()
    assert worker.proc.poll() is not None  # the worker exits with the executor
    assert not os.path.exists(worker.log_path)


@needs_simulator
def test_graph_set_for_another_target_toolkit_or_onnx_is_refused(rknn_sets, tmp_path):
    gdir = rknn_sets["vlm_demo"]
    with pytest.raises(GraphSetNotFoundError) as info:
        build_executor("rknn", metas(gdir), gdir, {"target": "rk3576"}).load()
    assert os.path.join(gdir, "rknn", "rk3576", "rknn.json") in str(info.value)
    assert "(it has: rk3588)" in str(info.value)
    assert f"synflux-build --config <model.yaml> --out {gdir} --backend rknn --target rk3576" in str(info.value)

    with pytest.raises(BackendUnavailableError, match=r"simulator worker .* failed to start: cannot import "
                                                      r"rknn-toolkit2.*run `make rknn-venv`"):
        build_executor("rknn", metas(gdir), gdir, {"simulator_python": sys.executable}).load()

    copy = tmp_path / "copy"
    shutil.copytree(gdir, copy)
    side_path = copy / "rknn" / TARGET / "rknn.json"
    side = json.loads(side_path.read_text())
    side["toolkit"] = "2.3.0"
    side_path.write_text(json.dumps(side))
    with pytest.raises(GraphSetError, match=r"compiled by rknn-toolkit2 2\.3\.0, this machine has rknn-toolkit2 "
                                            r"\(simulator\) 2\.5\.0; recompile them with: synflux-build"):
        build_executor("rknn", metas(str(copy)), str(copy), {}).load()
    side["toolkit"] = "2.5.0"
    side["graphs"]["decode_256"]["onnx_key"] = "0000"
    side_path.write_text(json.dumps(side))
    with pytest.raises(GraphSetError, match=r"decode_256\.rknn was compiled from another version of "
                                            r"decode_256\.onnx .*--backend rknn --target rk3588"):
        build_executor("rknn", metas(str(copy), "decode_256"), str(copy), {}).load()


# ------------------------------------------------------------------------------------------ int8 quantization
def test_quantize_values_are_checked(tmp_path):
    assert rknn_build.parse_quantize("fp16") == () and rknn_build.parse_quantize("int8") == ("vision_encoder",)
    assert rknn_build.parse_quantize("int8:decode,vision_encoder") == ("vision_encoder", "decode")
    assert rknn_build.parse_quantize("int8:all") == rknn_build.KINDS
    assert rknn_build.quantize_spec(rknn_build.parse_quantize("int8")) == "int8:vision_encoder"
    for bad, said in (("int4", "is not allowed"), ("w8a8", "is not allowed"), ("int8:", "name at least one"),
                      ("int8:vision_encoder,", "name at least one"), ("int8:vision", "unknown graph kind 'vision'")):
        with pytest.raises(rknn_build.RKNNBuildError, match=rf"--quantize '{bad}'.*{said}.*action_expert, all"):
            rknn_build.parse_quantize(bad)
    with pytest.raises(rknn_build.RKNNBuildError, match=r"--calib is for --quantize int8"):
        rknn_build.compile_graph_set(str(tmp_path), {"graphs": []}, TARGET, "fp16", calib=str(tmp_path))
    with pytest.raises(rknn_build.RKNNBuildError, match=r"--calib /nonexistent: no such directory"):
        rknn_build.compile_graph_set(str(tmp_path), {"graphs": []}, TARGET, "int8", calib="/nonexistent")
    from synflux_ros.buildtool.export import main
    assert main(["--config", str(REPO / "config" / "vlm_demo.yaml"), "--out", str(tmp_path / "cli"), "--backend",
                 "rknn", "--target", TARGET, "--quantize", "int8:vison_encoder"]) == 2
    assert main(["--config", str(REPO / "config" / "vlm_demo.yaml"), "--out", str(tmp_path / "cli"), "--backend",
                 "rknn", "--target", TARGET, "--calib", str(tmp_path)]) == 2  # --calib without --quantize int8
    assert main(["--config", str(REPO / "config" / "vlm_demo.yaml"), "--out", str(tmp_path / "cli"), "--backend",
                 "onnxruntime", "--calib", str(tmp_path)]) == 2  # --calib stays tensorrt's/rknn's
    assert not (tmp_path / "cli").exists()  # all refused before exporting anything


def _npz(path, **arrays):
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)


def test_bad_calibration_data_names_graph_and_input(tmp_path):
    # the action-token head reads logits, so this set has decode graphs (a flow-matching VLA's has none)
    cfg = load_config(str(REPO / "config" / "vla_demo_orin.yaml")).with_overrides(
        action={"head_type": "autoregressive"})
    by_name = {m.name: m for m in graph_set(cfg)}
    vision, decode = [by_name["vision_encoder"]], [by_name["decode_256"]]
    calib = tmp_path / "calib"
    calib.mkdir()
    plan = rknn_build.plan_quantization
    with pytest.raises(rknn_build.RKNNBuildError, match=r"no samples for graph 'vision_encoder' \(int8\): expected "
                                                        r".*vision_encoder/\*\.npz"):
        plan(str(tmp_path), vision, ("vision_encoder",), str(calib))
    px = np.zeros((4, 3, 224, 224), np.float32)
    _npz(calib / "vision_encoder" / "a.npz", pixels=px)
    with pytest.raises(rknn_build.RKNNBuildError, match=r"graph 'vision_encoder': .*a\.npz has no input 'pixel_values' "
                                                        r"\(it has: pixels; the graph takes: pixel_values\)"):
        plan(str(tmp_path), vision, ("vision_encoder",), str(calib))
    _npz(calib / "vision_encoder" / "a.npz", pixel_values=px[:, :, :112, :112])
    with pytest.raises(rknn_build.RKNNBuildError, match=r"graph 'vision_encoder' input 'pixel_values': .*a\.npz "
                                                        r"holds shape \[4, 3, 112, 112\], the graph takes "
                                                        r"\[4, 3, 224, 224\]"):
        plan(str(tmp_path), vision, ("vision_encoder",), str(calib))
    px[0, 0, 0, 0] = np.nan
    _npz(calib / "vision_encoder" / "a.npz", pixel_values=px)
    with pytest.raises(rknn_build.RKNNBuildError, match=r"input 'pixel_values': .*non-finite"):
        plan(str(tmp_path), vision, ("vision_encoder",), str(calib))
    # the --backend tensorrt layout (batches of pixel_values directly in DIR) serves the vision encoder
    shutil.rmtree(calib / "vision_encoder")
    _npz(calib / "b.npz", pixel_values=np.ones((4, 3, 224, 224), np.float32))
    assert len(plan(str(tmp_path), vision, ("vision_encoder",), str(calib))["vision_encoder"].samples) == 1
    # multi-input graph: the KV cache as its views or whole; ids must stay integers
    kv = np.random.default_rng(0).standard_normal(cfg.llm.kv_shape).astype(np.float32)
    ids, pos = np.array([[5]], np.int64), np.array([200], np.int64)
    _npz(calib / "decode_256" / "s0.npz", input_ids=ids, cache_position=pos, past_kv=kv)
    views = {f"past_kv.{l}.{k}": kv[l, k] for l in range(2) for k in range(2)}
    _npz(calib / "decode_256" / "s1.npz", input_ids=ids, cache_position=pos, **views)
    cal = plan(str(tmp_path), decode, ("decode",), str(calib))["decode_256"]
    assert [n for n, _ in cal.inputs] == ["input_ids", "cache_position", *views]
    assert all(np.array_equal(a, b) for a, b in zip(*cal.samples))
    _npz(calib / "decode_256" / "s1.npz", input_ids=ids.astype(np.float32), cache_position=pos, **views)
    with pytest.raises(rknn_build.RKNNBuildError, match=r"graph 'decode_256' input 'input_ids': .*s1\.npz holds "
                                                        r"float32 values; the graph takes integers"):
        plan(str(tmp_path), decode, ("decode",), str(calib))
    del views["past_kv.1.0"]
    _npz(calib / "decode_256" / "s1.npz", input_ids=ids, cache_position=pos, **views)
    with pytest.raises(rknn_build.RKNNBuildError, match=r"graph 'decode_256': .*s1\.npz has no input 'past_kv\.1\.0'"):
        plan(str(tmp_path), decode, ("decode",), str(calib))
    # without --calib the samples are generated (seeded) from the graph set's config.yaml
    with pytest.raises(rknn_build.RKNNBuildError, match=r"config\.yaml not found; pass --calib DIR"):
        plan(str(tmp_path), vision, ("vision_encoder",))


def test_key_changes_with_dtype_and_calibration():
    cfg = load_config(str(REPO / "config" / "vla_demo_orin.yaml"))
    vision = next(m for m in graph_set(cfg) if m.kind == "vision_encoder")
    gen = rknn_build.generated_calibration(cfg, vision)
    again = rknn_build.generated_calibration(cfg, vision)
    other = rknn_build.generated_calibration(cfg, vision, n=2)
    assert len(gen.samples) == rknn_build.CALIB_SAMPLES and gen.sha256 == again.sha256 != other.sha256
    key = rknn_build.rknn_key
    fp16 = key("k", TARGET, "2.5.0", "fp16")
    int8 = key("k", TARGET, "2.5.0", "int8", gen.choices())
    assert len({fp16, int8, key("k", TARGET, "2.5.0", "int8", other.choices()),
                key("k", TARGET, "2.5.0", "int8", {**gen.choices(), "algorithm": "mmse"})}) == 4
    assert int8 == key("k", TARGET, "2.5.0", "int8", again.choices())


@needs_simulator
def test_int8_vision_encoder_on_the_simulator(rknn_sets, tmp_path):
    """--quantize int8 on the compiled fp16 demo VLA set: only the vision encoder is compiled again (int8, on
    generated samples), it runs in the simulator within the measured tolerance of onnxruntime, and other
    calibration data or going back to fp16 recompile it alone."""
    from synflux_ros.buildtool.validate import cosine, seeded_feeds

    gdir = str(tmp_path / "vla")
    shutil.copytree(rknn_sets["vla_demo_orin"], gdir)
    tdir = Path(gdir, "rknn", TARGET)
    fp16 = json.loads((tdir / "rknn.json").read_text())
    manifest = graphset.read_manifest(gdir)
    mtimes = {f.name: f.stat().st_mtime_ns for f in tdir.glob("*.rknn")}
    lines = []
    side = rknn_build.compile_graph_set(gdir, manifest, TARGET, "int8", progress=lines.append)
    assert "1 of 4 graphs to compile" in lines[0] and "int8:vision_encoder" in lines[0], lines
    assert any("4 generated samples (bring-up only" in line for line in lines), lines
    assert side["dtype"] == "int8" and side["quantize"] == "int8:vision_encoder"
    entry = side["graphs"]["vision_encoder"]
    assert entry["dtype"] == "int8" and entry["key"] != fp16["graphs"]["vision_encoder"]["key"]
    q = entry["quantization"]
    assert (q["dtype"], q["algorithm"], q["samples"], q["calib_source"]) == ("w8a8", "normal", 4, "generated")
    assert (tdir / q["dataset"]).read_text().splitlines()[0] == "s000_0_pixel_values.npy"
    for name, e in side["graphs"].items():  # the fp16 graphs are those of the fp16 build, untouched
        if name != "vision_encoder":
            assert e == fp16["graphs"][name] and (tdir / e["file"]).stat().st_mtime_ns == mtimes[e["file"]]

    cfg = load_config(os.path.join(gdir, "config.yaml"))
    meta = metas(gdir, "vision_encoder")
    ex = build_executor("rknn", meta, gdir, {}).load()
    ref = build_executor("onnxruntime", meta, gdir, {}).load()
    try:
        for seed in range(2):
            feeds = seeded_feeds(meta[0], cfg, np.random.default_rng([0, seed]), None)
            got = ex.run("vision_encoder", feeds)["vision_embeds"]
            want = ref.run("vision_encoder", feeds)["vision_embeds"]
            # measured: 0.9993 (fp16 build: 0.99999); int8 on 4 generated samples
            assert cosine(got, want) > 0.998, cosine(got, want)
            assert cosine(got, want) < 0.99995  # it ran quantized, not in fp16
    finally:
        ex.close()
        ref.close()

    # a set whose calibration samples are gone is refused in the simulator, with the command
    shutil.move(str(tdir / "calib"), str(tmp_path / "calib_moved"))
    with pytest.raises(GraphSetNotFoundError, match=r"graph 'vision_encoder' is int8 .*dataset\.txt is missing; "
                                                    r"synflux-build .*--target rk3588 --quantize int8:vision_encoder"):
        build_executor("rknn", meta, gdir, {}).load()
    shutil.move(str(tmp_path / "calib_moved"), str(tdir / "calib"))

    # other calibration data: the vision encoder alone is compiled again, under another key
    calib = tmp_path / "frames"
    for i in range(2):
        _npz(calib / "vision_encoder" / f"f{i}.npz",
             pixel_values=np.random.default_rng(i).uniform(-1, 1, (4, 3, 224, 224)).astype(np.float32))
    lines.clear()
    side2 = rknn_build.compile_graph_set(gdir, manifest, TARGET, "int8", calib=str(calib), progress=lines.append)
    assert "1 of 4 graphs to compile" in lines[0], lines
    q2 = side2["graphs"]["vision_encoder"]["quantization"]
    assert q2["samples"] == 2 and q2["calib_source"] == str(calib) and q2["calib_sha256"] != q["calib_sha256"]
    assert side2["graphs"]["vision_encoder"]["key"] != entry["key"]
    # back to fp16: the vision encoder is compiled again and its calibration samples are removed
    lines.clear()
    side3 = rknn_build.compile_graph_set(gdir, manifest, TARGET, "fp16", progress=lines.append)
    assert "1 of 4 graphs to compile" in lines[0] and side3["dtype"] == "fp16", lines
    assert side3["graphs"]["vision_encoder"]["key"] == fp16["graphs"]["vision_encoder"]["key"]
    assert not (tdir / "calib").exists()


@needs_simulator
def test_int8_prefill_that_takes_unread_views_is_calibrated_on_the_inputs_it_takes(rknn_sets, tmp_path):
    """A flow-matching VLA's prefill takes its last layer's KV views without reading them; its compiled
    graph leaves them out, and so must each calibration sample (one .npy per compiled input)."""
    from synflux_ros.graphkit.feeds import seeded_feeds
    gdir = str(tmp_path / "vla")
    shutil.copytree(rknn_sets["vla_demo_orin"], gdir)
    manifest = graphset.read_manifest(gdir)
    side = rknn_build.compile_graph_set(gdir, manifest, TARGET, "int8:prefill", progress=lambda *_: None)
    entry = side["graphs"]["prefill_96"]
    fed = [n for n, _ in entry["inputs"]]
    assert entry["dtype"] == "int8" and len(fed) < len(rknn_build.model_inputs(metas(gdir, "prefill_96")[0]))
    lines = Path(gdir, "rknn", TARGET, entry["quantization"]["dataset"]).read_text().splitlines()
    assert lines and all(len(line.split()) == len(fed) for line in lines), lines[:1]
    cfg = load_config(os.path.join(gdir, "config.yaml"))
    meta = metas(gdir, "prefill_96")
    ex = build_executor("rknn", meta, gdir, {}).load()  # the simulator quantizes it again on those samples
    try:
        kv = ex.alloc_tensor("kv", cfg.llm.kv_shape, cfg.llm.kv_dtype)
        out = ex.run("prefill_96", seeded_feeds(meta[0], cfg, np.random.default_rng(0), kv))
        assert np.isfinite(out["new_kv"]).all() and np.abs(out["new_kv"]).max() > 0
    finally:
        ex.close()


# ------------------------------------------------------------------------------------------ board path
FAKE_RKNNLITE = '''
"""Stand-in of rknn-toolkit-lite2 for tests: RKNNLite runs the ONNX graph a .rknn was compiled from."""
import json, os
import numpy as np
import onnxruntime

CALLS = []


class RKNNLite:
    NPU_CORE_AUTO, NPU_CORE_0, NPU_CORE_1, NPU_CORE_2 = 0, 1, 2, 4
    NPU_CORE_0_1, NPU_CORE_0_1_2, NPU_CORE_ALL = 3, 7, 0xffff

    def __init__(self, verbose=False):
        self.session = None

    def load_rknn(self, path):
        tdir = os.path.dirname(path)
        side = json.load(open(os.path.join(tdir, "rknn.json")))
        entry = [e for e in side["graphs"].values() if e["file"] == os.path.basename(path)][0]
        self.source = os.path.join(tdir, "..", "..", entry["source"])
        return 0

    def init_runtime(self, core_mask=0):
        self.core_mask = core_mask
        self.session = onnxruntime.InferenceSession(self.source)
        return 0

    def inference(self, inputs, data_format=None):
        names = [i.name for i in self.session.get_inputs()]
        assert len(inputs) == len(names) and data_format == ["nchw"] * len(inputs)
        CALLS.append(len(inputs))
        return self.session.run(None, dict(zip(names, [np.array(x) for x in inputs])))

    def release(self):
        self.session = None
'''


@pytest.fixture()
def fake_board(tmp_path, monkeypatch):
    pkg = tmp_path / "fake_site" / "rknnlite"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "api.py").write_text(FAKE_RKNNLITE)
    monkeypatch.syspath_prepend(str(tmp_path / "fake_site"))
    for mod in ("rknnlite", "rknnlite.api"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    yield
    for mod in ("rknnlite", "rknnlite.api"):
        sys.modules.pop(mod, None)


def _sidecar_without_toolkit(gdir: str, target: str) -> None:
    """What synflux-build --backend rknn writes, with empty .rknn files (the stand-in runs the ONNX)."""
    manifest = graphset.read_manifest(gdir)
    by_name = {m.name: m for m in metas(gdir)}
    tdir = Path(gdir, "rknn", target)
    tdir.mkdir(parents=True)
    graphs = {}
    for g in manifest["graphs"]:
        (tdir / f"{g['name']}.rknn").write_bytes(b"stand-in")
        graphs[g["name"]] = {"file": f"{g['name']}.rknn", "source": g["file"], "key": "k", "onnx_key": g["key"],
                             "inputs": [[n, list(s)] for n, s in rknn_build.model_inputs(by_name[g["name"]])],
                             "outputs": [t.name for t in by_name[g["name"]].outputs]}
    (tdir / "rknn.json").write_text(json.dumps({"format": "synflux-rknn/1", "target": target, "toolkit": "2.5.0",
                                                "dtype": "fp16", "graphs": graphs}))


def test_board_runtime_feeds_rknnlite_in_compiled_order(tmp_path, fake_board):
    gdir = str(tmp_path / "vlm")
    build(load_config(str(REPO / "config" / "vlm_demo.yaml")), gdir)
    _sidecar_without_toolkit(gdir, "rk3576")
    board = VLMRuntime(config(gdir, "rknn", runtime="board", target="rk3576", core_mask="0_1"))
    ref = VLMRuntime(config(gdir, "onnxruntime"))
    try:
        assert board.executor.device_of("decode_256") == "rknn:rk3576"
        assert all(isinstance(b, rknn_backend.HostBuffer) and not isinstance(b, rknn_backend.ShmBuffer)
                   for b in board.executor._staging.values())
        assert board.executor._handles["decode_256"].rknn.core_mask == 3
        for prompt in ("hello there", "and again"):
            a = board.chat(ChatRequest("s", prompt, max_new_tokens=6, temperature=0.0))
            b = ref.chat(ChatRequest("s", prompt, max_new_tokens=6, temperature=0.0))
            assert a.token_ids == b.token_ids and a.cached_tokens == b.cached_tokens
        import rknnlite.api
        assert 2 * 2 + 2 in rknnlite.api.CALLS  # decode: input_ids, cache_position and 2 layers x K/V views
    finally:
        board.close()
        ref.close()


def test_the_rtc_vjp_graphs_compile_and_run_as_on_onnxruntime(tmp_path):
    """The vjp guidance's graph compiles for rk3588 (its forward pass is written so that the toolkit's RMS-norm and
    attention fusions keep what the backward pass reads) and the simulator computes the velocity and the
    correction as onnxruntime does."""
    cfg = load_config(str(REPO / "config" / "vla_demo_orin.yaml")).with_overrides(
        llm=SHRUNK["vla_demo_orin"], execution={"mode": "rtc", "rtc": {"guidance": "vjp"}})
    build(cfg, str(tmp_path), backend="rknn", options=RKNNOptions(target=TARGET))
    assert (tmp_path / "rknn" / TARGET / "action_expert_vjp_160.rknn").is_file()
    rows = {r.check: r for r in validate(str(tmp_path), "rknn", options={"target": TARGET}, precision="reduced")}
    vjp = sorted(c for c in rows if c.startswith("action_expert_vjp_"))
    assert vjp == ["action_expert_vjp_160/correction", "action_expert_vjp_160/velocity"]
    assert all(rows[c].passed and rows[c].cosine > 0.99999 for c in vjp), [rows[c] for c in vjp]


def test_groot_s_rtc_vjp_graph_compiles_and_runs_as_on_onnxruntime(tmp_path):
    """GR00T N1.7's dit_vjp graph (demo size, its first prefill bucket) compiles for rk3588 and the simulator
    computes the velocity and the correction as onnxruntime does."""
    import yaml
    from checkpoints import demo_size
    from synflux_ros.core.config import from_dict
    raw = demo_size(yaml.safe_load((REPO / "config" / "vla_groot_n17.yaml").read_text()))
    raw["llm"]["prefill_buckets"] = raw["llm"]["prefill_buckets"][:1]
    raw["execution"] = {"mode": "rtc", "rtc": {"guidance": "vjp"}}
    bucket = raw["llm"]["prefill_buckets"][0]
    # the vision encoder that takes both cameras at once is refused before anything is exported
    with pytest.raises(BuildError, match="takes 2 cameras in one call.*set vision.batch_cameras: false"):
        build(from_dict(raw), str(tmp_path), backend="rknn", options=RKNNOptions(target=TARGET))
    assert not list(tmp_path.iterdir())
    raw["vision"]["batch_cameras"] = False
    build(from_dict(raw), str(tmp_path), backend="rknn", options=RKNNOptions(target=TARGET))
    graphs = json.loads((tmp_path / "manifest.json").read_text())["graphs"]
    pixels = next(g for g in graphs if g["name"] == "vision_encoder")["inputs"][0]
    assert pixels["shape"] == [1, 3, 256, 256]
    assert (tmp_path / "rknn" / TARGET / f"dit_vjp_{bucket}.rknn").is_file()
    rows = {r.check: r for r in validate(str(tmp_path), "rknn", options={"target": TARGET}, precision="reduced")}
    vjp = sorted(c for c in rows if c.startswith("dit_vjp_"))
    assert vjp == [f"dit_vjp_{bucket}/correction", f"dit_vjp_{bucket}/velocity"]
    assert all(rows[c].passed and rows[c].cosine > 0.99999 for c in vjp), [rows[c] for c in vjp]
