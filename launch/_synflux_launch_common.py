"""Launch arguments and node actions shared by vla.launch.py, vlm.launch.py, synflux.launch.py and
planner.launch.py.

Launch files are loaded by path, not as a package, so each of them loads this module from its own
directory (it is installed next to them, in share/synflux_ros/launch). Only the functions that build
launch actions import ``launch`` and ``launch_ros``: the argument tables and the parsing of argument
values work without a ROS installation (test/integration/test_launch_files.py checks them that way).

Node parameters: a launch argument left empty does not set its parameter, so the value comes from
``params_file`` when one is given, else from the node's own default; a non-empty argument overrides
the params file.
"""

import math
import os
import re

PACKAGE = 'synflux_ros'
# The setting's name in Fast DDS 3 (Kilted) and in Fast DDS 2.x (Humble, Jazzy); a user setting under either
# is kept. Which one the launch sets: synflux_ros.nodes.ros_compat.fastdds_profile_variables.
FASTDDS_PROFILE_VARIABLE = 'FASTDDS_DEFAULT_PROFILES_FILE'
FASTDDS_LEGACY_PROFILE_VARIABLE = 'FASTRTPS_DEFAULT_PROFILES_FILE'
LOG_LEVELS = ['debug', 'info', 'warn', 'error', 'fatal']
BOOL_CHOICES = ['', 'true', 'false', 'True', 'False']


class Argument:
    """One launch argument: its name, default, description and (optionally) allowed values."""

    def __init__(self, name, description, default='', choices=None):
        self.name = name
        self.description = description
        self.default = default
        self.choices = choices

    def renamed(self, name, description):
        return Argument(name, description, self.default, self.choices)


def _unset(fallback):
    return f"Empty = not set here (the params file's value, else {fallback})."


BACKENDS_HELP = ("one of the registered backends: mock, onnxruntime, openvino, qnn, rknn, tensorrt. tensorrt "
                 "(Jetson Orin) needs JetPack's TensorRT 10 and cuda-python, and a graph_dir whose engines were "
                 "built on that device: synflux-build --config <model.yaml> --out <graph_dir> --backend "
                 "tensorrt --fp16.")
EXECUTOR_HELP = "Inference backend (the executor parameter). Empty = the config's executor.backend; " + BACKENDS_HELP

# fastdds_profile's words. An empty value cannot be typed (`ros2 launch` refuses `name:=`), and a shell hands
# `fastdds_profile:="''"` over as the two quote characters: those spellings mean 'none' too.
FASTDDS_SHIPPED = 'shipped'
FASTDDS_NONE = 'none'
FASTDDS_NONE_SPELLINGS = (FASTDDS_NONE, "''", '""', '')
SHIPPED_PROFILE = ('config', 'fastdds_shm.xml')

FASTDDS_HELP = (
    "Fast DDS XML profile, set for the processes this launch starts (the nodes) as "
    "FASTRTPS_DEFAULT_PROFILES_FILE on Fast DDS 2.x (Humble, Jazzy) or FASTDDS_DEFAULT_PROFILES_FILE on Fast DDS 3 "
    "(Kilted). shipped (the default) = the package's shared-memory profile, "
    "share/synflux_ros/config/fastdds_shm.xml, with which large camera frames (448x448 rgb8 and up) "
    "arrive complete between processes on one machine; none = leave the environment as it is; anything "
    "else = the path of another profile (./none for a file named none). Not applied when "
    "FASTDDS_DEFAULT_PROFILES_FILE (or the older FASTRTPS_DEFAULT_PROFILES_FILE) is already set in the "
    "environment: that setting is kept. The shared memory a frame travels through belongs to the sending "
    "process: start the camera driver with the same profile variable. Only Fast DDS "
    "(rmw_fastrtps_cpp) reads it.")


def _model_arguments(node, configs, default_config):
    """Arguments of one model node (``node``: vla_node or vlm_node)."""
    return [
        Argument('config', 'Model config YAML (the config parameter): a path, or a file name in '
                 f'share/synflux_ros/config ({configs}). ' + _unset(default_config)),
        Argument('executor', EXECUTOR_HELP),
        Argument('graph_dir', 'Directory of the compiled graph set (the graph_dir parameter). '
                 "Empty = the config's executor.graph_dir."),
        Argument('params_file', f'ROS 2 parameters YAML applied to {node}, keyed by its full name '
                 f'(/{node}, /<namespace>/{node}) or a wildcard (/**/{node}, /**). Empty = none. '
                 'Launch arguments left empty do not set their parameter; the others override the file.'),
        Argument('namespace', 'ROS namespace of the node and its relative names. Empty = the root '
                 'namespace.'),
        Argument('log_level', 'Logging level of the node.', default='info', choices=LOG_LEVELS),
        Argument('fastdds_profile', FASTDDS_HELP, default=FASTDDS_SHIPPED),
    ]


VLA_ARGUMENTS = _model_arguments(
    'vla_node', 'vla_demo_orin.yaml, vla_pi0.yaml, vla_openvla.yaml', 'vla_demo_orin.yaml') + [
    Argument('image_topic', 'Camera topic (sensor_msgs/Image); image/compressed is remapped to '
             '<image_topic>/compressed.', default='image'),
    Argument('instruction_topic', 'Topic of the task instruction (std_msgs/String; volatile or '
             'transient-local publishers).', default='instruction'),
    Argument('default_instruction', 'Instruction used until one arrives on the instruction topic. '
             + _unset("the config's default_instruction")),
    Argument('image_transport', 'raw: sensor_msgs/Image on <image_topic>; compressed: '
             'sensor_msgs/CompressedImage on <image_topic>/compressed. ' + _unset('raw'),
             choices=['', 'raw', 'compressed']),
    Argument('publish_joint_trajectory', 'Also publish each action chunk as '
             'trajectory_msgs/JointTrajectory on joint_trajectory (needs joint_names). '
             + _unset('false'), choices=BOOL_CHOICES),
    Argument('joint_names', 'Joint names of joint_trajectory, one per action dimension (7 for '
             "vla_demo_orin.yaml), as '[j1, j2, ...]', 'j1,j2,...' or 'j1 j2 ...'. "
             + _unset('no names')),
    Argument('camera_rate_hz', 'Rate the camera publishes at, in Hz (the camera_rate_hz parameter): '
             'vla_node counts the frames that never arrive against it and says so in /diagnostics. '
             + _unset('0, not stated: the rate is estimated from the frames that arrive')),
]

VLM_ARGUMENTS = _model_arguments('vlm_node', 'vlm_demo.yaml, vlm_qwen3.yaml', 'vlm_demo.yaml')

# Node parameters set from launch arguments, with the type each is converted to.
VLA_PARAMETERS = {'config': str, 'executor': str, 'graph_dir': str, 'default_instruction': str,
                  'image_transport': str, 'publish_joint_trajectory': bool, 'joint_names': list,
                  'camera_rate_hz': float}
VLM_PARAMETERS = {'config': str, 'executor': str, 'graph_dir': str}

# synflux.launch.py: the arguments of both files, once each. Model-specific ones are renamed; all
# others are handed to every included file that declares them.
SYNFLUX_RENAMES = {
    'vla.launch.py': {'config': 'vla_config', 'graph_dir': 'vla_graph_dir'},
    'vlm.launch.py': {'config': 'vlm_config', 'graph_dir': 'vlm_graph_dir'},
}
INCLUDED = {'vla.launch.py': VLA_ARGUMENTS, 'vlm.launch.py': VLM_ARGUMENTS}


def _synflux_arguments():
    vla = {a.name: a for a in VLA_ARGUMENTS}
    vlm = {a.name: a for a in VLM_ARGUMENTS}
    return [
        vla['config'].renamed('vla_config', 'VLA model config YAML: a path, or a file name in '
                              'share/synflux_ros/config. ' + _unset('vla_demo_orin.yaml')),
        vlm['config'].renamed('vlm_config', 'VLM model config YAML: a path, or a file name in '
                              'share/synflux_ros/config. ' + _unset('vlm_demo.yaml')),
        vla['executor'].renamed('executor', "Inference backend of both nodes. Empty = each config's "
                                'executor.backend; ' + BACKENDS_HELP),
        vla['graph_dir'].renamed('vla_graph_dir', 'Directory of the VLA graph set. '
                                 "Empty = the VLA config's executor.graph_dir."),
        vlm['graph_dir'].renamed('vlm_graph_dir', 'Directory of the VLM graph set. '
                                 "Empty = the VLM config's executor.graph_dir."),
        vla['params_file'].renamed(
            'params_file', 'ROS 2 parameters YAML applied to both nodes, with sections keyed by their '
            'full names (/vla_node, /vlm_node, /<namespace>/vla_node, ...) or wildcards (/**/vla_node, '
            '/**). Empty = none. Launch arguments left empty do not set their parameter; the others '
            'override the file.'),
        vla['namespace'].renamed('namespace', 'ROS namespace of both nodes. Empty = the root namespace.'),
        vla['log_level'].renamed('log_level', 'Logging level of both nodes.'),
        vla['fastdds_profile'],
        *(a for a in VLA_ARGUMENTS if a.name not in vlm),
    ]


SYNFLUX_ARGUMENTS = _synflux_arguments()


# planner.launch.py: synflux.launch.py's arguments, and the planner's. It starts the two nodes itself (the
# planner's parameters are not arguments of vlm.launch.py) and gives vlm_node the VLA's topics.
PLANNER_ARGUMENTS = SYNFLUX_ARGUMENTS + [
    Argument('goal', 'Goal the planner works towards until one arrives on goal_topic (vlm_node\'s planner_goal). '
             + _unset('none: nothing is asked before a goal arrives')),
    Argument('goal_topic', 'Topic of the goal (std_msgs/String; volatile or transient-local publishers).',
             default='goal'),
    Argument('planner_period', "Seconds between the planner's questions (vlm_node's planner_period): with the "
             'latest frame on image_topic, the next subtask towards the goal, published on instruction_topic. '
             '0 = off.', default='2.0'),
    Argument('planner_prompt', "The planner's question to the VLM, with {goal} where the goal goes. "
             + _unset("vlm_node's default")),
    Argument('planner_max_new_tokens', "Longest answer of the planner, in tokens (1 to 256). "
             + _unset('32')),
]
PLANNER_VLM_PARAMETERS = {**VLM_PARAMETERS, 'planner_period': float, 'planner_goal': str, 'planner_prompt': str,
                          'planner_max_new_tokens': int}


def synflux_forwarding():
    """{included file: [(its argument, the synflux.launch.py argument handed to it)]}."""
    return {file: [(a.name, SYNFLUX_RENAMES[file].get(a.name, a.name)) for a in arguments]
            for file, arguments in INCLUDED.items()}


# ------------------------------------------------------------------ argument values (no ROS needed)
def parse_bool(name, text):
    value = text.strip().lower()
    if value not in ('true', 'false'):
        raise ValueError(f'{name}:={text!r}: expected true or false')
    return value == 'true'


def parse_float(name, text):
    """A finite number, or a ValueError naming the argument."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f'{name}:={text!r}: expected a number')
    return value


def parse_int(name, text):
    """An integer, or a ValueError naming the argument."""
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f'{name}:={text!r}: expected an integer') from None


def parse_joint_names(text):
    """'[a, b]', "['a', 'b']", 'a,b' or 'a b' -> ['a', 'b']; '' -> []."""
    inner = text.strip()
    if inner.startswith('[') and inner.endswith(']'):
        inner = inner[1:-1]
    names = [n.strip().strip('\'"') for n in re.split(r'[,\s]+', inner)]
    names = [n for n in names if n]
    bad = [n for n in names if re.search(r'[\[\]\'"]', n)]
    if bad:
        raise ValueError(f'joint_names:={text!r}: not a list of names (at {bad[0]!r})')
    return names


def node_parameters(types, values):
    """The parameters that the launch arguments ``values`` set: every non-empty one, converted."""
    params = {}
    for name, kind in types.items():
        text = values.get(name, '')
        if not text.strip():
            continue
        if kind is bool:
            params[name] = parse_bool(name, text)
        elif kind is float:
            params[name] = parse_float(name, text)
        elif kind is int:
            params[name] = parse_int(name, text)
        elif kind is list:
            names = parse_joint_names(text)
            if names:
                params[name] = names
        else:
            params[name] = text
    return params


def params_file_path(text):
    """The params file to load, or None for ''."""
    if not text.strip():
        return None
    if not os.path.isfile(text):
        raise FileNotFoundError(f'params_file:={text!r}: no such file')
    return os.path.abspath(text)


def fastdds_profile_to_set(profile, environment, shipped_profile):
    """The value to export as FASTDDS_DEFAULT_PROFILES_FILE, or None to leave the environment as it is.

    ``shipped_profile()`` gives the path of the package's profile; it is called only for 'shipped'.
    """
    word = profile.strip()
    if word.lower() in FASTDDS_NONE_SPELLINGS:
        return None
    if environment.get(FASTDDS_PROFILE_VARIABLE) or environment.get(FASTDDS_LEGACY_PROFILE_VARIABLE):
        return None
    path = shipped_profile() if word.lower() == FASTDDS_SHIPPED else word
    if not os.path.isfile(path):
        raise FileNotFoundError(f'fastdds_profile:={profile!r}: no such file ({path}); {FASTDDS_NONE} leaves '
                                f'the environment as it is, {FASTDDS_SHIPPED} applies the package\'s profile')
    return os.path.abspath(path)


# ------------------------------------------------------------------ launch actions
def declare(arguments):
    from launch.actions import DeclareLaunchArgument
    return [DeclareLaunchArgument(a.name, default_value=a.default,
                                  description=a.description, choices=a.choices)
            for a in arguments]


def values_of(context, arguments):
    from launch.substitutions import LaunchConfiguration
    return {a.name: LaunchConfiguration(a.name).perform(context) for a in arguments}


def _environment_actions(context, profile):
    """SetEnvironmentVariable and its log line for fastdds_profile, or nothing (see FASTDDS_HELP).

    synflux.launch.py applies it before including vla.launch.py and vlm.launch.py; they then find the
    variable set and leave it, so it is set and logged once.
    """
    from launch.actions import LogInfo, SetEnvironmentVariable

    def shipped_profile():
        from launch_ros.substitutions import FindPackageShare
        return os.path.join(FindPackageShare(PACKAGE).perform(context), *SHIPPED_PROFILE)
    path = fastdds_profile_to_set(profile, context.environment, shipped_profile)
    if path is None:
        return []
    # Fast DDS 2.x (Humble, Jazzy) reads only FASTRTPS_DEFAULT_PROFILES_FILE, Fast DDS 3 (Kilted) only
    # FASTDDS_DEFAULT_PROFILES_FILE: the variable the installed one reads (both when that cannot be told)
    from synflux_ros.nodes.ros_compat import fastdds_profile_variables
    actions = []
    for variable in fastdds_profile_variables(context.environment):
        actions += [SetEnvironmentVariable(variable, path), LogInfo(msg=f'{variable}={path} (fastdds_profile)')]
    return actions


def _node(values, executable, types, remappings=()):
    from launch_ros.actions import Node
    parameters = []
    params_file = params_file_path(values['params_file'])
    if params_file:
        parameters.append(params_file)
    overrides = node_parameters(types, values)
    if overrides:
        parameters.append(overrides)
    return Node(
        package=PACKAGE,
        executable=executable,
        name=executable,
        namespace=values['namespace'],
        output='screen',
        parameters=parameters,
        remappings=[(name, target) for name, target in remappings if target],
        ros_arguments=['--log-level', values['log_level']],
    )


def _vla_remappings(values):
    image = values['image_topic'].strip()
    return [
        ('image', image),
        # Remapping rules match whole names, so the compressed topic needs its own rule.
        ('image/compressed', image and image.rstrip('/') + '/compressed'),
        ('instruction', values['instruction_topic'].strip()),
    ]


def vla_actions(context):
    values = values_of(context, VLA_ARGUMENTS)
    return _environment_actions(context, values['fastdds_profile']) + [
        _node(values, 'vla_node', VLA_PARAMETERS, _vla_remappings(values))]


def vlm_actions(context):
    values = values_of(context, VLM_ARGUMENTS)
    return _environment_actions(context, values['fastdds_profile']) + [
        _node(values, 'vlm_node', VLM_PARAMETERS)]


def synflux_actions(context, launch_dir):
    """The Fast DDS profile, then vla.launch.py and vlm.launch.py, each in its own scope, with
    synflux.launch.py's arguments."""
    from launch.actions import GroupAction, IncludeLaunchDescription
    from launch.launch_description_sources import PythonLaunchDescriptionSource
    from launch.substitutions import LaunchConfiguration
    profile = LaunchConfiguration('fastdds_profile').perform(context)
    return _environment_actions(context, profile) + [
        GroupAction([IncludeLaunchDescription(
            PythonLaunchDescriptionSource(os.path.join(launch_dir, file)),
            launch_arguments=[(child, LaunchConfiguration(parent)) for child, parent in forwarding],
        )])
        for file, forwarding in synflux_forwarding().items()
    ]


def planner_actions(context):
    """The Fast DDS profile, then vla_node and vlm_node with its planner, which reads vla_node's camera topic
    and publishes on its instruction topic."""
    values = values_of(context, PLANNER_ARGUMENTS)
    vla = dict(values, config=values['vla_config'], graph_dir=values['vla_graph_dir'])
    vlm = dict(values, config=values['vlm_config'], graph_dir=values['vlm_graph_dir'], planner_goal=values['goal'])
    planner_topics = [(name, target) for name, target in _vla_remappings(values) if name != 'image/compressed']
    planner_topics.append(('goal', values['goal_topic'].strip()))
    return _environment_actions(context, values['fastdds_profile']) + [
        _node(vla, 'vla_node', VLA_PARAMETERS, _vla_remappings(values)),
        _node(vlm, 'vlm_node', PLANNER_VLM_PARAMETERS, planner_topics),
    ]


def launch_description(arguments, function, *args):
    """The declared ``arguments``, then the actions ``function(context, *args)`` returns.

    The actions are built at launch time, once the argument values are known: joint_names becomes a
    list of strings and empty arguments set no parameter. For synflux.launch.py this also keeps the
    included files' own arguments (config, graph_dir) out of ``ros2 launch --show-args``: it lists
    exactly the arguments synflux.launch.py takes and forwards.
    """
    from launch import LaunchDescription
    from launch.actions import OpaqueFunction
    return LaunchDescription(declare(arguments) + [OpaqueFunction(function=function, args=list(args))])
