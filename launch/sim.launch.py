"""Start the simulated arm and the VLA node in a closed loop: camera frames and joint states from sim_robot_node to
vla_node, joint_command back.

Examples:
  ros2 launch synflux_ros sim.launch.py                        # built-in arm, vla_sim_arm.yaml on mock
  ros2 launch synflux_ros sim.launch.py executor:=onnxruntime graph_dir:=/opt/graphs/vla_demo_orin
  ros2 launch synflux_ros sim.launch.py camera:=wrist image_width:=448 image_height:=448
  ros2 launch synflux_ros sim.launch.py model:=/path/to/robot.xml joint_names:='[j1, j2, j3, j4, j5, j6, grip]'
  ros2 launch synflux_ros sim.launch.py --show-args            # every argument, described

vla_node streams joint_command only while enabled: `ros2 service call /vla_node/enable std_srvs/srv/SetBool
"{data: true}"` (or set execution.autoenable in its config). The parameters of sim_robot_node are described in
docs/simulation.md; the arguments shared with vla.launch.py in _synflux_launch_common.py, next to this file.
"""

import os
import sys

# Launch files are loaded by path: the module installed next to this file is imported from here.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _synflux_launch_common as common  # noqa: E402

BUILT_IN_JOINTS = ['joint_1', 'joint_2', 'joint_3', 'joint_4', 'joint_5', 'joint_6', 'gripper']
"""The built-in arm's commanded joints (synflux_ros/sim/arm.py), handed to vla_node when joint_names is empty."""
CAMERA_RATE_HZ = 10.0
"""sim_robot_node's camera_rate_hz default, handed to vla_node (its camera_rate_hz) when camera_rate_hz is empty."""


def _unset(fallback):
    return f"Empty = not set here (the params file's value, else {fallback})."


_VLA = {a.name: a for a in common.VLA_ARGUMENTS}
SIM_ARGUMENTS = [
    common.Argument('config', 'vla_node model config YAML: a path, or a file name in share/synflux_ros/config. '
                    "Default: vla_sim_arm.yaml, the demo model with the built-in arm's joints and limits.",
                    default='vla_sim_arm.yaml'),
    _VLA['executor'],
    _VLA['graph_dir'],
    _VLA['params_file'].renamed(
        'params_file', 'ROS 2 parameters YAML applied to both nodes, with sections keyed by their full names '
        '(/sim_robot_node, /vla_node, /<namespace>/vla_node, ...) or wildcards (/**). Empty = none. Launch '
        'arguments left empty do not set their parameter; the others override the file.'),
    _VLA['namespace'].renamed('namespace', 'ROS namespace of both nodes. Empty = the root namespace.'),
    _VLA['log_level'].renamed('log_level', 'Logging level of both nodes.'),
    _VLA['fastdds_profile'],
    _VLA['default_instruction'],
    common.Argument('joint_names', "Commanded joints in action order, for both nodes, as '[j1, j2, ...]', "
                    "'j1,j2,...' or 'j1 j2 ...'. Empty = the built-in arm's joint_1 .. joint_6, gripper "
                    '(required with model).'),
    common.Argument('model', 'MJCF file of the simulated robot and its scene (sim_robot_node model). Empty = '
                    'the built-in 6-joint arm with a gripper, a table and a block.'),
    common.Argument('camera', 'MJCF camera whose frames go to vla_node (the built-in arm has scene and wrist). '
                    + _unset('scene')),
    common.Argument('image_width', 'Camera frame width in pixels. ' + _unset('224')),
    common.Argument('image_height', 'Camera frame height in pixels. ' + _unset('224')),
    common.Argument('camera_rate_hz', 'Camera frames per simulated second. ' + _unset('10')),
    common.Argument('physics_rate_hz', 'Physics steps and servo updates per simulated second, at least 200. '
                    + _unset('500')),
    common.Argument('joint_state_rate_hz', 'joint_states messages per simulated second. ' + _unset('100')),
    common.Argument('real_time', 'Keep simulated time on the wall clock (false: as fast as the CPU allows). '
                    + _unset('true'), choices=common.BOOL_CHOICES),
    common.Argument('initial_positions', "Start position per joint, as '[0.0, 0.35, ...]'. "
                    + _unset("the model's keyframe 'home'")),
    common.Argument('use_sim_time', 'Run the loop on simulated time: sim_robot_node publishes /clock and stamps '
                    'its joint states and frames with it, and vla_node takes use_sim_time, so its control, '
                    'watchdog and frame rates follow the simulation when it runs slower than real time. false: '
                    'the wall clock.', default='true', choices=common.BOOL_CHOICES),
]

VLA_PARAMETERS = {'config': str, 'executor': str, 'graph_dir': str, 'default_instruction': str, 'joint_names': list}
SIM_PARAMETERS = {'model': str, 'joint_names': list, 'camera': str, 'image_width': int, 'image_height': int,
                  'camera_rate_hz': float, 'physics_rate_hz': float, 'joint_state_rate_hz': float,
                  'real_time': bool, 'initial_positions': 'floats'}


# ------------------------------------------------------------------ argument values (no ROS needed)
def parse_floats(name, text):
    """'[0.1, 2]', '0.1,2' or '0.1 2' -> [0.1, 2.0]."""
    inner = text.strip()
    if inner.startswith('[') and inner.endswith(']'):
        inner = inner[1:-1]
    try:
        return [float(v) for v in inner.replace(',', ' ').split()]
    except ValueError:
        raise ValueError(f'{name}:={text!r}: expected numbers, as [0.0, 0.35, ...]') from None


def sim_parameters(values):
    """sim_robot_node's parameters from the launch arguments ``values``: every non-empty one, converted."""
    params = {}
    for name, kind in SIM_PARAMETERS.items():
        text = values.get(name, '').strip()
        if not text:
            continue
        if kind is bool:
            params[name] = common.parse_bool(name, text)
        elif kind is list:
            params[name] = common.parse_joint_names(text)
        elif kind == 'floats':
            params[name] = parse_floats(name, text)
        elif kind in (int, float):
            try:
                params[name] = kind(text)
            except ValueError:
                raise ValueError(f'{name}:={text!r}: expected {"an integer" if kind is int else "a number"}') \
                    from None
        else:
            params[name] = text
    return params


def commanded_joints(values):
    """The joints both nodes command: joint_names, else the built-in arm's (a model of one's own needs names)."""
    names = common.parse_joint_names(values.get('joint_names', ''))
    if names:
        return names
    if values.get('model', '').strip():
        raise ValueError('joint_names: required with model:=... (the joints vla_node commands, in the order '
                         'of its actions)')
    return list(BUILT_IN_JOINTS)


# ------------------------------------------------------------------ launch actions
def _node(values, executable, parameters):
    from launch_ros.actions import Node
    files = [f for f in [common.params_file_path(values['params_file'])] if f]
    return Node(
        package=common.PACKAGE,
        executable=executable,
        name=executable,
        namespace=values['namespace'],
        output='screen',
        parameters=files + ([parameters] if parameters else []),
        ros_arguments=['--log-level', values['log_level']],
    )


def sim_actions(context):
    values = common.values_of(context, SIM_ARGUMENTS)
    joints = commanded_joints(values)
    sim = sim_parameters(values)
    vla = common.node_parameters({k: v for k, v in VLA_PARAMETERS.items() if k != 'joint_names'}, values)
    vla['joint_names'] = joints
    vla['camera_rate_hz'] = sim.get('camera_rate_hz', CAMERA_RATE_HZ)  # the rate vla_node expects frames at
    sim_time = common.parse_bool('use_sim_time', values['use_sim_time'])
    sim['publish_clock'] = vla['use_sim_time'] = sim_time  # sim_robot_node is the time source: its own clock
    return common._environment_actions(context, values['fastdds_profile']) + [
        _node(values, 'sim_robot_node', sim),
        _node(values, 'vla_node', vla),
    ]


def generate_launch_description():
    return common.launch_description(SIM_ARGUMENTS, sim_actions)
