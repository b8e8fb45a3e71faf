"""The TensorRT engine plan (pure Python, no TensorRT): engines and profiles per config, routes and their
bindings, KV view addresses, the 2-D copy of a KV append, and the engine cache keys."""
from __future__ import annotations

import os

import numpy as np
import pytest

from synflux_ros.backends.tensorrt import plan
from synflux_ros.core.config import load_config
from synflux_ros.core.contract import TensorSpec
from synflux_ros.core.contract import graph_set

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "..", "config")


def metas(name: str):
    cfg = load_config(os.path.join(CONFIG, name))
    return cfg, graph_set(cfg)


@pytest.mark.parametrize("name", ["vla_demo_orin.yaml", "vla_openvla.yaml"])
def test_one_engine_per_kind_with_a_static_profile_per_bucket(name):
    cfg, ms = metas(name)
    llm = cfg.llm
    flow = cfg.action.head_type == "flow_matching"
    # a flow-matching VLA reads no logits: no decode graphs (its decode buckets are the expert's spans)
    decodes = [] if flow else list(llm.decode_buckets)
    assert [m.attrs["bucket"] for m in ms if m.kind == "decode"] == decodes
    engines = {e.name: e for e in plan.plan_engines(ms)}
    assert list(engines) == ["vision_encoder", "embed", "llm"] + (["action_expert"] if flow else [])
    assert engines["vision_encoder"].onnx == "vision_encoder.onnx"
    assert [p.graph for p in engines["vision_encoder"].profiles] == ["vision_encoder"]
    embed = engines["embed"]
    assert [p.graph for p in embed.profiles] == [f"embed_{p}" for p in llm.prefill_buckets] + ["embed_1"] * bool(decodes)
    assert [p.shape("input_ids") for p in embed.profiles] == [(1, p) for p in llm.prefill_buckets] + [(1, 1)] * bool(decodes)
    eng = engines["llm"]
    assert eng.onnx == "tensorrt/onnx/llm.onnx"
    assert [p.graph for p in eng.profiles] == [f"prefill_{p}" for p in llm.prefill_buckets] + [f"decode_{d}" for d in decodes]
    for p, prof in zip(llm.prefill_buckets, eng.profiles):
        assert prof.shape("inputs_embeds") == (1, p, llm.hidden_dim)
        assert prof.shape(plan.SPAN_INPUT) == (llm.max_seq_len,)  # prefill attends to the whole slot
    for d, prof in zip(decodes, eng.profiles[len(llm.prefill_buckets):]):
        assert prof.shape("inputs_embeds") == (1, 1, llm.hidden_dim)
        assert prof.shape(plan.SPAN_INPUT) == (d,)
    if flow:
        assert [p.shape(plan.SPAN_INPUT) for p in engines["action_expert"].profiles] == [(d,) for d in llm.decode_buckets]
    assert plan.span_elements(list(engines.values())) == llm.max_seq_len


def test_vlm_and_action_token_sets_have_no_action_expert():
    for name in ("vlm_demo.yaml", "vla_openvla.yaml"):
        _, ms = metas(name)
        assert [e.name for e in plan.plan_engines(ms)] == ["vision_encoder", "embed", "llm"]


def test_dla_kinds_are_static_engines_per_graph():
    cfg, ms = metas("vla_demo_orin.yaml")
    engines = plan.plan_engines(ms, dla_kinds=plan.DLA_CAPABLE)
    dla = [e for e in engines if e.dla]
    assert [e.name for e in dla] == ["vision_encoder"] + [f"action_expert_{d}" for d in cfg.llm.decode_buckets]
    assert all(len(e.profiles) == 1 and e.profiles[0].shapes == () for e in dla)
    assert all(e.onnx == f"{e.name}.onnx" for e in dla)
    assert not any(e.dla for e in engines if e.kind in ("embed", "llm"))
    with pytest.raises(plan.PlanError, match="cannot run on DLA"):
        plan.plan_engines(ms, dla_kinds=("llm",))


def test_every_graph_has_a_route_and_decode_is_embed_then_llm():
    cfg, ms = metas("vla_openvla.yaml")
    engines = plan.plan_engines(ms)
    routes = plan.plan_routes(ms, engines)
    assert set(routes) == {m.name for m in ms}
    by = {e.name: e for e in engines}
    d = cfg.llm.decode_buckets[0]
    route = routes[f"decode_{d}"]
    assert [s.engine for s in route.steps] == ["embed", "llm"]
    assert route.steps[0].profile == by["embed"].profile_index("embed_1")
    assert route.steps[1].profile == by["llm"].profile_index(f"decode_{d}")
    first, second = (dict(s.bindings) for s in route.steps)
    assert first["input_ids"] == plan.Bind("input", "input_ids")
    assert first["inputs_embeds"] == second["inputs_embeds"] == plan.Bind("scratch", "inputs_embeds")
    assert route.scratch == (TensorSpec("inputs_embeds", (1, 1, cfg.llm.hidden_dim), "float32"),)
    assert second["num_tokens"] == plan.Bind("one")
    assert second[plan.SPAN_INPUT] == plan.Bind("span")
    assert second["logits"] == plan.Bind("output", "logits") and second["new_kv"] == plan.Bind("output", "new_kv")
    # prefill: one llm call, contract inputs bound directly
    pre = dict(routes[f"prefill_{cfg.llm.prefill_buckets[0]}"].steps[0].bindings)
    assert pre["inputs_embeds"] == plan.Bind("input", "inputs_embeds") and pre["num_tokens"] == plan.Bind("input", "num_tokens")
    # every KV view of every layer is bound, at its offset
    L = cfg.llm.num_layers
    views = sorted(n for n in second if n.startswith("past_kv."))
    assert views == sorted(f"past_kv.{layer}.{j}" for layer in range(L) for j in (0, 1))
    # a flow-matching VLA's prefill: new_kv alone, every view still bound (the engine may have dropped the
    # last layer's, which nothing reads; the runtime binds the tensors the engine has)
    cfg, ms = metas("vla_demo_orin.yaml")
    routes = plan.plan_routes(ms, plan.plan_engines(ms))
    pre = dict(routes[f"prefill_{cfg.llm.prefill_buckets[0]}"].steps[0].bindings)
    assert "logits" not in pre and pre["new_kv"] == plan.Bind("output", "new_kv")
    assert sum(n.startswith("past_kv.") for n in pre) == 2 * cfg.llm.num_layers


def test_kv_view_offsets_are_the_views_of_the_slot():
    spec = TensorSpec("past_kv", (3, 2, 2, 16, 8), "float16", resident=True)
    slot = np.arange(np.prod(spec.shape), dtype=np.float16).reshape(spec.shape)
    raw = slot.reshape(-1).view(np.uint8)
    views = plan.kv_view_offsets(spec)
    assert [n for n, _, _ in views] == [f"past_kv.{layer}.{j}" for layer in range(3) for j in (0, 1)]
    for name, offset, shape in views:
        layer, j = (int(x) for x in name.split(".")[1:])
        assert shape == (2, 16, 8)
        got = raw[offset:offset + int(np.prod(shape)) * 2].view(np.float16).reshape(shape)
        np.testing.assert_array_equal(got, slot[layer, j])
    assert plan.kv_view_offsets(TensorSpec("x", (4, 5), "float32")) == [("x", 0, (4, 5))]
    # 2 heads x 16 positions x 8 dims x 2 bytes = 512 bytes per view: aligned to 256, not to 1024
    assert plan.misaligned_views(spec, 256) == []
    assert plan.misaligned_views(spec, 1024) == ["past_kv.0.1", "past_kv.1.1", "past_kv.2.1"]


def _copy_2d(dst: np.ndarray, src: np.ndarray, offset, pitch, width, height):
    """What cudaMemcpy2D does, on host bytes."""
    for row in range(height):
        dst[offset + row * pitch: offset + row * pitch + width] = src[row * width:(row + 1) * width]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("start,count", [(0, 1), (5, 3), (13, 3), (0, 16)])
def test_a_kv_append_is_one_2d_copy(dtype, start, count):
    shape = (2, 2, 3, 16, 4)
    slot = np.zeros(shape, dtype)
    new = np.random.default_rng(0).standard_normal((2, 2, 3, count, 4)).astype(dtype)
    index = (slice(None), slice(None), slice(None), slice(start, start + count))
    offset, pitch, width, height = plan.region_copy(shape, dtype, index)
    raw = slot.reshape(-1).view(np.uint8)
    _copy_2d(raw, np.ascontiguousarray(new).reshape(-1).view(np.uint8), offset, pitch, width, height)
    expected = np.zeros(shape, dtype)
    expected[index] = new
    np.testing.assert_array_equal(slot, expected)
    if count < 16:  # the whole slot is one plain copy
        assert height == 12 and width == count * 4 * np.dtype(dtype).itemsize
    else:
        assert height == 1


def test_region_copy_refuses_what_one_2d_copy_cannot_do():
    with pytest.raises(ValueError, match="only one axis"):
        plan.region_copy((4, 8), "float32", (slice(0, 2), slice(0, 3)))
    with pytest.raises(ValueError, match="step 1"):
        plan.region_copy((4, 8), "float32", (slice(None), slice(0, 8, 2)))
    assert plan.region_copy((4, 8), "float32", ()) == (0, 128, 128, 1)  # one row: pitch = width


def test_engine_keys_change_with_everything_an_engine_depends_on():
    _, ms = metas("vla_demo_orin.yaml")
    spec = {e.name: e for e in plan.plan_engines(ms)}["llm"]
    base = dict(onnx_digest="a" * 64, tensorrt_version="10.3.0", sm="8.7", dla_core=None, flags={"precision": "fp16"})
    key = plan.engine_key(spec, **base)
    assert key == plan.engine_key(spec, **base)
    for change in ({"onnx_digest": "b" * 64}, {"tensorrt_version": "10.4.0"}, {"sm": "8.6"}, {"dla_core": 0},
                   {"flags": {"precision": "fp32"}}):
        assert plan.engine_key(spec, **{**base, **change}) != key, change
    fewer = plan.EngineSpec(spec.name, spec.kind, spec.onnx, spec.profiles[:-1])
    assert plan.engine_key(fewer, **base) != key


def test_device_tags_keep_builds_apart():
    assert plan.device_tag("8.7", None, "fp16") == "sm87-fp16"
    assert plan.device_tag("8.7", 1, "int8") == "sm87-int8-dla1"
    assert plan.device_tag("12.0", None, "fp32") == "sm120-fp32"


def test_the_rtc_vjp_graphs_get_an_engine_of_their_own_with_a_profile_per_bucket():
    """The vjp guidance's graphs: one shape-polymorphic engine with a profile per span, on the GPU even when the
    action expert is placed on DLA; each graph's route binds its contract tensors and the span."""
    cfg = load_config(os.path.join(CONFIG, "vla_demo_orin.yaml")).with_overrides(
        execution={"mode": "rtc", "rtc": {"guidance": "vjp"}})
    metas = graph_set(cfg)
    for dla in ((), plan.DLA_CAPABLE):
        engines = {e.name: e for e in plan.plan_engines(metas, dla)}
        vjp = engines["action_expert_vjp"]
        assert (vjp.kind, vjp.onnx, vjp.dla) == ("action_expert_vjp", "tensorrt/onnx/action_expert_vjp.onnx", False)
        assert [(p.graph, p.shape(plan.SPAN_INPUT)) for p in vjp.profiles] == [
            ("action_expert_vjp_160", (160,)), ("action_expert_vjp_256", (256,))]
        routes = plan.plan_routes(metas, list(engines.values()))
        (step,) = routes["action_expert_vjp_256"].steps
        binds = dict(step.bindings)
        assert step.engine == "action_expert_vjp" and step.profile == 1
        assert binds[plan.SPAN_INPUT].source == "span"
        assert {n for n, b in step.bindings if b.source == "output"} == {"velocity", "correction"}
        assert {"target", "weights", "flow_time", "past_kv.0.0"} <= set(binds)
    lerobot = cfg.with_overrides(execution={"mode": "rtc", "rtc": {"guidance": "lerobot"}})
    assert "action_expert_vjp" not in {e.name for e in plan.plan_engines(graph_set(lerobot))}
