"""Start the synflux_ros VLM node: multi-turn chat services backed by a per-session KV cache.

Examples:
  ros2 launch synflux_ros vlm.launch.py
  ros2 launch synflux_ros vlm.launch.py executor:=mock
  ros2 launch synflux_ros vlm.launch.py config:=vlm_qwen3.yaml executor:=tensorrt \
      graph_dir:=/opt/models/qwen3 namespace:=assistant
"""

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import Node
from launch_ros.parameter_descriptions import ParameterValue
from launch_ros.substitutions import FindPackageShare

PACKAGE = 'synflux_ros'


def generate_launch_description():
    config = LaunchConfiguration('config')
    executor = LaunchConfiguration('executor')
    graph_dir = LaunchConfiguration('graph_dir')
    namespace = LaunchConfiguration('namespace')
    log_level = LaunchConfiguration('log_level')

    arguments = [
        DeclareLaunchArgument(
            'config',
            default_value=PathJoinSubstitution(
                [FindPackageShare(PACKAGE), 'config', 'vlm_demo.yaml']),
            description=(
                'Model config YAML. An absolute path, or a bare file name looked up in '
                'share/synflux_ros/config (vlm_demo.yaml, vlm_qwen3.yaml).'),
        ),
        DeclareLaunchArgument(
            'executor',
            default_value='',
            description=(
                "Inference executor: mock, onnxruntime or tensorrt. "
                "Empty = the executor named in the config."),
        ),
        DeclareLaunchArgument(
            'graph_dir',
            default_value='',
            description=(
                'Directory holding the compiled model graphs. Empty = the directory named '
                'in the config.'),
        ),
        DeclareLaunchArgument(
            'namespace',
            default_value='',
            description=(
                'ROS namespace for the node and its services (chat, end_session). '
                'Empty = root namespace.'),
        ),
        DeclareLaunchArgument(
            'log_level',
            default_value='info',
            choices=['debug', 'info', 'warn', 'error', 'fatal'],
            description='Logging level of the node.',
        ),
    ]

    vlm_node = Node(
        package=PACKAGE,
        executable='vlm_node',
        name='vlm_node',
        namespace=namespace,
        output='screen',
        emulate_tty=True,
        parameters=[{
            'config': ParameterValue(config, value_type=str),
            'executor': ParameterValue(executor, value_type=str),
            'graph_dir': ParameterValue(graph_dir, value_type=str),
        }],
        ros_arguments=['--log-level', log_level],
    )

    return LaunchDescription(arguments + [vlm_node])
