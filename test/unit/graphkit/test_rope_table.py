"""Rotary embeddings from a build-time table (``decoder.rope_table`` / ``rope_lookup``): the exported decode,
prefill and action-expert graphs Gather cos/sin by position from one shared initializer instead of
computing ``position * inv_freq`` in the graph, which an fp16 device (NPU, TensorRT fp16) would compute
in fp16 (spacing 2 at position 4095). In float32 the graphs compute what they computed before.

Needs torch, onnx and onnxruntime (the build extra); skipped without them.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, numpy_helper  # noqa: E402

from synflux_ros.buildtool import export as build_tool  # noqa: E402
from synflux_ros.graphkit.torch_models import build_graph_modules  # noqa: E402
from synflux_ros.graphkit.torch_models import decoder  # noqa: E402
from synflux_ros.graphkit.torch_models.decoder import rope_cos_sin, rope_inv_freq  # noqa: E402
from synflux_ros.graphset import reader as graphset  # noqa: E402
from synflux_ros.core.config import load_config  # noqa: E402
from synflux_ros.core.contract import graph_set
from synflux_ros.model.time_embedding import time_embedding  # noqa: E402

torch.set_num_threads(2)

CONFIG_DIR = Path(__file__).resolve().parents[3] / "config"
TINY_LLM = {"num_layers": 2, "hidden_dim": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
            "vocab_size": 512, "intermediate_size": 128}
POSITION_INPUTS = ("cache_position", "prefix_len")
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)


def tiny_pi0(**llm):
    """pi0-like (Gemma decoder, fp16 KV, flow-matching action expert), tiny widths."""
    cfg = load_config(str(CONFIG_DIR / "vla_pi0.yaml"))
    return cfg.with_overrides(
        llm={**TINY_LLM, "num_kv_heads": 1, "prefill_buckets": [32, 48], "decode_buckets": [48, 64],
             "max_seq_len": 64, **llm},
        vision={"tokens_per_tile": 16, "hidden_dim": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
        action={"action_dim": 6, "action_horizon": 8, "expert_hidden_dim": 32, "expert_intermediate_size": 48})


def long_qwen3():
    """Qwen3 decoder (theta 5e6 as vlm_qwen3) with a 4096-position float32 cache: positions where fp16 fails."""
    cfg = load_config(str(CONFIG_DIR / "vlm_demo.yaml"))
    return cfg.with_overrides(llm={**TINY_LLM, "prefill_buckets": [16], "decode_buckets": [4096],
                                   "max_seq_len": 4096, "rope_theta": 5e6, "kv_dtype": "float32"})


@pytest.fixture(scope="module")
def pi0():
    cfg = tiny_pi0()
    return cfg, build_graph_modules(cfg, seed=3)


def session(model):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def feeds_of(meta, values: dict) -> dict:
    """Contract inputs (torch tensors) -> the exported graph's inputs (past_kv as per-layer views)."""
    feeds = {}
    for spec in meta.inputs:
        x = values[spec.name].numpy()
        lead = graphset.VIEW_INPUTS.get(spec.name, 0)
        if lead:
            feeds.update({graphset.view_name(spec.name, idx): x[idx] for idx in graphset.view_indices(spec.shape, lead)})
        else:
            feeds[spec.name] = x
    return feeds


def random_inputs(meta, rng, **scalars) -> dict:
    out = {}
    for spec in meta.inputs:
        if spec.name == "time_embedding":
            a = time_embedding(scalars.get("t", 0.5), spec.shape[-1])
        elif spec.name in scalars:
            a = np.array([scalars[spec.name]], spec.dtype)
        elif spec.dtype.startswith("int"):
            a = rng.integers(0, 256, spec.shape).astype(spec.dtype)
        else:
            a = rng.standard_normal(spec.shape).astype(spec.dtype)
        out[spec.name] = torch.from_numpy(a)
    return out


def eager(module, meta, values: dict):
    with torch.no_grad():
        return [t.float().numpy() for t in module(*(values[s.name] for s in meta.inputs))]


def computed_in_graph(monkeypatch, owner):
    """Make ``rope_lookup`` compute cos/sin from the positions as the graphs did before the table
    (``rope_cos_sin(positions, owner.inv_freq)``, no clamping): the reference for float32 equality."""
    monkeypatch.setattr(decoder, "rope_lookup", lambda cos, sin, positions: rope_cos_sin(positions, owner.inv_freq))
    from synflux_ros.graphkit.torch_models import action_expert
    monkeypatch.setattr(action_expert, "rope_lookup",
                        lambda cos, sin, positions: rope_cos_sin(positions, owner.inv_freq))


# ---------------------------------------------------------------------------------------------- the graphs

def _downstream_of_positions(model) -> list:
    """Nodes computing on the position inputs (cache_position, prefix_len) before the rotary lookup:
    values flow on through every node except a Gather (the lookup: its output holds table values) and
    a comparison (an attention mask)."""
    reached = set(POSITION_INPUTS)
    nodes = []
    for node in model.graph.node:  # ONNX nodes are topologically sorted
        if any(i in reached for i in node.input):
            nodes.append(node)
            if node.op_type not in ("Gather", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Equal"):
                reached.update(node.output)
    return nodes


def test_exported_graphs_gather_rotary_tables_and_compute_no_angles(pi0, tmp_path):
    cfg, gm = pi0
    # the expert's positions: the state token (vla_pi0 has one) and the action tokens after the prefix
    n_lm = cfg.llm.max_seq_len
    n_expert = cfg.llm.max_seq_len + cfg.action.action_horizon + (1 if cfg.action.state_dim else 0)
    for meta in graph_set(cfg):
        if meta.kind not in ("prefill", "decode", "action_expert"):
            continue
        model = build_tool.export_graph(gm.modules[meta.name], meta, str(tmp_path))
        inits = {i.name: i for i in model.graph.initializer}
        owner = "expert" if meta.kind == "action_expert" else "lm"
        tables = {f"inner.{owner}.rope_cos", f"inner.{owner}.rope_sin"}
        rows = n_expert if owner == "expert" else n_lm
        assert tables <= set(inits), (meta.name, sorted(inits))
        assert all(list(inits[t].dims) == [rows, cfg.llm.head_dim] for t in tables), meta.name
        assert not any("inv_freq" in name for name in inits), meta.name
        # the positions reach the tables through a Clip to [0, rows - 1] and nothing float
        down = _downstream_of_positions(model)
        ops = [n.op_type for n in down]
        assert not {"Mul", "Cos", "Sin", "Div", "MatMul"} & set(ops), (meta.name, ops)
        casts = [n for n in down if n.op_type == "Cast"
                 and any(a.name == "to" and a.i in FLOAT_TYPES for a in n.attribute)]
        assert not casts, (meta.name, casts)
        gathers = [n for n in model.graph.node if n.op_type == "Gather" and n.input[0] in tables]
        assert sorted(n.input[0] for n in gathers) == sorted(tables) and all(n in down for n in gathers), meta.name
        clip = next(n for n in model.graph.node if n.output[0] == gathers[0].input[1])
        assert clip.op_type == "Clip" and gathers[1].input[1] == clip.output[0]
        const = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node
                 if n.op_type == "Constant"}
        bounds = [int(const[name] if name in const else numpy_helper.to_array(inits[name])) for name in clip.input[1:]]
        assert bounds == [0, rows - 1], (meta.name, bounds)
        # no rotary math is left in the graph, and the flow-time embedding is an input: no Cos / Sin at all
        cos_sin = [n for n in model.graph.node if n.op_type in ("Cos", "Sin")]
        assert not cos_sin, meta.name


def test_tables_equal_the_positions_values_and_are_stored_once(pi0, tmp_path):
    cfg, gm = pi0
    lm = gm.modules[f"prefill_{cfg.llm.prefill_buckets[0]}"].lm
    expert = gm.modules[f"action_expert_{cfg.llm.decode_buckets[0]}"].expert
    inv = rope_inv_freq(cfg.llm.head_dim, cfg.llm.rope_theta)
    expert_rows = cfg.llm.max_seq_len + cfg.action.action_horizon + (1 if cfg.action.state_dim else 0)
    for owner, rows in ((lm, cfg.llm.max_seq_len), (expert, expert_rows)):
        cos, sin = rope_cos_sin(torch.arange(rows), inv)
        assert owner.rope_cos.dtype == torch.float32 and owner.rope_cos.shape == (rows, cfg.llm.head_dim)
        assert torch.equal(owner.rope_cos, cos) and torch.equal(owner.rope_sin, sin)
        assert isinstance(owner.rope_cos, torch.nn.Parameter) and not owner.rope_cos.requires_grad
    # every module of a kind holds the same table objects (one initializer per table in the set)
    assert all(m.lm.rope_cos is lm.rope_cos for n, m in gm.modules.items() if n.startswith(("prefill", "decode")))
    # the graph set: each table once in weights.bin, its bytes those of rope_table
    out = tmp_path / "set"
    build_tool.build(cfg, str(out))
    where = {}
    for meta in graph_set(cfg):
        for t in graphset.external_initializers(str(out / f"{meta.name}.onnx")):
            if "rope_" in t.name:
                where.setdefault(t.name, set()).add((t.offset, t.length))
    assert set(where) == {"inner.lm.rope_cos", "inner.lm.rope_sin", "inner.expert.rope_cos", "inner.expert.rope_sin"}
    assert all(len(v) == 1 for v in where.values()), where
    blob = (out / graphset.WEIGHTS_FILE).read_bytes()
    (offset, length), = where["inner.lm.rope_sin"]
    stored = np.frombuffer(blob[offset:offset + length], np.float32).reshape(cfg.llm.max_seq_len, cfg.llm.head_dim)
    np.testing.assert_array_equal(stored, lm.rope_sin.numpy())


def test_float32_results_unchanged_at_the_end_of_the_cache(monkeypatch, tmp_path):
    """A 4096-position cache: decode at positions up to 4095 and a prefill whose padded rows pass the end
    of the cache, exported and run by onnxruntime, equal the torch modules computing the angles from the
    positions (the graphs before the table)."""
    cfg = long_qwen3()
    gm = build_graph_modules(cfg, seed=1)
    s = cfg.llm.max_seq_len
    metas = {m.name: m for m in graph_set(cfg)}
    rng = np.random.default_rng(0)
    cases = [("decode_4096", {"cache_position": p}) for p in (s - 1, s - 2, 4000)]
    cases += [("prefill_16", {"cache_position": s - 5, "num_tokens": 5})]  # rows 5..15 at positions >= s
    exported = {name: session(build_tool.export_graph(gm.modules[name], metas[name], str(tmp_path)))
                for name in {n for n, _ in cases}}
    runs = []
    for name, scalars in cases:
        values = random_inputs(metas[name], rng, **scalars)
        runs.append((name, values, eager(gm.modules[name], metas[name], values),
                     exported[name].run(None, feeds_of(metas[name], values))))
    lm = gm.modules["decode_4096"].lm
    computed_in_graph(monkeypatch, lm)
    for name, values, table_eager, table_onnx in runs:
        before = eager(gm.modules[name], metas[name], values)
        for spec, a, b, c in zip(metas[name].outputs, before, table_eager, table_onnx):
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-6, err_msg=f"{name} {spec.name} eager")
            np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-5, err_msg=f"{name} {spec.name} onnx")
        if name.startswith("prefill"):
            assert not table_onnx[1][:, :, :, 5:].any()  # the padded rows' keys are zero


def test_action_expert_at_the_largest_prefix_unchanged(pi0, monkeypatch, tmp_path):
    """prefix_len = max_seq_len (the largest bucket): action rows at positions up to max_seq_len + h - 1,
    all inside the expert's table."""
    cfg, gm = pi0
    d = cfg.llm.decode_buckets[-1]
    meta = {m.name: m for m in graph_set(cfg)}[f"action_expert_{d}"]
    module = gm.modules[meta.name]
    sess = session(build_tool.export_graph(module, meta, str(tmp_path)))
    rng = np.random.default_rng(2)
    runs = []
    for prefix in (d, d - 1, 7):
        values = random_inputs(meta, rng, prefix_len=prefix, t=0.6)
        runs.append((values, eager(module, meta, values), sess.run(None, feeds_of(meta, values))))
    computed_in_graph(monkeypatch, module.expert)
    for values, table_eager, table_onnx in runs:
        before = eager(module, meta, values)
        np.testing.assert_allclose(table_eager[0], before[0], rtol=0, atol=1e-6)
        np.testing.assert_allclose(table_onnx[0], before[0], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- fp16

def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("head_dim,theta", [(16, 5e6), (128, 5e6), (16, 1e4)])
def test_fp16_table_keeps_rotary_accuracy_where_fp16_angles_lose_it(head_dim, theta):
    """What an fp16 device makes of each form at positions 4000 .. 4095: the old graphs' angle
    ``position * inv_freq`` computed in fp16 (the position itself rounds to a multiple of 2 above 2048)
    against the table's cos/sin rounded to fp16; the rotated keys' cosine to the float64 truth."""
    inv = rope_inv_freq(head_dim, theta)
    pos = torch.arange(4000, 4096)
    angles = pos.double()[:, None] * inv.double()[None, :]
    truth_cos, truth_sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    fp16_angles = pos.half()[:, None] * inv.half()[None, :]  # what the HTP computed
    old_cos = torch.cat((fp16_angles, fp16_angles), -1).float().cos().half()
    old_sin = torch.cat((fp16_angles, fp16_angles), -1).float().sin().half()
    cos, sin = decoder.rope_table(4096, inv)
    new_cos, new_sin = cos[4000:].half(), sin[4000:].half()
    new_err = max((new_cos.double() - truth_cos).abs().max().item(), (new_sin.double() - truth_sin).abs().max().item())
    old_err = max((old_cos.double() - truth_cos).abs().max().item(), (old_sin.double() - truth_sin).abs().max().item())
    assert new_err < 2e-3 < 0.1 < old_err, (new_err, old_err)
    # keys [KV=2, T, Dh] rotated in fp16 arithmetic with either form, against the exact rotation
    k = torch.from_numpy(np.random.default_rng(0).standard_normal((2, len(pos), head_dim))).half()
    exact = decoder.apply_rope(k.double(), truth_cos, truth_sin).numpy()
    with_table = decoder.apply_rope(k, new_cos, new_sin).float().numpy()
    with_angles = decoder.apply_rope(k, old_cos, old_sin).float().numpy()
    assert _cosine(with_table, exact) > 0.9999
    assert _cosine(with_angles, exact) < 0.99
