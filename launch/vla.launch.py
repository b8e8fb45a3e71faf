"""Start the synflux_ros VLA node: camera frames + instruction in, action chunks out.

Examples:
  ros2 launch synflux_ros vla.launch.py
  ros2 launch synflux_ros vla.launch.py executor:=mock image_topic:=/camera/color/image_raw
  ros2 launch synflux_ros vla.launch.py config:=vla_pi0.yaml executor:=tensorrt \
      graph_dir:=/opt/models/pi0 namespace:=arm publish_joint_trajectory:=true
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
    image_topic = LaunchConfiguration('image_topic')
    instruction_topic = LaunchConfiguration('instruction_topic')
    default_instruction = LaunchConfiguration('default_instruction')
    image_transport = LaunchConfiguration('image_transport')
    publish_joint_trajectory = LaunchConfiguration('publish_joint_trajectory')
    log_level = LaunchConfiguration('log_level')

    arguments = [
        DeclareLaunchArgument(
            'config',
            default_value=PathJoinSubstitution(
                [FindPackageShare(PACKAGE), 'config', 'vla_demo_orin.yaml']),
            description=(
                'Model config YAML. An absolute path, or a bare file name looked up in '
                'share/synflux_ros/config (vla_demo_orin.yaml, vla_pi0.yaml, vla_openvla.yaml).'),
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
                'ROS namespace for the node and its relative topics '
                '(image, instruction, action_chunk, joint_trajectory). Empty = root namespace.'),
        ),
        DeclareLaunchArgument(
            'image_topic',
            default_value='image',
            description=(
                'Camera topic to subscribe to. With image_transport:=compressed the node '
                'listens on <image_topic>/compressed.'),
        ),
        DeclareLaunchArgument(
            'instruction_topic',
            default_value='instruction',
            description=(
                'Topic carrying the task instruction (std_msgs/String, reliable, '
                'transient local).'),
        ),
        DeclareLaunchArgument(
            'default_instruction',
            default_value='',
            description=(
                'Instruction used until one arrives on the instruction topic. '
                "Empty = the node's own default."),
        ),
        DeclareLaunchArgument(
            'image_transport',
            default_value='raw',
            choices=['raw', 'compressed'],
            description=(
                'How camera frames arrive: raw (sensor_msgs/Image on <image_topic>) or '
                'compressed (sensor_msgs/CompressedImage on <image_topic>/compressed).'),
        ),
        DeclareLaunchArgument(
            'publish_joint_trajectory',
            default_value='false',
            choices=['true', 'false', 'True', 'False'],
            description=(
                'Also publish each action chunk as trajectory_msgs/JointTrajectory '
                'on joint_trajectory.'),
        ),
        DeclareLaunchArgument(
            'log_level',
            default_value='info',
            choices=['debug', 'info', 'warn', 'error', 'fatal'],
            description='Logging level of the node.',
        ),
    ]

    vla_node = Node(
        package=PACKAGE,
        executable='vla_node',
        name='vla_node',
        namespace=namespace,
        output='screen',
        emulate_tty=True,
        parameters=[{
            'config': ParameterValue(config, value_type=str),
            'executor': ParameterValue(executor, value_type=str),
            'graph_dir': ParameterValue(graph_dir, value_type=str),
            'default_instruction': ParameterValue(default_instruction, value_type=str),
            'image_transport': ParameterValue(image_transport, value_type=str),
            'publish_joint_trajectory': ParameterValue(
                publish_joint_trajectory, value_type=bool),
        }],
        remappings=[
            ('image', image_topic),
            # Remapping rules match whole names, so the compressed topic needs its own rule.
            ('image/compressed', [image_topic, '/compressed']),
            ('instruction', instruction_topic),
        ],
        ros_arguments=['--log-level', log_level],
    )

    return LaunchDescription(arguments + [vla_node])
