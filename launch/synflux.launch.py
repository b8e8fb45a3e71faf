"""Start the VLA node and the VLM node together (vla.launch.py + vlm.launch.py).

Examples:
  ros2 launch synflux_ros synflux.launch.py executor:=mock
  ros2 launch synflux_ros synflux.launch.py namespace:=robot1 \
      image_topic:=/camera/color/image_raw vla_config:=vla_pi0.yaml vlm_config:=vlm_qwen3.yaml
"""

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, GroupAction, IncludeLaunchDescription
from launch.launch_description_sources import PythonLaunchDescriptionSource
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.substitutions import FindPackageShare

PACKAGE = 'synflux_ros'


def _include(launch_file, launch_arguments):
    # Each include runs in its own scope so that `config` handed to one file
    # does not leak into the other.
    return GroupAction([
        IncludeLaunchDescription(
            PythonLaunchDescriptionSource(
                PathJoinSubstitution([FindPackageShare(PACKAGE), 'launch', launch_file])),
            launch_arguments=launch_arguments.items(),
        ),
    ])


def generate_launch_description():
    vla_config = LaunchConfiguration('vla_config')
    vlm_config = LaunchConfiguration('vlm_config')
    executor = LaunchConfiguration('executor')
    graph_dir = LaunchConfiguration('graph_dir')
    namespace = LaunchConfiguration('namespace')
    image_topic = LaunchConfiguration('image_topic')
    log_level = LaunchConfiguration('log_level')

    config_dir = PathJoinSubstitution([FindPackageShare(PACKAGE), 'config'])

    arguments = [
        DeclareLaunchArgument(
            'vla_config',
            default_value=PathJoinSubstitution([config_dir, 'vla_demo_orin.yaml']),
            description=(
                'VLA model config YAML: an absolute path, or a bare file name looked up in '
                'share/synflux_ros/config.'),
        ),
        DeclareLaunchArgument(
            'vlm_config',
            default_value=PathJoinSubstitution([config_dir, 'vlm_demo.yaml']),
            description=(
                'VLM model config YAML: an absolute path, or a bare file name looked up in '
                'share/synflux_ros/config.'),
        ),
        DeclareLaunchArgument(
            'executor',
            default_value='',
            description=(
                'Inference executor for both nodes: mock, onnxruntime or tensorrt. '
                'Empty = the executor named in each config.'),
        ),
        DeclareLaunchArgument(
            'graph_dir',
            default_value='',
            description=(
                'Directory holding the compiled model graphs, for both nodes. '
                'Empty = the directory named in each config.'),
        ),
        DeclareLaunchArgument(
            'namespace',
            default_value='',
            description='ROS namespace for both nodes. Empty = root namespace.',
        ),
        DeclareLaunchArgument(
            'image_topic',
            default_value='image',
            description='Camera topic the VLA node subscribes to.',
        ),
        DeclareLaunchArgument(
            'log_level',
            default_value='info',
            choices=['debug', 'info', 'warn', 'error', 'fatal'],
            description='Logging level of both nodes.',
        ),
    ]

    vla = _include('vla.launch.py', {
        'config': vla_config,
        'executor': executor,
        'graph_dir': graph_dir,
        'namespace': namespace,
        'image_topic': image_topic,
        'log_level': log_level,
    })
    vlm = _include('vlm.launch.py', {
        'config': vlm_config,
        'executor': executor,
        'graph_dir': graph_dir,
        'namespace': namespace,
        'log_level': log_level,
    })

    return LaunchDescription(arguments + [vla, vlm])
