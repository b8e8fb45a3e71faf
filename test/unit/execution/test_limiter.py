"""The joint limiter's invariant, on every tick, under hostile targets, arms that do not follow, and enable
and disable at any moment (hypothesis): no command jumps (velocity, acceleration and deceleration limits), none
leaves the position limits once inside (braking in time, never a dead stop), and each stays within
max_relative_target of the measured position unless that cannot hold with the others, which is counted. Then the
edges one by one: enable outside the limits, enable twice, a blocked joint, a braking approach, the watchdog's
hold and safe_action."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from synflux_ros.core.config import ConfigError, ExecutionConfig, LimitsConfig
from synflux_ros.execution.controller import Controller
from synflux_ros.tools.limiter_loop import violations

RATE = 100.0
DT = 1 / RATE


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 3))
    lo = np.array(draw(st.lists(st.floats(-2.0, 0.0), min_size=n, max_size=n)))
    span = np.array(draw(st.lists(st.floats(0.05, 3.0), min_size=n, max_size=n)))
    vmax = draw(st.lists(st.floats(0.05, 5.0), min_size=n, max_size=n))
    amax = draw(st.lists(st.floats(0.5, 100.0), min_size=n, max_size=n))
    dmax = draw(st.one_of(st.just(()), st.lists(st.floats(0.5, 100.0), min_size=n, max_size=n)))
    rel = draw(st.one_of(st.just(()), st.lists(st.floats(0.01, 1.0), min_size=1, max_size=1)))
    jerk = draw(st.one_of(st.just(()), st.lists(st.floats(5.0, 5000.0), min_size=n, max_size=n)))
    limits = LimitsConfig(position_min=tuple(lo), position_max=tuple(lo + span), max_velocity=tuple(vmax),
                          max_acceleration=tuple(amax), max_deceleration=tuple(dmax), max_jerk=tuple(jerk),
                          max_relative_target=tuple(rel), outside_at_enable="move_inside")
    ticks = draw(st.integers(20, 200))
    seed = draw(st.integers(0, 2**32 - 1))
    return n, limits, ticks, seed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_command_keeps_the_invariant(scenario):
    n, limits, ticks, seed = scenario
    rng = np.random.default_rng(seed)
    joints = tuple(f"j{i}" for i in range(n))
    c = Controller(ExecutionConfig(joints=joints, control_rate_hz=RATE, limits=limits, state_timeout=0.0,
                                   chunk_timeout=0.0), 0.02, 16)
    lim = c.filter
    lo, hi = np.array(limits.position_min), np.array(limits.position_max)
    measured = lo + rng.uniform(-0.3, 1.3) * (hi - lo)  # may start outside: move_inside
    t = 10.0
    prev = None  # (command, velocity, acceleration) of the previous tick while enabled
    for k in range(ticks):
        t += DT
        event = rng.random()
        if event < 0.03:
            c.disable("test")
            prev = None
        elif event < 0.08 or k == 0:
            c.on_joint_state(t, list(joints), list(measured), t)
            c.enable(t)  # a second enable while enabled changes nothing
        if rng.random() < 0.3:  # hostile chunks: far outside the limits, flipping sign, huge
            chunk = rng.normal(0, 1, (16, n)) * 10.0 ** rng.integers(-1, 4) * rng.choice([-1, 1])
            c.on_chunk(chunk, t, t)
        # the arm: follows the command, lags, or is held by an obstacle
        if prev is not None and rng.random() < 0.7:
            measured = prev[0] + rng.normal(0, 0.01, n) * (rng.random() < 0.5)
        c.on_joint_state(t, list(joints), list(measured), t)
        before = Counter(c.counts)
        cmd = c.tick(t)
        if cmd is None:
            prev = None
            continue
        if prev is not None and c.status.state == "running":  # the invariant's check bench.limiter counts with
            unmet = c.counts["relative_target_unmet"] > before["relative_target_unmet"]
            jerk_unmet = c.counts["jerk_unmet"] > before["jerk_unmet"]
            assert not violations(lim, prev[0], prev[1], cmd, measured, unmet, prev[2], jerk_unmet), \
                (prev, cmd, measured)
        prev = (cmd, lim.velocity.copy(), lim.accel.copy())


J = ("j1", "j2")


def controller(**kw) -> Controller:
    limits = kw.pop("limits", LimitsConfig(position_min=(-1.0, -1.0), position_max=(1.0, 1.0),
                                           max_velocity=(0.8, 0.8), max_acceleration=(4.0, 4.0)))
    return Controller(ExecutionConfig(joints=J, control_rate_hz=RATE, limits=limits, **kw), 0.02, 16)


def test_enable_outside_the_limits_is_refused_naming_the_joint_by_default():
    c = controller(state_timeout=1.0)
    c.on_joint_state(10.0, list(J), [0.0, 1.2], 10.0)
    with pytest.raises(ValueError, match=r"joint 'j2' is at 1.2, outside its position limits \[-1, 1\]"):
        c.enable(10.0)
    assert not c.enabled


def test_enable_outside_the_limits_moves_back_without_a_jump_when_asked():
    limits = LimitsConfig(position_min=(-1.0, -1.0), position_max=(1.0, 0.5), max_velocity=(0.8, 0.8),
                          max_acceleration=(4.0, 4.0), outside_at_enable="move_inside")
    c = controller(limits=limits, state_timeout=1.0, chunk_timeout=0.0)
    c.on_joint_state(10.0, list(J), [0.0, 0.7], 10.0)  # moved by hand 0.2 past its limit
    c.enable(10.0)
    c.on_chunk(np.zeros((16, 2)), 10.0, 10.0)
    cmds, t = [], 10.0
    for _ in range(150):
        t += DT
        cmds.append(c.tick(t))
    cmds = np.array(cmds)
    steps = np.diff(np.vstack([[0.0, 0.7], cmds]), axis=0)
    assert abs(steps[0, 1]) <= 4.0 * DT * DT + 1e-12  # the first command: from rest, not a jump to 0.5
    assert np.all(np.abs(steps) <= 0.8 * DT + 1e-9)
    assert np.all(np.abs(np.diff(steps, axis=0)) <= 4.0 * DT * DT + 1e-9)
    assert cmds[-1, 1] <= 0.5 + 1e-9 and c.counts["enabled_outside_limits"] == 1


def test_a_second_enable_while_moving_changes_nothing():
    c = controller(state_timeout=1.0, chunk_timeout=0.0)
    c.on_joint_state(10.0, list(J), [0.0, 0.0], 10.0)
    c.enable(10.0)
    c.on_chunk(np.tile(np.linspace(0, 0.3, 16)[:, None], 2), 10.0, 10.0)
    t, cmds = 10.0, []
    for k in range(30):
        t += DT
        if k == 15:
            c.on_joint_state(t, list(J), [-0.05, -0.05], t)  # tracking error
            assert c.enable(t) == "already enabled"
        cmds.append(c.tick(t))
    steps = np.diff(np.array(cmds), axis=0)
    assert np.all(np.abs(steps) <= 0.8 * DT + 1e-9) and np.all(np.abs(np.diff(steps, axis=0)) <= 4 * DT * DT + 1e-9)
    assert c.counts["enable_while_enabled"] == 1


def test_a_blocked_joint_is_never_commanded_beyond_max_relative_target_with_acceleration_limits():
    limits = LimitsConfig(max_velocity=(0.8, 0.8), max_acceleration=(4.0, 4.0), max_relative_target=(0.05,))
    c = controller(limits=limits, state_timeout=1.0, chunk_timeout=0.0)
    c.on_joint_state(10.0, list(J), [0.1, 0.1], 10.0)
    c.enable(10.0)
    rng = np.random.default_rng(3)
    t = 10.0
    for k in range(2800):
        t += DT
        if k % 20 == 0:
            c.on_chunk(rng.normal(0, 2, (16, 2)), t, t)
        c.on_joint_state(t, list(J), [0.1, 0.1], t)  # held by an obstacle
        cmd = c.tick(t)
        assert np.all(np.abs(cmd - 0.1) <= 0.05 + 1e-9), (k, cmd)
    assert c.counts["max_relative_target"] > 0 and c.counts["relative_target_unmet"] == 0


@pytest.mark.parametrize("moving", [False, True])
def test_the_arm_brakes_before_a_position_limit_instead_of_stopping_dead(moving):
    c = controller(state_timeout=0.0, chunk_timeout=0.0)
    c.enable(10.0)
    c.on_chunk(np.full((16, 2), 0.0), 10.0, 10.0)
    c.tick(10.0)
    t, cmds = 10.0, []
    for k in range(400):  # chunk after chunk towards +1: a target far beyond it, or one moving past it at 0.6
        t += DT
        if k % 10 == 0:
            rows = 0.6 * (t + 0.02 * np.arange(16) - 10.0) if moving else np.full(16, 5.0)
            c.on_chunk(np.repeat(rows[:, None], 2, axis=1), t, t)
        cmds.append(c.tick(t)[0])
    cmds = np.array(cmds)
    v = np.diff(cmds) / DT
    assert v.max() == pytest.approx(0.8) and cmds.max() <= 1.0 + 1e-12  # (catching up with the moving one)
    assert np.all(np.abs(np.diff(v)) <= 4.0 * DT + 1e-9)  # slowed within max_acceleration, no dead stop
    assert cmds[-1] == pytest.approx(1.0, abs=1e-3)
    # a target clamped at the limit is approached braking in time; one that runs past it meets the limit's braking
    assert c.counts["position_limit"] > 0 and (c.counts["braking"] > 0) == moving


def test_a_still_target_is_reached_without_overshoot_or_hunting():
    c = controller(state_timeout=0.0, chunk_timeout=0.0)
    c.enable(10.0)
    c.on_chunk(np.zeros((16, 2)), 10.0, 10.0)
    c.tick(10.0)
    t, cmds = 10.0, []
    for k in range(300):  # a step of 0.5: the chunk holds it
        t += DT
        if k % 10 == 0:
            c.on_chunk(np.full((16, 2), 0.5), t, t)
        cmds.append(c.tick(t)[0])
    cmds = np.array(cmds)
    assert cmds.max() <= 0.5 + 1e-12 and np.all(np.diff(cmds) >= -1e-12)  # never past it, never back
    assert cmds[-1] == pytest.approx(0.5, abs=1e-9)


@pytest.mark.parametrize("jerk", [20.0, 200.0])
def test_max_jerk_smooths_the_acceleration_and_still_arrives(jerk):
    limits = LimitsConfig(position_min=(-1.0, -1.0), position_max=(1.0, 1.0), max_velocity=(0.8, 0.8),
                          max_acceleration=(4.0, 4.0), max_jerk=(jerk, jerk))
    c = controller(limits=limits, state_timeout=0.0, chunk_timeout=0.0)
    c.enable(10.0)
    c.on_chunk(np.zeros((16, 2)), 10.0, 10.0)
    c.tick(10.0)
    t, cmds = 10.0, []
    for k in range(300):
        t += DT
        if k % 10 == 0:
            c.on_chunk(np.full((16, 2), 0.5), t, t)
        cmds.append(c.tick(t)[0])
    cmds = np.array(cmds)
    a = np.diff(np.diff(np.r_[0.0, 0.0, cmds]) / DT) / DT
    assert np.all(np.abs(np.diff(np.r_[0.0, a])) <= jerk * DT * (1 + 1e-9) + 1e-9)
    assert np.abs(a).max() <= 4.0 + 1e-9 and c.counts["jerk_limit"] > 0 and c.counts["jerk_unmet"] == 0
    assert cmds[-1] == pytest.approx(0.5, abs=1e-6) and cmds.max() < 0.5 + 0.005  # arrives, barely passing


def test_max_jerk_needs_max_acceleration():
    with pytest.raises(ConfigError, match="max_jerk: give max_acceleration"):
        LimitsConfig(max_jerk=(10.0, 10.0)).check(J)


def test_the_watchdog_brakes_within_max_deceleration_and_hold_exact_repeats():
    limits = LimitsConfig(max_velocity=(0.8, 0.8), max_acceleration=(4.0, 4.0), max_deceleration=(2.0, 2.0))
    for mode in ("hold", "hold_exact"):
        c = controller(limits=limits, state_timeout=0.0, chunk_timeout=0.3, on_timeout=mode)
        c.enable(10.0)
        c.on_chunk(np.zeros((16, 2)), 10.0, 10.0)
        c.tick(10.0)
        c.on_chunk(np.tile(np.linspace(0, 5, 16)[:, None], 2), 10.01, 10.01)
        t, cmds = 10.01, []
        for _ in range(100):
            t += DT
            cmds.append(c.tick(t)[0])
        v = np.diff(cmds) / DT
        held = int(np.argmax(np.array([0.0] * 29 + [1.0] * 71)))  # the hold starts after chunk_timeout
        assert c.counts["hold_chunk_timeout"] == 1
        if mode == "hold":
            assert np.all(np.diff(v[held - 2:]) >= -2.0 * DT - 1e-9)  # slowing at max_deceleration at most
            assert abs(v[-1]) < 1e-9  # and at rest
        else:
            assert v[held] < -1.0 or np.all(v[held + 1:] == 0.0)


def test_safe_action_is_reached_at_rest_without_overshoot():
    c = controller(state_timeout=0.0, chunk_timeout=0.05, on_timeout="safe_action", safe_action=(0.5, -0.3))
    c.enable(10.0)
    c.on_chunk(np.zeros((16, 2)), 10.0, 10.0)
    t, cmds = 10.0, []
    for _ in range(400):
        t += DT
        cmds.append(c.tick(t))
    cmds = np.array(cmds)
    assert cmds[:, 0].max() <= 0.5 + 1e-9 and cmds[:, 1].min() >= -0.3 - 1e-9  # never past it
    np.testing.assert_allclose(cmds[-1], [0.5, -0.3], atol=1e-6)
    steps = np.diff(cmds, axis=0)
    assert np.all(np.abs(np.diff(steps, axis=0)) <= 4.0 * DT * DT + 1e-9)


@pytest.mark.parametrize("limits,needle", [
    (dict(position_min=(0.0, 0.0), position_max=(1.0, float("nan"))), r"limits.position_max\[1\] \(j2\): NaN"),
    (dict(max_velocity=(float("nan"), 1.0)), r"limits.max_velocity\[0\] \(j1\): NaN"),
    (dict(max_deceleration=(1.0, 0.0)), "limits.max_deceleration: joint 'j2' has 0.0"),
])
def test_limit_errors_name_the_joint(limits, needle):
    with pytest.raises(ConfigError, match=needle):
        ExecutionConfig(joints=J, limits=LimitsConfig(**limits))


def test_a_state_is_aged_by_its_stamp_and_one_from_the_future_is_refused():
    c = controller(state_timeout=0.25, chunk_timeout=0.0)
    c.on_joint_state(0.0, list(J), [0.0, 0.0], 20.0)  # unstamped: aged from its arrival
    assert c.enable(20.1) == "enabled"
    c.disable("test")
    c.on_joint_state(10.0, list(J), [0.0, 0.0], 20.0)  # measured 10 s ago, delivered now
    with pytest.raises(ValueError, match=r"10.00 s old by its stamp"):
        c.enable(20.0)
    with pytest.raises(ValueError, match="ahead of this node's clock"):
        c.on_joint_state(21.0, list(J), [0.0, 0.0], 20.0)
    assert c.counts["states_from_the_future"] == 1
    c.on_joint_state(20.04, list(J), [0.0, 0.0], 20.0)  # within the skew allowed
    assert c.enable(20.05) == "enabled"


def test_a_chunk_over_the_validation_thresholds_is_refused_naming_the_worst_joint_and_step():
    from synflux_ros.core.config import ChunkValidation
    from synflux_ros.execution.plan import ChunkRefused
    check = ChunkValidation(max_step=(0.1,), max_acceleration=(50.0, 500.0))
    c = controller(state_timeout=0.0, validate=check)
    chunk = np.tile(np.linspace(0, 0.3, 16)[:, None], 2)
    c.on_chunk(chunk, 10.0, 10.0)  # 0.02 a step: fine
    bad = chunk.copy()
    bad[9:, 1] += 0.25  # a jump of 0.27 between steps 8 and 9 of j2
    with pytest.raises(ChunkRefused, match=r"jumps 0.27 between steps 8 and 9 of joint 'j2'"):
        c.on_chunk(bad, 10.02, 10.02)
    wobble = chunk.copy()
    wobble[5, 0] += 0.05  # within max_step, but 0.05 / 0.02^2 = 125 units/s^2 over step 5 of j1
    with pytest.raises(ChunkRefused, match=r"acceleration .* at step 5 of joint 'j1' is over"):
        c.on_chunk(wobble, 10.02, 10.02)
    assert c.counts["chunks_invalid"] == 2 and c.counts["chunks_accepted"] == 1


def test_clip_mode_limits_each_step_and_keeps_the_chunk():
    from synflux_ros.core.config import ChunkValidation
    c = controller(state_timeout=0.0, validate=ChunkValidation(max_velocity=(1.0,), on_violation="clip"))
    chunk = np.zeros((16, 2))
    chunk[4:, 0] = 5.0  # a jump of 5 in one step of 0.02 s
    c.on_chunk(chunk, 10.0, 10.0)
    steps = np.diff(c.plan.actions[:, 0])
    assert np.all(np.abs(steps) <= 1.0 * 0.02 + 1e-12) and c.counts["chunks_clipped"] == 1


@pytest.mark.parametrize("check,needle", [
    (dict(max_step=(0.1, 0.2, 0.3)), "validate.max_step: 3 values, give 1 or one per joint"),
    (dict(max_jerk=(float("nan"),)), r"validate.max_jerk\[0\] \(every joint\): nan"),
])
def test_validation_thresholds_are_checked_at_load(check, needle):
    from synflux_ros.core.config import ChunkValidation
    with pytest.raises(ConfigError, match=needle):
        ExecutionConfig(joints=J, validate=ChunkValidation(**check))


def approach_with_checks(limits) -> Counter:
    """Full speed towards +1 and a hold there, every command through bench.limiter's invariant check."""
    c = controller(limits=limits, state_timeout=0.0, chunk_timeout=0.0)
    c.enable(10.0)
    c.on_chunk(np.zeros((16, 2)), 10.0, 10.0)
    c.tick(10.0)
    lim, bad, t = c.filter, Counter(), 10.0
    prev = (lim.last.copy(), lim.velocity.copy(), lim.accel.copy())
    for k in range(300):
        t += DT
        if k % 10 == 0:
            c.on_chunk(np.full((16, 2), 0.6 * (t - 10.0)) + 0.6 * 0.02 * np.arange(16)[:, None], t, t)
        before = Counter(c.counts)
        cmd = c.tick(t)
        bad.update(violations(lim, prev[0], prev[1], cmd, cmd, False, prev[2],
                              c.counts["jerk_unmet"] > before["jerk_unmet"]))
        prev = (cmd, lim.velocity.copy(), lim.accel.copy())
    return bad


@pytest.mark.parametrize("plant,breach", [("no_braking", "acceleration"), ("no_jerk", "jerk")])
def test_the_invariant_check_catches_a_limiter_without_braking_or_jerk_limit(monkeypatch, plant, breach):
    from synflux_ros.execution.limiter import JointLimiter
    limits = LimitsConfig(position_min=(-1.0, -1.0), position_max=(1.0, 1.0), max_velocity=(0.8, 0.8),
                          max_acceleration=(4.0, 4.0), max_jerk=(100.0, 100.0))
    assert not approach_with_checks(limits)  # the real one keeps it
    if plant == "no_braking":  # only the clamp to the position limits: a dead stop there
        monkeypatch.setattr(JointLimiter, "brake_speed", lambda self, d, rate=None, lag=0.0:
                            np.where(np.asarray(d) > 0, np.inf, 0.0) if rate is None else np.full_like(d, np.inf))
    else:
        monkeypatch.setattr(JointLimiter, "_jerk_band", lambda self, lo, hi, counts: (lo, hi))
        monkeypatch.setattr(JointLimiter, "_smooth", lambda self, want, measured=None: want)
    assert approach_with_checks(limits)[breach] > 0
