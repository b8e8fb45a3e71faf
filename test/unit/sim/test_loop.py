"""SimLoop: simulated time on the wall clock (or faster), periodic hooks on simulated time, commands taken from
other threads, refused commands counted with the last target held."""
import math
import time

import numpy as np
import pytest

from synflux_ros.sim import arm
from synflux_ros.sim.loop import SimLoop, Tick
from synflux_ros.sim.robot import SimRobot


def run_for(loop: SimLoop, seconds: float) -> float:
    t0 = time.monotonic()
    loop.start()
    try:
        time.sleep(seconds)
    finally:
        assert loop.stop()
    return time.monotonic() - t0


def test_real_time_keeps_simulated_time_on_the_wall_clock():
    robot = SimRobot(render=False)
    stamps = []
    loop = SimLoop(robot, real_time=True, ticks=[Tick(100.0, lambda r: stamps.append(r.time))])
    loop.start()
    time.sleep(1.0)
    rate, factor = loop.rates()
    wall = 1.0
    assert loop.stop()
    # never ahead of the wall clock; behind only by what a loaded machine's scheduler costs
    assert robot.time <= wall + 0.1 + 0.01
    assert robot.time >= 0.3 * wall
    assert 150 < rate < 550 and 0.3 < factor < 1.1, (rate, factor)
    # the hook runs every 10 ms of simulated time, to the physics step
    gaps = np.diff(stamps)
    assert len(stamps) >= 40 and np.allclose(gaps, 0.01, atol=robot.timestep + 1e-9), gaps


def test_without_real_time_it_steps_as_fast_as_it_can():
    robot = SimRobot(render=False)
    wall = run_for(SimLoop(robot, real_time=False), 0.5)
    assert robot.time > 2 * wall


def test_commands_from_another_thread_move_the_arm_and_bad_ones_are_held():
    robot = SimRobot(render=False)
    loop = SimLoop(robot, real_time=False)
    target = [0.5, 0.4, 1.3, 0.2, 1.0, -0.2, 0.03]
    assert loop.command(target) == ""
    assert loop.command(target[:6]) == "6 values for 7 joints (joint_1, joint_2, joint_3, joint_4, joint_5, " \
                                       "joint_6, gripper)"
    assert "not finite: joint_3=nan" in loop.command([0.5, 0.4, math.nan, 0.2, 1.0, -0.2, 0.03])
    assert loop.command([9.0, 0.4, 1.3, 0.2, 1.0, -0.2, 0.03]) == ""  # clamped, taken
    assert loop.counters() == dict(commands=2, refused=2, clamped=1, last_refusal=
                                   "not finite: joint_3=nan")
    loop.start()
    deadline = time.monotonic() + 10
    while robot.time < 2.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.stop()
    np.testing.assert_allclose(robot.positions(), [2.96, *target[1:]], atol=2e-3)


def test_a_refused_command_leaves_the_last_target():
    robot = SimRobot(render=False)
    loop = SimLoop(robot, real_time=False)
    loop.command([np.inf] * 7)
    run_for(loop, 0.3)
    np.testing.assert_allclose(robot.target, arm.HOME)
    np.testing.assert_allclose(robot.positions(), arm.HOME, atol=2e-3)


def test_a_failing_hook_stops_the_physics_and_says_why():
    def broken(robot):
        raise RuntimeError("publisher gone")
    loop = SimLoop(SimRobot(render=False), real_time=False, ticks=[Tick(50.0, broken)])
    run_for(loop, 0.2)
    assert loop.error == "RuntimeError: publisher gone" and not loop.running


@pytest.mark.parametrize("rate", [1000.0, 500.0])
def test_a_hook_at_the_physics_rate_runs_every_step(rate):
    robot = SimRobot(render=False)
    count = []
    loop = SimLoop(robot, real_time=False, ticks=[Tick(rate, lambda r: count.append(r.time))])
    run_for(loop, 0.2)
    assert len(count) == loop.steps  # at most once a step, and at every step
