"""The built-in robot: a 6-joint arm with a parallel gripper on a table with a block, as MJCF.

Seven commanded positions (``joint_1`` .. ``joint_6`` in radians, ``gripper`` the finger opening in metres),
the action layout of ``config/vla_demo_orin.yaml``. Each commanded joint has a MuJoCo position actuator (a PD
servo: kp, kv, a torque limit) whose control range is the joint's range, the links are gravity-compensated as
an arm's controller would do, and the second finger follows the first through an equality constraint. Two
cameras: ``scene`` (fixed, looking at the arm and the table) and ``wrist`` (on the gripper, looking along it).
The keyframe ``home`` is the start pose.
The proportions and ranges are those of a small industrial arm (reach about 0.6 m). No shadows and no
multisampling: a software renderer (Mesa's llvmpipe) draws a frame several times faster without them.
"""
from __future__ import annotations

import math

JOINT_NAMES = ("joint_1", "joint_2", "joint_3", "joint_4", "joint_5", "joint_6", "gripper")
CAMERAS = ("scene", "wrist")
HOME = (0.0, 0.35, 1.6, 0.0, 1.19, 0.0, 0.02)
"""The start pose (MJCF keyframe ``home``): the gripper above the table, pointing down, half open."""
BLOCK_POSE = (0.62, 0.18, 0.42, 1.0, 0.0, 0.0, 0.0)
SCENE_CAMERA_POS = (1.45, -1.0, 1.4)
SCENE_CAMERA_TARGET = (0.4, 0.0, 0.62)

# joint: (lower, upper, kp, kv, torque limit); revolute joints in rad and N m, the gripper in m and N
JOINTS = {
    "joint_1": (-2.96, 2.96, 400.0, 40.0, 150.0),
    "joint_2": (-2.0, 2.0, 600.0, 60.0, 150.0),
    "joint_3": (-2.6, 2.6, 400.0, 40.0, 100.0),
    "joint_4": (-3.05, 3.05, 100.0, 10.0, 30.0),
    "joint_5": (-2.0, 2.0, 100.0, 10.0, 30.0),
    "joint_6": (-3.05, 3.05, 60.0, 6.0, 20.0),
    "gripper": (0.0, 0.04, 400.0, 20.0, 40.0),
}


def _look_at(pos, target) -> str:
    """MJCF ``xyaxes`` of a camera at ``pos`` looking at ``target`` (z up); a camera looks along its -z."""
    z = [p - t for p, t in zip(pos, target)]
    n = math.sqrt(sum(c * c for c in z))
    z = [c / n for c in z]
    x = [-z[1], z[0], 0.0]  # up x z, horizontal
    n = math.sqrt(sum(c * c for c in x))
    x = [c / n for c in x]
    y = [z[1] * x[2] - z[2] * x[1], z[2] * x[0] - z[0] * x[2], z[0] * x[1] - z[1] * x[0]]
    return " ".join(f"{c:.4f}" for c in x + y)


def _joint(name: str, axis: str) -> str:
    lo, hi = JOINTS[name][:2]
    kind = 'type="slide"' if name == "gripper" else ""
    return f'<joint name="{name}" {kind} axis="{axis}" range="{lo} {hi}"/>'


def _actuator(name: str) -> str:
    lo, hi, kp, kv, limit = JOINTS[name]
    return (f'<position name="{name}_servo" joint="{name}" kp="{kp}" kv="{kv}" ctrlrange="{lo} {hi}" '
            f'forcerange="{-limit} {limit}"/>')


def mjcf() -> str:
    """The built-in scene as an MJCF document."""
    scene_cam = _look_at(SCENE_CAMERA_POS, SCENE_CAMERA_TARGET)
    return f"""<mujoco model="synflux_arm">
  <compiler angle="radian" autolimits="true"/>
  <option timestep="0.002" integrator="implicitfast"/>
  <visual>
    <global offwidth="1280" offheight="960"/>
    <quality offsamples="0"/>
    <headlight ambient="0.35 0.35 0.35" diffuse="0.5 0.5 0.5"/>
  </visual>
  <default>
    <joint armature="0.05" damping="0.5"/>
    <geom density="800" friction="1 0.01 0.001"/>
    <default class="link"><geom rgba="0.85 0.86 0.88 1"/></default>
    <default class="joint_housing"><geom rgba="0.2 0.35 0.65 1"/></default>
    <default class="finger"><geom rgba="0.15 0.15 0.15 1" friction="1.5 0.02 0.001"/></default>
  </default>
  <asset>
    <texture name="floor" type="2d" builtin="checker" rgb1="0.32 0.34 0.38" rgb2="0.26 0.28 0.3" width="256"
             height="256"/>
    <material name="floor" texture="floor" texrepeat="6 6"/>
    <texture name="wood" type="2d" builtin="flat" rgb1="0.62 0.47 0.32" width="64" height="64"/>
    <material name="table" texture="wood"/>
  </asset>
  <worldbody>
    <light name="key" pos="0.8 -0.6 2.2" dir="-0.3 0.3 -1" diffuse="0.7 0.7 0.7" castshadow="false"/>
    <light name="fill" pos="-0.6 0.8 2.0" dir="0.3 -0.4 -1" diffuse="0.3 0.3 0.3" castshadow="false"/>
    <geom name="floor" type="plane" size="3 3 0.1" material="floor"/>
    <body name="table" pos="0.45 0 0">
      <geom name="table_top" type="box" pos="0 0 0.39" size="0.45 0.6 0.01" material="table"/>
      <geom type="box" pos="0.4 0.55 0.19" size="0.025 0.025 0.19" rgba="0.4 0.3 0.2 1"/>
      <geom type="box" pos="-0.4 0.55 0.19" size="0.025 0.025 0.19" rgba="0.4 0.3 0.2 1"/>
      <geom type="box" pos="0.4 -0.55 0.19" size="0.025 0.025 0.19" rgba="0.4 0.3 0.2 1"/>
      <geom type="box" pos="-0.4 -0.55 0.19" size="0.025 0.025 0.19" rgba="0.4 0.3 0.2 1"/>
      <geom name="target_pad" type="box" pos="0.25 -0.25 0.401" size="0.07 0.07 0.001" rgba="0.2 0.7 0.3 1"
            contype="0" conaffinity="0"/>
    </body>
    <body name="block" pos="{" ".join(map(str, BLOCK_POSE[:3]))}">
      <freejoint name="block"/>
      <geom name="block" type="box" size="0.02 0.02 0.02" rgba="0.85 0.15 0.12 1" density="500"/>
    </body>
    <camera name="scene" pos="{" ".join(map(str, SCENE_CAMERA_POS))}" xyaxes="{scene_cam}" fovy="50"/>
    <body name="base" pos="0.1 0 0.4" gravcomp="1">
      <geom class="joint_housing" type="cylinder" size="0.07 0.03" pos="0 0 0.03"/>
      <body name="link_1" pos="0 0 0.06" gravcomp="1">
        {_joint("joint_1", "0 0 1")}
        <geom class="link" type="cylinder" size="0.05 0.05" pos="0 0 0.05"/>
        <body name="link_2" pos="0 0 0.1" gravcomp="1">
          {_joint("joint_2", "0 1 0")}
          <geom class="joint_housing" type="cylinder" size="0.055 0.05" zaxis="0 1 0"/>
          <geom class="link" type="capsule" fromto="0 0 0 0 0 0.3" size="0.04"/>
          <body name="link_3" pos="0 0 0.3" gravcomp="1">
            {_joint("joint_3", "0 1 0")}
            <geom class="joint_housing" type="cylinder" size="0.048 0.045" zaxis="0 1 0"/>
            <geom class="link" type="capsule" fromto="0 0 0 0 0 0.22" size="0.035"/>
            <body name="link_4" pos="0 0 0.22" gravcomp="1">
              {_joint("joint_4", "0 0 1")}
              <geom class="joint_housing" type="cylinder" size="0.035 0.025" pos="0 0 0.025"/>
              <body name="link_5" pos="0 0 0.06" gravcomp="1">
                {_joint("joint_5", "0 1 0")}
                <geom class="joint_housing" type="cylinder" size="0.033 0.035" zaxis="0 1 0"/>
                <geom class="link" type="capsule" fromto="0 0 0 0 0 0.05" size="0.028"/>
                <body name="link_6" pos="0 0 0.07" gravcomp="1">
                  {_joint("joint_6", "0 0 1")}
                  <geom class="joint_housing" type="box" size="0.045 0.06 0.015" pos="0 0 0.015"/>
                  <camera name="wrist" pos="0.05 0 0.02" xyaxes="0 -1 0 -1 0 0" fovy="70"/>
                  <body name="finger_left" pos="0 0 0.03" gravcomp="1">
                    {_joint("gripper", "0 1 0")}
                    <geom class="finger" type="box" size="0.012 0.006 0.035" pos="0 0.008 0.035"/>
                  </body>
                  <body name="finger_right" pos="0 0 0.03" gravcomp="1">
                    <joint name="gripper_follower" type="slide" axis="0 -1 0" range="0 0.04"/>
                    <geom class="finger" type="box" size="0.012 0.006 0.035" pos="0 -0.008 0.035"/>
                  </body>
                </body>
              </body>
            </body>
          </body>
        </body>
      </body>
    </body>
  </worldbody>
  <keyframe>
    <key name="home" qpos="{" ".join(map(str, BLOCK_POSE + HOME + HOME[-1:]))}" ctrl="{" ".join(map(str, HOME))}"/>
  </keyframe>
  <equality>
    <joint joint1="gripper_follower" joint2="gripper" polycoef="0 1 0 0 0"/>
  </equality>
  <contact>
    <exclude body1="finger_left" body2="finger_right"/>
  </contact>
  <actuator>
    {"".join(_actuator(n) for n in JOINT_NAMES)}
  </actuator>
</mujoco>
"""
