"""bench.control's simulated clock on a tiny config with the mock backend (--quick): what it measures at chunk
switches and between ticks, and its limits check."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from synflux_ros.bench import control
from synflux_ros.core.config import LimitsConfig

EVERY, FRAMES = 10, 8
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "docs"))


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    cfg, rt = control.mock_runtime(str(tmp_path_factory.mktemp("control")))
    frames = control.Frames(cfg.vision.resolution[0], 0, EVERY * cfg.action.step_period)
    chunks = control.Chunks(rt, frames)
    try:
        runs, limits = control.sweep(chunks, FRAMES, EVERY, cfg.action.step_period, cfg.action.action_horizon)
        yield cfg, chunks, runs, limits
    finally:
        rt.close()


def test_every_mode_and_delay_runs_on_the_same_unguided_chunks(quick):
    cfg, chunks, runs, _ = quick
    assert set(runs) == {(m, d) for m in control.MODES for d in control.DELAYS}
    # the unguided chunks are computed once per frame; only the rtc runs compute their own
    assert chunks.calls == FRAMES + 2 * len(control.DELAYS) * (FRAMES - 1)
    for (mode, d), run in runs.items():
        assert len(run.offer_jumps) == FRAMES - 1, (mode, d)  # every chunk after the first is a switch
        # the switch happens d steps after the frame, and commands start with the first chunk
        t0 = 1.0
        assert run.switch_times[0] == pytest.approx(t0 + (EVERY + d) * cfg.action.step_period)
        assert run.times[0] == pytest.approx(t0 + d * cfg.action.step_period)


def test_rtc_switches_more_smoothly_than_replace_on_the_same_frames(quick):
    _, _, runs, _ = quick
    for d in control.DELAYS:
        replace, rtc = runs[("replace", d)].summary(), runs[("rtc/lerobot", d)].summary()
        assert replace["jump_mean"] > 0.1, "the frames' chunks disagree at the switches"
        assert rtc["jump_mean"] < 0.5 * replace["jump_mean"], d
        assert rtc["jump_max"] < replace["jump_max"], d


def test_the_executed_jump_is_what_the_merge_leaves_of_the_offered_one(quick):
    _, _, runs, _ = quick
    for d in control.DELAYS:
        for mode in ("replace", "rtc/lerobot", "rtc/vjp"):  # no merge: the new chunk takes over as it is
            r = runs[(mode, d)]
            np.testing.assert_allclose(r.executed_jumps, r.offer_jumps, atol=1e-9)
        # weighted_average executes 0.3 old + 0.7 new at the switch: 0.7 of the disagreement
        r = runs[("weighted_average", d)]
        np.testing.assert_allclose(r.executed_jumps, 0.7 * np.array(r.offer_jumps), rtol=1e-6, atol=1e-9)
        # the temporal ensemble averages at least two predictions there: less than the whole disagreement
        r = runs[("temporal_ensemble", d)]
        assert all(e < o for e, o in zip(r.executed_jumps, r.offer_jumps))


def test_no_command_leaves_the_limits_and_the_limits_bind(quick):
    _, _, runs, limits = quick
    lo, hi = np.array(limits.position_min), np.array(limits.position_max)
    clamped = 0
    for (mode, d), r in runs.items():
        assert r.limits_ok, (mode, d, r.limits_why)
        assert np.all(r.commands >= lo - 1e-9) and np.all(r.commands <= hi + 1e-9)
        speed = np.abs(np.diff(r.commands, axis=0)) * control.CONTROL_RATE_HZ
        assert np.all(speed <= np.array(limits.max_velocity) * (1 + 1e-9))
        clamped += r.counts.get("position_limit", 0)
        steps = np.abs(np.diff(r.commands, axis=0)).max()
        assert r.summary()["tick_step_max"] == pytest.approx(steps)
    assert clamped > 0, "the limits never bound: the check would pass without them"


def test_the_limits_check_finds_a_command_outside():
    limits = LimitsConfig(position_min=(-1.0, -1.0), position_max=(1.0, 1.0), max_velocity=(10.0, 10.0))
    ok = np.array([[0.0, 0.0], [0.05, -0.05], [0.1, -0.1]])
    assert control.check_limits(ok, limits, 0.01) == (True, "")
    high = ok.copy()
    high[2, 1] = 1.2
    assert not control.check_limits(high, limits, 0.01)[0]
    fast = ok.copy()
    fast[2, 0] = 0.3  # 20 /s
    good, why = control.check_limits(fast, limits, 0.01)
    assert not good and "joint 0" in why


def test_quick_run_writes_rows_the_benchmark_page_accepts(tmp_path):
    import gen_benchmarks

    out = tmp_path / "rows.jsonl"
    assert control.main(["--quick", "--work", str(tmp_path), "--frames", "6", "--jsonl", str(out),
                         "--plot", str(tmp_path / "c.png"), "--label", "run 1 of 1"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(control.MODES) * len(control.DELAYS)
    for i, r in enumerate(rows):
        gen_benchmarks.check_row(r, f"row {i}")
        assert r["metric"].endswith("run 1 of 1")
    ratios = {r["metric"].split(":")[0]: r["ratio"] for r in rows}
    assert ratios["rtc/lerobot, d = 4"] < 0.5 and ratios["replace, d = 4"] is None


def test_the_loop_figures_from_synthetic_streams():
    pytest.importorskip("rclpy")
    from synflux_ros.tools import control_loop as loop

    t = np.arange(0, 2.0, 0.01)
    t_gappy = np.delete(t, [50, 51, 52])  # a 40 ms gap
    t_gappy[120:] += 0.005  # and a 15 ms one, not a stall
    count, largest = loop.stalls(t_gappy, 0.01)
    assert count == 1 and largest == pytest.approx(0.04)
    # a joint that follows its command 60 ms late, another that does not move
    cmd = np.stack([np.sin(2 * np.pi * 0.7 * t), np.full_like(t, 0.3)], axis=1)
    t_state = np.arange(0, 2.0, 0.005)
    state = np.stack([np.sin(2 * np.pi * 0.7 * (t_state - 0.06)), np.full_like(t_state, 0.3)], axis=1)
    delay, moving = loop.tracking_delay(t, cmd, t_state, state, 0.0, 2.0)
    assert moving == 1 and delay == pytest.approx(0.06, abs=0.003)
    # commands that change until 1.5 s, then repeat the last one: the hold starts at the first repetition
    held = cmd.copy()
    held[t >= 1.5] = held[t < 1.5][-1]
    assert loop.first_hold(t, held, after=1.0) == pytest.approx(t[t >= 1.5][0])
    assert loop.first_hold(t, held, after=1.6) is None  # held before the moment asked about
    assert loop.first_hold(t, cmd, after=1.0) is None  # never settles
