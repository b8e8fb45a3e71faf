"""Launch test: synflux.launch.py starts both nodes and hands its arguments to both files.

One params_file reaches the VLA node (its joint-trajectory parameters come only from the file),
image_topic reaches vla.launch.py and namespace reaches both nodes: the VLA node answers camera
frames on the remapped topic with trajectories named as in the file, and the VLM node serves a
chat turn in the same namespace.

Run with `colcon test --packages-select synflux_ros` or directly with
`launch_test test/launch/test_synflux_launch.py` on a sourced ROS 2 install.
"""

import os
import tempfile
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
from lifecycle_msgs.msg import State  # noqa: E402
from lifecycle_msgs.srv import GetState  # noqa: E402
from rclpy.qos import qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from synflux_ros.nodes.testing import config_path, rgb_image  # noqa: E402
from synflux_ros.srv import Chat  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402
import yaml  # noqa: E402

# A namespace of its own keeps this test's names apart from anything else on the same ROS domain
# (launch_test does not choose a domain; CMakeLists.txt runs launch tests through ament_cmake_ros's
# isolation runner, which sets ROS_DOMAIN_ID for the test).
NAMESPACE = f'/synflux_test_both_{os.getpid()}_{uuid.uuid4().hex[:8]}'
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
FRAME_PERIOD_S = 0.1
CALL_TIMEOUT_S = 30.0


@pytest.mark.launch_test
def generate_test_description():
    both = IncludeLaunchDescription(
        PythonLaunchDescriptionSource(
            PathJoinSubstitution([FindPackageShare('synflux_ros'), 'launch', 'synflux.launch.py'])),
        launch_arguments={
            'executor': 'mock',
            'namespace': NAMESPACE,
            'params_file': PARAMS_FILE,
            'image_topic': IMAGE_TOPIC,
        }.items(),
    )
    return launch.LaunchDescription([
        both,
        launch_testing.actions.ReadyToTest(),
    ])


class TestBothNodes(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        # This test publishes the camera frames: like a camera driver, it loads the Fast DDS profile
        # that the launch files apply to the nodes (unless the environment names one already).
        os.environ.setdefault('FASTDDS_DEFAULT_PROFILES_FILE', config_path('fastdds_shm.xml'))
        rclpy.init()

    @classmethod
    def tearDownClass(cls):
        rclpy.shutdown()

    def setUp(self):
        self.node = rclpy.create_node('synflux_launch_test_client', namespace=NAMESPACE)

    def tearDown(self):
        self.node.destroy_node()

    def test_vla_uses_params_file_and_image_topic(self):
        trajectories = []
        self.node.create_subscription(JointTrajectory, 'joint_trajectory', trajectories.append, 10)
        image_pub = self.node.create_publisher(Image, IMAGE_TOPIC, qos_profile_sensor_data)
        image = rgb_image(448, 448, frame_id='test_camera')

        frame = 0
        next_frame_at = time.monotonic()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline and not trajectories:
            now = time.monotonic()
            if now >= next_frame_at:
                image.header.stamp.sec, image.header.stamp.nanosec = divmod(time.time_ns(), 10**9)
                image_pub.publish(image)
                frame += 1
                next_frame_at = now + FRAME_PERIOD_S
            rclpy.spin_once(self.node, timeout_sec=max(0.0, min(0.05, next_frame_at - now)))

        self.assertTrue(
            trajectories,
            f'no JointTrajectory on {NAMESPACE}/joint_trajectory within {STARTUP_TIMEOUT_S:.0f} s '
            f'for {frame} frame(s) published on {NAMESPACE}/{IMAGE_TOPIC}')
        self.assertEqual(list(trajectories[0].joint_names), JOINT_NAMES)

    def test_vlm_serves_chat(self):
        get_state = self.node.create_client(GetState, 'vlm_node/get_state')
        chat = self.node.create_client(Chat, 'chat')
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        state = None
        while time.monotonic() < deadline:
            if not get_state.wait_for_service(timeout_sec=0.5):
                continue
            future = get_state.call_async(GetState.Request())
            rclpy.spin_until_future_complete(self.node, future, timeout_sec=5.0)
            if future.done() and future.result() is not None:
                state = future.result().current_state
                if state.id == State.PRIMARY_STATE_ACTIVE:
                    break
            rclpy.spin_once(self.node, timeout_sec=0.2)
        else:
            self.fail(f'{NAMESPACE}/vlm_node did not become active within {STARTUP_TIMEOUT_S:.0f} s '
                      f'(last state: {state.label if state else "unknown"})')
        self.assertTrue(chat.wait_for_service(timeout_sec=CALL_TIMEOUT_S),
                        f'{chat.srv_name} is not available')

        request = Chat.Request()
        request.session_id = f'launch-test-{uuid.uuid4().hex}'
        request.prompt = 'Hello.'
        request.max_new_tokens = 8
        request.temperature = 0.0   # greedy
        future = chat.call_async(request)
        rclpy.spin_until_future_complete(self.node, future, timeout_sec=CALL_TIMEOUT_S)
        self.assertTrue(future.done(), f'{chat.srv_name} did not answer within {CALL_TIMEOUT_S:.0f} s')
        response = future.result()
        self.assertIsNotNone(response, f'{chat.srv_name} call failed: {future.exception()}')
        self.assertTrue(response.success, f'chat failed: {response.error}')
        self.assertGreater(response.generated_tokens, 0)


@launch_testing.post_shutdown_test()
class TestBothNodesShutdown(unittest.TestCase):

    def test_exit_codes(self, proc_info):
        launch_testing.asserts.assertExitCodes(proc_info)
