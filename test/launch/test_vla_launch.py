"""Launch test: vla.launch.py with the mock executor turns camera frames into action chunks.

Run with `colcon test --packages-select synflux_ros` or directly with
`launch_test test/launch/test_vla_launch.py` on a sourced ROS 2 install.
"""

import math
import os
import sys

import pytest

# launch_test loads this file by path: the shared module next to it is imported from its directory.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import launch_test_support as support  # noqa: E402  (skips without launch_testing / launch_ros)

import launch_testing  # noqa: E402
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
from synflux_ros.tools.harness import rgb_image  # noqa: E402

NAMESPACE = support.unique_namespace('vla')

IMAGE_WIDTH = 448
IMAGE_HEIGHT = 448
FRAME_ID = 'test_camera'
INSTRUCTION = 'pick up the red cube'

STARTUP_TIMEOUT_S = 60.0   # node start-up + lifecycle activation + first chunks
CHUNKS_WANTED = 3


@pytest.mark.launch_test
def generate_test_description():
    return support.launch_description(
        'vla.launch.py', executor='mock', namespace=NAMESPACE, default_instruction=INSTRUCTION)


class TestVlaPipeline(support.ClientNodeTestCase):

    NODE_NAME = 'vla_launch_test_client'
    NAMESPACE = NAMESPACE

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

        def frame_stamp(frame):
            sec_nanosec = (base_sec + frame, (frame * 1_000_003) % 1_000_000_000)
            published_stamps.add(sec_nanosec)
            return sec_nanosec

        frames = self.publish_frames_until(
            image_pub, image, lambda: len(chunks) >= CHUNKS_WANTED, STARTUP_TIMEOUT_S,
            stamp=frame_stamp)

        self.assertGreaterEqual(
            len(chunks), CHUNKS_WANTED,
            f'received {len(chunks)} action chunk(s) for {frames} published frame(s) '
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
class TestVlaShutdown(support.ExitCodesTest):
    pass
