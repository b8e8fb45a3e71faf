"""synflux-validate on graph sets built by synflux-build: a backend that computes the same passes, one
that does not fails with exit code 1, and the report names each graph output."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="synflux-build needs torch (make test installs it)")
pytest.importorskip("onnxruntime", reason="the reference backend needs onnxruntime")

from synflux_ros.buildtool.validate import main, validate  # noqa: E402
from synflux_ros.core.config import load_config  # noqa: E402
from synflux_ros.core.contract import graph_set  # noqa: E402
from synflux_ros.tools.harness import config_path  # noqa: E402


@pytest.mark.parametrize("name", ["vla_demo_orin", "vlm_demo"])
def test_the_same_computation_passes(demo_graphs, name):
    # onnxruntime without its graph optimiser against onnxruntime with it: same math, other kernels
    rows = validate(str(demo_graphs[name]), "onnxruntime", "onnxruntime", {"graph_optimization_level": "disable"}, {})
    expected = {f"{g.name}/{o.name}" for g in graph_set(load_config(config_path(f"{name}.yaml"))) for o in g.outputs}
    outputs = {r.check for r in rows if "/" in r.check}
    assert outputs == expected  # every output of every graph
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]
    assert all(r.max_abs_diff <= 1e-4 for r in rows if "/" in r.check)
    model_rows = [r for r in rows if "/" not in r.check]
    assert model_rows and all(r.cosine > 0.999 for r in model_rows)
    if name.startswith("vlm"):  # turn 2 reused turn 1's cache, and equals the same turn recomputed
        assert [r.check for r in model_rows] == ["greedy tokens, turn 1", "greedy tokens, turn 2",
                                                 "turn 2: cache reuse against recompute"]


def test_a_wrong_cache_append_fails_the_reuse_check(demo_graphs, monkeypatch):
    """A backend whose KV append is off by one position computes turn 1 right but not a reused turn 2."""
    from synflux_ros.model.backbone import LLMBackbone
    prefill = LLMBackbone.prefill

    def shifted(self, slot, start, embeds, *rest):
        return prefill(self, slot, start + 1 if start else 0, embeds, *rest)
    monkeypatch.setattr(LLMBackbone, "prefill", shifted)
    rows = {r.check: r for r in validate(str(demo_graphs["vlm_demo"]), "onnxruntime", "onnxruntime", {}, {})}
    assert not rows["turn 2: cache reuse against recompute"].passed


def test_a_backend_that_computes_something_else_fails(demo_graphs, tmp_path):
    # the mock ignores the weights: every output differs, and the exit code says so
    report = tmp_path / "report.json"
    code = main(["--graphs", str(demo_graphs["vlm_demo"]), "--backend", "mock", "--json", str(report)])
    assert code == 1
    data = json.loads(report.read_text())
    assert data["passed"] is False and data["backend"] == "mock"
    failed = {r["check"] for r in data["rows"] if not r["passed"]}
    assert "decode_256/logits" in failed and any(c.startswith("greedy tokens") for c in failed)


def test_reduced_precision_uses_cosine(demo_graphs):
    rows = validate(str(demo_graphs["vla_demo_orin"]), "onnxruntime", "onnxruntime", {}, {}, precision="reduced",
                    min_cosine=0.99)
    assert all(r.passed for r in rows)


def test_usage_errors_exit_2(tmp_path):
    assert main(["--graphs", str(tmp_path), "--backend", "onnxruntime"]) == 2
    with pytest.raises(SystemExit, match="--options: not JSON"):
        main(["--graphs", str(tmp_path), "--backend", "onnxruntime", "--options", "{bad"])


def test_the_command_is_installed(demo_graphs):
    from synflux_ros.tools.harness import executable
    r = subprocess.run([sys.executable, executable("synflux-validate"), "--graphs", str(demo_graphs["vla_demo_orin"]),
                        "--backend", "onnxruntime", "--options", '{"graph_optimization_level": "basic"}'],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "action chunk, frame 0" in r.stdout and "checks within the thresholds" in r.stdout


def test_rtc_guidance_inputs_are_fed_in_their_ranges():
    """Prefix weights and flow time are fractions; a Gaussian feed would validate the vjp graph far outside them."""
    import numpy as np
    from synflux_ros.graphkit.feeds import seeded_feeds
    cfg = load_config(config_path("vla_demo_orin.yaml")).with_overrides(
        execution={"mode": "rtc", "rtc": {"guidance": "vjp"}})
    vjp = [m for m in graph_set(cfg) if m.kind == "action_expert_vjp"]
    assert vjp
    for i, meta in enumerate(vjp):
        feeds = seeded_feeds(meta, cfg, np.random.default_rng([0, i]), kv=None)
        for name in ("weights", "flow_time"):
            spec = next(s for s in meta.inputs if s.name == name)
            assert feeds[name].shape == tuple(spec.shape) and feeds[name].dtype == np.dtype(spec.dtype)
            assert 0.0 <= feeds[name].min() and feeds[name].max() <= 1.0, name
        assert feeds["target"].std() > 0.5  # the leftover chunk: Gaussian like the noisy actions
