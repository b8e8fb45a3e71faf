"""Launch test: vla.launch.py with the mock executor turns camera frames into action chunks.

Run with `colcon test --packages-select synflux_ros` or directly with
`launch_test test/launch/test_vla_launch.py` on a sourced ROS 2 install.
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
from rclpy.qos import (  # noqa: E402
    DurabilityPolicy,
    HistoryPolicy,
    QoSProfile,
    ReliabilityPolicy,
    qos_profile_sensor_data,
)
from sensor_msgs.msg import Image  # noqa: E402
from std_msgs.msg import String  # noqa: E402
from synflux_ros.msg import ActionChunk  # noqa: E402
from synflux_ros.nodes.testing import rgb_image  # noqa: E402

# A namespace of its own keeps this test's topics apart from anything else running on the
# same ROS domain. launch_test itself does not choose a domain: CMakeLists.txt runs it through
# ament_cmake_ros's isolation runner, which sets ROS_DOMAIN_ID for the test.
NAMESPACE = f'/synflux_test_vla_{os.getpid()}_{uuid.uuid4().hex[:8]}'

IMAGE_WIDTH = 448
IMAGE_HEIGHT = 448
FRAME_ID = 'test_camera'
INSTRUCTION = 'pick up the red cube'

STARTUP_TIMEOUT_S = 60.0   # node start-up + lifecycle activation + first chunks
FRAME_PERIOD_S = 0.1       # publish camera frames at 10 Hz
CHUNKS_WANTED = 3


@pytest.mark.launch_test
def generate_test_description():
    vla_launch = IncludeLaunchDescription(
        PythonLaunchDescriptionSource(
            PathJoinSubstitution([FindPackageShare('synflux_ros'), 'launch', 'vla.launch.py'])),
        launch_arguments={
            'executor': 'mock',
            'namespace': NAMESPACE,
            'default_instruction': INSTRUCTION,
        }.items(),
    )
    return launch.LaunchDescription([
        vla_launch,
        launch_testing.actions.ReadyToTest(),
    ])


class TestVlaPipeline(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        rclpy.init()

    @classmethod
    def tearDownClass(cls):
        rclpy.shutdown()

    def setUp(self):
        self.node = rclpy.create_node('vla_launch_test_client', namespace=NAMESPACE)

    def tearDown(self):
        self.node.destroy_node()

    def test_frames_produce_action_chunks(self):
        chunks = []
        # Best effort accepts the chunk publisher whatever reliability it offers.
        chunk_qos = QoSProfile(
            history=HistoryPolicy.KEEP_LAST, depth=50,
            reliability=ReliabilityPolicy.BEST_EFFORT)
        self.node.create_subscription(ActionChunk, 'action_chunk', chunks.append, chunk_qos)

        instruction_qos = QoSProfile(
            history=HistoryPolicy.KEEP_LAST, depth=1,
            reliability=ReliabilityPolicy.RELIABLE,
            durability=DurabilityPolicy.TRANSIENT_LOCAL)
        instruction_pub = self.node.create_publisher(String, 'instruction', instruction_qos)
        instruction_pub.publish(String(data=INSTRUCTION))

        image_pub = self.node.create_publisher(Image, 'image', qos_profile_sensor_data)
        image = rgb_image(IMAGE_HEIGHT, IMAGE_WIDTH, frame_id=FRAME_ID)

        published_stamps = set()
        base_sec = 1_700_000_000
        frame = 0
        next_frame_at = time.monotonic()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline and len(chunks) < CHUNKS_WANTED:
            now = time.monotonic()
            if now >= next_frame_at:
                image.header.stamp.sec = base_sec + frame
                image.header.stamp.nanosec = (frame * 1_000_003) % 1_000_000_000
                published_stamps.add((image.header.stamp.sec, image.header.stamp.nanosec))
                image_pub.publish(image)
                frame += 1
                next_frame_at = now + FRAME_PERIOD_S
            rclpy.spin_once(self.node, timeout_sec=max(0.0, min(0.05, next_frame_at - now)))

        self.assertGreaterEqual(
            len(chunks), CHUNKS_WANTED,
            f'received {len(chunks)} action chunk(s) for {frame} published frame(s) '
            f'within {STARTUP_TIMEOUT_S:.0f} s on {NAMESPACE}/action_chunk')

        for chunk in chunks:
            stamp = (chunk.header.stamp.sec, chunk.header.stamp.nanosec)
            with self.subTest(frame_seq=chunk.frame_seq, stamp=stamp):
                self.assertGreater(chunk.horizon, 0)
                self.assertGreater(chunk.action_dim, 0)
                self.assertEqual(chunk.horizon * chunk.action_dim, len(chunk.actions))
                self.assertTrue(all(math.isfinite(v) for v in chunk.actions))
                self.assertTrue(stamp in published_stamps,
                                f'chunk stamp {stamp} is not the stamp of any of the '
                                f'{len(published_stamps)} published frames')
                self.assertEqual(chunk.header.frame_id, FRAME_ID)
                self.assertGreater(chunk.latency_ms, 0.0)


@launch_testing.post_shutdown_test()
class TestVlaShutdown(unittest.TestCase):

    def test_exit_codes(self, proc_info):
        launch_testing.asserts.assertExitCodes(proc_info)
