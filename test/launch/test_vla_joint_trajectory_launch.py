"""Launch test: vla.launch.py publish_joint_trajectory:=true joint_names:='[...]' publishes, once
commands are enabled, trajectory_msgs/JointTrajectory with those joint names, every point ahead of
the header stamp at the action steps' spacing.

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
    ACTION = yaml.safe_load(_fh)['action']
# One name per action dimension, passed the way a user types it: joint_names:='[a, b, ...]'.
JOINT_NAMES = [f'joint_{i + 1}' for i in range(ACTION['action_dim'])]

IMAGE_SIZE = 448
STARTUP_TIMEOUT_S = 60.0   # node start-up + lifecycle activation + first trajectories
TRAJECTORIES_WANTED = 2


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

        frames = self.publish_frames_until(
            image_pub, image, lambda: len(trajectories) >= TRAJECTORIES_WANTED, STARTUP_TIMEOUT_S,
            each_frame=keep_state_fresh)

        self.assertGreaterEqual(
            len(trajectories), TRAJECTORIES_WANTED,
            f'received {len(trajectories)} JointTrajectory message(s) for {frames} published '
            f'frame(s) within {STARTUP_TIMEOUT_S:.0f} s on {NAMESPACE}/joint_trajectory')

        step = float(ACTION['step_period'])
        for traj in trajectories:
            with self.subTest(stamp=(traj.header.stamp.sec, traj.header.stamp.nanosec)):
                self.assertEqual(list(traj.joint_names), JOINT_NAMES)
                self.assertTrue(0 < len(traj.points) <= ACTION['action_horizon'])
                self.assertEqual(traj.header.frame_id, 'test_camera')
                times = []
                for point in traj.points:
                    self.assertEqual(len(point.positions), len(JOINT_NAMES))
                    self.assertTrue(all(math.isfinite(p) for p in point.positions))
                    times.append(point.time_from_start.sec + point.time_from_start.nanosec * 1e-9)
                self.assertGreater(times[0], 0.0)
                for a, b in zip(times, times[1:]):
                    self.assertAlmostEqual(b - a, step, places=6)


@launch_testing.post_shutdown_test()
class TestVlaJointTrajectoryShutdown(support.ExitCodesTest):
    pass
