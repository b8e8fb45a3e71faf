"""The TensorRT build path, run for real through TensorRT-RTX on this CPU: every graph of every shipped config
(demo-sized) is parsed and built into engines by the same builder code that JetPack's TensorRT runs on the
robot, one engine per graph kind with a profile per bucket; engines are cached by key; errors name what is
wrong. TensorRT-RTX cannot run engines (no GPU here), so nothing here executes one."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import yaml

trt = pytest.importorskip("tensorrt_rtx_bindings", reason="TensorRT-RTX (requirements-build.txt) builds the engines")
pytest.importorskip("torch", reason="synflux-build needs torch (make test installs it)")

from synflux_ros.backends import BackendUnavailableError, build_executor  # noqa: E402
from synflux_ros.backends.tensorrt import plan  # noqa: E402
from synflux_ros.backends.tensorrt import build as trt_build  # noqa: E402
from synflux_ros.buildtool.export import build  # noqa: E402
from synflux_ros.graphset import reader as graphset  # noqa: E402
from synflux_ros.core.config import load_config  # noqa: E402
from synflux_ros.tools.harness import config_path, share_dir  # noqa: E402

from checkpoints import demo_size  # noqa: E402

CONFIGS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(share_dir() or "", "config", "*.yaml")))
RTX = trt_build.TensorRTOptions(module="tensorrt_rtx_bindings", sm="8.6")
"""TensorRT-RTX on a CPU needs the compute capability named; 8.6 is one it builds for."""


def demo_config(tmp_path, name: str) -> str:
    with open(config_path(name), encoding="utf-8") as fh:
        raw = demo_size(yaml.safe_load(fh))
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.fixture(scope="module")
def vla_set(tmp_path_factory):
    d = tmp_path_factory.mktemp("trt_vla")
    cfg = load_config(demo_config(d, "vla_demo_orin.yaml"))
    build(cfg, str(d / "graphs"), "tensorrt", options=RTX)
    return cfg, d / "graphs"


def sidecar(graph_dir, opts=RTX) -> dict:
    with open(os.path.join(trt_build.engine_dir(str(graph_dir), opts.sm, opts), plan.SIDECAR), encoding="utf-8") as fh:
        return json.load(fh)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_builds_one_engine_per_kind_with_a_profile_per_bucket(tmp_path, name):
    cfg = load_config(demo_config(tmp_path, name))
    out = tmp_path / "graphs"
    if cfg.llm.mrope_section and not cfg.groot_dit:  # Qwen3-VL's multimodal LLM inputs are not profiled yet
        with pytest.raises(plan.PlanError, match="does not take the LLM inputs deepstack_embeds, position_ids"):
            build(cfg, str(out), "tensorrt", options=RTX)
        return
    build(cfg, str(out), "tensorrt", options=RTX)
    side = sidecar(out)
    metas = graphset.graph_metas(str(out), graphset.read_manifest(str(out)))
    expected = plan.plan_engines(metas)
    assert side["format"] == plan.FORMAT and side["tensorrt"] == trt.__version__ and side["sm"] == "8.6"
    assert sorted(side["engines"]) == sorted(e.name for e in expected)
    for spec in expected:
        entry = side["engines"][spec.name]
        assert entry["profiles"] == [p.graph for p in spec.profiles]
        path = os.path.join(trt_build.engine_dir(str(out), "8.6", RTX), entry["file"])
        assert os.path.getsize(path) == entry["bytes"] > 0
    # every graph of the contract is served by some engine profile (decode through embed_1 + llm)
    routes = plan.plan_routes(metas, expected)
    assert set(routes) == {m.name for m in metas}
    # the buckets of a kind share one engine (decode steps the llm's): an engine per kind, fewer engines than
    # graphs wherever a kind has several buckets (vla_smolvla has one of each)
    kinds = [m.kind for m in metas]
    assert len(expected) == len(set(kinds) - {"decode"})
    assert len(expected) < len(metas) or len(set(kinds)) == len(kinds)


def test_unchanged_engines_are_not_rebuilt_and_force_rebuilds(vla_set, capsys):
    cfg, out = vla_set
    edir = trt_build.engine_dir(str(out), "8.6", RTX)
    before = {f: os.stat(os.path.join(edir, f)).st_mtime_ns for f in os.listdir(edir) if f.endswith(".engine")}
    capsys.readouterr()
    build(cfg, str(out), "tensorrt", options=RTX)
    err = capsys.readouterr().out
    assert err.count("unchanged, skipped") == len(before) + 1  # + the profiled ONNX
    assert "building" not in err
    assert before == {f: os.stat(os.path.join(edir, f)).st_mtime_ns for f in before}
    # another precision / device is another build beside it, keyed separately
    assert plan.device_tag("8.6", None, "fp32") == os.path.basename(edir)
    build(cfg, str(out), "tensorrt", options=RTX, force=True)
    err = capsys.readouterr().out
    assert err.count("building") == len(before)
    assert all(os.stat(os.path.join(edir, f)).st_mtime_ns != t for f, t in before.items())


def test_a_changed_graph_set_rebuilds_only_its_engines(tmp_path, capsys):
    cfg = load_config(demo_config(tmp_path, "vlm_demo.yaml"))
    out = str(tmp_path / "graphs")
    build(cfg, out, "tensorrt", options=RTX)
    capsys.readouterr()
    more = cfg.with_overrides(llm={"decode_buckets": list(cfg.llm.decode_buckets) + [cfg.llm.max_seq_len * 2],
                                   "max_seq_len": cfg.llm.max_seq_len * 2})
    build(more, out, "tensorrt", options=RTX)
    err = capsys.readouterr().out
    # the vision encoder's and the embedding's ONNX and profiles did not change; the llm has a new profile
    assert "vision_encoder: unchanged, skipped" in err and "embed: unchanged, skipped" in err
    assert "llm: building" in err


def test_the_build_names_an_operator_tensorrt_cannot_parse(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    node = helper.make_node("FancyOp", ["x"], ["y"], name="the_fancy_node", domain="com.example")
    model = helper.make_model(helper.make_graph([node], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    onnx.save(model, str(tmp_path / "bad.onnx"))
    spec = plan.EngineSpec("bad", "vision_encoder", "bad.onnx", (plan.Profile("bad", ()),))
    with pytest.raises(trt_build.TensorRTBuildError, match=r"engine bad: .*the_fancy_node.*FancyOp"):
        trt_build.build_engine(trt, str(tmp_path), spec, RTX)


def test_dla_without_gpu_fallback_names_the_layers_dla_cannot_run(vla_set):
    """TensorRT-RTX has no DLA, so every layer is one DLA cannot run: the check that JetPack's TensorRT
    applies per layer on an Orin reports them by name and type."""
    _, out = vla_set
    opts = trt_build.TensorRTOptions(module="tensorrt_rtx_bindings", sm="8.6", precision="fp16", dla_core=0,
                                     gpu_fallback=False)
    spec = plan.plan_engines(graphset.graph_metas(str(out), graphset.read_manifest(str(out))), plan.DLA_CAPABLE)[0]
    assert spec.dla and spec.name == "vision_encoder"
    logger = trt.Logger(trt.Logger.ERROR)
    builder, network, _parser = trt_build.parse(trt, logger, str(out / spec.onnx), spec.name)
    config = builder.create_builder_config()
    config.default_device_type = trt.DeviceType.DLA
    layers = trt_build.dla_fallback_layers(config, network)
    assert len(layers) == network.num_layers > 0
    with pytest.raises(trt_build.TensorRTBuildError, match=r"engine vision_encoder: \d+ layers cannot run on DLA core 0 "
                                                           r"and GPU fallback is off: .+ \(.+\)"):
        trt_build.check_dla(spec, layers, opts)
    assert trt_build.check_dla(spec, layers, trt_build.TensorRTOptions(
        module="tensorrt_rtx_bindings", sm="8.6", precision="fp16", dla_core=0)) is None


def run_build(*args):
    return subprocess.run([sys.executable, "-m", "synflux_ros.buildtool", *args], capture_output=True, text=True,
                          timeout=600)


def test_cli_check_reports_every_engine(vla_set):
    _, out = vla_set
    res = run_build("--config", str(out / "config.yaml"), "--out", str(out), "--backend", "tensorrt",
                    "--tensorrt-module", "tensorrt_rtx_bindings", "--sm", "8.6", "--check")
    assert res.returncode == 0, res.stderr
    for name in ("vision_encoder", "embed", "llm", "action_expert"):
        assert any(line.startswith(name) and " yes " in line for line in res.stdout.splitlines()), res.stdout
    assert "4 of 4 graphs compile on tensorrt" in res.stdout


def test_cli_errors_are_clear(vla_set, tmp_path):
    _, out = vla_set
    cfg = str(out / "config.yaml")
    res = run_build("--config", cfg, "--out", str(tmp_path / "x"), "--backend", "tensorrt")
    assert res.returncode == 2 and "cannot import 'tensorrt'" in res.stderr and "JetPack" in res.stderr
    res = run_build("--config", cfg, "--out", str(out), "--backend", "tensorrt", "--fp16",
                    "--tensorrt-module", "tensorrt_rtx_bindings", "--sm", "8.6")
    assert res.returncode == 2 and "no BuilderFlag.FP16" in res.stderr
    res = run_build("--config", cfg, "--out", str(out), "--backend", "tensorrt", "--dla-core", "0")
    assert res.returncode == 2 and "DLA runs fp16 or int8 only" in res.stderr
    res = run_build("--config", cfg, "--out", str(out), "--backend", "tensorrt", "--int8")
    assert res.returncode == 2 and "--int8 needs --calib" in res.stderr
    res = run_build("--config", cfg, "--out", str(out), "--backend", "onnxruntime", "--fp16")
    assert res.returncode == 2 and "--fp16 is for --backend tensorrt, not 'onnxruntime'" in res.stderr
    res = run_build("--config", cfg, "--out", str(out), "--backend", "tensorrt", "--sm", "87",
                    "--tensorrt-module", "tensorrt_rtx_bindings")
    assert res.returncode == 2 and "expected MAJOR.MINOR" in res.stderr


def test_without_tensorrt_the_backend_says_how_to_install_it(vla_set):
    _, out = vla_set
    metas = graphset.graph_metas(str(out), graphset.read_manifest(str(out)))
    with pytest.raises(BackendUnavailableError, match=r"'tensorrt'.*JetPack"):
        build_executor("tensorrt", metas, str(out), {})


def test_without_a_device_the_builder_asks_for_the_compute_capability():
    with pytest.raises(trt_build.TensorRTBuildError, match=r"no CUDA device to build for \(cudaError\w+\); pass --sm"):
        trt_build.device_sm()
