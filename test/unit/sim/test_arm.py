"""The built-in arm's MJCF: seven position-servoed joints in vla_demo_orin's action order, realistic ranges, two
cameras, a start pose within the ranges."""
import mujoco
import numpy as np
import yaml

from synflux_ros.sim import arm
from synflux_ros.tools.harness import config_path


def test_seven_servoed_joints_match_the_demo_action_layout():
    m = mujoco.MjModel.from_xml_string(arm.mjcf())
    with open(config_path("vla_demo_orin.yaml"), encoding="utf-8") as fh:
        assert yaml.safe_load(fh)["action"]["action_dim"] == len(arm.JOINT_NAMES) == m.nu == 7
    for a, name in enumerate(arm.JOINT_NAMES):
        j = m.joint(name)
        lo, hi, kp = arm.JOINTS[name][:3]
        assert m.actuator_trnid[a][0] == j.id and m.actuator_gainprm[a][0] == kp
        np.testing.assert_allclose(j.range, [lo, hi])
        np.testing.assert_allclose(m.actuator_ctrlrange[a], [lo, hi])
        assert m.jnt_limited[j.id]
    revolute = [arm.JOINTS[n] for n in arm.JOINT_NAMES[:6]]
    assert all(-np.pi <= lo < 0 < hi <= np.pi for lo, hi, *_ in revolute)
    assert {m.camera(i).name for i in range(m.ncam)} == set(arm.CAMERAS)


def test_the_home_keyframe_is_within_the_ranges():
    m = mujoco.MjModel.from_xml_string(arm.mjcf())
    key = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_KEY, "home")
    assert key >= 0
    for name, q in zip(arm.JOINT_NAMES, arm.HOME):
        assert arm.JOINTS[name][0] <= q <= arm.JOINTS[name][1]
        assert m.key_qpos[key][m.jnt_qposadr[m.joint(name).id]] == q


def test_the_scene_camera_looks_at_its_target():
    pos, target = np.array(arm.SCENE_CAMERA_POS), np.array(arm.SCENE_CAMERA_TARGET)
    x, y = np.array([float(v) for v in arm._look_at(pos, target).split()]).reshape(2, 3)
    z = np.cross(x, y)
    np.testing.assert_allclose([x @ x, y @ y, x @ y], [1, 1, 0], atol=1e-3)
    np.testing.assert_allclose(-z, (target - pos) / np.linalg.norm(target - pos), atol=1e-3)
    assert abs(x[2]) < 1e-9 and y[2] > 0  # level horizon, upright picture
