"""The tensorrt backend's runtime.

* ``stand_in`` tests (run everywhere): the executor runs against ``tensorrt_stand_in`` (TensorRT's runtime
  API and cuda-python's memory calls, computing with onnxruntime on host memory), which checks its
  routes, profiles, bindings, KV view offsets, 2-D KV copies, CUDA-graph replay and load errors with
  ``synflux-validate``'s comparison against the onnxruntime backend.
* ``gpu`` tests: the same comparison with JetPack's TensorRT on a real device; they run where
  ``import tensorrt`` works and a CUDA device answers (a Jetson), and skip elsewhere with that reason.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys

import pytest

pytest.importorskip("torch", reason="synflux-build needs torch (make test installs it)")
pytest.importorskip("onnxruntime", reason="the reference backend is onnxruntime")

from synflux_ros.backends.tensorrt import plan  # noqa: E402
from synflux_ros.buildtool.validate import validate  # noqa: E402
from synflux_ros.buildtool.export import build  # noqa: E402
from synflux_ros.backends.tensorrt.build import export_profiled  # noqa: E402
from synflux_ros.graphset import reader as graphset  # noqa: E402
from synflux_ros.core.config import load_config  # noqa: E402
from synflux_ros.core.contract import reads_logits  # noqa: E402
from synflux_ros.runtimes.base import create_executor  # noqa: E402
from synflux_ros.runtimes.vlm import ChatRequest, VLMRuntime  # noqa: E402

import tensorrt_stand_in as stand_in  # noqa: E402

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "..", "config")
TAG = plan.device_tag("8.7", None, "fp16")


def graph_set_for(tmp_path_factory, name: str, shipped_graphs) -> str:
    """A copy of the session's graph set of a shipped config at demo size (``<config>.yaml+vjp``: with Real-Time
    Chunking's vjp graphs, which holds every graph of the plain set too), with its profiled ONNX."""
    out = str(tmp_path_factory.mktemp(name.replace(".yaml", "").replace("+", "-")) / "graphs")
    shutil.copytree(shipped_graphs(name), out)
    cfg = load_config(os.path.join(out, "config.yaml"))
    export_profiled(cfg, out, graphset.read_manifest(out), None, 0, False, progress=lambda *_: None)
    return out


@pytest.fixture(scope="module")
def vlm_graphs(tmp_path_factory, shipped_graphs):
    """A fresh copy of vlm_demo's graph set (with its profiled ONNX, made once for the module) for each caller,
    to write engines into."""
    built = graph_set_for(tmp_path_factory, "vlm_demo.yaml", shipped_graphs)

    def copy() -> str:
        out = str(tmp_path_factory.mktemp("vlm_demo-copy") / "graphs")
        shutil.copytree(built, out)
        return out
    return copy


@pytest.fixture(scope="module")
def fake_device():
    """The stand-in installed as ``tensorrt`` and ``cuda.bindings.runtime`` for this module's tests."""
    import cuda.bindings
    cudart = stand_in.make_cudart()
    trt = stand_in.make_tensorrt(cudart)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "tensorrt", trt)
        mp.setitem(sys.modules, "cuda.bindings.runtime", cudart)
        mp.setattr(cuda.bindings, "runtime", cudart, raising=False)
        yield trt, cudart


@pytest.fixture(scope="module", params=["vla_demo_orin.yaml", "vlm_demo.yaml", "vla_pi0.yaml+vjp", "vla_pi05.yaml",
                                               "vla_smolvla.yaml", "vla_groot_n17.yaml+vjp"])
def graphs(request, tmp_path_factory, shipped_graphs):
    out = graph_set_for(tmp_path_factory, request.param, shipped_graphs)
    stand_in.write_engines(out, TAG)
    return out


def failures(rows):
    return [f"{r.check}: diff {r.max_abs_diff:.3g} cos {r.cosine:.6f} {r.detail}" for r in rows if not r.passed]


def test_stand_in_every_graph_and_the_whole_model_match_onnxruntime(fake_device, graphs):
    rows = validate(graphs, "tensorrt")
    assert rows and not failures(rows), failures(rows)
    # every LLM graph of the set is compared: decode steps, or a flow-matching VLA's prefill (it has no decode)
    cfg = load_config(os.path.join(graphs, "config.yaml"))
    llm = "decode_" if reads_logits(cfg) else "features_" if cfg.groot_dit else "prefill_"
    assert any(r.check.startswith(llm) for r in rows)
    if "-vjp" in os.path.basename(os.path.dirname(graphs)):  # the vjp guidance's engine: velocity and correction
        assert {r.check.split("/")[-1] for r in rows if r.check.startswith(("action_expert_vjp_", "dit_vjp_"))} \
            == {"velocity", "correction"}, sorted(r.check for r in rows)


def test_stand_in_decode_steps_replay_as_cuda_graphs(fake_device, graphs):
    _, cudart = fake_device
    before = cudart.state["launches"]
    rows = validate(graphs, "tensorrt", options={"cuda_graphs": True})
    assert not failures(rows), failures(rows)
    if load_config(os.path.join(graphs, "config.yaml")).mode == "vlm":  # greedy chat decodes on one slot
        assert cudart.state["launches"] > before


def test_stand_in_decode_that_cannot_be_captured_runs_uncaptured(fake_device, vlm_graphs):
    _, cudart = fake_device
    out = vlm_graphs()
    stand_in.write_engines(out, TAG)
    before = cudart.state["launches"]
    cudart.state["refuse_capture"] = True
    try:
        rows = validate(out, "tensorrt", options={"cuda_graphs": True})
    finally:
        cudart.state["refuse_capture"] = False
    assert not failures(rows), failures(rows)
    assert cudart.state["launches"] == before


def test_stand_in_chat_reuses_the_cache_as_recomputing_does(fake_device, vlm_graphs):
    out = vlm_graphs()
    stand_in.write_engines(out, TAG)
    cfg = load_config(os.path.join(out, "config.yaml"))

    def chat(reuse: bool):
        c = cfg.with_overrides(executor={"backend": "tensorrt", "graph_dir": out},
                               session={"reuse_kv_cache": reuse})
        rt = VLMRuntime(c)
        try:
            replies = []
            for text in ("hello robot", "what is on the table?", "and to the left?"):
                replies.append(rt.chat(ChatRequest("s", text, max_new_tokens=6)).token_ids)
            return replies
        finally:
            rt.close()
    assert chat(True) == chat(False)


def test_stand_in_device_memory_counts_engines_and_the_pool(fake_device, graphs):
    cfg = load_config(os.path.join(graphs, "config.yaml")).with_overrides(
        executor={"backend": "tensorrt", "graph_dir": graphs})
    ex = create_executor(cfg)
    ex.load()
    try:
        engine_bytes = sum(e.bytes for e in ex.sidecar.engines.values())
        assert ex.device_bytes == engine_bytes + ex.pool.allocated_bytes
        names = ex.pool.breakdown()
        if cfg.groot_dit:  # no llm engine: an engine per GR00T kind, one activation buffer each, not per bucket
            acts = {n.split("/")[2] for n in names if n.startswith("tensorrt/activations/")}
            assert {"features", "vl_context", "dit", "dit_vjp"} <= acts, "\n".join(sorted(names))
            assert not any(n.startswith(f"tensorrt/activations/dit_{p}") for n in names
                           for p in cfg.llm.prefill_buckets), "\n".join(sorted(names))
            assert ex.device_of(f"dit_{cfg.llm.prefill_buckets[0]}") == "tensorrt:cuda0"
            return
        assert any(n.startswith("tensorrt/activations/llm/") for n in names)
        # one activation buffer per (engine, graph group), not per bucket
        llm_groups = {n.split("/")[3] for n in names if n.startswith("tensorrt/activations/llm/")}
        assert llm_groups == ({"prefill", "decode"} if reads_logits(cfg) else {"prefill"})
        assert ex.device_of("prefill_" + str(cfg.llm.prefill_buckets[0])) == "tensorrt:cuda0"
    finally:
        ex.close()


@pytest.mark.parametrize("change,message", [
    ({"sm": "8.6"}, r"built with TensorRT 10\.3\.0 for sm 8\.6; this device is sm 8\.7"),
    ({"version": "10.0.1"}, r"built with TensorRT 10\.0\.1 for sm 8\.7; this device is sm 8\.7 with TensorRT 10\.3\.0"),
])
def test_stand_in_engines_for_another_device_or_version_are_refused(fake_device, vlm_graphs, change, message):
    out = vlm_graphs()
    edir = stand_in.write_engines(out, TAG, **change)
    cfg = load_config(os.path.join(out, "config.yaml")).with_overrides(executor={"backend": "tensorrt", "graph_dir": out})
    with pytest.raises(RuntimeError, match=message) as info:
        create_executor(cfg).load()
    assert edir in str(info.value) and "synflux-build" in str(info.value) and "--backend tensorrt" in str(info.value)


def test_stand_in_bad_sidecar_names_the_field_and_the_build_command(fake_device, vlm_graphs):
    out = vlm_graphs()
    edir = stand_in.write_engines(out, TAG)
    path = os.path.join(edir, "tensorrt.json")
    with open(path, encoding="utf-8") as fh:
        side = json.load(fh)
    side["engines"]["llm"]["profiles"] = "prefill_8"
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(side, fh)
    cfg = load_config(os.path.join(out, "config.yaml")).with_overrides(executor={"backend": "tensorrt", "graph_dir": out})
    with pytest.raises(RuntimeError, match=r"tensorrt\.json: engine 'llm': field 'profiles' must be a list.*"
                                           r"rebuild with: synflux-build .*--backend tensorrt"):
        create_executor(cfg).load()


def test_stand_in_missing_engines_name_the_file_and_the_build_command(fake_device, vlm_graphs):
    out = vlm_graphs()
    cfg = load_config(os.path.join(out, "config.yaml")).with_overrides(
        executor={"backend": "tensorrt", "graph_dir": out, "options": {"precision": "fp32"}})
    with pytest.raises(RuntimeError, match=r"no engines for this device \(sm 8\.7, fp32\): .*sm87-fp32/tensorrt\.json "
                                           r"is missing; build them on this device with: synflux-build .*--backend tensorrt"):
        create_executor(cfg).load()
    bad = cfg.with_overrides(executor={"backend": "tensorrt", "graph_dir": out, "options": {"precision": "fp8"}})
    with pytest.raises(ValueError, match=r"executor\.options\.precision: 'fp8' is not allowed \(choices: fp32, fp16, int8\)"):
        create_executor(bad)


def _gpu_reason() -> str:
    if importlib.util.find_spec("tensorrt") is None:
        return "needs JetPack's TensorRT (import tensorrt)"
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return "needs cuda-python"
    err, count = cudart.cudaGetDeviceCount()
    return "" if int(err) == 0 and count > 0 else "needs a CUDA device"


@pytest.mark.gpu
@pytest.mark.skipif(bool(_gpu_reason()), reason=_gpu_reason() or "runs")
@pytest.mark.parametrize("name", ["vla_demo_orin.yaml", "vlm_demo.yaml"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_gpu_engines_match_onnxruntime(tmp_path_factory, name, precision):
    from synflux_ros.backends.tensorrt.build import TensorRTOptions
    d = tmp_path_factory.mktemp("gpu")
    with open(os.path.join(CONFIG, name), encoding="utf-8") as fh:
        (d / name).write_text(fh.read())
    out = str(d / "graphs")
    build(load_config(str(d / name)), out, "tensorrt", options=TensorRTOptions(precision=precision))
    rows = validate(out, "tensorrt", options={"precision": precision, "cuda_graphs": True},
                    precision="fp32" if precision == "fp32" else "reduced")
    assert not failures(rows), failures(rows)
    assert graphset.read_manifest(out)
