"""What the launch tests in this directory share: the launch description under test, a client
node, frame publishing, lifecycle and service helpers, and the exit-code check after shutdown.

launch_test loads a test file by path, so each test file puts this directory on sys.path before it
imports this module. Importing it skips the importing test module under pytest where launch_testing
or launch_ros is not installed: these tests run on a full ROS 2 install (colcon test).
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
from sensor_msgs.msg import JointState  # noqa: E402
from std_srvs.srv import SetBool  # noqa: E402

PACKAGE = 'synflux_ros'
FRAME_PERIOD_S = 0.1   # camera frames at 10 Hz


def unique_namespace(tag):
    """A namespace of the test's own, which keeps its names apart from anything else on the same ROS
    domain (launch_test does not choose a domain; CMakeLists.txt runs launch tests through
    ament_cmake_ros's isolation runner, which sets ROS_DOMAIN_ID for the test)."""
    return f'/synflux_test_{tag}_{os.getpid()}_{uuid.uuid4().hex[:8]}'


def launch_description(launch_file, **arguments):
    """The test's launch: the package's installed ``launch_file`` with ``arguments``, then
    ReadyToTest."""
    included = IncludeLaunchDescription(
        PythonLaunchDescriptionSource(
            PathJoinSubstitution([FindPackageShare(PACKAGE), 'launch', launch_file])),
        launch_arguments=arguments.items(),
    )
    return launch.LaunchDescription([
        included,
        launch_testing.actions.ReadyToTest(),
    ])


def wall_clock_stamp(frame):
    """(sec, nanosec) of the current wall-clock time, whatever the frame number."""
    return divmod(time.time_ns(), 10**9)


class ClientNodeTestCase(unittest.TestCase):
    """rclpy for the whole class and, for each test, a client node ``self.node`` named ``NODE_NAME``
    in ``NAMESPACE`` (both set by the subclass)."""

    NODE_NAME = None
    NAMESPACE = None

    @classmethod
    def setUpClass(cls):
        rclpy.init()

    @classmethod
    def tearDownClass(cls):
        rclpy.shutdown()

    def setUp(self):
        self.node = rclpy.create_node(self.NODE_NAME, namespace=self.NAMESPACE)

    def tearDown(self):
        self.node.destroy_node()

    def publish_frames_until(self, publisher, image, done, timeout_s, *, stamp=wall_clock_stamp,
                             period_s=FRAME_PERIOD_S, each_frame=None):
        """Publish ``image`` every ``period_s``, stamped ``stamp(frame number)``, and spin the
        client node until ``done()`` or ``timeout_s`` has passed; returns the number of frames
        published. ``each_frame()`` is called with every frame (e.g. to publish a joint state)."""
        frame = 0
        next_frame_at = time.monotonic()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not done():
            now = time.monotonic()
            if now >= next_frame_at:
                if each_frame is not None:
                    each_frame()
                image.header.stamp.sec, image.header.stamp.nanosec = stamp(frame)
                publisher.publish(image)
                frame += 1
                next_frame_at = now + period_s
            rclpy.spin_once(self.node, timeout_sec=max(0.0, min(0.05, next_frame_at - now)))
        return frame

    def wait_until_active(self, lifecycle_node, timeout_s):
        """Wait until the self-starting lifecycle node ``lifecycle_node`` (in ``NAMESPACE``)
        reports the active state; fails the test after ``timeout_s``. Returns the deadline
        (a time.monotonic() value)."""
        deadline = time.monotonic() + timeout_s
        get_state = self.node.create_client(GetState, f'{lifecycle_node}/get_state')
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
                        return deadline
                # Not active yet: give the node a moment while still servicing callbacks.
                rclpy.spin_once(self.node, timeout_sec=0.2)
            self.fail(f'{self.NAMESPACE}/{lifecycle_node} did not become active within '
                      f'{timeout_s:.0f} s (last state: {state.label if state else "unknown"})')
        finally:
            self.node.destroy_client(get_state)

    def assert_service_available(self, client, timeout_s):
        self.assertTrue(client.wait_for_service(timeout_sec=timeout_s),
                        f'{client.srv_name} is not available')

    def enable_commands(self, joint_names, timeout_s, node='vla_node'):
        """Publish joint states of ``joint_names`` and call ``<node>/enable`` until commands are
        enabled (the node refuses without a fresh joint state); returns a function that publishes
        one more joint state, to keep it fresh (pass it as ``each_frame``)."""
        publisher = self.node.create_publisher(JointState, 'joint_states', 10)
        client = self.node.create_client(SetBool, f'{node}/enable')
        self.assert_service_available(client, timeout_s)

        def publish_state():
            msg = JointState(name=list(joint_names), position=[0.0] * len(joint_names))
            msg.header.stamp = self.node.get_clock().now().to_msg()
            publisher.publish(msg)

        deadline = time.monotonic() + timeout_s
        response = None
        while time.monotonic() < deadline:
            publish_state()
            rclpy.spin_once(self.node, timeout_sec=0.05)
            response = self.call_service(client, SetBool.Request(data=True), timeout_s)
            if response.success:
                return publish_state
        self.fail(f'{node}/enable refused: {response.message if response else "no answer"}')

    def call_service(self, client, request, timeout_s):
        """Call ``client`` and return its response; fails the test on no answer or a failed call."""
        future = client.call_async(request)
        rclpy.spin_until_future_complete(self.node, future, timeout_sec=timeout_s)
        self.assertTrue(future.done(),
                        f'{client.srv_name} did not answer within {timeout_s:.0f} s')
        response = future.result()
        self.assertIsNotNone(response, f'{client.srv_name} call failed: {future.exception()}')
        return response


class ExitCodesTest(unittest.TestCase):
    """Every process the launch started exited cleanly. Subclass it in a test file, decorated with
    ``@launch_testing.post_shutdown_test()``."""

    def test_exit_codes(self, proc_info):
        launch_testing.asserts.assertExitCodes(proc_info)
