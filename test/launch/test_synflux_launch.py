"""Launch test: synflux.launch.py starts both nodes and hands its arguments to both files.

One params_file reaches the VLA node (its joint-trajectory parameters come only from the file),
image_topic reaches vla.launch.py and namespace reaches both nodes: the VLA node answers camera
frames on the remapped topic with trajectories named as in the file, and the VLM node serves a
chat turn in the same namespace.

Run with `colcon test --packages-select synflux_ros` or directly with
`launch_test test/launch/test_synflux_launch.py` on a sourced ROS 2 install.
"""

import os
import sys
import tempfile
import uuid

import pytest

# launch_test loads this file by path: the shared module next to it is imported from its directory.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import launch_test_support as support  # noqa: E402  (skips without launch_testing / launch_ros)

import launch_testing  # noqa: E402
from rclpy.qos import qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from synflux_ros.tools.harness import config_path, rgb_image  # noqa: E402
from synflux_ros.srv import Chat  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402
import yaml  # noqa: E402

NAMESPACE = support.unique_namespace('both')
IMAGE_TOPIC = 'camera/image_raw'   # relative: resolved in NAMESPACE

with open(config_path('vla_demo_orin.yaml'), encoding='utf-8') as _fh:
    ACTION_DIM = yaml.safe_load(_fh)['action']['action_dim']
JOINT_NAMES = [f'file_joint_{i + 1}' for i in range(ACTION_DIM)]

# The parameters file handed to both nodes; only the VLA node's section matches the VLA node.
_PARAMS_DIR = tempfile.TemporaryDirectory(prefix='synflux_launch_test_')
PARAMS_FILE = os.path.join(_PARAMS_DIR.name, 'params.yaml')
with open(PARAMS_FILE, 'w', encoding='utf-8') as _fh:
    yaml.safe_dump({'/**/vla_node': {'ros__parameters': {
        'publish_joint_trajectory': True,
        'joint_names': JOINT_NAMES,
    }}}, _fh)

STARTUP_TIMEOUT_S = 90.0   # both nodes start, configure and activate
CALL_TIMEOUT_S = 30.0


@pytest.mark.launch_test
def generate_test_description():
    return support.launch_description(
        'synflux.launch.py',
        executor='mock',
        namespace=NAMESPACE,
        params_file=PARAMS_FILE,
        image_topic=IMAGE_TOPIC,
    )


class TestBothNodes(support.ClientNodeTestCase):

    NODE_NAME = 'synflux_launch_test_client'
    NAMESPACE = NAMESPACE

    @classmethod
    def setUpClass(cls):
        # This test publishes the camera frames: like a camera driver, it loads the Fast DDS profile
        # that the launch files apply to the nodes (unless the environment names one already).
        os.environ.setdefault('FASTDDS_DEFAULT_PROFILES_FILE', config_path('fastdds_shm.xml'))
        super().setUpClass()

    def test_vla_uses_params_file_and_image_topic(self):
        trajectories = []
        self.node.create_subscription(JointTrajectory, 'joint_trajectory', trajectories.append, 10)
        image_pub = self.node.create_publisher(Image, IMAGE_TOPIC, qos_profile_sensor_data)
        image = rgb_image(448, 448, frame_id='test_camera')
        keep_state_fresh = self.enable_commands(JOINT_NAMES, STARTUP_TIMEOUT_S)

        frames = self.publish_frames_until(
            image_pub, image, lambda: bool(trajectories), STARTUP_TIMEOUT_S,
            each_frame=keep_state_fresh)

        self.assertTrue(
            trajectories,
            f'no JointTrajectory on {NAMESPACE}/joint_trajectory within {STARTUP_TIMEOUT_S:.0f} s '
            f'for {frames} frame(s) published on {NAMESPACE}/{IMAGE_TOPIC}')
        self.assertEqual(list(trajectories[0].joint_names), JOINT_NAMES)

    def test_vlm_serves_chat(self):
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
        self.assertGreater(response.generated_tokens, 0)


@launch_testing.post_shutdown_test()
class TestBothNodesShutdown(support.ExitCodesTest):
    pass
