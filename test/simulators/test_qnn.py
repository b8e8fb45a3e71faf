"""QNN backend (onnxruntime + the QNN execution provider, HTP; Qualcomm's HTP simulator on an x86-64 host) on
the demo graph sets built with int32 token ids: every graph and the whole model against onnxruntime
(synflux-validate), int64 ids refused, options, context binaries written once and reused, an operator QNN
cannot run named at load, the exported embedding indexing with int32 ids directly."""
from __future__ import annotations

import json
import os
import platform
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

pytest.importorskip("onnxruntime", reason="the qnn backend runs on onnxruntime")
pytest.importorskip("onnxruntime_qnn", reason="the qnn backend needs onnxruntime-qnn (pip install onnxruntime-qnn)")
pytest.importorskip("torch", reason="synflux-build needs torch (make test installs it)")
onnx = pytest.importorskip("onnx")

from synflux_ros.backends import BackendUnavailableError, build_executor, resolve_executor_class  # noqa: E402
from synflux_ros.buildtool import validate as validate_cli  # noqa: E402
from synflux_ros.buildtool.validate import seeded_feeds, validate  # noqa: E402
from synflux_ros.buildtool.export import build  # noqa: E402
from synflux_ros.graphset import writer as graphset_writer  # noqa: E402
from synflux_ros.core.config import ConfigError, load_config  # noqa: E402
from synflux_ros.core.contract import GraphMeta, TensorSpec  # noqa: E402
from synflux_ros.core.contract import graph_set  # noqa: E402
from synflux_ros.graphset.reader import GraphSetError  # noqa: E402
from synflux_ros.runtimes.base import create_executor  # noqa: E402
from checkpoints import config, metas  # noqa: E402
from synflux_ros.runtimes.vlm import ChatRequest, VLMRuntime  # noqa: E402

pytestmark = pytest.mark.simulator

REPO = Path(__file__).resolve().parents[2]
CONFIGS = ("vla_demo_orin", "vlm_demo")
# The target SoC for the HTP simulator (an x86-64 host cannot detect one): SM8550, HTP v73.
SOC = 43
QNN = {"soc_model": SOC}


def int32_config(name: str, directory: Path) -> Path:
    """The shipped demo config with int32 token ids and the simulator's SoC in its executor options."""
    raw = yaml.safe_load((REPO / "config" / f"{name}.yaml").read_text())
    raw["llm"]["token_id_dtype"] = "int32"
    raw.setdefault("executor", {})["options"] = dict(QNN)
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def int32_graph_sets(tmp_path_factory):
    """The two demo configs built once with int32 token ids (random weights)."""
    out = {}
    for name in CONFIGS:
        d = tmp_path_factory.mktemp(f"{name}_i32")
        build(load_config(str(int32_config(name, d))), str(d / "graphs"))
        out[name] = str(d / "graphs")
    return out


# ------------------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("name", CONFIGS)
def test_every_graph_and_the_model_match_onnxruntime(int32_graph_sets, name):
    gdir = int32_graph_sets[name]
    cfg = load_config(os.path.join(gdir, "config.yaml"))
    rows = validate(gdir, "qnn", options=QNN, precision="reduced")
    graph_rows = [r for r in rows if "/" in r.check]
    assert len(graph_rows) == sum(len(m.outputs) for m in metas(gdir))
    # every output within the reduced-precision bar (the rotary table keeps long-context keys exact)
    failed = [r for r in rows if not r.passed]
    assert not failed, failed
    # the whole model: greedy tokens or action chunks as onnxruntime's
    model_rows = [r for r in rows if "/" not in r.check]
    assert model_rows and all(r.passed for r in model_rows)
    if cfg.mode == "vlm":
        assert all(r.detail.split("/")[0] == r.detail.split("/")[1].split()[0] for r in model_rows), model_rows


def test_every_node_runs_on_qnn_and_outputs_land_in_the_bound_buffers(int32_graph_sets):
    gdir = int32_graph_sets["vla_demo_orin"]
    cfg = config(gdir, "qnn", **QNN)
    names = ("embed_96", "prefill_96", "action_expert_160")
    ex = build_executor("qnn", metas(gdir, *names), gdir, QNN).load()
    assert ex.device_of("prefill_96") == "qnn:htp"
    kv = ex.alloc_tensor("kv", cfg.llm.kv_shape, cfg.llm.kv_dtype)
    for i, name in enumerate(names):
        meta = ex.graphs[name]
        ex.run(name, seeded_feeds(meta, cfg, np.random.default_rng(i), kv))
        g = ex._handles[name]
        so = g.session.get_session_options()
        assert so.get_session_config_entry("session.disable_cpu_ep_fallback") == "1"
        assert g.session.get_provider_options()["QNNExecutionProvider"]["soc_model"] == str(SOC)
        assert g.verified  # IOBinding: every output was written into its staging buffer
        if any(s.name == "past_kv" for s in meta.inputs):  # the KV slot is read in place
            assert g.bound["past_kv"] == kv.handle.ptr
    ex.close()


def test_other_backends_run_int32_ids(int32_graph_sets):
    """mock, onnxruntime and (where installed) openvino run the int32 graph set; the backbone feeds int32."""
    gdir = int32_graph_sets["vlm_demo"]
    backends = ["mock", "onnxruntime"]
    try:
        resolve_executor_class("openvino")
        backends.append("openvino")
    except BackendUnavailableError:
        pass
    tokens = {}
    for backend in backends:
        rt = VLMRuntime(config(gdir, backend))
        try:
            assert rt.backbone.id_dtype == np.int32
            tokens[backend] = rt.chat(ChatRequest("s", "hello robot", max_new_tokens=6, temperature=0.0)).token_ids
        finally:
            rt.close()
    assert all(len(t) >= 1 for t in tokens.values())
    if "openvino" in tokens:
        assert tokens["openvino"] == tokens["onnxruntime"]


# ------------------------------------------------------------------------------------------ token ids
def test_token_id_dtype_is_a_validated_config_field_that_shapes_the_graphs():
    base = load_config(str(REPO / "config" / "vlm_demo.yaml"))
    assert base.llm.token_id_dtype == "int64"
    with pytest.raises(ConfigError, match=r"llm\.token_id_dtype: 'int16' is not allowed \(choices: int64, int32\)"):
        base.with_overrides(llm={"token_id_dtype": "int16"})
    i32 = base.with_overrides(llm={"token_id_dtype": "int32"})
    assert i32.graph_hash() != base.graph_hash()
    ids = {m.name: m.input("input_ids").dtype for m in graph_set(i32) if m.kind in ("embed", "decode")}
    assert set(ids.values()) == {"int32"} and len(ids) == 5
    assert {s.dtype for m in graph_set(i32) for s in m.inputs if s.name != "input_ids" and "int" in s.dtype} == {
        "int64"}  # counts and positions stay int64


def test_the_embedding_gathers_with_the_int32_ids_directly(int32_graph_sets):
    gdir = int32_graph_sets["vlm_demo"]
    for name in ("embed_32", "decode_256"):
        model = onnx.load(os.path.join(gdir, f"{name}.onnx"), load_external_data=False)
        ids = next(i for i in model.graph.input if i.name == "input_ids")
        assert ids.type.tensor_type.elem_type == onnx.TensorProto.INT32
        weights = {t.name for t in model.graph.initializer}
        derived, found = {"input_ids"}, False
        for node in model.graph.node:  # topological order
            if not derived & set(node.input):
                continue
            assert node.op_type != "Cast", f"{name}: the ids are cast before the embedding ({node.name})"
            if node.op_type == "Gather" and node.input[0] in weights:
                found = True
                break
            derived |= set(node.output)
        assert found, f"{name}: no Gather of the embedding table on the ids"


def test_a_graph_set_with_int64_ids_is_refused_naming_the_file(int32_graph_sets, tmp_path, capsys):
    src = Path(int32_graph_sets["vlm_demo"])
    gdir = tmp_path / "graphs"
    shutil.copytree(src, gdir)
    # the same graph set as the runtime sees one built with int64 ids
    manifest = json.loads((gdir / "manifest.json").read_text())
    for g in manifest["graphs"]:
        for t in g["inputs"]:
            if t["name"] == "input_ids":
                t["dtype"] = "int64"
    graphset_writer.write_manifest(str(gdir), manifest)
    raw = yaml.safe_load((gdir / "config.yaml").read_text())
    raw["llm"]["token_id_dtype"] = "int64"
    (gdir / "config.yaml").write_text(yaml.safe_dump(raw))
    cfg = config(str(gdir), "qnn", **QNN)
    with pytest.raises(GraphSetError, match=r"graph 'embed_32' \(.*embed_32\.onnx\) takes input_ids as int64.*"
                                            r"llm\.token_id_dtype: int32.*synflux-build"):
        create_executor(cfg)
    # synflux-validate: a load error, exit code 2, the reason on stderr
    assert validate_cli.main(["--graphs", str(gdir), "--backend", "qnn", "--options", json.dumps(QNN)]) == 2
    assert "token_id_dtype: int32" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ options
def test_options_are_validated(int32_graph_sets, monkeypatch):
    gdir = int32_graph_sets["vlm_demo"]
    m = metas(gdir, "decode_256")
    with pytest.raises(ValueError, match=r"qnn executor: executor\.options\.soc_modle: unknown field .*did you mean 'soc_model'"):
        build_executor("qnn", m, gdir, {"soc_modle": SOC})
    with pytest.raises(ValueError, match=r"executor\.options\.providers: unknown field"):  # the provider is QNN, always
        build_executor("qnn", m, gdir, {**QNN, "providers": ["CPUExecutionProvider"]})
    with pytest.raises(ValueError, match=r"executor\.options\.optimized_model_dir: unknown field .*context_cache"):
        build_executor("qnn", m, gdir, {**QNN, "optimized_model_dir": "x"})
    for key, value, allowed in (("backend", "cpu", "htp, gpu"), ("precision", "int8", "fp32, fp16"),
                                ("performance_mode", "turbo", "default, burst")):
        with pytest.raises(ValueError, match=rf"executor\.options\.{key}: '{value}' is not allowed \(choices: {allowed}"):
            build_executor("qnn", m, gdir, {**QNN, key: value})
    for soc in ("43", 0, True):
        with pytest.raises(ValueError, match=r"executor\.options\.soc_model: (expected an integer|0 is below the minimum 1)"):
            build_executor("qnn", m, gdir, {"soc_model": soc})
    with pytest.raises(ValueError, match=r"executor\.options\.provider_options: expected a mapping"):
        build_executor("qnn", m, gdir, {**QNN, "provider_options": ["vtcm_mb"]})
    with pytest.raises(ValueError, match=r"executor\.options\.provider_options\.soc_model: set by the executor's own options"):
        build_executor("qnn", m, gdir, {"provider_options": {"soc_model": "43"}, **QNN})
    with pytest.raises(ValueError, match=r"executor\.options\.context_cache: expected true, false or a directory path"):
        build_executor("qnn", m, gdir, {**QNN, "context_cache": 3})
    with pytest.raises(ValueError, match=r"executor\.options\.intra_op_num_threads: -1 is below the minimum 0"):
        build_executor("qnn", m, gdir, {**QNN, "intra_op_num_threads": -1})
    # the simulator needs the target SoC; a Snapdragon device detects it
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    with pytest.raises(ValueError, match=r"x86-64 host.*simulator.*soc_model"):
        build_executor("qnn", m, gdir, {"precision": "fp16"})
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert build_executor("qnn", m, gdir, {}).provider_options == {"backend_type": "htp",
                                                                    "enable_htp_fp16_precision": "0"}
    monkeypatch.undo()
    # the mock's latency_ms, which the factory hands to every backend, is not an error
    ex = build_executor("qnn", m, gdir, {**QNN, "precision": "fp16", "performance_mode": "burst",
                                         "provider_options": {"vtcm_mb": 8}, "latency_ms": {"decode": 1.0}})
    assert ex.provider_options == {"backend_type": "htp", "enable_htp_fp16_precision": "1", "soc_model": "43",
                                   "htp_performance_mode": "burst", "vtcm_mb": "8"}
    ex.load()
    got = ex._handles["decode_256"].session.get_provider_options()["QNNExecutionProvider"]
    assert {k: got.get(k) for k in ("htp_performance_mode", "enable_htp_fp16_precision", "vtcm_mb")} == {
        "htp_performance_mode": "burst", "enable_htp_fp16_precision": "1", "vtcm_mb": "8"}
    ex.close()


def test_an_operator_qnn_cannot_run_is_named(tmp_path):
    """A graph holding an operator the HTP lacks fails at load (no CPU fallback), naming the operator."""
    from onnx import TensorProto, helper

    meta = GraphMeta("vision_encoder", "vision_encoder", (TensorSpec("pixel_values", (2, 3, 3), "float32"),),
                     (TensorSpec("vision_embeds", (2, 1), "float32"),), file="vision_encoder.onnx")
    graph = helper.make_graph(
        [helper.make_node("Relu", ["pixel_values"], ["r"]), helper.make_node("Det", ["r"], ["d"], name="the_det"),
         helper.make_node("Unsqueeze", ["d", "one"], ["vision_embeds"])], "g",
        [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, [2, 3, 3])],
        [helper.make_tensor_value_info("vision_embeds", TensorProto.FLOAT, [2, 1])],
        [helper.make_tensor("one", TensorProto.INT64, [1], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "vision_encoder.onnx"))
    graphset_writer.write_manifest(str(tmp_path), {"model": "det", "graphs": [meta]})
    ex = build_executor("qnn", [meta], str(tmp_path), QNN)
    with pytest.raises(RuntimeError, match=r"cannot load graph 'vision_encoder' from .*vision_encoder\.onnx on QNN "
                                           r"htp, soc_model 43: QNN cannot run 1 of its operators \(Det 'the_det'\)"):
        ex.load()
    assert not ex.loaded
    if platform.machine().lower() in ("x86_64", "amd64"):  # no Adreno GPU: QNN's GPU backend does not start
        with pytest.raises(RuntimeError, match=r"on QNN gpu: QNN took none of its 3 operators: the QNN gpu backend "
                                               r"did not start on this machine"):
            build_executor("qnn", [meta], str(tmp_path), {"backend": "gpu"}).load()
    # the same graph runs on onnxruntime (on the CPU)
    ref = build_executor("onnxruntime", [meta], str(tmp_path), {}).load()
    x = np.random.default_rng(0).standard_normal((2, 3, 3)).astype(np.float32)
    np.testing.assert_allclose(ref.run("vision_encoder", {"pixel_values": x})["vision_embeds"][:, 0],
                               np.linalg.det(np.maximum(x, 0)), rtol=1e-4, atol=1e-5)
    ref.close()


def test_the_rtc_vjp_graphs_run_on_qnn_as_on_onnxruntime(tmp_path):
    """The vjp guidance's graph multiplies by each expert weight in two roles (forward and backward products); the
    executor gives the second role a private copy (backends/qnn/weights.py), so QNN takes the graph whole and
    computes the velocity and the correction as onnxruntime does."""
    raw = yaml.safe_load(int32_config("vla_demo_orin", tmp_path).read_text())
    raw["execution"] = {"mode": "rtc", "rtc": {"guidance": "vjp"}}
    (tmp_path / "vjp.yaml").write_text(yaml.safe_dump(raw))
    gdir = str(tmp_path / "graphs")
    build(load_config(str(tmp_path / "vjp.yaml")), gdir)
    rows = {r.check: r for r in validate(gdir, "qnn", options=QNN, precision="reduced")}
    vjp = sorted(c for c in rows if c.startswith("action_expert_vjp_"))
    assert vjp == ["action_expert_vjp_160/correction", "action_expert_vjp_160/velocity",
                   "action_expert_vjp_256/correction", "action_expert_vjp_256/velocity"]
    assert all(rows[c].passed and rows[c].cosine > 0.99999 for c in vjp), [rows[c] for c in vjp]


def test_groot_s_rtc_vjp_graph_runs_on_qnn_as_on_onnxruntime(tmp_path):
    """GR00T N1.7's dit_vjp graph (demo size, its first prefill bucket) on the HTP simulator."""
    from checkpoints import demo_size
    raw = demo_size(yaml.safe_load((REPO / "config" / "vla_groot_n17.yaml").read_text()))
    raw["llm"].update(token_id_dtype="int32", prefill_buckets=raw["llm"]["prefill_buckets"][:1])
    raw["execution"] = {"mode": "rtc", "rtc": {"guidance": "vjp"}}
    raw.setdefault("executor", {})["options"] = dict(QNN)
    (tmp_path / "groot.yaml").write_text(yaml.safe_dump(raw))
    gdir = str(tmp_path / "graphs")
    build(load_config(str(tmp_path / "groot.yaml")), gdir)
    rows = {r.check: r for r in validate(gdir, "qnn", options=QNN, precision="reduced")}
    vjp = sorted(c for c in rows if c.startswith("dit_vjp_"))
    bucket = raw["llm"]["prefill_buckets"][0]
    assert vjp == [f"dit_vjp_{bucket}/correction", f"dit_vjp_{bucket}/velocity"]
    # float16 on the HTP: the DiT's velocities at demo size are small (about 4e-3), so their relative error is
    # larger than the π0 expert's; the Jacobian term of the correction is below float16's resolution of the
    # error it is added to, and is checked on the float32 backends
    assert all(rows[c].passed and rows[c].cosine > 0.9999 for c in vjp), [rows[c] for c in vjp]


# ------------------------------------------------------------------------------------------ context binaries
def test_context_binaries_are_written_once_and_reused(int32_graph_sets, tmp_path):
    gdir = tmp_path / "graphs"
    shutil.copytree(int32_graph_sets["vlm_demo"], gdir)
    gdir = str(gdir)
    cfg = config(gdir, "qnn", **QNN)
    names = ("vision_encoder", "embed_32", "decode_256")
    outputs, stamps, paths = [], [], []
    for round_ in range(2):
        ex = build_executor("qnn", metas(gdir, *names), gdir, {**QNN, "context_cache": True}).load()
        # context_cache: true -> qnn_context/ beside the graph set, one subdirectory per graph set and settings
        assert ex.context_path.startswith(os.path.join(gdir, "qnn_context") + os.sep)
        files = sorted(os.listdir(ex.context_path))
        assert files == sorted(["manifest.json"] + [f"{n}.onnx" for n in names] + [f"{n}_qnn.bin" for n in names])
        info = json.loads(Path(ex.context_path, "manifest.json").read_text())["qnn_context"]
        assert info["provider_options"]["soc_model"] == str(SOC) and info["qnn_sdk"]
        for n in names:  # each session runs an EPContext model of the cache
            assert ex._handles[n].path == os.path.join(ex.context_path, f"{n}.onnx")
            assert ex.loaded_from_context(n)
            ctx = onnx.load(ex._handles[n].path, load_external_data=False)
            assert [node.op_type for node in ctx.graph.node] == ["EPContext"]
        kv = ex.alloc_tensor("kv", cfg.llm.kv_shape, cfg.llm.kv_dtype)
        meta = ex.graphs["decode_256"]
        outputs.append(ex.run("decode_256", seeded_feeds(meta, cfg, np.random.default_rng(0), kv))["logits"])
        stamps.append({f: os.stat(os.path.join(ex.context_path, f)).st_mtime_ns for f in files})
        paths.append(ex.context_path)
        ex.close()
    assert paths[0] == paths[1] and stamps[0] == stamps[1]  # the second load compiled nothing
    np.testing.assert_array_equal(outputs[0], outputs[1])
    # a cache missing a binary is compiled again in place
    os.remove(os.path.join(paths[0], "embed_32_qnn.bin"))
    ex = build_executor("qnn", metas(gdir, *names), gdir, {**QNN, "context_cache": True}).load()
    assert ex.context_path == paths[0] and os.path.isfile(os.path.join(paths[0], "embed_32_qnn.bin"))
    ex.close()
    # a run-time option (performance mode) reuses the binaries; another SoC or a rebuilt graph does not
    ex = build_executor("qnn", metas(gdir, *names), gdir,
                        {**QNN, "context_cache": True, "performance_mode": "burst"}).load()
    assert ex.context_path == paths[0]
    ex.close()
    for options, where in (({"soc_model": 57, "context_cache": "ctx"}, os.path.join(gdir, "ctx")),
                           ({**QNN, "context_cache": str(tmp_path / "abs")}, str(tmp_path / "abs"))):
        ex = build_executor("qnn", metas(gdir, "embed_32"), gdir, options).load()
        assert ex.context_path.startswith(where + os.sep)  # relative to the graph set, or absolute
        ex.close()
    st = os.stat(os.path.join(gdir, "decode_256.onnx"))
    os.utime(os.path.join(gdir, "decode_256.onnx"), ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    ex = build_executor("qnn", metas(gdir, *names), gdir, {**QNN, "context_cache": True}).load()
    assert os.path.dirname(ex.context_path) == os.path.dirname(paths[0]) and ex.context_path != paths[0]
    ex.close()


def test_registry_entry(monkeypatch):
    from synflux_ros.backends import EXECUTORS

    assert resolve_executor_class("qnn").name == "qnn"
    entry = EXECUTORS["qnn"]
    assert entry.requires == ("onnxruntime", "onnxruntime_qnn")
    monkeypatch.setitem(EXECUTORS, "qnn", entry.__class__(entry.target, requires=("onnxruntime_qnn_missing",),
                                                          install_hint=entry.install_hint))
    with pytest.raises(BackendUnavailableError, match=r"'qnn'.*pip install onnxruntime-qnn"):
        resolve_executor_class("qnn")
