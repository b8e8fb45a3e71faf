"""Real-Time Chunking through the runtime: the controller's plan steers the next chunk of a flow head."""
from __future__ import annotations

import numpy as np
import pytest

from synflux_ros.core.config import load_config
from synflux_ros.execution.controller import Controller
from synflux_ros.runtimes.vla import VLARuntime
from synflux_ros.tools.harness import config_path


@pytest.fixture(scope="module")
def rtc_runtime():
    cfg = load_config(config_path("vla_sim_arm.yaml"))
    cfg = cfg.with_overrides(execution={"mode": "rtc", "rtc": {"schedule": "ones", "execution_horizon": 8,
                                                                 "max_guidance_weight": 100.0}})
    rt = VLARuntime(cfg)
    yield cfg, rt
    rt.close()


def image(seed):
    return np.random.default_rng(seed).integers(0, 255, (448, 448, 3), dtype=np.uint8)


def test_the_next_chunk_continues_the_plan_in_force(rtc_runtime):
    cfg, rt = rtc_runtime
    period = cfg.action.step_period
    ctl = Controller(cfg.execution, period, cfg.action.action_horizon)
    first = rt.infer(image(0), seq=0)
    ctl.on_chunk(first.actions, 10.0, 10.0 + 0.05, raw=first.raw_actions)  # delay: 3 steps
    t_obs = 10.0 + 5 * period
    guidance = ctl.rtc_guidance(t_obs)
    np.testing.assert_allclose(guidance.prev_chunk, first.raw_actions[5:], rtol=1e-6)
    assert guidance.inference_delay == 3 and guidance.execution_horizon == 8 and guidance.schedule == "ones"
    guided = rt.infer(image(1), seq=1, rtc=ctl.rtc_guidance(t_obs))
    free = rt.infer(image(1), seq=1)
    target = first.raw_actions[5:13]
    err_guided = np.abs(guided.raw_actions[:8] - target).mean()
    err_free = np.abs(free.raw_actions[:8] - target).mean()
    assert err_guided < 0.5 * err_free, (err_guided, err_free)


def test_a_provider_is_asked_when_the_head_starts(rtc_runtime):
    cfg, rt = rtc_runtime
    calls = []

    def provider():
        calls.append(1)
        return None  # no previous chunk yet: plain denoising
    out = rt.infer(image(2), seq=2, rtc=provider)
    np.testing.assert_array_equal(out.raw_actions, rt.infer(image(2), seq=2).raw_actions)
    assert calls == [1]
