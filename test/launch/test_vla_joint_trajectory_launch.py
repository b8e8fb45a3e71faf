"""Launch test: vla.launch.py publish_joint_trajectory:=true joint_names:='[...]' publishes, once
commands are enabled, trajectory_msgs/JointTrajectory with those joint names: the executing plan's
rows ahead of the header stamp (docs/execution.md, "Trajectories").

What the plan holds after a chunk is accepted (docs/execution.md): the chunk's steps on its frame's
clock, step i at t_obs + i * step_period, from the first step not behind the node's clock (plus
execution.lookahead) to the chunk's last step; before them, the rows of the plan in force between now
and the new chunk's first step, kept so the target stays continuous across the switch. A kept row lies
on an earlier frame's steps, so its gap to the new chunk's first step is below a step period, not equal
to it (frames are not stamped a whole number of steps apart).

Run with `colcon test --packages-select synflux_ros` or directly with
`launch_test test/launch/test_vla_joint_trajectory_launch.py` on a sourced ROS 2 install.
"""

import math
import os
import sys

import pytest

# launch_test loads this file by path: the shared module next to it is imported from its directory.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import launch_test_support as support  # noqa: E402  (skips without launch_testing / launch_ros)

import launch_testing  # noqa: E402
from rclpy.qos import qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from synflux_ros.tools.harness import config_path, rgb_image  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402
import yaml  # noqa: E402

NAMESPACE = support.unique_namespace('traj')

with open(config_path('vla_demo_orin.yaml'), encoding='utf-8') as _fh:
    _CONFIG = yaml.safe_load(_fh)
ACTION = _CONFIG['action']
# One name per action dimension, passed the way a user types it: joint_names:='[a, b, ...]'.
JOINT_NAMES = [f'joint_{i + 1}' for i in range(ACTION['action_dim'])]
STEP_NS = round(float(ACTION['step_period']) * 1e9)
HORIZON = int(ACTION['action_horizon'])
# execution.lookahead (default 0, docs/execution.md): the chunk takes over from the first step at or
# after now + lookahead.
LOOKAHEAD_NS = round(float((_CONFIG.get('execution') or {}).get('lookahead', 0.0)) * 1e9)
# The trajectory's points start one control period plus the lookahead after its stamp, so none is in
# the past when joint_trajectory_controller takes it (docs/execution.md, "Trajectories").
CONTROL_PERIOD_NS = round(1e9 / float((_CONFIG.get('execution') or {}).get('control_rate_hz', 100.0)))
AHEAD_NS = CONTROL_PERIOD_NS + LOOKAHEAD_NS
# The node places steps in float64 seconds since the epoch (resolution about 0.24 us) and rounds
# stamps and offsets to nanoseconds.
TOLERANCE_NS = 2_000

IMAGE_SIZE = 448
STARTUP_TIMEOUT_S = 60.0   # node start-up + lifecycle activation + first trajectories
TRAJECTORIES_WANTED = 2


def _ns(stamp_or_duration):
    return stamp_or_duration.sec * 10**9 + stamp_or_duration.nanosec


def _step_of(t_ns, frame_ns):
    """j where t_ns is frame_ns + j * step period (within TOLERANCE_NS), else None."""
    j = round((t_ns - frame_ns) / STEP_NS)
    return j if abs(t_ns - frame_ns - j * STEP_NS) <= TOLERANCE_NS else None


@pytest.mark.launch_test
def generate_test_description():
    return support.launch_description(
        'vla.launch.py',
        config='vla_demo_orin.yaml',
        executor='mock',
        namespace=NAMESPACE,
        publish_joint_trajectory='true',
        joint_names='[' + ', '.join(JOINT_NAMES) + ']',
    )


class TestVlaJointTrajectory(support.ClientNodeTestCase):

    NODE_NAME = 'vla_trajectory_test_client'
    NAMESPACE = NAMESPACE

    def test_trajectory_carries_the_launch_joint_names(self):
        trajectories = []
        self.node.create_subscription(JointTrajectory, 'joint_trajectory', trajectories.append, 10)
        image_pub = self.node.create_publisher(Image, 'image', qos_profile_sensor_data)
        image = rgb_image(IMAGE_SIZE, IMAGE_SIZE, frame_id='test_camera')
        keep_state_fresh = self.enable_commands(JOINT_NAMES, STARTUP_TIMEOUT_S)

        frame_stamps_ns = []   # every frame published, to find the frame a point's step belongs to

        def stamp(frame):
            sec, nanosec = support.wall_clock_stamp(frame)
            frame_stamps_ns.append(sec * 10**9 + nanosec)
            return sec, nanosec

        frames = self.publish_frames_until(
            image_pub, image, lambda: len(trajectories) >= TRAJECTORIES_WANTED, STARTUP_TIMEOUT_S,
            stamp=stamp, each_frame=keep_state_fresh)

        self.assertGreaterEqual(
            len(trajectories), TRAJECTORIES_WANTED,
            f'received {len(trajectories)} JointTrajectory message(s) for {frames} published '
            f'frame(s) within {STARTUP_TIMEOUT_S:.0f} s on {NAMESPACE}/joint_trajectory')

        for traj in trajectories:
            with self.subTest(stamp=(traj.header.stamp.sec, traj.header.stamp.nanosec)):
                self.assertEqual(list(traj.joint_names), JOINT_NAMES)
                self.assertEqual(traj.header.frame_id, 'test_camera')
                self.assertTrue(traj.points)
                for point in traj.points:
                    self.assertEqual(len(point.positions), len(JOINT_NAMES))
                    self.assertTrue(all(math.isfinite(p) for p in point.positions))
                offsets = [_ns(point.time_from_start) for point in traj.points]
                self.assertGreaterEqual(
                    offsets[0], AHEAD_NS - TOLERANCE_NS,
                    f'the first point is {offsets[0]} ns after the stamp, less than a control period '
                    f'plus the lookahead ({AHEAD_NS} ns)')
                for a, b in zip(offsets, offsets[1:]):
                    self.assertLess(a, b, f'time_from_start not increasing: {offsets}')
                times = [_ns(traj.header.stamp) + o for o in offsets]

                # The new chunk: its last step is the trajectory's last point.
                owners = [f for f in frame_stamps_ns if _step_of(times[-1], f) == HORIZON - 1]
                self.assertEqual(
                    len(owners), 1,
                    f'the last point ({offsets[-1]} ns after the stamp) is not step {HORIZON - 1} '
                    f'of exactly one published frame')
                t_obs = owners[0]
                # Its steps are the trailing points, one step period apart on the frame's clock.
                first = len(times) - 1
                while first > 0 and _step_of(times[first - 1], t_obs) == _step_of(times[first], t_obs) - 1:
                    first -= 1
                first_step = _step_of(times[first], t_obs)
                self.assertGreaterEqual(first_step, 0)
                # The chunk's first point: its first step at least a control period (+ lookahead)
                # ahead of the stamp.
                self.assertLessEqual(
                    offsets[first], AHEAD_NS + STEP_NS + TOLERANCE_NS,
                    f'the chunk starts at step {first_step}, {offsets[first]} ns after the stamp: '
                    f'a step at or after the stamp was left out')

                # Before it, only rows kept from the plan in force: steps of earlier frames, all
                # between the stamp and the new chunk's first step.
                kept = times[:first]
                for t in kept:
                    self.assertTrue(
                        any(f < t_obs and _step_of(t, f) in range(HORIZON) for f in frame_stamps_ns),
                        f'a point {times[first] - t} ns before the chunk is no step of an earlier frame')
                if kept:
                    self.assertLess(
                        times[first] - kept[0], LOOKAHEAD_NS + STEP_NS + TOLERANCE_NS,
                        f'kept rows reach {times[first] - kept[0]} ns before the chunk: more than the '
                        f'rows between the stamp and its first step')


@launch_testing.post_shutdown_test()
class TestVlaJointTrajectoryShutdown(support.ExitCodesTest):
    pass
