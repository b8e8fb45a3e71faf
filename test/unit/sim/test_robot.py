"""SimRobot: joint lookup and errors that name the setting at fault, command checks, servos that reach their
target, joint ranges that hold when commanded beyond them, a user's MJCF with its own joint names."""
import math

import numpy as np
import pytest

from synflux_ros.sim import arm
from synflux_ros.sim.robot import CommandError, SimError, SimRobot

PENDULUM = """<mujoco>
  <compiler angle="radian" autolimits="true"/>
  <option gravity="0 0 -9.81"/>
  <worldbody>
    <body name="upper">
      <joint name="{a}" axis="0 1 0" range="-1 1"/>
      <geom type="capsule" fromto="0 0 0 0 0 -0.3" size="0.02"/>
      <body name="lower" pos="0 0 -0.3">
        <joint name="{b}" axis="0 1 0"/>
        <geom type="capsule" fromto="0 0 0 0 0 -0.3" size="0.02"/>
        <body name="tip" pos="0 0 -0.3"><joint name="free_spin" axis="0 0 1"/><geom size="0.02"/></body>
      </body>
    </body>
  </worldbody>
  <actuator>
    {actuators}
  </actuator>
</mujoco>"""
SERVOS = '<position joint="shoulder" kp="50" kv="5"/><position joint="elbow" kp="20" kv="2"/>'


def pendulum(tmp_path, actuators=SERVOS, a="shoulder", b="elbow"):
    path = tmp_path / "pendulum.xml"
    path.write_text(PENDULUM.format(a=a, b=b, actuators=actuators))
    return str(path)


def settle(robot, target, seconds=1.5):
    t, _ = robot.check_command(target)
    robot.set_target(t)
    robot.step(int(seconds * robot.physics_rate_hz))
    return t


def test_the_built_in_arm_starts_at_home_and_its_servos_reach_a_target():
    r = SimRobot(render=False)
    assert r.joint_names == list(arm.JOINT_NAMES) and r.timestep == pytest.approx(0.002)
    np.testing.assert_allclose(r.positions(), arm.HOME)
    target = [0.6, 0.5, 1.2, -0.4, 0.9, 0.3, 0.035]
    settle(r, target)
    np.testing.assert_allclose(r.positions(), target, atol=2e-3)
    assert np.abs(r.velocities()).max() < 1e-2
    assert r.time == pytest.approx(1.5)


def test_targets_beyond_the_ranges_are_clamped_and_the_joints_stay_within():
    r = SimRobot(render=False)
    target, clamped = r.check_command([4.0, 0.35, 1.6, 0.0, 1.19, -4.0, 0.2])
    assert clamped == 3
    np.testing.assert_allclose(target[[0, 5, 6]], [2.96, -3.05, 0.04])
    r.set_target(target)
    lowest, highest = np.full(7, np.inf), np.full(7, -np.inf)
    for _ in range(1000):
        r.step()
        lowest, highest = np.minimum(lowest, r.positions()), np.maximum(highest, r.positions())
    assert (lowest >= r.lower - 1e-3).all() and (highest <= r.upper + 1e-3).all(), (lowest, highest)
    np.testing.assert_allclose(r.positions(), target, atol=2e-3)


@pytest.mark.parametrize("command,reason", [
    ([0.1] * 6, "6 values for 7 joints (joint_1, joint_2"),
    ([0.1] * 8, "8 values for 7 joints"),
    ([], "0 values for 7 joints"),
    ([0.1, math.nan, 0.1, 0.1, 0.1, 0.1, 0.01], "not finite: joint_2=nan"),
    ([0.1, 0.1, 0.1, 0.1, 0.1, -math.inf, math.inf], "not finite: joint_6=-inf, gripper=inf"),
])
def test_bad_commands_are_refused_with_the_reason(command, reason):
    r = SimRobot(render=False)
    with pytest.raises(CommandError) as err:
        r.check_command(command)
    assert reason in str(err.value)
    np.testing.assert_allclose(r.target, arm.HOME)


def test_initial_positions(tmp_path):
    start = [0.2, 0.1, 1.0, 0.0, 1.0, 0.0, 0.01]
    r = SimRobot(initial_positions=start, render=False)
    np.testing.assert_allclose(r.positions(), start)
    r.step(250)  # held: the first target is the start
    np.testing.assert_allclose(r.positions(), start, atol=2e-3)
    with pytest.raises(SimError, match=r"initial positions: 3 values for 7 joints") as err:
        SimRobot(initial_positions=[0, 0, 0], render=False)
    assert err.value.field == "initial_positions"
    with pytest.raises(SimError, match=r"outside the joint ranges: joint_2=2.5 \(range -2 .. 2\)"):
        SimRobot(initial_positions=[0, 2.5, 0, 0, 0, 0, 0], render=False)


def test_the_physics_rate_sets_the_timestep_and_has_a_floor():
    assert SimRobot(physics_rate_hz=1000, render=False).timestep == pytest.approx(0.001)
    for bad in (199.0, math.nan, 0.0):
        with pytest.raises(SimError, match="must be at least 200 Hz") as err:
            SimRobot(physics_rate_hz=bad, render=False)
        assert err.value.field == "physics_rate"


def test_a_users_model_with_its_own_joint_names(tmp_path):
    path = pendulum(tmp_path)
    r = SimRobot(path, render=False)
    assert r.joint_names == ["shoulder", "elbow"]  # every position-servoed joint, in actuator order
    assert r.lower[0] == -1 and r.upper[0] == 1 and np.isinf(r.lower[1])
    settle(r, [0.5, -0.8], seconds=3.0)
    np.testing.assert_allclose(r.positions(), [0.5, -0.8], atol=0.05)  # no gravity compensation here
    assert SimRobot(path, joint_names=["elbow"], render=False).joint_names == ["elbow"]


def test_a_users_model_that_cannot_be_commanded(tmp_path):
    cases = [
        (dict(), ["wrist"], "joint 'wrist' is not in", "its joints: shoulder, elbow, free_spin"),
        (dict(), ["free_spin"], "joint 'free_spin' has no actuator", "<position> actuator"),
        (dict(actuators='<motor joint="shoulder"/>' + SERVOS[SERVOS.index("<position joint=\"elbow\""):]),
         ["shoulder", "elbow"], "its actuator", "is not a position servo"),
        (dict(), ["elbow", "elbow"], "each joint may appear once", ""),
        (dict(actuators='<motor joint="shoulder"/>'), [], "no joint is driven by a position actuator", ""),
    ]
    for kw, joints, first, second in cases:
        with pytest.raises(SimError) as err:
            SimRobot(pendulum(tmp_path, **kw), joint_names=joints, render=False)
        assert first in str(err.value) and second in str(err.value)
        assert err.value.field == "joint_names"


def test_a_model_that_does_not_load_names_the_file(tmp_path):
    bad = tmp_path / "broken.xml"
    bad.write_text("<mujoco><worldbody><body><joint name='j'/></worldbody></mujoco>")
    for path in (str(bad), str(tmp_path / "missing.xml")):
        with pytest.raises(SimError, match="cannot load MJCF") as err:
            SimRobot(path, render=False)
        assert path in str(err.value) and err.value.field == "model"
