"""Launch test: vlm.launch.py with the mock executor serves multi-turn chat sessions.

Run with `colcon test --packages-select synflux_ros` or directly with
`launch_test test/launch/test_vlm_launch.py` on a sourced ROS 2 install.
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
from synflux_ros.tools.harness import rgb_image  # noqa: E402
from synflux_ros.srv import Chat, EndSession  # noqa: E402

NAMESPACE = support.unique_namespace('vlm')

STARTUP_TIMEOUT_S = 60.0   # node start-up until it reports the active lifecycle state
CALL_TIMEOUT_S = 30.0      # one service call
MAX_NEW_TOKENS = 16


@pytest.mark.launch_test
def generate_test_description():
    return support.launch_description('vlm.launch.py', executor='mock', namespace=NAMESPACE)


class TestVlmChat(support.ClientNodeTestCase):

    NODE_NAME = 'vlm_launch_test_client'
    NAMESPACE = NAMESPACE

    def setUp(self):
        super().setUp()
        self.chat = self.node.create_client(Chat, 'chat')
        self.end_session = self.node.create_client(EndSession, 'end_session')
        # The services come up with the active state: wait for both within the same start-up time.
        deadline = self.wait_until_active('vlm_node', STARTUP_TIMEOUT_S)
        for client in (self.chat, self.end_session):
            self.assert_service_available(client, max(0.1, deadline - time.monotonic()))

    def _call(self, client, request):
        return self.call_service(client, request, CALL_TIMEOUT_S)

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
class TestVlmShutdown(support.ExitCodesTest):
    pass
