"""Launch test: vlm.launch.py with the mock executor serves multi-turn chat sessions.

Run with `colcon test --packages-select synflux_ros` or directly with
`launch_test test/launch/test_vlm_launch.py` on a sourced ROS 2 install.
"""

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
from lifecycle_msgs.msg import State  # noqa: E402
from lifecycle_msgs.srv import GetState  # noqa: E402
from synflux_ros.nodes.testing import rgb_image  # noqa: E402
from synflux_ros.srv import Chat, EndSession  # noqa: E402

# A namespace of its own keeps this test's services apart from anything else running on the
# same ROS domain. launch_test itself does not choose a domain: CMakeLists.txt runs it through
# ament_cmake_ros's isolation runner, which sets ROS_DOMAIN_ID for the test.
NAMESPACE = f'/synflux_test_vlm_{os.getpid()}_{uuid.uuid4().hex[:8]}'

STARTUP_TIMEOUT_S = 60.0   # node start-up until it reports the active lifecycle state
CALL_TIMEOUT_S = 30.0      # one service call
MAX_NEW_TOKENS = 16


@pytest.mark.launch_test
def generate_test_description():
    vlm_launch = IncludeLaunchDescription(
        PythonLaunchDescriptionSource(
            PathJoinSubstitution([FindPackageShare('synflux_ros'), 'launch', 'vlm.launch.py'])),
        launch_arguments={
            'executor': 'mock',
            'namespace': NAMESPACE,
        }.items(),
    )
    return launch.LaunchDescription([
        vlm_launch,
        launch_testing.actions.ReadyToTest(),
    ])


class TestVlmChat(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        rclpy.init()

    @classmethod
    def tearDownClass(cls):
        rclpy.shutdown()

    def setUp(self):
        self.node = rclpy.create_node('vlm_launch_test_client', namespace=NAMESPACE)
        self.chat = self.node.create_client(Chat, 'chat')
        self.end_session = self.node.create_client(EndSession, 'end_session')
        self._wait_until_active()

    def tearDown(self):
        self.node.destroy_node()

    def _call(self, client, request, timeout=CALL_TIMEOUT_S):
        future = client.call_async(request)
        rclpy.spin_until_future_complete(self.node, future, timeout_sec=timeout)
        self.assertTrue(future.done(),
                        f'{client.srv_name} did not answer within {timeout:.0f} s')
        response = future.result()
        self.assertIsNotNone(response, f'{client.srv_name} call failed: {future.exception()}')
        return response

    def _wait_until_active(self):
        """Wait until the self-starting lifecycle node is active and its services are up."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        get_state = self.node.create_client(GetState, 'vlm_node/get_state')
        try:
            state = None
            while time.monotonic() < deadline:
                if not get_state.wait_for_service(timeout_sec=0.5):
                    continue
                future = get_state.call_async(GetState.Request())
                rclpy.spin_until_future_complete(
                    self.node, future,
                    timeout_sec=max(0.1, min(5.0, deadline - time.monotonic())))
                if future.done() and future.result() is not None:
                    state = future.result().current_state
                    if state.id == State.PRIMARY_STATE_ACTIVE:
                        break
                # Not active yet: give the node a moment while still servicing callbacks.
                rclpy.spin_once(self.node, timeout_sec=0.2)
            else:
                self.fail(f'{NAMESPACE}/vlm_node did not become active within '
                          f'{STARTUP_TIMEOUT_S:.0f} s (last state: '
                          f'{state.label if state else "unknown"})')
        finally:
            self.node.destroy_client(get_state)

        for client in (self.chat, self.end_session):
            remaining = max(0.1, deadline - time.monotonic())
            self.assertTrue(client.wait_for_service(timeout_sec=remaining),
                            f'{client.srv_name} is not available')

    def _chat_request(self, session_id, prompt, images=(), reset=False):
        request = Chat.Request()
        request.session_id = session_id
        request.prompt = prompt
        request.images = list(images)
        request.reset = reset
        request.max_new_tokens = MAX_NEW_TOKENS
        request.temperature = 0.0   # greedy
        request.top_p = 0.0         # config default
        return request

    def test_two_turn_session(self):
        session_id = f'launch-test-{uuid.uuid4().hex}'

        image = rgb_image(48, 64, frame_id='test_camera')
        first = self._call(self.chat, self._chat_request(
            session_id, 'What is in this picture?', images=[image], reset=True))
        self.assertTrue(first.success, f'turn 1 failed: {first.error}')
        self.assertTrue(first.reply, 'turn 1 returned an empty reply')
        self.assertGreater(first.prompt_tokens, 0)
        self.assertGreater(first.generated_tokens, 0)
        self.assertLessEqual(first.generated_tokens, MAX_NEW_TOKENS)
        self.assertGreater(first.total_ms, 0.0)

        second = self._call(self.chat, self._chat_request(
            session_id, 'Describe it in one short sentence.'))
        self.assertTrue(second.success, f'turn 2 failed: {second.error}')
        self.assertTrue(second.reply, 'turn 2 returned an empty reply')
        self.assertGreater(second.cached_tokens, 0,
                           'turn 2 did not reuse the KV cache of turn 1')
        self.assertLessEqual(second.generated_tokens, MAX_NEW_TOKENS)

        ended = self._call(self.end_session, EndSession.Request(session_id=session_id))
        self.assertTrue(ended.success, f'end_session failed: {ended.error}')

    def test_end_unknown_session_fails(self):
        unknown = f'never-started-{uuid.uuid4().hex}'
        response = self._call(self.end_session, EndSession.Request(session_id=unknown))
        self.assertFalse(response.success, 'ending an unknown session reported success')
        self.assertTrue(response.error, 'ending an unknown session gave no error message')


@launch_testing.post_shutdown_test()
class TestVlmShutdown(unittest.TestCase):

    def test_exit_codes(self, proc_info):
        launch_testing.asserts.assertExitCodes(proc_info)
