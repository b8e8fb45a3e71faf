"""GR00T N1.7's shape-polymorphic graphs for TensorRT: one ONNX graph per kind (features, vl_context, dit and
the RTC vjp guidance's dit_vjp) with the prompt's rows as the dynamic dim T, numerically equal (onnxruntime) to
the static <kind>_<p> graphs at T = p, to the torch modules at a T no bucket has, and reading one copy of the
weights."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from synflux_ros.backends.tensorrt import build_onnx as tro, plan  # noqa: E402
from synflux_ros.buildtool import export as build_tool  # noqa: E402
from synflux_ros.core.config import from_dict  # noqa: E402
from synflux_ros.core.contract import graph_set  # noqa: E402
from synflux_ros.graphkit.feeds import seeded_feeds  # noqa: E402
from synflux_ros.graphkit.torch_models import build_graph_modules  # noqa: E402
from synflux_ros.graphset import reader as graphset  # noqa: E402

from checkpoints import demo_size  # noqa: E402

torch.set_num_threads(2)
CONFIG = Path(__file__).resolve().parents[3] / "config" / "vla_groot_n17.yaml"
KINDS = ["features", "vl_context", "dit", "dit_vjp"]


def session(src):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(src if isinstance(src, str) else src.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def groot(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("groot_profiled")
    raw = demo_size(yaml.safe_load(CONFIG.read_text()))
    raw["execution"] = {"mode": "rtc", "rtc": {"guidance": "vjp"}}
    cfg = from_dict(raw)
    gm = build_graph_modules(cfg, seed=0)
    metas = {m.name: m for m in graph_set(cfg) if m.kind in KINDS}
    static = {n: session(build_tool.export_graph(gm.modules[n], m, str(tmp))) for n, m in metas.items()}
    paths = tro.export_profiled_graphs(cfg, gm, str(tmp / "profiled"))
    return cfg, gm, metas, static, paths


def test_one_graph_per_kind_with_the_prompt_rows_dynamic(groot):
    cfg, _, metas, _, paths = groot
    assert list(paths) == tro.profiled_graph_names(cfg) == ["embed"] + KINDS
    for kind in KINDS:
        model = onnx.load(paths[kind], load_external_data=False)
        tro.check_profiled_io(model, cfg, kind)
        dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
                for v in list(model.graph.input) + list(model.graph.output)}
        for name, axis in plan.GROOT_KINDS[kind].items():
            if name in dims:
                assert dims[name][axis] == "T", (kind, name, dims[name])
    # the vjp graph reads the DiT's weights: stored once
    dit = {(t.offset, t.length) for t in graphset.external_initializers(paths["dit"])}
    vjp = {(t.offset, t.length) for t in graphset.external_initializers(paths["dit_vjp"])}
    assert dit and vjp <= dit


def test_each_kind_at_a_bucket_equals_its_static_graph(groot):
    cfg, _, metas, static, paths = groot
    prof = {k: session(paths[k]) for k in KINDS}
    for i, (name, meta) in enumerate(sorted(metas.items())):
        feeds = seeded_feeds(meta, cfg, np.random.default_rng([3, i]), None)
        want = static[name].run(None, feeds)
        got = prof[meta.kind].run(None, feeds)
        assert len(got) == len(want) == len(meta.outputs)
        for spec, g, w in zip(meta.outputs, got, want):
            assert g.shape == w.shape, (name, spec.name)
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * max(1.0, np.abs(w).max()),
                                       err_msg=f"{name}/{spec.name}")


def test_a_size_no_bucket_has_matches_the_torch_modules(groot):
    """Nothing was frozen to the trace's example size: at T = 11 the graphs equal the modules run eagerly."""
    from synflux_ros.graphkit.torch_models.groot import DiTGraph, FeaturesGraph, VLContextGraph
    cfg, gm, metas, _, paths = groot
    t = 11
    assert t not in cfg.llm.prefill_buckets
    p = cfg.llm.prefill_buckets[0]
    modules = {"features": FeaturesGraph(gm.modules[f"features_{p}"].lm, None, gm.modules[f"features_{p}"].deepstack),
               "vl_context": VLContextGraph(gm.modules[f"vl_context_{p}"].head, None),
               "dit": DiTGraph(gm.modules[f"dit_{p}"].head, None)}
    rng = np.random.default_rng(5)
    for kind, module in modules.items():
        meta = metas[f"{kind}_{p}"]
        axes = plan.GROOT_KINDS[kind]
        shaped = [spec.__class__(spec.name, tuple(t if i == axes.get(spec.name) else d
                                                 for i, d in enumerate(spec.shape)), spec.dtype)
                  for spec in meta.inputs]
        feeds = seeded_feeds(meta.__class__(meta.name, meta.kind, tuple(shaped), meta.outputs, group=meta.group,
                                            file=meta.file, attrs=meta.attrs), cfg, rng, None)
        if "num_tokens" in feeds:
            feeds["num_tokens"] = np.array([t - 2], np.int64)
        with torch.no_grad():
            want = module(*[torch.from_numpy(feeds[s.name]) for s in meta.inputs])
        want = (want,) if isinstance(want, torch.Tensor) else want
        got = session(paths[kind]).run(None, feeds)
        for spec, g, w in zip(meta.outputs, got, want):
            w = w.numpy()
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * max(1.0, np.abs(w).max()),
                                       err_msg=f"{kind} at T={t}: {spec.name}")
