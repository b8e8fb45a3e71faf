"""Launch test: vla.launch.py publish_joint_trajectory:=true joint_names:='[...]' publishes
trajectory_msgs/JointTrajectory with those joint names, one point per action step.

Run with `colcon test --packages-select synflux_ros` or directly with
`launch_test test/launch/test_vla_joint_trajectory_launch.py` on a sourced ROS 2 install.
"""

import math
import os
import time
import unittest
import uuid

import pytest

pytest.importorskip(
    'launch_testing',
    reason='launch_testing is not installed; '
           'these tests run on a full ROS 2 install (colcon test)')
pytest.importorskip(
    'launch_ros',
    reason='launch_ros is not installed; '
           'these tests run on a full ROS 2 install (colcon test)')

import launch  # noqa: E402
import launch_testing.actions  # noqa: E402
import launch_testing.asserts  # noqa: E402
from launch.actions import IncludeLaunchDescription  # noqa: E402
from launch.launch_description_sources import PythonLaunchDescriptionSource  # noqa: E402
from launch.substitutions import PathJoinSubstitution  # noqa: E402
from launch_ros.substitutions import FindPackageShare  # noqa: E402

import rclpy  # noqa: E402
from rclpy.qos import qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from synflux_ros.nodes.testing import config_path, rgb_image  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402
import yaml  # noqa: E402

# A namespace of its own keeps this test's topics apart from anything else on the same ROS domain
# (launch_test does not choose a domain; CMakeLists.txt runs launch tests through ament_cmake_ros's
# isolation runner, which sets ROS_DOMAIN_ID for the test).
NAMESPACE = f'/synflux_test_traj_{os.getpid()}_{uuid.uuid4().hex[:8]}'

with open(config_path('vla_demo_orin.yaml'), encoding='utf-8') as _fh:
    ACTION = yaml.safe_load(_fh)['action']
# One name per action dimension, passed the way a user types it: joint_names:='[a, b, ...]'.
JOINT_NAMES = [f'joint_{i + 1}' for i in range(ACTION['action_dim'])]

IMAGE_SIZE = 448
STARTUP_TIMEOUT_S = 60.0   # node start-up + lifecycle activation + first trajectories
FRAME_PERIOD_S = 0.1
TRAJECTORIES_WANTED = 2


@pytest.mark.launch_test
def generate_test_description():
    vla_launch = IncludeLaunchDescription(
        PythonLaunchDescriptionSource(
            PathJoinSubstitution([FindPackageShare('synflux_ros'), 'launch', 'vla.launch.py'])),
        launch_arguments={
            'config': 'vla_demo_orin.yaml',
            'executor': 'mock',
            'namespace': NAMESPACE,
            'publish_joint_trajectory': 'true',
            'joint_names': '[' + ', '.join(JOINT_NAMES) + ']',
        }.items(),
    )
    return launch.LaunchDescription([
        vla_launch,
        launch_testing.actions.ReadyToTest(),
    ])


class TestVlaJointTrajectory(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        rclpy.init()

    @classmethod
    def tearDownClass(cls):
        rclpy.shutdown()

    def setUp(self):
        self.node = rclpy.create_node('vla_trajectory_test_client', namespace=NAMESPACE)

    def tearDown(self):
        self.node.destroy_node()

    def test_trajectory_carries_the_launch_joint_names(self):
        trajectories = []
        self.node.create_subscription(JointTrajectory, 'joint_trajectory', trajectories.append, 10)
        image_pub = self.node.create_publisher(Image, 'image', qos_profile_sensor_data)
        image = rgb_image(IMAGE_SIZE, IMAGE_SIZE, frame_id='test_camera')

        frame = 0
        next_frame_at = time.monotonic()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline and len(trajectories) < TRAJECTORIES_WANTED:
            now = time.monotonic()
            if now >= next_frame_at:
                image.header.stamp.sec, image.header.stamp.nanosec = divmod(time.time_ns(), 10**9)
                image_pub.publish(image)
                frame += 1
                next_frame_at = now + FRAME_PERIOD_S
            rclpy.spin_once(self.node, timeout_sec=max(0.0, min(0.05, next_frame_at - now)))

        self.assertGreaterEqual(
            len(trajectories), TRAJECTORIES_WANTED,
            f'received {len(trajectories)} JointTrajectory message(s) for {frame} published '
            f'frame(s) within {STARTUP_TIMEOUT_S:.0f} s on {NAMESPACE}/joint_trajectory')

        step = float(ACTION['step_period'])
        for traj in trajectories:
            with self.subTest(stamp=(traj.header.stamp.sec, traj.header.stamp.nanosec)):
                self.assertEqual(list(traj.joint_names), JOINT_NAMES)
                self.assertEqual(len(traj.points), ACTION['action_horizon'])
                self.assertEqual(traj.header.frame_id, 'test_camera')
                for i, point in enumerate(traj.points):
                    self.assertEqual(len(point.positions), len(JOINT_NAMES))
                    self.assertTrue(all(math.isfinite(p) for p in point.positions))
                    t = point.time_from_start.sec + point.time_from_start.nanosec * 1e-9
                    self.assertAlmostEqual(t, (i + 1) * step, places=6)


@launch_testing.post_shutdown_test()
class TestVlaJointTrajectoryShutdown(unittest.TestCase):

    def test_exit_codes(self, proc_info):
        launch_testing.asserts.assertExitCodes(proc_info)
