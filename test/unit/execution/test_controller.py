"""Controller: nothing leaves outside the limits, commands only while enabled, the watchdog holds; hostile
chunks and joint states are refused with the reason."""
from __future__ import annotations

import numpy as np
import pytest

from synflux_ros.core.config import ConfigError, ExecutionConfig, LimitsConfig
from synflux_ros.execution.controller import Controller
from synflux_ros.execution.plan import ChunkRefused

J = ("j1", "j2", "j3")
RATE = 100.0
P = 0.02
H = 16
LIMITS = LimitsConfig(position_min=(-1.0, -0.5, 0.0), position_max=(1.0, 0.5, 0.1), max_velocity=(2.0, 1.0, 0.5),
                      max_acceleration=(40.0, 40.0, 40.0))


def controller(**kw) -> Controller:
    kw.setdefault("limits", LIMITS)
    return Controller(ExecutionConfig(joints=J, control_rate_hz=RATE, **kw), P, H)


def state(c, now, q=(0.0, 0.0, 0.05)):
    c.on_joint_state(now, list(J), list(q), now)


def run(c, t0, t1, feed_state=True):
    out = []
    for t in np.arange(t0, t1, 1 / RATE):
        if feed_state:
            state(c, t)
        out.append(c.tick(t))
    return out


def test_nothing_is_commanded_until_enabled():
    c = controller(state_timeout=0.0)
    c.on_chunk(np.zeros((H, 3)), 10.0, 10.0)
    assert c.tick(10.01) is None and c.status.state == "disabled"
    c.enable(10.02)
    assert c.tick(10.03) is not None
    c.disable("test")
    assert c.tick(10.04) is None


def test_enable_needs_a_fresh_joint_state():
    c = controller(state_timeout=0.2)
    with pytest.raises(ValueError, match="no joint state"):
        c.enable(10.0)
    state(c, 10.0)
    with pytest.raises(ValueError, match="0.50 s old"):
        c.enable(10.5)
    state(c, 10.5)
    assert c.enable(10.5) == "enabled"


def test_hostile_chunks_never_leave_the_limits():
    rng = np.random.default_rng(0)
    c = controller()
    state(c, 10.0)
    c.enable(10.0)
    lo, hi = np.array(LIMITS.position_min), np.array(LIMITS.position_max)
    vmax = np.array(LIMITS.max_velocity)
    cmds, t = [], 10.0
    for k in range(40):
        wild = rng.normal(0, 50, (H, 3)) * (10 ** rng.integers(0, 6))  # far outside, huge jumps
        c.on_chunk(wild, t, t + 0.015)
        for _ in range(5):
            t += 1 / RATE
            state(c, t)
            cmds.append(c.tick(t))
    cmds = np.array(cmds)
    assert np.all(cmds >= lo - 1e-12) and np.all(cmds <= hi + 1e-12)
    assert np.all(np.abs(np.diff(cmds, axis=0)) <= vmax / RATE + 1e-9)
    assert c.counts["position_limit"] > 0 and c.counts["velocity_limit"] > 0


def test_non_finite_and_misshapen_chunks_are_refused_and_the_command_held():
    c = controller(state_timeout=0.0)
    c.enable(10.0)
    c.on_chunk(np.full((H, 3), 0.05), 10.0, 10.0)
    good = c.tick(10.01)
    for bad, why in [(np.full((H, 3), np.nan), "non-finite"), (np.full((H, 3), np.inf), "non-finite"),
                     (np.zeros((H, 2)), "expected"), (np.zeros(H), "expected")]:
        with pytest.raises(ChunkRefused, match=why):
            c.on_chunk(bad, 10.01, 10.02)
    mixed = np.full((H, 3), 0.05)
    mixed[7, 2] = np.nan
    with pytest.raises(ChunkRefused, match=r"step 7, joint 'j3'"):
        c.on_chunk(mixed, 10.01, 10.02)
    np.testing.assert_allclose(c.tick(10.02), good)
    assert c.counts["chunks_non_finite"] == 3 and c.counts["chunks_refused"] == 5


@pytest.mark.parametrize("names,positions,why", [
    (["j1", "j2"], [0.0, 0.0], "no position for commanded joint"),
    (list(J), [0.0, np.nan, 0.0], "non-finite"),
    (list(J), [0.0], "positions for 3 names"),
])
def test_bad_joint_states_are_refused(names, positions, why):
    c = controller()
    with pytest.raises(ValueError, match=why):
        c.on_joint_state(10.0, names, positions, 10.0)


def test_the_watchdog_holds_within_one_tick_of_the_chunk_timeout():
    c = controller(chunk_timeout=0.1, state_timeout=0.0)
    c.enable(10.0)
    c.on_chunk(np.tile(np.linspace(0, 0.1, 50)[:, None], 3), 10.0, 10.0)  # long enough not to run out
    c.plan.horizon = 50
    t = 10.0
    last = None
    while t < 10.1 - 1e-9:
        last = c.tick(t)
        assert c.status.state == "running"
        t += 1 / RATE
    t += 1 / RATE  # the first tick after the timeout
    held = c.tick(t)
    assert c.status.state == "holding" and "chunk_timeout" in c.status.reason
    np.testing.assert_array_equal(held, c.filter.last)
    for _ in range(10):
        t += 1 / RATE
        np.testing.assert_array_equal(c.tick(t), held)
    assert c.counts["hold_chunk_timeout"] == 1
    assert 0 < c.hold_reaction_s <= 1 / RATE + 1e-9  # the first tick after the timeout expired


def test_a_stale_joint_state_holds_and_a_fresh_one_resumes():
    c = controller(state_timeout=0.05, chunk_timeout=0.0)
    state(c, 10.0)
    c.enable(10.0)
    c.on_chunk(np.tile(np.linspace(0, 0.1, H)[:, None], 3), 10.0, 10.0)
    c.tick(10.01)
    held = c.tick(10.07)
    assert c.status.state == "holding" and "joint state is" in c.status.reason
    np.testing.assert_array_equal(c.tick(10.08), held)
    state(c, 10.09)
    c.tick(10.09)
    assert c.status.state == "running"


def test_safe_action_is_approached_within_the_velocity_limit():
    c = controller(state_timeout=0.0, chunk_timeout=0.05, on_timeout="safe_action", safe_action=(0.5, 0.0, 0.0))
    c.enable(10.0)
    c.on_chunk(np.zeros((H, 3)), 10.0, 10.0)
    cmds = np.array(run(c, 10.0, 11.0, feed_state=False))
    assert np.all(np.abs(np.diff(cmds, axis=0)) <= np.array(LIMITS.max_velocity) / RATE + 1e-9)
    np.testing.assert_allclose(cmds[-1], [0.5, 0.0, 0.0], atol=1e-9)


def test_max_relative_target_keeps_commands_near_the_measured_position():
    c = controller(limits=LimitsConfig(max_relative_target=(0.1,)), state_timeout=1.0)
    state(c, 10.0, (0.0, 0.0, 0.0))
    c.enable(10.0)
    c.on_chunk(np.full((H, 3), 5.0), 10.0, 10.0)
    for t in (10.01, 10.02, 10.03):
        cmd = c.tick(t)  # the arm does not move (no new state): the target stays within 0.1 of it
        np.testing.assert_allclose(cmd, 0.1)
    assert c.counts["max_relative_target"] == 3


def test_delta_actions_add_the_joint_state_of_their_frame():
    c = controller(limits=LimitsConfig(), delta_mask=(True, False, True), state_timeout=0.0)
    c.on_joint_state(9.99, list(J), [0.2, 0.3, 0.4], 9.99)
    c.on_joint_state(10.5, list(J), [9.0, 9.0, 9.0], 10.5)  # after the frame: not its state
    c.on_chunk(np.full((H, 3), 0.01), 10.0, 10.0)
    np.testing.assert_allclose(c.plan.actions[0], [0.21, 0.01, 0.41])
    c2 = controller(limits=LimitsConfig(), delta_mask=(True, False, True), state_timeout=0.0)
    with pytest.raises(ChunkRefused, match="delta actions need the joint state of the frame"):
        c2.on_chunk(np.zeros((H, 3)), 10.0, 10.0)


def test_the_trajectory_lies_ahead_and_continues_from_the_last_command():
    c = controller(state_timeout=0.0)
    c.enable(10.0)
    c.on_chunk(np.zeros((H, 3)), 10.0, 10.0)
    for t in np.arange(10.0, 10.05, 0.01):
        c.tick(t)
    last = c.filter.last.copy()
    c.on_chunk(np.tile([0.9, 0.4, 0.1], (H, 1)), 10.05, 10.06)
    points = c.trajectory(10.06)
    # ahead by at least one control period (plus lookahead, 0 here): never in the past when it arrives
    assert points and all(t >= 1 / RATE - 1e-9 for t, _ in points)
    lookahead = controller(state_timeout=0.0, lookahead=0.03)
    lookahead.enable(10.0)
    lookahead.on_chunk(np.zeros((H, 3)), 10.0, 10.0)
    lookahead.tick(10.0)
    assert all(t >= 1 / RATE + 0.03 - 1e-9 for t, _ in lookahead.trajectory(10.0))
    first_t, first = points[0]
    assert np.all(np.abs(first - last) <= np.array(LIMITS.max_velocity) * (first_t + 0.01) + 1e-9)
    c.disable("test")
    assert c.trajectory(10.07) == []


@pytest.mark.parametrize("limits,needle", [
    (dict(position_min=(0.0, 0.0, 0.0), position_max=(1.0, -1.0, 1.0)), "joint 'j2' has position_min 0.0 not below"),
    (dict(position_min=(0.0,), position_max=(1.0,)), "limits.position_min: 1 values for 3 joints"),
    (dict(max_velocity=(1.0, 0.0, 1.0)), "limits.max_velocity: joint 'j2' has 0.0"),
    (dict(max_relative_target=(0.1, 0.2)), "give 1 or one per joint"),
    (dict(position_min=(0.0, 0.0, 0.0)), "give both or neither"),
])
def test_inconsistent_limits_are_a_config_error_naming_the_joint(limits, needle):
    with pytest.raises(ConfigError, match=needle):
        ExecutionConfig(joints=J, limits=LimitsConfig(**limits))


def test_a_limits_error_in_a_config_file_names_its_path(make_config):
    from synflux_ros.core.config import load_config
    joints = [f"joint_{i}" for i in range(7)]
    path = make_config("vla_demo_orin.yaml", execution={"joints": joints, "limits": {
        "position_min": [0.0] * 7, "position_max": [1.0] * 6 + [-1.0]}})
    with pytest.raises(ConfigError, match=r"execution\.limits: joint 'joint_6' has position_min"):
        load_config(path)


def test_the_callers_chunk_is_never_changed():
    c = controller(mode="weighted_average", state_timeout=0.0)
    c.on_chunk(np.zeros((H, 3)), 10.0, 10.0)
    chunk = np.full((H, 3), 0.05)
    c.on_chunk(chunk, 10.04, 10.08)
    np.testing.assert_array_equal(chunk, 0.05)


def test_the_control_loop_ticks_on_schedule_and_survives_a_failing_tick():
    import threading
    import time as _time
    c = controller(state_timeout=0.0)
    c.enable(10.0)
    c.on_chunk(np.zeros((H, 3)), 10.0, 10.0)
    sent, errors = [], []
    fail = threading.Event()

    def send(cmd):
        if fail.is_set():
            fail.clear()
            raise RuntimeError("publisher gone")
        sent.append(_time.monotonic())
    from synflux_ros.execution.controller import ControlLoop
    loop = ControlLoop(c, lambda: 10.05, send, errors.append)
    loop.start()
    _time.sleep(0.3)
    fail.set()
    _time.sleep(0.3)
    loop.stop()
    assert errors and "publisher gone" in str(errors[0])
    assert 0.6 * 0.6 * RATE <= loop.ticks <= 0.6 * RATE + 5, loop.ticks
    gaps = np.diff(sent)
    assert np.median(gaps) == pytest.approx(1 / RATE, rel=0.3)
    n = loop.ticks
    _time.sleep(0.05)
    assert loop.ticks == n  # stopped


def test_on_simulated_time_a_stamp_may_lead_the_clock_by_the_lag_of_clock_messages():
    from synflux_ros.execution.plan import CLOCK_SKEW_S, SIM_CLOCK_SKEW_S
    cfg = ExecutionConfig(joints=("a",), state_timeout=1.0)
    lead = (CLOCK_SKEW_S + SIM_CLOCK_SKEW_S) / 2
    with pytest.raises(ValueError, match="ahead of this node's clock"):
        Controller(cfg, 0.02, 16).on_joint_state(10.0 + lead, ["a"], [0.0], 10.0)
    sim = Controller(cfg, 0.02, 16, clock_skew=SIM_CLOCK_SKEW_S)
    sim.on_joint_state(10.0 + lead, ["a"], [0.0], 10.0)
    sim.on_chunk(np.zeros((16, 1)), 10.0 + lead, 10.0)  # a frame as far ahead: placed, not refused
    assert sim.counts["chunks_accepted"] == 1 and sim.counts["states_from_the_future"] == 0
    with pytest.raises(ValueError, match="ahead of this node's clock"):
        sim.on_joint_state(10.0 + 2 * SIM_CLOCK_SKEW_S, ["a"], [0.0], 10.0)
