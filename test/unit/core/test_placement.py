"""executor.placement: graph kinds on other executors behind one PlacedExecutor."""
from __future__ import annotations

import numpy as np
import pytest

from synflux_ros.core.config import ConfigError, load_config
from synflux_ros.core.placement import PlacedExecutor, PlacementError
from synflux_ros.tools.harness import config_path
from synflux_ros.runtimes.base import create_executor
from synflux_ros.runtimes.vla import VLARuntime
from synflux_ros.runtimes.vlm import ChatRequest, VLMRuntime


def cfg_with(name: str, **executor):
    return load_config(config_path(name)).with_overrides(executor=executor)


@pytest.mark.parametrize("placement,needle", [
    ({"vision": "mock:NPU"}, "executor.placement.vision: unknown graph kind (choices: vision_encoder"),
    ({"vision_encoder": ""}, "expected 'backend[:device]'"),
    ({"vision_encoder": {"options": {}}}, "expected 'backend[:device]'"),
    ({"vision_encoder": {"backend": "mock", "opts": {}}}, "unknown field 'opts'"),
    ({"vision_encoder": "mock"}, "is the default executor; remove the entry"),
])
def test_bad_placements_fail_at_load_with_the_field(placement, needle):
    with pytest.raises(ConfigError, match=None) as exc:
        cfg_with("vla_demo_orin.yaml", placement=placement)
    assert needle in str(exc.value)


def test_graphs_run_where_their_kind_is_placed():
    cfg = cfg_with("vla_demo_orin.yaml", placement={"vision_encoder": "mock:NPU",
                                                     "embed": {"backend": "mock", "options": {"device": "NPU"}}})
    ex = create_executor(cfg)
    try:
        assert isinstance(ex, PlacedExecutor)
        assert sorted(ex.members) == ["mock", "mock:NPU"]  # equal placements share one executor
        assert sorted(ex.members["mock:NPU"].graphs) == ["embed_160", "embed_96", "vision_encoder"]
        assert ex.device_of("vision_encoder") == "mock:NPU" and ex.device_of("prefill_96") == "mock"
        assert ex.kv_label == "mock"
    finally:
        ex.close()


def test_a_split_placement_computes_what_one_executor_does():
    plain = VLARuntime(cfg_with("vla_demo_orin.yaml"))
    split = VLARuntime(cfg_with("vla_demo_orin.yaml", placement={"vision_encoder": "mock:NPU"}))
    try:
        image = np.random.default_rng(3).integers(0, 256, (240, 320, 3), np.uint8)
        np.testing.assert_array_equal(plain.infer(image, 5).actions, split.infer(image, 5).actions)
        assert split.stage_devices == {"vision": "mock:NPU", "backbone": "mock", "head": "mock"}
        assert plain.stage_devices == {"vision": "mock", "backbone": "mock", "head": "mock"}
        # the KV slots live on the executor of the KV graphs; every member is frozen after load
        assert all(m.pool.frozen for m in split.executor.members.values())
        assert "vla_kv/slot0" in split.executor.members["mock"].pool.breakdown()
        assert not any(k.startswith("vla_kv") for k in split.executor.members["mock:NPU"].pool.breakdown())
        assert split.executor.device_bytes == sum(m.device_bytes for m in split.executor.members.values())
    finally:
        plain.close()
        split.close()


def test_chat_with_the_vision_encoder_placed_elsewhere():
    plain = VLMRuntime(cfg_with("vlm_demo.yaml"))
    split = VLMRuntime(cfg_with("vlm_demo.yaml", placement={"vision_encoder": "mock:GPU"}))
    try:
        image = np.random.default_rng(1).integers(0, 256, (64, 96, 3), np.uint8)
        a = plain.chat(ChatRequest("s", "what is this?", images=[image], temperature=0.0))
        b = split.chat(ChatRequest("s", "what is this?", images=[image], temperature=0.0))
        assert a.token_ids == b.token_ids
    finally:
        plain.close()
        split.close()


def test_kv_graphs_apart_are_refused():
    cfg = cfg_with("vla_demo_orin.yaml", placement={"action_expert": "mock:NPU"})
    with pytest.raises(PlacementError, match=r"read the KV cache .* must run on one executor, they are placed on "
                                             r"mock, mock:NPU"):
        create_executor(cfg)


def test_the_rtc_vjp_graph_goes_where_the_action_expert_goes():
    cfg = load_config(config_path("vla_demo_orin.yaml")).with_overrides(
        execution={"mode": "rtc", "rtc": {"guidance": "vjp"}},
        executor={"placement": {"prefill": "mock:NPU", "action_expert": "mock:NPU"}})
    ex = create_executor(cfg)
    try:
        vjp = [g for g in ex.graphs if g.startswith("action_expert_vjp_")]
        assert vjp, "the vjp config has no action_expert_vjp graphs"
        for g in vjp:
            assert ex.device_of(g) == ex.device_of(g.replace("_vjp", "")) == "mock:NPU"
    finally:
        ex.close()
