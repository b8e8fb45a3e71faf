"""OpenVINO backend on graph sets built by synflux-build: every graph against onnxruntime (f32 hint), chat
and action chunks through the runtimes, tensors set in place over the static buffers (KV views at their
offsets), options and device errors, the compiled-model cache, load-time errors."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

ov = pytest.importorskip("openvino")
pytest.importorskip("onnxruntime", reason="onnxruntime is the reference these tests compare against")
pytest.importorskip("torch", reason="synflux-build needs torch (make test installs it)")

from synflux_ros.backends import BackendUnavailableError, build_executor, resolve_executor_class  # noqa: E402
from synflux_ros.graphkit.feeds import seeded_feeds  # noqa: E402
from synflux_ros.graphset import reader as graphset  # noqa: E402
from synflux_ros.core.contract import GraphMeta, TensorSpec
from synflux_ros.core.executor import ShapeError  # noqa: E402
from synflux_ros.core.memory import PoolFrozenError  # noqa: E402
from synflux_ros.runtimes.base import create_executor  # noqa: E402
from checkpoints import config, metas  # noqa: E402
from synflux_ros.runtimes.vla import VLARuntime  # noqa: E402
from synflux_ros.runtimes.vlm import ChatRequest, VLMRuntime  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
CONFIGS = ("vla_demo_orin", "vlm_demo")
TOL = 1e-4  # f32 inference precision: measured ~1e-6 against onnxruntime




def kv_pair(cfg, executors, seed=0):
    """The same random KV cache in a slot of each executor."""
    value = (np.random.default_rng(seed).standard_normal(cfg.llm.kv_shape) * 0.5).astype(cfg.llm.kv_dtype)
    slots = []
    for ex in executors:
        slot = ex.alloc_tensor(f"test/kv{seed}", cfg.llm.kv_shape, cfg.llm.kv_dtype, zero=False)
        ex.write(slot, (), value)
        slots.append(slot)
    return value, slots


# ------------------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("name", CONFIGS)
def test_every_graph_matches_onnxruntime(demo_graphs, name):
    gdir = str(demo_graphs[name])
    cfg = config(gdir, "openvino")
    ex, ref = create_executor(cfg), create_executor(config(gdir, "onnxruntime"))
    value, (kv, kv_ref) = kv_pair(cfg, (ex, ref))
    ex.freeze()
    ref.freeze()
    assert type(ex).__name__ == "OpenVINOExecutor" and ex.device_of("decode_256") == "openvino:CPU"
    for i, meta in enumerate(ex.graphs.values()):
        feeds = seeded_feeds(meta, cfg, np.random.default_rng([0, i]), kv)
        got = ex.run(meta.name, feeds)
        want = ref.run(meta.name, {k: (kv_ref if v is kv else v) for k, v in feeds.items()})
        for spec in meta.outputs:
            np.testing.assert_allclose(got[spec.name], want[spec.name], rtol=TOL, atol=TOL,
                                       err_msg=f"{name}: {meta.name}/{spec.name}")
        # the CPU plugin writes every output into the staging buffer set on the request
        g = ex._handles[meta.name]
        assert g.verified and ex.copied_outputs(meta.name) == ()
        for spec in meta.outputs:
            assert g.request.get_tensor(spec.name).data.ctypes.data == ex._staging[(meta.group, spec.name)].ptr
        # a KV view is read where the slot holds it: layer l, K or V at its byte offset
        if "past_kv" in feeds:
            views = g.plan["past_kv"]
            assert len(views) == 2 * cfg.llm.num_layers
            for view, offset, shape in views:
                assert g.request.get_tensor(view).data.ctypes.data == kv.handle.ptr + offset
    np.testing.assert_array_equal(ex.read(kv), value)  # read in place, never written
    ex.close()
    ref.close()


def test_a_second_kv_slot_is_rebound(demo_graphs):
    gdir = str(demo_graphs["vlm_demo"])
    cfg = config(gdir, "openvino")
    ex = build_executor("openvino", metas(gdir, "decode_256"), gdir, {}).load()
    ref = build_executor("onnxruntime", metas(gdir, "decode_256"), gdir, {}).load()
    _, (a, a_ref) = kv_pair(cfg, (ex, ref), seed=1)
    _, (b, b_ref) = kv_pair(cfg, (ex, ref), seed=2)
    meta = ex.graphs["decode_256"]
    feeds = seeded_feeds(meta, cfg, np.random.default_rng(3), a)
    for slot, slot_ref in ((a, a_ref), (b, b_ref), (a, a_ref)):
        got = ex.run("decode_256", {**feeds, "past_kv": slot})["logits"]
        want = ref.run("decode_256", {**feeds, "past_kv": slot_ref})["logits"]
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
        assert ex._handles["decode_256"].bound["past_kv"] == slot.handle.ptr
    ex.close()
    ref.close()


def test_chat_on_openvino_gives_onnxruntimes_tokens_and_reuse_equals_recompute(demo_graphs):
    gdir = str(demo_graphs["vlm_demo"])
    runtimes = {"onnxruntime": VLMRuntime(config(gdir, "onnxruntime")),
                "openvino": VLMRuntime(config(gdir, "openvino")),
                "openvino, recompute": VLMRuntime(config(gdir, "openvino").with_overrides(
                    session={"reuse_kv_cache": False}))}
    picture = np.random.default_rng(5).integers(0, 256, (90, 150, 3), np.uint8)
    turns = [("a", "hello there", []), ("a", "what is in this picture?", [picture]),
             ("b", "a second session in another KV slot", []), ("a", "and what colour is it?", [])]
    seen = set()
    for i, (sid, prompt, images) in enumerate(turns):
        results = {k: rt.chat(ChatRequest(sid, prompt, images=images, max_new_tokens=8, temperature=0.0))
                   for k, rt in runtimes.items()}
        tokens = {k: r.token_ids for k, r in results.items()}
        assert len(set(map(tuple, tokens.values()))) == 1, f"turn {i}: {tokens}"
        assert results["openvino"].cached_tokens == results["onnxruntime"].cached_tokens
        assert results["openvino, recompute"].cached_tokens == 0
        assert (results["openvino"].cached_tokens > 0) == (sid in seen)
        seen.add(sid)
    for rt in runtimes.values():
        rt.close()


def test_action_chunks_match_onnxruntime(demo_graphs):
    gdir = str(demo_graphs["vla_demo_orin"])
    frames = [np.random.default_rng([7, i]).integers(0, 256, (240, 320, 3), np.uint8) for i in range(2)]
    chunks = {}
    for backend in ("onnxruntime", "openvino"):
        rt = VLARuntime(config(gdir, backend))
        chunks[backend] = [rt.infer(f, seq=i).actions for i, f in enumerate(frames)]
        rt.close()
    for a, b in zip(chunks["openvino"], chunks["onnxruntime"]):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)


# ------------------------------------------------------------------------------------------ memory
def test_steady_state_allocates_nothing(demo_graphs):
    gdir = str(demo_graphs["vlm_demo"])
    cfg = config(gdir, "openvino")
    ex = create_executor(cfg)
    _, (kv,) = kv_pair(cfg, (ex,))
    ex.freeze()
    with pytest.raises(PoolFrozenError):
        ex.alloc_tensor("kv1", kv.shape, kv.dtype)
    n_alloc, nbytes = ex.pool.num_allocations, ex.device_bytes
    names = ("prefill_32", "prefill_128", "decode_256", "decode_512")
    bound = None
    for i in range(12):
        meta = ex.graphs[names[i % len(names)]]
        ex.run(meta.name, seeded_feeds(meta, cfg, np.random.default_rng(i), kv))
        if i >= len(names):
            assert {n: dict(ex._handles[n].bound) for n in names} == bound  # nothing set again
        bound = {n: dict(ex._handles[n].bound) for n in names}
    assert (ex.pool.num_allocations, ex.device_bytes) == (n_alloc, nbytes)
    # the two prefill buckets read the group's one staging buffer
    assert ex._handles["prefill_32"].bound["inputs_embeds"] == ex._handles["prefill_128"].bound["inputs_embeds"]
    ex.close()


def test_an_output_the_plugin_keeps_is_copied(demo_graphs):
    """If a device plugin returns an output in memory of its own, the first run notices and copies it."""
    gdir = str(demo_graphs["vlm_demo"])
    cfg = config(gdir, "openvino")
    ex = build_executor("openvino", metas(gdir, "decode_256"), gdir, {}).load()
    ref = build_executor("onnxruntime", metas(gdir, "decode_256"), gdir, {}).load()
    _, (kv, kv_ref) = kv_pair(cfg, (ex, ref))
    meta = ex.graphs["decode_256"]
    feeds = seeded_feeds(meta, cfg, np.random.default_rng(0), kv)
    ex.run("decode_256", feeds)
    g = ex._handles["decode_256"]
    g.request.set_tensor("logits", ov.Tensor(np.zeros(meta.output("logits").shape, np.float32)))
    g.verified = False
    for _ in range(2):
        got = ex.run("decode_256", feeds)
        assert ex.copied_outputs("decode_256") == ("logits",)
        want = ref.run("decode_256", {**feeds, "past_kv": kv_ref})
        np.testing.assert_allclose(got["logits"], want["logits"], rtol=TOL, atol=TOL)
    ex.close()
    ref.close()


# ------------------------------------------------------------------------------------------ options
def test_options_are_validated(demo_graphs):
    gdir = str(demo_graphs["vlm_demo"])
    m = metas(gdir, "decode_256")
    with pytest.raises(ValueError, match=r"executor\.options\.precison: unknown field \(choices: device, precision.*"
                                         r"did you mean 'precision'"):
        build_executor("openvino", m, gdir, {"precison": "f32"})
    with pytest.raises(ValueError, match=r"executor\.options\.precision: 'fp64' is not allowed \(choices: f32, f16, "
                                         r"bf16, default"):
        build_executor("openvino", m, gdir, {"precision": "fp64"})
    for key, value, error in (("num_streams", -1, "-1 is below the minimum 0"),
                              ("num_streams", True, "expected an integer, got True"),
                              ("inference_num_threads", "2", "expected an integer, got '2'")):
        with pytest.raises(ValueError, match=rf"executor\.options\.{key}: {error}"):
            build_executor("openvino", m, gdir, {key: value})
    with pytest.raises(ValueError, match=r"executor\.options\.properties: expected a mapping"):
        build_executor("openvino", m, gdir, {"properties": ["ENABLE_CPU_PINNING"]})
    with pytest.raises(ValueError, match=r"executor\.options\.cache_dir: expected a string"):
        build_executor("openvino", m, gdir, {"cache_dir": 3})
    # the factory passes the mock's latency_ms to every backend; it is not an error here
    build_executor("openvino", m, gdir, {"latency_ms": {"decode": 1.0}})
    # a property the device rejects fails at compile time, naming the graph, file and device
    with pytest.raises(RuntimeError, match=r"cannot compile graph 'decode_256' \(.*decode_256\.onnx\) for device "
                                           r"'CPU':.*NO_SUCH_PROPERTY"):
        build_executor("openvino", m, gdir, {"properties": {"NO_SUCH_PROPERTY": 1}}).load()


def test_precision_hint_and_properties_reach_the_compiled_model(demo_graphs):
    gdir = str(demo_graphs["vlm_demo"])
    ex = build_executor("openvino", metas(gdir, "decode_256"), gdir,
                        {"inference_num_threads": 1, "properties": {"ENABLE_CPU_PINNING": False}}).load()
    compiled = ex._handles["decode_256"].compiled
    assert str(compiled.get_property("INFERENCE_PRECISION_HINT")) in ("<Type: 'float32'>", "f32")
    assert compiled.get_property("INFERENCE_NUM_THREADS") == 1
    assert compiled.get_property("ENABLE_CPU_PINNING") is False
    ex.close()
    assert "INFERENCE_PRECISION_HINT" not in build_executor("openvino", [], gdir,
                                                            {"precision": "default"}).compile_config


def test_a_device_that_is_not_present_is_named_with_the_available_ones(demo_graphs):
    gdir = str(demo_graphs["vlm_demo"])
    m = metas(gdir, "decode_256")
    available = ov.Core().available_devices
    missing = [d for d in ("NPU", "GPU") if d not in available]
    if not missing:
        pytest.skip("this machine has both a GPU and an NPU")
    listed = r".*".join(re.escape(d) for d in available)
    for device in (missing[0], f"{missing[0]}.1", f"AUTO:{missing[0]},CPU"):
        with pytest.raises(ValueError, match=rf"device '{missing[0]}(\.1)?' is not available.*available: "
                                             rf"{listed}.*driver"):
            build_executor("openvino", m, gdir, {"device": device})
    with pytest.raises(ValueError, match=r"only AUTO, MULTI, HETERO, BATCH take a device list"):
        build_executor("openvino", m, gdir, {"device": "CPU:GPU"})
    with pytest.raises(ValueError, match=r"executor\.options\.device: expected a device name"):
        build_executor("openvino", m, gdir, {"device": ""})


def test_auto_device_runs_with_the_f32_hint_on_the_cpu(demo_graphs):
    gdir = str(demo_graphs["vlm_demo"])
    cfg = config(gdir, "openvino")
    ex = build_executor("openvino", metas(gdir, "decode_256"), gdir, {"device": "AUTO"}).load()
    assert ex.compile_config["DEVICE_PROPERTIES"]["CPU"]["INFERENCE_PRECISION_HINT"] == "f32"
    ref = build_executor("onnxruntime", metas(gdir, "decode_256"), gdir, {}).load()
    _, (kv, kv_ref) = kv_pair(cfg, (ex, ref))
    feeds = seeded_feeds(ex.graphs["decode_256"], cfg, np.random.default_rng(0), kv)
    np.testing.assert_allclose(ex.run("decode_256", feeds)["logits"],
                               ref.run("decode_256", {**feeds, "past_kv": kv_ref})["logits"], rtol=TOL, atol=TOL)
    ex.close()
    ref.close()


# ------------------------------------------------------------------------------------------ cache
def test_cache_dir_is_filled_once_and_used_by_the_next_load(demo_graphs, tmp_path):
    gdir = tmp_path / "graphs"
    shutil.copytree(str(demo_graphs["vlm_demo"]), gdir)
    gdir = str(gdir)
    cfg = config(gdir, "openvino")
    names = ("vision_encoder", "prefill_32", "decode_256")
    outputs, paths = [], []
    for round_ in range(2):
        ex = build_executor("openvino", metas(gdir, *names), gdir, {"cache_dir": "ov_cache"}).load()
        # a relative cache_dir is relative to the graph set; one subdirectory per graph set and settings
        assert ex.cache_path.startswith(os.path.join(gdir, "ov_cache") + os.sep)
        assert [ex.loaded_from_cache(n) for n in names] == [round_ == 1] * len(names)
        blobs = [f for f in os.listdir(ex.cache_path) if f.endswith(".blob")]
        assert len(blobs) == len(names)
        info = json.loads(Path(ex.cache_path, "synflux-cache.json").read_text())
        assert info["openvino"] == ov.get_version() and info["device"] == "CPU"
        (kv,) = kv_pair(cfg, (ex,))[1]
        meta = ex.graphs["decode_256"]
        outputs.append(ex.run("decode_256", seeded_feeds(meta, cfg, np.random.default_rng(0), kv))["logits"])
        paths.append(ex.cache_path)
        ex.close()
    np.testing.assert_array_equal(outputs[0], outputs[1])
    assert paths[0] == paths[1]
    # a rebuilt graph file gets a fresh cache instead of a stale blob
    st = os.stat(os.path.join(gdir, "decode_256.onnx"))
    os.utime(os.path.join(gdir, "decode_256.onnx"), ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    ex = build_executor("openvino", metas(gdir, *names), gdir, {"cache_dir": "ov_cache"}).load()
    assert ex.cache_path != paths[0] and not ex.loaded_from_cache("decode_256")
    ex.close()


# ------------------------------------------------------------------------------------------ load errors
def test_missing_and_garbled_files_name_the_path(demo_graphs, tmp_path):
    src = str(demo_graphs["vlm_demo"])
    m = metas(src)
    with pytest.raises(graphset.GraphSetNotFoundError, match=r"manifest\.json not found.*synflux-build --config"):
        build_executor("openvino", m, str(tmp_path)).load()
    gdir = tmp_path / "graphs"
    shutil.copytree(src, gdir)
    os.remove(gdir / "decode_512.onnx")
    with pytest.raises(graphset.GraphSetNotFoundError, match=r"decode_512.*decode_512\.onnx not found.*synflux-build"):
        build_executor("openvino", m, str(gdir)).load()
    (gdir / "prefill_32.onnx").write_bytes(b"\x08\x07garbled" * 64)
    ex = build_executor("openvino", m, str(gdir))
    with pytest.raises(graphset.GraphSetError, match=r"prefill_32.*prefill_32\.onnx is not a readable ONNX model"):
        ex.load()
    assert not ex.loaded and not ex._handles


def test_a_graph_set_for_other_shapes_is_named(demo_graphs):
    gdir = str(demo_graphs["vlm_demo"])
    (m,) = metas(gdir, "decode_256")
    wider = GraphMeta(m.name, m.kind, m.inputs, (TensorSpec("logits", (1, 600), "float32"),) + m.outputs[1:],
                      m.group, m.file)
    with pytest.raises(ShapeError, match=r"decode_256.*output 'logits' is float32\[1, 512\] in the ONNX model but "
                                         r"float32\[1, 600\] in the graph contract.*synflux-build"):
        build_executor("openvino", [wider], gdir).load()
    kv = m.input("past_kv")
    shorter = GraphMeta(m.name, m.kind, m.inputs[:-1] + (TensorSpec("past_kv", kv.shape[:3] + (512, kv.shape[4]),
                                                                    "float32", True),), m.outputs, m.group, m.file)
    with pytest.raises(ShapeError, match=r"decode_256.*'past_kv\.0\.0' \(a view of 'past_kv'\)"):
        build_executor("openvino", [shorter], gdir).load()
    renamed = GraphMeta(m.name, m.kind, m.inputs[:1] + (TensorSpec("position", (1,), "int64"),) + m.inputs[2:],
                        m.outputs, m.group, m.file)
    with pytest.raises(ShapeError, match=r"decode_256.*missing \['position'\], unexpected \['cache_position'\]"):
        build_executor("openvino", [renamed], gdir).load()


def test_registry_entry(monkeypatch):
    from synflux_ros.backends import EXECUTORS

    assert resolve_executor_class("openvino").name == "openvino"
    entry = EXECUTORS["openvino"]
    monkeypatch.setitem(EXECUTORS, "openvino", entry.__class__(entry.target, requires=("openvino_missing_pkg",),
                                                              install_hint=entry.install_hint))
    with pytest.raises(BackendUnavailableError, match=r"'openvino'.*pip install openvino"):
        resolve_executor_class("openvino")


# ------------------------------------------------------------------------------------------ RTC vjp graphs
@pytest.fixture(scope="module", params=["pi0", "pi05", "groot"])
def vjp_graphs(request, tmp_path_factory, shipped_graphs):
    """vla_demo_orin with the vjp guidance of Real-Time Chunking (adds the action_expert_vjp graphs); as π0.5
    (adaptive norms, the state in the prompt) too; GR00T N1.7 at demo size (the dit_vjp graphs)."""
    from synflux_ros.buildtool.export import build
    from synflux_ros.core.config import load_config
    from synflux_ros.model.normalization import PI05_PROMPT
    if request.param == "groot":
        out = tmp_path_factory.mktemp("vjp_graphs") / "graphs"
        shutil.copytree(shipped_graphs("vla_groot_n17.yaml+vjp"), out)
        return out
    cfg = load_config(str(REPO / "config" / "vla_demo_orin.yaml")).with_overrides(
        execution={"mode": "rtc", "rtc": {"guidance": "vjp"}})
    if request.param == "pi05":
        cfg = cfg.with_overrides(action={"time_conditioning": "adarms", "state_input": "prompt", "state_dim": 8,
                                         "state_joints": [f"j{i}" for i in range(6)]},
                                 tokenizer={"prompt_template": PI05_PROMPT})
    out = tmp_path_factory.mktemp("vjp_graphs")
    build(cfg, str(out))
    return out


def test_vjp_graphs_validate_against_onnxruntime(vjp_graphs):
    """The correction multiplies by the transposes of square weights that the velocity multiplies by as they are;
    OpenVINO's CPU plugin got those products wrong (1e-2 relative) until the build put them the other way round."""
    from synflux_ros.buildtool.validate import validate
    from synflux_ros.core.config import load_config
    rows = {r.check: r for r in validate(str(vjp_graphs), "openvino")}
    vjp = [c for c in rows if c.startswith(("action_expert_vjp_", "dit_vjp_"))]
    cfg = load_config(str(vjp_graphs / "config.yaml"))
    kind = "dit_vjp" if cfg.groot_dit else "action_expert_vjp"
    buckets = cfg.llm.prefill_buckets if cfg.groot_dit else cfg.llm.decode_buckets
    assert sorted(vjp) == sorted(f"{kind}_{b}/{o}" for b in buckets for o in ("correction", "velocity"))
    assert all(r.passed for r in rows.values()), [r for r in rows.values() if not r.passed]
    assert all(rows[c].max_abs_diff <= TOL and rows[c].cosine > 0.999999 for c in vjp)
