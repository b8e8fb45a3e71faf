"""Shape-polymorphic graphs for TensorRT (``synflux_ros.backends.tensorrt.build_onnx``): one ONNX graph per kind with
dynamic dims T / D, numerically equal (onnxruntime, CPU) to the static per-bucket graphs exported from the
same torch modules: llm at (T=p, D=S) == prefill_<p>; embed(T=1) -> llm at (T=1, D=d) == decode_<d>;
embed at T=p == embed_<p>; action_expert at D=d == action_expert_<d>."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from synflux_ros.buildtool import export as build_tool  # noqa: E402
from synflux_ros.backends.tensorrt import build_onnx as tro  # noqa: E402
from synflux_ros.graphkit.torch_models import build_graph_modules  # noqa: E402
from synflux_ros.graphset import reader as graphset  # noqa: E402
from synflux_ros.core.config import from_dict  # noqa: E402
from synflux_ros.core.contract import graph_set, reads_logits, time_embedding_dim
from synflux_ros.model.time_embedding import time_embedding  # noqa: E402

from checkpoints import demo_size  # noqa: E402

torch.set_num_threads(2)

CONFIG_DIR = Path(__file__).resolve().parents[3] / "config"
# "+vjp" sets hold every graph of the plain set too, so π0 and π0.5 run only with it
CONFIGS = ["vla_demo_orin", "vlm_demo", "vla_openvla", "vla_pi0+vjp", "vla_pi05+vjp", "vla_smolvla+vjp",
           "vlm_demo+gemma3"]
VJP = {"mode": "rtc", "rtc": {"guidance": "vjp"}}  # "+vjp": Real-Time Chunking's vjp guidance (its own graphs)
# "+gemma3": a text-only Gemma 3 decoder with a sliding-window layer of its own rope base, soft-caps, fp16 KV
GEMMA3 = {"architecture": "gemma3", "kv_dtype": "float16", "sliding_window": 5, "sliding_window_layers": [0],
          "rope_local_theta": 100.0, "query_pre_attn_scalar": 24.0, "attn_logit_softcapping": 1.5,
          "final_logit_softcapping": 4.0}


def session(model) -> "ort.InferenceSession":
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    src = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])


class Built:
    """One config: its modules (seed 0), the static graphs (in-memory sessions) and the profiled ones
    (sessions on the written files, so their external data is read the way TensorRT's parser reads it)."""

    def __init__(self, name: str, tmp: Path):
        with open(CONFIG_DIR / f"{name.split('+')[0]}.yaml", encoding="utf-8") as fh:
            raw = demo_size(yaml.safe_load(fh))
        if name.endswith("+vjp"):
            raw["execution"] = VJP
        if name.endswith("+gemma3"):
            raw["vision"] = None
            raw["llm"].update(GEMMA3)
        self.cfg = cfg = from_dict(raw)
        self.gm = build_graph_modules(cfg, seed=0)
        self.metas = {m.name: m for m in graph_set(cfg) if m.kind != "vision_encoder"}
        self.static = {n: session(build_tool.export_graph(self.gm.modules[n], m, str(tmp)))
                       for n, m in self.metas.items()}
        self.out = str(tmp / "profiled")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.paths = tro.export_profiled_graphs(cfg, self.gm, self.out)
        self.warnings = [str(w.message) for w in caught]
        self.prof = {k: session(p) for k, p in self.paths.items()}
        llm = cfg.llm
        rng = np.random.default_rng(1)
        self.kv = rng.standard_normal(llm.kv_shape).astype(llm.kv_dtype)
        self.rng = rng

    @property
    def llm(self):
        return self.cfg.llm

    def views(self) -> dict:
        return {graphset.view_name("past_kv", (l, j)): self.kv[l, j]
                for l in range(self.llm.num_layers) for j in range(2)}

    @staticmethod
    def span(d: int) -> np.ndarray:
        return np.full((d,), np.nan, np.float32)  # values are never read: NaN would show if they were

    def kv_tol(self) -> dict:
        return dict(rtol=2e-3, atol=1e-6) if self.llm.kv_dtype == "float16" else dict(rtol=0, atol=1e-5)


@pytest.fixture(scope="module", params=CONFIGS)
def built(request, tmp_path_factory):
    return Built(request.param, tmp_path_factory.mktemp(request.param.replace("+", "-")))


def i64(v) -> np.ndarray:
    return np.array([v], np.int64)


def close(got, want, rtol=0.0, atol=1e-5, what=""):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, what
    assert np.isfinite(got).all(), what
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


# ---------------------------------------------------------------------------------------------- the graphs

def test_names_files_and_quiet_export(built):
    cfg = built.cfg
    want = ["embed", "llm"] + (["action_expert"] if cfg.action is not None
                               and cfg.action.head_type == "flow_matching" else [])
    want += ["action_expert_vjp"] if any(m.kind == "action_expert_vjp" for m in graph_set(cfg)) else []
    assert tro.profiled_graph_names(cfg) == want
    assert list(built.paths) == want
    assert all(os.path.isabs(p) and p == os.path.join(os.path.abspath(built.out), f"{k}.onnx")
               for k, p in built.paths.items())
    assert sorted(os.listdir(built.out)) == sorted([f"{k}.onnx" for k in want] + ["weights.bin"])
    assert built.warnings == []


def test_declared_dims_symbolic_and_standard_ops(built):
    for kind, path in built.paths.items():
        model = onnx.load(path, load_external_data=False)
        tro.check_profiled_io(model, built.cfg, kind)  # names, order, dtypes, T/D named, standard ops
        onnx.checker.check_model(path)
        dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
                for v in list(model.graph.input) + list(model.graph.output)}
        if kind == "embed":
            assert dims["input_ids"] == [1, "T"] and dims["inputs_embeds"] == [1, "T", built.llm.hidden_dim]
        else:
            assert dims["attention_span"] == ["D"]
            assert all(dims[graphset.view_name("past_kv", (l, j))] == list(built.llm.kv_shape[2:])
                       for l in range(built.llm.num_layers) for j in range(2))
        if kind == "llm":
            assert dims["inputs_embeds"][1] == "T" and dims["new_kv"][3] == "T"
        assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
        assert model.opset_import[0].version == build_tool.OPSET


def test_weights_external_and_shared(built):
    """One weights.bin beside the graphs, referenced by a relative path, every large tensor in it once (the vjp
    graph reads the action expert's)."""
    size = os.path.getsize(os.path.join(built.out, graphset.WEIGHTS_FILE))
    stored = set()
    for path in built.paths.values():
        for t in graphset.external_initializers(path):
            assert t.location == graphset.WEIGHTS_FILE and t.offset + t.length <= size
            stored.add((t.offset, t.length))
        model = onnx.load(path, load_external_data=False)
        assert all(len(i.raw_data) < graphset.EXTERNAL_MIN_BYTES for i in model.graph.initializer)
    total = sum(length for _, length in stored)
    assert stored and total <= size <= total + len(stored) * graphset.ALIGNMENT
    if "action_expert_vjp" in built.paths:
        expert = {(t.offset, t.length) for t in graphset.external_initializers(built.paths["action_expert"])}
        vjp = {(t.offset, t.length) for t in graphset.external_initializers(built.paths["action_expert_vjp"])}
        assert vjp and vjp <= expert


def test_embed_equals_static(built):
    for p in built.llm.prefill_buckets:
        ids = built.rng.integers(0, built.llm.vocab_size, (1, p)).astype(built.llm.token_id_dtype)
        want = built.static[f"embed_{p}"].run(None, {"input_ids": ids})[0]
        got = built.prof["embed"].run(None, {"input_ids": ids})[0]
        np.testing.assert_array_equal(got, want)


def test_llm_at_full_span_equals_prefill(built):
    s = built.llm.max_seq_len
    for p in built.llm.prefill_buckets:
        emb = built.rng.standard_normal((1, p, built.llm.hidden_dim)).astype(np.float32)
        start = 0 if built.llm.prefill_attention == "bidirectional" else 5  # a bidirectional prefix starts the cache
        feeds = {"inputs_embeds": emb, "num_tokens": i64(p - 3), "cache_position": i64(start), **built.views()}
        if built.cfg.action is not None and built.cfg.action.prefix_state_dim:  # SmolVLA: the state's row
            feeds["state"] = built.rng.standard_normal((1, built.cfg.action.prefix_state_dim)).astype(np.float32)
        want = built.static[f"prefill_{p}"].run(None, feeds)
        got = built.prof["llm"].run(None, {**feeds, "attention_span": built.span(s)})
        # a flow-matching VLA's prefill returns new_kv alone (reads_logits), in both forms
        assert len(got) == len(want) == 1 + reads_logits(built.cfg)
        new_kv, got_kv = want[-1], got[-1]
        assert got_kv.dtype == new_kv.dtype == np.dtype(built.llm.kv_dtype)
        if reads_logits(built.cfg):
            close(got[0], want[0], atol=1e-5 if built.llm.kv_dtype == "float32" else 1e-4, what=f"prefill_{p} logits")
        close(got_kv, new_kv, **built.kv_tol(), what=f"prefill_{p} new_kv")
        assert not got_kv[:, :, :, p - 3:].any()


def test_embed_then_llm_equals_decode(built):
    if not reads_logits(built.cfg):
        assert not any(m.kind == "decode" for m in built.metas.values())
        pytest.skip(f"{built.cfg.name}: a flow-matching VLA has no decode graphs")
    for d in built.llm.decode_buckets:
        for pos in (5, d - 1):
            ids = built.rng.integers(0, built.llm.vocab_size, (1, 1)).astype(built.llm.token_id_dtype)
            want_logits, want_kv = built.static[f"decode_{d}"].run(
                None, {"input_ids": ids, "cache_position": i64(pos), **built.views()})
            emb = built.prof["embed"].run(None, {"input_ids": ids})[0]
            logits, new_kv = built.prof["llm"].run(None, {
                "inputs_embeds": emb, "num_tokens": i64(1), "cache_position": i64(pos), **built.views(),
                "attention_span": built.span(d)})
            close(logits, want_logits, atol=1e-5 if built.llm.kv_dtype == "float32" else 1e-4,
                  what=f"decode_{d} logits at {pos}")
            close(new_kv, want_kv, **built.kv_tol(), what=f"decode_{d} new_kv at {pos}")


def test_action_expert_equals_static(built):
    if "action_expert" not in built.prof:
        pytest.skip(f"{built.cfg.name}: no flow-matching action expert")
    act = built.cfg.action
    for d in built.llm.decode_buckets:
        for prefix in (7, d):
            feeds = {"noisy_actions": built.rng.standard_normal((1, act.action_horizon, act.action_dim)).astype(np.float32),
                     "time_embedding": time_embedding(0.7, time_embedding_dim(built.cfg)), "prefix_len": i64(prefix), **built.views()}
            if act.state_token_dim:  # the robot state token (vla_pi0)
                feeds["state"] = built.rng.standard_normal((1, act.state_token_dim)).astype(np.float32)
            want = built.static[f"action_expert_{d}"].run(None, feeds)[0]
            got = built.prof["action_expert"].run(None, {**feeds, "attention_span": built.span(d)})[0]
            close(got, want, atol=1e-5, what=f"action_expert_{d} at prefix {prefix}")


def test_action_expert_vjp_equals_static(built):
    if "action_expert_vjp" not in built.prof:
        pytest.skip(f"{built.cfg.name}: no Real-Time Chunking vjp graphs")
    act = built.cfg.action
    h, a = act.action_horizon, act.action_dim
    for d in built.llm.decode_buckets:
        for prefix, t in ((7, 0.9), (d, 0.3)):
            feeds = {"noisy_actions": built.rng.standard_normal((1, h, a)).astype(np.float32),
                     "time_embedding": time_embedding(t, time_embedding_dim(built.cfg)), "prefix_len": i64(prefix),
                     **built.views(), "target": built.rng.standard_normal((1, h, a)).astype(np.float32),
                     "weights": np.linspace(1, 0, h, dtype=np.float32).reshape(1, h, 1),
                     "flow_time": np.array([t], np.float32)}
            if act.state_token_dim:
                feeds["state"] = built.rng.standard_normal((1, act.state_token_dim)).astype(np.float32)
            want = built.static[f"action_expert_vjp_{d}"].run(None, feeds)
            got = built.prof["action_expert_vjp"].run(None, {**feeds, "attention_span": built.span(d)})
            assert np.abs(want[1]).max() > 1e-3  # a correction to compare
            for name, g, w in zip(("velocity", "correction"), got, want):
                close(g, w, atol=1e-5, what=f"action_expert_vjp_{d} {name} at prefix {prefix}")


def test_other_sizes_match_eager_torch(built):
    """Sizes no bucket has (and unlike the trace's example sizes) agree with the torch modules run eagerly:
    nothing was frozen to the example."""
    from synflux_ros.backends.tensorrt.build_models import ProfiledActionExpert, ProfiledLLM
    prefill = built.gm.modules[f"prefill_{built.llm.prefill_buckets[0]}"]
    ref = ProfiledLLM(prefill.lm, built.llm.kv_dtype, logits=reads_logits(built.cfg),
                      state_proj=prefill.state_proj, expert=prefill.expert).eval()
    state_dim = built.cfg.action.prefix_state_dim if built.cfg.action is not None else 0
    kv = torch.from_numpy(built.kv)
    past = [(kv[l, 0], kv[l, 1]) for l in range(built.llm.num_layers)]
    s = built.llm.max_seq_len
    for t, d, n, pos in ((5, 7, 4, 9), (2, s - 3, 2, 11), (1, 2, 1, 1), (6, s, 6, s - 6)):
        emb = built.rng.standard_normal((1, t, built.llm.hidden_dim)).astype(np.float32)
        state = {"state": built.rng.standard_normal((1, state_dim)).astype(np.float32)} if state_dim else {}
        with torch.no_grad():
            want = ref(torch.from_numpy(emb), torch.tensor([n]), torch.tensor([pos]), past, torch.zeros(d),
                       *(torch.from_numpy(v) for v in state.values()))
        got = built.prof["llm"].run(None, {
            "inputs_embeds": emb, "num_tokens": i64(n), "cache_position": i64(pos), **built.views(),
            "attention_span": built.span(d), **state})
        assert len(got) == len(want)
        new_kv = got[-1]
        assert new_kv.shape == (built.llm.num_layers, 2, built.llm.num_kv_heads, t, built.llm.head_dim)
        if len(got) == 2:
            close(got[0], want[0].numpy(), atol=1e-4, what=f"llm T={t} D={d}")
        close(new_kv, want[-1].numpy(), **built.kv_tol(), what=f"llm T={t} D={d}")
    if "action_expert" in built.prof:
        act = built.cfg.action
        expert = ProfiledActionExpert(built.gm.modules[f"action_expert_{built.llm.decode_buckets[0]}"].expert).eval()
        for d, prefix in ((3, 2), (s - 5, s - 9)):
            noisy = built.rng.standard_normal((1, act.action_horizon, act.action_dim)).astype(np.float32)
            state = built.rng.standard_normal((1, act.state_token_dim)).astype(np.float32) if act.state_token_dim else None
            with torch.no_grad():
                emb = time_embedding(0.3, time_embedding_dim(built.cfg))
                want = expert(torch.from_numpy(noisy), torch.from_numpy(emb), torch.tensor([prefix]), past,
                              torch.zeros(d), None if state is None else torch.from_numpy(state))[0]
            got = built.prof["action_expert"].run(None, {
                "noisy_actions": noisy, "time_embedding": emb, "prefix_len": i64(prefix),
                **built.views(), "attention_span": built.span(d), **({"state": state} if act.state_token_dim else {})})[0]
            close(got, want.numpy(), atol=1e-4, what=f"action_expert D={d}")


# ---------------------------------------------------------------------------------------------- helpers

def test_example_sizes_avoid_model_dims():
    with open(CONFIG_DIR / "vla_demo_orin.yaml", encoding="utf-8") as fh:
        cfg = from_dict(yaml.safe_load(fh))
    t, d = tro.example_sizes(cfg)
    llm = cfg.llm
    dims = {1, 2, llm.num_layers, llm.num_heads, llm.num_kv_heads, llm.head_dim, llm.hidden_dim, llm.vocab_size,
            llm.max_seq_len, cfg.action.action_horizon, cfg.action.action_dim, *llm.prefill_buckets,
            *llm.decode_buckets}
    assert t not in dims and d not in dims and t != d and 2 < d < llm.max_seq_len


def test_unknown_kind():
    with open(CONFIG_DIR / "vlm_demo.yaml", encoding="utf-8") as fh:
        cfg = from_dict(yaml.safe_load(fh))
    with pytest.raises(ValueError, match="unknown profiled graph kind"):
        tro.profiled_io(cfg, "vision_encoder")
