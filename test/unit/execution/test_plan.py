"""ChunkPlan: chunks placed on the clock by their measured delay and merged as execution.mode says."""
from __future__ import annotations

import numpy as np
import pytest

from synflux_ros.core.config import ExecutionConfig
from synflux_ros.execution.plan import ChunkPlan, ChunkRefused

P = 0.02  # step period
H = 10


def plan(mode="replace", **kw) -> ChunkPlan:
    return ChunkPlan(ExecutionConfig(joints=("a",), mode=mode, **kw), P, H)


def ramp(start, n=H, step=1.0):
    return (start + step * np.arange(n, dtype=float))[:, None]


@pytest.mark.parametrize("late,lookahead,d", [(0.0, 0.0, 0), (0.001, 0.0, 1), (0.04, 0.0, 2), (0.041, 0.0, 3),
                                              (0.01, 0.02, 2)])
def test_a_chunk_starts_at_the_measured_delay(late, lookahead, d):
    p = plan(lookahead=lookahead)
    offer = p.offer(ramp(0.0), t_obs=10.0, now=10.0 + late)
    assert offer.delay_steps == d
    assert p.times[0] == pytest.approx(10.0 + d * P)
    assert p.actions[0, 0] == d  # step d of the chunk is the first executed
    assert p.sample(10.0 + d * P + P / 2)[0] == pytest.approx(d + 0.5)  # linear between steps


def test_late_future_and_unstamped_chunks_are_refused_and_the_plan_kept():
    p = plan()
    p.offer(ramp(0.0), 10.0, 10.0)
    before = p.actions.copy()
    with pytest.raises(ChunkRefused, match=r"arrived 200 ms after its frame.*horizon of 10 steps"):
        p.offer(ramp(5.0), 10.0, 10.2)
    with pytest.raises(ChunkRefused, match="ahead of this node's clock"):
        p.offer(ramp(5.0), 11.0, 10.0)
    with pytest.raises(ChunkRefused, match="no stamp"):
        p.offer(ramp(5.0), 0.0, 10.0)
    np.testing.assert_array_equal(p.actions, before)


def test_the_plan_runs_out_after_the_last_step():
    p = plan()
    p.offer(ramp(0.0), 10.0, 10.0)
    assert p.sample(10.0 + (H - 1) * P) is not None
    assert p.sample(10.0 + (H - 1) * P + 1e-3) is None
    assert p.steps_left(10.0 + 3.5 * P) == H - 4


@pytest.mark.parametrize("mode,w_old", [("replace", 0.0), ("latest_only", 0.0), ("weighted_average", 0.3),
                                        ("average", 0.5), ("conservative", 0.7)])
def test_aggregate_modes_weigh_old_and_new_where_they_overlap(mode, w_old):
    p = plan(mode)
    p.offer(np.zeros((H, 1)), 10.0, 10.0)
    chunk = np.ones((H, 1))
    offer = p.offer(chunk, 10.0 + 2 * P, 10.0 + 3 * P)  # new chunk from step 1 (t = 10.06)
    assert offer.disagreement == pytest.approx(1.0)  # what the model offered at the switch
    assert offer.switch_jump == pytest.approx(1.0 - w_old)  # what the robot is sent
    np.testing.assert_array_equal(chunk, 1.0)  # the caller's chunk is not merged into
    t = 10.0 + 2 * P + P * np.arange(1, H)
    got = p.sample_rows(t)[:, 0]
    overlap = t <= 10.0 + (H - 1) * P + 1e-9  # the old chunk covers these times
    np.testing.assert_allclose(got[overlap], 1.0 - w_old)
    np.testing.assert_allclose(got[~overlap], 1.0)


def test_temporal_ensemble_weighs_predictions_by_age():
    m = 0.5
    p = plan("temporal_ensemble", temporal_ensemble_coeff=m)
    for k, value in enumerate([0.0, 1.0, 2.0]):
        p.offer(np.full((H, 1), value), 10.0, 10.0)  # three predictions for the same times
    w = np.exp(-m * np.arange(3))  # i = 0 the oldest prediction
    expect = (w * np.array([0.0, 1.0, 2.0])).sum() / w.sum()
    np.testing.assert_allclose(p.actions[:, 0], expect)


def test_cubic_interpolation_passes_through_the_steps_and_is_smooth():
    p = plan(interpolation="cubic")
    x = np.sin(np.arange(H) * 0.5)[:, None]
    p.offer(x, 10.0, 10.0)
    for i in range(H):
        assert p.sample(10.0 + i * P)[0] == pytest.approx(x[i, 0])
    mid = p.sample(10.0 + 2.5 * P)[0]
    assert mid != pytest.approx((x[2, 0] + x[3, 0]) / 2)  # not the linear value


def test_the_rows_before_a_switch_are_kept_so_the_target_stays_continuous():
    p = plan()
    p.offer(ramp(0.0), 10.0, 10.0)
    now = 10.0 + 3.3 * P
    before = p.sample(now)[0]
    p.offer(ramp(3.0), 10.0 + 3 * P, now)  # the same trajectory, a new chunk: no jump at the switch
    assert p.sample(now)[0] == pytest.approx(before)


def test_the_rtc_leftover_is_the_model_space_plan_from_the_frame_on():
    p = plan("rtc")
    raw = np.arange(H * 2, dtype=float).reshape(H, 2)
    p.offer(ramp(0.0), 10.0, 10.0 + 0.5 * P, raw=raw)  # from step 1
    left = p.leftover(10.0 + 4 * P)
    np.testing.assert_allclose(left, raw[4:])
    assert p.inference_delay() == 1
    assert plan("rtc").leftover(10.0) is None


def test_auto_is_rtc_for_flow_heads_with_absolute_actions_else_replace():
    from synflux_ros.core.config import load_config
    from synflux_ros.tools.harness import config_path
    arm = load_config(config_path("vla_sim_arm.yaml"))
    assert arm.execution.mode == "auto" and arm.resolved_execution.mode == "rtc"
    deltas = arm.with_overrides(execution={"delta_mask": [True] * 7})
    assert deltas.resolved_execution.mode == "replace"
    tokens = load_config(config_path("vla_openvla.yaml"))
    assert tokens.resolved_execution.mode == "replace"
    assert arm.with_overrides(execution={"mode": "temporal_ensemble"}).resolved_execution.mode == "temporal_ensemble"
