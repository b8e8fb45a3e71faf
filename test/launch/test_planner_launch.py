"""Launch test: planner.launch.py starts vla_node and vlm_node with the planner on.

Given a goal and camera frames on the remapped image topic, vlm_node publishes a subtask on the instruction
topic and vla_node takes it as its instruction (the demo models have random weights: the subtask is
gibberish, which does not matter here); the chat service keeps serving beside the planner.

Run with `colcon test --packages-select synflux_ros` or directly with
`launch_test test/launch/test_planner_launch.py` on a sourced ROS 2 install.
"""

import os
import sys
import time
import uuid

import pytest

# launch_test loads this file by path: the shared module next to it is imported from its directory.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import launch_test_support as support  # noqa: E402  (skips without launch_testing / launch_ros)

import launch_testing  # noqa: E402
import rclpy  # noqa: E402
from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_msgs.msg import String  # noqa: E402
from synflux_ros.tools.harness import config_path, rgb_image  # noqa: E402
from synflux_ros.srv import Chat  # noqa: E402

NAMESPACE = support.unique_namespace('planner')
IMAGE_TOPIC = 'camera/image_raw'   # relative: resolved in NAMESPACE
GOAL = 'pick up the red block'
LATCHED = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)

STARTUP_TIMEOUT_S = 90.0   # both nodes start, configure and activate
CALL_TIMEOUT_S = 30.0


@pytest.mark.launch_test
def generate_test_description():
    return support.launch_description(
        'planner.launch.py',
        executor='mock',
        namespace=NAMESPACE,
        image_topic=IMAGE_TOPIC,
        goal=GOAL,
        planner_period='0.5',
        planner_max_new_tokens='12',
    )


class TestPlanner(support.ClientNodeTestCase):

    NODE_NAME = 'planner_launch_test_client'
    NAMESPACE = NAMESPACE

    @classmethod
    def setUpClass(cls):
        # This test publishes the camera frames: like a camera driver, it loads the Fast DDS profile
        # that the launch files apply to the nodes (unless the environment names one already).
        os.environ.setdefault('FASTDDS_DEFAULT_PROFILES_FILE', config_path('fastdds_shm.xml'))
        super().setUpClass()

    def test_vla_node_applies_the_planner_s_subtask(self):
        subtasks, instructions = [], []
        self.node.create_subscription(String, 'instruction', lambda m: subtasks.append(m.data), LATCHED)

        def on_diagnostics(msg):
            for status in msg.status:
                if status.name.startswith(f'{NAMESPACE}/vla_node:'):
                    instructions.extend(kv.value for kv in status.values if kv.key == 'instruction')
        self.node.create_subscription(DiagnosticArray, '/diagnostics', on_diagnostics, 50)
        image_pub = self.node.create_publisher(Image, IMAGE_TOPIC, qos_profile_sensor_data)
        frames = self.publish_frames_until(
            image_pub, rgb_image(224, 224, frame_id='test_camera'), lambda: bool(subtasks), STARTUP_TIMEOUT_S)
        self.assertTrue(subtasks, f'no subtask on {NAMESPACE}/instruction within {STARTUP_TIMEOUT_S:.0f} s for '
                                  f'{frames} frame(s) published on {NAMESPACE}/{IMAGE_TOPIC} (goal {GOAL!r})')
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while time.monotonic() < deadline and subtasks[-1] not in instructions:
            rclpy.spin_once(self.node, timeout_sec=0.1)
        self.assertIn(subtasks[-1], instructions, 'vla_node did not take the subtask as its instruction')

    def test_vlm_serves_chat_beside_the_planner(self):
        chat = self.node.create_client(Chat, 'chat')
        self.wait_until_active('vlm_node', STARTUP_TIMEOUT_S)
        self.assert_service_available(chat, CALL_TIMEOUT_S)
        request = Chat.Request()
        request.session_id = f'launch-test-{uuid.uuid4().hex}'
        request.prompt = 'Hello.'
        request.max_new_tokens = 8
        request.temperature = 0.0   # greedy
        response = self.call_service(chat, request, CALL_TIMEOUT_S)
        self.assertTrue(response.success, f'chat failed: {response.error}')


@launch_testing.post_shutdown_test()
class TestPlannerShutdown(support.ExitCodesTest):
    pass
