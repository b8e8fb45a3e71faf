"""Checks of the launch files, the test registration and the package manifest that run without ROS 2's
``launch`` packages.

The launch files are executed against a small stand-in of the ``launch``/``launch_ros`` API (the classes
they use, with the real constructor signatures) and a stand-in launch context: argument declarations,
the arguments synflux.launch.py hands to each included file, and the nodes, parameters, remappings and
environment each file produces. Where the real ``launch`` and ``launch_ros`` are installed (``colcon
test`` on a ROS 2 machine), ``test_with_the_real_launch_api`` also builds every launch description
with them.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import py_compile
import re
import shlex
import sys
import types
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from synflux_ros.backends import EXECUTORS
from synflux_ros.nodes.ros_compat import FASTDDS_PROFILE_VARIABLE, FASTRTPS_PROFILE_VARIABLE, fastdds_profile_variables

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_DIR = ROOT / "launch"
LAUNCH_FILES = sorted(LAUNCH_DIR.glob("*.launch.py"))
PYTHON_LAUNCH_SOURCES = sorted(LAUNCH_DIR.glob("*.py"))
SHIPPED_PROFILE = ROOT / "config" / "fastdds_shm.xml"
# The profile variable the installed Fast DDS reads (FASTRTPS_... on Fast DDS 2.x: Humble, Jazzy; FASTDDS_... on 3)
FASTDDS = fastdds_profile_variables()[0]

VLA_ARGS = {"config", "executor", "graph_dir", "params_file", "namespace", "log_level", "fastdds_profile",
            "image_topic", "instruction_topic", "default_instruction", "image_transport",
            "publish_joint_trajectory", "joint_names", "camera_rate_hz"}
VLM_ARGS = {"config", "executor", "graph_dir", "params_file", "namespace", "log_level", "fastdds_profile"}

with open(ROOT / "config" / "vla_demo_orin.yaml", encoding="utf-8") as _fh:
    ACTION_DIM = yaml.safe_load(_fh)["action"]["action_dim"]
JOINTS = [f"j{i + 1}" for i in range(ACTION_DIM)]


# ----------------------------------------------------------------------------- stand-in launch API
class Substitution:
    def describe(self):
        return f"{type(self).__name__}(...)"


class LaunchConfiguration(Substitution):
    def __init__(self, variable_name, *, default=None):
        self.name, self.default = variable_name, default

    def perform(self, context):
        if self.name in context.launch_configurations:
            return context.launch_configurations[self.name]
        if self.default is None:
            raise KeyError(f"launch configuration {self.name!r} does not exist")
        return resolve(self.default, context)


class PathJoinSubstitution(Substitution):
    def __init__(self, substitutions):
        self.substitutions = list(substitutions)

    def perform(self, context):
        return os.path.join(*(resolve(s, context) for s in self.substitutions))


class FindPackageShare(Substitution):
    """The package's share directory; here the source tree, which holds the same launch/ and config/."""

    def __init__(self, package):
        self.package = package

    def perform(self, context):
        assert resolve(self.package, context) == "synflux_ros"
        return str(ROOT)


class ParameterValue:
    def __init__(self, value, *, value_type=None):
        self.value, self.value_type = value, value_type


class Action:
    def __init__(self, **kwargs):
        self.condition = kwargs.pop("condition", None)
        assert not kwargs, f"unexpected arguments {sorted(kwargs)}"


class DeclareLaunchArgument(Action):
    def __init__(self, name, *, default_value=None, description=None, choices=None, **kwargs):
        super().__init__(**kwargs)
        if choices is not None:
            assert choices, "empty choices"
            if isinstance(default_value, str):
                assert default_value in choices, f"{name}: default {default_value!r} not in {choices}"
        self.name, self.default_value, self.description, self.choices = name, default_value, description, choices


class OpaqueFunction(Action):
    def __init__(self, *, function, args=None, kwargs=None, **left_over_kwargs):
        super().__init__(**left_over_kwargs)
        assert callable(function)
        self.function, self.args, self.kwargs = function, list(args or []), dict(kwargs or {})


class SetEnvironmentVariable(Action):
    def __init__(self, name, value, **kwargs):
        super().__init__(**kwargs)
        self.name, self.value = name, value


class LogInfo(Action):
    def __init__(self, *, msg, **kwargs):
        super().__init__(**kwargs)
        self.msg = msg


class GroupAction(Action):
    def __init__(self, actions, *, scoped=True, forwarding=True, launch_configurations=None, **kwargs):
        super().__init__(**kwargs)
        self.actions, self.scoped, self.forwarding = list(actions), scoped, forwarding
        self.launch_configurations = launch_configurations or {}


class PythonLaunchDescriptionSource:
    def __init__(self, launch_file_path):
        self.location = launch_file_path


class IncludeLaunchDescription(Action):
    def __init__(self, launch_description_source, *, launch_arguments=None, **kwargs):
        super().__init__(**kwargs)
        self.source = launch_description_source
        self.launch_arguments = list(launch_arguments or [])


class Node(Action):
    def __init__(self, *, executable, package=None, name=None, namespace=None, exec_name=None,
                 parameters=None, remappings=None, ros_arguments=None, arguments=None, **kwargs):
        self.extra = {k: kwargs.pop(k) for k in ("output", "emulate_tty", "additional_env", "env")
                      if k in kwargs}
        super().__init__(**kwargs)
        self.executable, self.package, self.name, self.namespace = executable, package, name, namespace
        self.parameters, self.remappings = parameters, remappings
        self.ros_arguments, self.arguments = ros_arguments, arguments


class LaunchDescription:
    def __init__(self, initial_entities=None, *, deprecated_reason=None):
        self.entities = list(initial_entities or [])


class Context:
    def __init__(self, launch_configurations, environment):
        self.launch_configurations = dict(launch_configurations)
        self.environment = dict(environment)


def resolve(value, context):
    """A launch value as the launch system would hand it over: substitutions performed, lists joined."""
    if isinstance(value, Substitution):
        return value.perform(context)
    if isinstance(value, ParameterValue):
        return resolve(value.value, context)
    if isinstance(value, (list, tuple)) and any(isinstance(v, Substitution) for v in value):
        return "".join(str(resolve(v, context)) for v in value)
    if isinstance(value, dict):
        return {k: resolve(v, context) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [resolve(v, context) for v in value]
    return value


def _stand_in_modules() -> dict[str, types.ModuleType]:
    modules = {name: types.ModuleType(name) for name in (
        "launch", "launch.actions", "launch.substitutions", "launch.launch_description_sources",
        "launch_ros", "launch_ros.actions", "launch_ros.substitutions", "launch_ros.parameter_descriptions")}
    modules["launch"].LaunchDescription = LaunchDescription
    for cls in (DeclareLaunchArgument, OpaqueFunction, SetEnvironmentVariable, LogInfo, GroupAction,
                IncludeLaunchDescription):
        setattr(modules["launch.actions"], cls.__name__, cls)
    modules["launch.substitutions"].LaunchConfiguration = LaunchConfiguration
    modules["launch.substitutions"].PathJoinSubstitution = PathJoinSubstitution
    modules["launch.launch_description_sources"].PythonLaunchDescriptionSource = PythonLaunchDescriptionSource
    modules["launch_ros.actions"].Node = Node
    modules["launch_ros.substitutions"].FindPackageShare = FindPackageShare
    modules["launch_ros.parameter_descriptions"].ParameterValue = ParameterValue
    for name, module in modules.items():
        if "." in name:
            parent, _, child = name.rpartition(".")
            setattr(modules[parent], child, module)
    return modules


@pytest.fixture()
def stand_in_launch(monkeypatch):
    for name, module in _stand_in_modules().items():
        monkeypatch.setitem(sys.modules, name, module)


def load_launch_file(path: Path):
    """Load a launch file by path, as ``ros2 launch`` does (without writing bytecode into the tree)."""
    spec = importlib.util.spec_from_file_location(f"launch_file_{path.name.split('.')[0]}", path)
    module = importlib.util.module_from_spec(spec)
    dont_write, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = dont_write
    return module


def declared(description) -> dict[str, DeclareLaunchArgument]:
    return {e.name: e for e in description.entities if isinstance(e, DeclareLaunchArgument)}


def included_file(include: IncludeLaunchDescription, context) -> str:
    return os.path.basename(resolve(include.source.location, context))


def run(path: Path, arguments: dict | None = None, environment: dict | None = None, *, follow=True,
        check_choices=True):
    """Execute a launch file: returns [(launch file name, action)] for every action it produces.

    Declared arguments get their defaults unless given; OpaqueFunctions are called; included files are
    executed in turn (``follow``) with the including file's configurations plus the include's arguments.
    """
    description = load_launch_file(path).generate_launch_description()
    context = Context({}, environment or {})
    return _execute(path.name, description, context, dict(arguments or {}), follow, check_choices)


def _execute(file_name, description, context, arguments, follow, check_choices):
    context.launch_configurations.update(arguments)
    for name, arg in declared(description).items():
        if name not in context.launch_configurations:
            assert arg.default_value is not None, f"{file_name}: argument {name} has no default"
            context.launch_configurations[name] = resolve(arg.default_value, context)
        if arg.choices is not None and check_choices:
            value = context.launch_configurations[name]
            assert value in arg.choices, f"{file_name}: {name}:={value!r} is not one of {arg.choices}"
    out = []

    def walk(entities):
        for entity in entities:
            if isinstance(entity, DeclareLaunchArgument):
                continue
            out.append((file_name, entity))
            if isinstance(entity, OpaqueFunction):
                walk(entity.function(context, *entity.args, **entity.kwargs) or [])
            elif isinstance(entity, GroupAction):
                saved = (dict(context.launch_configurations), dict(context.environment))
                walk(entity.actions)
                if entity.scoped:
                    context.launch_configurations, context.environment = map(dict, saved)
            elif isinstance(entity, IncludeLaunchDescription) and follow:
                child = included_file(entity, context)
                child_args = {resolve(k, context): str(resolve(v, context)) for k, v in entity.launch_arguments}
                child_description = load_launch_file(LAUNCH_DIR / child).generate_launch_description()
                out.extend(_execute(child, child_description, context, child_args, follow, check_choices))
            elif isinstance(entity, SetEnvironmentVariable):
                context.environment[resolve(entity.name, context)] = resolve(entity.value, context)
            elif isinstance(entity, Node):
                entity.launch_environment = dict(context.environment)  # what the node's process gets

    walk(description.entities)
    return out


def command_line_arguments(command: str) -> tuple[Path, dict[str, str]]:
    """The launch file and the arguments of a typed ``ros2 launch synflux_ros <file> ...`` command line.

    The line is split as a POSIX shell splits it; each ``name:=value`` word is then taken as ros2launch
    takes it: ``name:=`` with nothing after it is refused, the last of two values wins.
    """
    words = shlex.split(command)
    assert words[:3] == ["ros2", "launch", "synflux_ros"], command
    arguments = {}
    for word in words[4:]:
        if word.startswith("-"):
            continue
        if ":=" not in word or word.startswith(":=") or (word.count(":=") == 1 and word.endswith(":=")):
            raise RuntimeError(f"malformed launch argument '{word}', expected format '<name>:=<value>'")
        name, value = word.split(":=", 1)
        arguments[name] = value
    return LAUNCH_DIR / words[3], arguments


def run_command(command: str, environment: dict | None = None):
    """Execute the launch file of a typed command line with the arguments exactly as the shell hands them over."""
    path, arguments = command_line_arguments(command)
    return run(path, arguments, environment)


def show_args(path: Path) -> str:
    """What ``ros2 launch synflux_ros <file> --show-args`` prints: each argument, its description and default.

    A plain-text default is shown quoted; a substitution only by its kind (``PathJoin(...)``).
    """
    lines = ["Arguments (pass arguments as '<name>:=<value>'):"]
    for name, arg in declared(load_launch_file(path).generate_launch_description()).items():
        default = arg.default_value
        shown = f"'{default}'" if isinstance(default, str) else " + ".join(
            d.describe() if isinstance(d, Substitution) else f"'{d}'"
            for d in (default if isinstance(default, (list, tuple)) else [default]))
        lines += [f"    '{name}':", f"        {arg.description}", f"        (default: {shown})"]
    return "\n".join(lines)


def nodes(actions) -> dict[str, Node]:
    found = {resolve(a.executable, None): a for _, a in actions if isinstance(a, Node)}
    assert len(found) == sum(isinstance(a, Node) for _, a in actions), "two nodes of one executable"
    return found


def parameters_of(node: Node) -> tuple[list, dict]:
    """(parameter files, parameter values) of a node, values merged in order."""
    files, values = [], {}
    for item in resolve(node.parameters or [], None):
        if isinstance(item, dict):
            values.update(item)
        else:
            files.append(item)
    return files, values


@pytest.fixture()
def params_file(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"/**": {"ros__parameters": {"diagnostics_period": 2.0}}}))
    return str(path)


def common_module():
    return load_launch_file(LAUNCH_DIR / "_synflux_launch_common.py")


# ----------------------------------------------------------------------------- source checks
@pytest.mark.parametrize("path", PYTHON_LAUNCH_SOURCES, ids=lambda p: p.name)
def test_launch_sources_compile(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / "out.pyc"), doraise=True)


def test_the_launch_files_are_there():
    assert {p.name for p in LAUNCH_FILES} == {"vla.launch.py", "vlm.launch.py", "synflux.launch.py",
                                              "sim.launch.py", "planner.launch.py"}


@pytest.mark.parametrize("path", PYTHON_LAUNCH_SOURCES, ids=lambda p: p.name)
def test_no_emulate_tty(path):
    """emulate_tty=True puts ANSI colour codes into redirected logs."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    used = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.keyword) and n.arg == "emulate_tty"]
    assert not used, f"{path.name}: emulate_tty at line(s) {used}"


def _unregistered(text: str) -> set[str]:
    """Backend names given as ``executor:=NAME`` that are not registered."""
    return {m for m in re.findall(r"executor:=([A-Za-z0-9_]+)", text)} - set(EXECUTORS)


@pytest.mark.parametrize("path", PYTHON_LAUNCH_SOURCES, ids=lambda p: p.name)
def test_launch_examples_use_registered_backends(path):
    assert not _unregistered(path.read_text(encoding="utf-8")), f"{path.name} offers an unregistered backend"


def test_readme_commands_use_registered_backends():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = "\n".join(re.findall(r"```[a-z]*\n(.*?)```", readme, flags=re.S))
    assert not _unregistered(blocks), f"README commands use unregistered backends {_unregistered(blocks)}"


# Backend families that have a place in the design but no executor in the registry yet.
KNOWN_BACKEND_NAMES = {"tensorrt", "trt", "openvino", "qnn", "rknn", "cuda"}


@pytest.mark.parametrize("path", LAUNCH_FILES, ids=lambda p: p.name)
def test_executor_description_names_only_registered_backends(stand_in_launch, path):
    description = declared(load_launch_file(path).generate_launch_description())["executor"].description
    words = set(re.findall(r"[a-z0-9_-]+", description.lower()))
    assert not words & (KNOWN_BACKEND_NAMES - set(EXECUTORS)), description
    assert {"mock", "onnxruntime", "tensorrt"} <= words, description
    # tensorrt is offered with what it needs: JetPack's TensorRT, cuda-python and engines built on the device
    assert {"jetpack", "cuda-python", "--backend"} <= words and "synflux-build" in words, description


# ----------------------------------------------------------------------------- declared arguments
@pytest.mark.parametrize("path,expected", [("vla.launch.py", VLA_ARGS), ("vlm.launch.py", VLM_ARGS)])
def test_model_launch_files_declare_their_arguments(stand_in_launch, path, expected):
    args = declared(load_launch_file(LAUNCH_DIR / path).generate_launch_description())
    assert set(args) == expected
    for name, arg in args.items():
        assert arg.description and len(arg.description) > 20, f"{path}: {name} is not described"


def test_fastdds_profile_defaults_to_the_shipped_file(stand_in_launch):
    for path in LAUNCH_FILES:
        arg = declared(load_launch_file(path).generate_launch_description())["fastdds_profile"]
        assert arg.default_value == "shipped"
        assert FASTDDS in arg.description and "camera driver" in arg.description
        assert "share/synflux_ros/config/fastdds_shm.xml" in arg.description and "none =" in arg.description
        node_env = [n.launch_environment for n in nodes(run(path, environment={})).values()]
        assert node_env and all(env == {FASTDDS: str(SHIPPED_PROFILE)} for env in node_env), path.name
    cmake = (ROOT / "CMakeLists.txt").read_text(encoding="utf-8")
    assert re.search(r"install\(DIRECTORY[^)]*\bconfig\b", cmake), "config/ is not installed"
    assert SHIPPED_PROFILE.is_file()


@pytest.mark.parametrize("path", LAUNCH_FILES, ids=lambda p: p.name)
def test_show_args_prints_readable_defaults(stand_in_launch, path):
    """--show-args prints each default as the text a user would type: no substitution such as PathJoin(...)."""
    text = show_args(path)
    assert "(...)" not in text, text
    for name, arg in declared(load_launch_file(path).generate_launch_description()).items():
        assert isinstance(arg.default_value, str), f"{path.name}: {name} defaults to {arg.default_value!r}"
    assert "    'fastdds_profile':" in text and "(default: 'shipped')" in text


def test_camera_rate_hz_sets_the_vla_node_parameter(stand_in_launch):
    for command in ("ros2 launch synflux_ros vla.launch.py camera_rate_hz:=30",
                    "ros2 launch synflux_ros synflux.launch.py camera_rate_hz:=30.0"):
        found = nodes(run_command(command, environment={}))
        values = parameters_of(found["vla_node"])[1]
        assert values == {"camera_rate_hz": 30.0} and type(values["camera_rate_hz"]) is float, command
        if "vlm_node" in found:
            assert parameters_of(found["vlm_node"]) == ([], {})
    assert "camera_rate_hz" not in parameters_of(nodes(run(LAUNCH_DIR / "vla.launch.py"))["vla_node"])[1]


@pytest.mark.parametrize("text", ["fast", "30Hz", "nan", "inf"])
def test_camera_rate_hz_must_be_a_number(stand_in_launch, text):
    with pytest.raises(ValueError, match=r"camera_rate_hz:=.*expected a number"):
        run_command(f"ros2 launch synflux_ros vla.launch.py camera_rate_hz:={text}", environment={})


# ----------------------------------------------------------------------------- synflux.launch.py
def test_synflux_forwards_every_argument_it_declares(stand_in_launch):
    """Each synflux.launch.py argument reaches an included file, and each argument of vla.launch.py and
    vlm.launch.py is set from a synflux.launch.py argument (none is left to its own default)."""
    description = load_launch_file(LAUNCH_DIR / "synflux.launch.py").generate_launch_description()
    own = declared(description)
    markers = {name: f"<{name}>" for name in own}
    # A profile already in the environment is kept: the marker given as fastdds_profile is not looked up.
    actions = run(LAUNCH_DIR / "synflux.launch.py", markers, {FASTDDS: "/etc/profile.xml"}, follow=False,
                  check_choices=False)
    context = Context(markers, {})
    includes = {included_file(a, context): {resolve(k, context): resolve(v, context) for k, v in a.launch_arguments}
                for _, a in actions if isinstance(a, IncludeLaunchDescription)}
    assert set(includes) == {"vla.launch.py", "vlm.launch.py"}

    forwarded = set()
    for child, given in includes.items():
        child_args = set(declared(load_launch_file(LAUNCH_DIR / child).generate_launch_description()))
        assert set(given) == child_args, f"{child}: not set from synflux.launch.py: {child_args - set(given)}"
        for value in given.values():
            assert value in markers.values(), f"{child} gets {value!r}, not a synflux.launch.py argument"
            forwarded.add(value[1:-1])
    assert forwarded == set(own), f"declared but not forwarded: {set(own) - forwarded}"
    assert includes["vla.launch.py"]["config"] == "<vla_config>"
    assert includes["vlm.launch.py"]["config"] == "<vlm_config>"
    assert includes["vla.launch.py"]["graph_dir"] == "<vla_graph_dir>"
    assert includes["vlm.launch.py"]["graph_dir"] == "<vlm_graph_dir>"


def test_synflux_starts_both_nodes_with_their_own_arguments(stand_in_launch, params_file):
    actions = run(LAUNCH_DIR / "synflux.launch.py", {
        "vla_config": "vla_pi0.yaml", "vlm_config": "vlm_qwen3.yaml", "executor": "onnxruntime",
        "vla_graph_dir": "/graphs/pi0", "vlm_graph_dir": "/graphs/qwen3", "params_file": params_file,
        "namespace": "robot1", "log_level": "debug", "image_topic": "/cam/image_raw",
        "instruction_topic": "/task", "publish_joint_trajectory": "true", "joint_names": ",".join(JOINTS),
    })
    found = nodes(actions)
    assert set(found) == {"vla_node", "vlm_node"}
    vla_files, vla = parameters_of(found["vla_node"])
    vlm_files, vlm = parameters_of(found["vlm_node"])
    assert vla_files == vlm_files == [params_file]
    assert vla == {"config": "vla_pi0.yaml", "executor": "onnxruntime", "graph_dir": "/graphs/pi0",
                   "publish_joint_trajectory": True, "joint_names": JOINTS}
    assert vlm == {"config": "vlm_qwen3.yaml", "executor": "onnxruntime", "graph_dir": "/graphs/qwen3"}
    for node in found.values():
        assert resolve(node.namespace, None) == "robot1"
        assert resolve(node.ros_arguments, None) == ["--log-level", "debug"]
    remaps = dict(resolve(found["vla_node"].remappings, None))
    assert remaps["image"] == "/cam/image_raw" and remaps["instruction"] == "/task"


def test_synflux_shows_only_its_own_arguments(stand_in_launch):
    """`ros2 launch --show-args` also lists the arguments of included files it can see without running
    the launch: synflux.launch.py must not expose vla.launch.py's `config`, which it sets itself."""
    description = load_launch_file(LAUNCH_DIR / "synflux.launch.py").generate_launch_description()

    def visible(entities):
        for e in entities:
            if isinstance(e, IncludeLaunchDescription):
                yield e
            elif isinstance(e, GroupAction):
                yield from visible(e.actions)
    assert not list(visible(description.entities))
    assert not {"config", "graph_dir"} & set(declared(description))


# ----------------------------------------------------------------------------- planner.launch.py
PLANNER_ONLY = {"goal", "goal_topic", "planner_period", "planner_prompt", "planner_max_new_tokens"}


def test_planner_takes_synflux_s_arguments_and_the_planner_s(stand_in_launch):
    own = declared(load_launch_file(LAUNCH_DIR / "planner.launch.py").generate_launch_description())
    synflux = declared(load_launch_file(LAUNCH_DIR / "synflux.launch.py").generate_launch_description())
    assert set(own) == set(synflux) | PLANNER_ONLY
    for name in PLANNER_ONLY:
        assert own[name].description and len(own[name].description) > 20, f"{name} is not described"


def test_planner_starts_both_nodes_with_the_planner_on_by_default(stand_in_launch):
    found = nodes(run(LAUNCH_DIR / "planner.launch.py", environment={}))
    assert set(found) == {"vla_node", "vlm_node"}
    assert parameters_of(found["vla_node"]) == ([], {})
    assert parameters_of(found["vlm_node"]) == ([], {"planner_period": 2.0})
    assert dict(resolve(found["vlm_node"].remappings, None)) == {
        "image": "image", "instruction": "instruction", "goal": "goal"}
    assert dict(resolve(found["vla_node"].remappings, None)) == {
        "image": "image", "image/compressed": "image/compressed", "instruction": "instruction"}


def test_planner_hands_its_arguments_to_the_node_they_belong_to(stand_in_launch, params_file):
    actions = run(LAUNCH_DIR / "planner.launch.py", {
        "vla_config": "vla_pi0.yaml", "vlm_config": "vlm_qwen3.yaml", "executor": "onnxruntime",
        "vla_graph_dir": "/graphs/pi0", "vlm_graph_dir": "/graphs/qwen3", "params_file": params_file,
        "namespace": "robot1", "log_level": "debug", "image_topic": "/cam/image_raw", "instruction_topic": "/task",
        "goal": "true", "goal_topic": "/mission", "planner_period": "5", "planner_prompt": "Next step to {goal}?",
        "planner_max_new_tokens": "16", "default_instruction": "wait",
    }, environment={})
    found = nodes(actions)
    vla_files, vla = parameters_of(found["vla_node"])
    vlm_files, vlm = parameters_of(found["vlm_node"])
    assert vla_files == vlm_files == [params_file]
    assert vla == {"config": "vla_pi0.yaml", "executor": "onnxruntime", "graph_dir": "/graphs/pi0",
                   "default_instruction": "wait"}
    assert vlm == {"config": "vlm_qwen3.yaml", "executor": "onnxruntime", "graph_dir": "/graphs/qwen3",
                   "planner_period": 5.0, "planner_goal": "true", "planner_prompt": "Next step to {goal}?",
                   "planner_max_new_tokens": 16}
    assert type(vlm["planner_period"]) is float and type(vlm["planner_max_new_tokens"]) is int
    assert isinstance(vlm["planner_goal"], str)
    for node in found.values():
        assert resolve(node.namespace, None) == "robot1"
        assert resolve(node.ros_arguments, None) == ["--log-level", "debug"]
    # the planner reads the VLA's camera and writes the VLA's instruction topic
    assert dict(resolve(found["vlm_node"].remappings, None)) == {
        "image": "/cam/image_raw", "instruction": "/task", "goal": "/mission"}
    remaps = dict(resolve(found["vla_node"].remappings, None))
    assert remaps["image"] == "/cam/image_raw" and remaps["instruction"] == "/task"


@pytest.mark.parametrize("argument,text,needle", [
    ("planner_period", "soon", "expected a number"),
    ("planner_period", "nan", "expected a number"),
    ("planner_max_new_tokens", "many", "expected an integer"),
    ("planner_max_new_tokens", "1.5", "expected an integer"),
])
def test_planner_numbers_are_checked_at_launch(stand_in_launch, argument, text, needle):
    with pytest.raises(ValueError, match=rf"{argument}:=.*{needle}"):
        run(LAUNCH_DIR / "planner.launch.py", {argument: text}, environment={})


def test_planner_off_starts_the_pair_without_it(stand_in_launch):
    found = nodes(run_command("ros2 launch synflux_ros planner.launch.py planner_period:=0", environment={}))
    assert parameters_of(found["vlm_node"])[1] == {"planner_period": 0.0}


# ----------------------------------------------------------------------------- node actions
def test_vla_defaults_set_no_parameters(stand_in_launch):
    actions = run(LAUNCH_DIR / "vla.launch.py")
    node = nodes(actions)["vla_node"]
    assert parameters_of(node) == ([], {})
    assert node.extra.get("output") == "screen" and not node.extra.get("emulate_tty")
    assert resolve(node.package, None) == "synflux_ros" and resolve(node.name, None) == "vla_node"
    assert dict(resolve(node.remappings, None)) == {
        "image": "image", "image/compressed": "image/compressed", "instruction": "instruction"}


def test_vla_joint_trajectory_arguments(stand_in_launch, params_file):
    actions = run(LAUNCH_DIR / "vla.launch.py", {
        "executor": "mock", "publish_joint_trajectory": "true", "joint_names": "[" + ", ".join(JOINTS) + "]",
        "params_file": params_file, "image_topic": "/camera/color/image_raw", "default_instruction": "true",
    })
    files, values = parameters_of(nodes(actions)["vla_node"])
    assert files == [params_file]
    assert values == {"executor": "mock", "publish_joint_trajectory": True, "joint_names": JOINTS,
                      "default_instruction": "true"}
    assert isinstance(values["default_instruction"], str)
    remaps = dict(resolve(nodes(actions)["vla_node"].remappings, None))
    assert remaps["image"] == "/camera/color/image_raw"
    assert remaps["image/compressed"] == "/camera/color/image_raw/compressed"


@pytest.mark.parametrize("text,names", [
    ("[a, b, c]", ["a", "b", "c"]),
    ("['a', \"b\"]", ["a", "b"]),
    ("a,b,c", ["a", "b", "c"]),
    ("a b  c", ["a", "b", "c"]),
    (" [ a ,b ] ", ["a", "b"]),
    ("", []),
    ("[]", []),
])
def test_joint_names_forms(text, names):
    assert common_module().parse_joint_names(text) == names


@pytest.mark.parametrize("text", ["[a, b", "a]b", "[a, [b]]"])
def test_joint_names_malformed(text):
    with pytest.raises(ValueError, match="joint_names"):
        common_module().parse_joint_names(text)


def test_bad_boolean_is_refused_by_its_choices(stand_in_launch):
    with pytest.raises(AssertionError, match="publish_joint_trajectory"):
        run(LAUNCH_DIR / "vla.launch.py", {"publish_joint_trajectory": "yes"})


def test_missing_params_file_fails_at_launch(stand_in_launch, tmp_path):
    with pytest.raises(FileNotFoundError, match="params_file"):
        run(LAUNCH_DIR / "vlm.launch.py", {"params_file": str(tmp_path / "none.yaml")})


# ----------------------------------------------------------------------------- Fast DDS profile
def _environment_sets(actions):
    return [(resolve(a.name, None), resolve(a.value, None)) for _, a in actions
            if isinstance(a, SetEnvironmentVariable)]


@pytest.mark.parametrize("path", ["vla.launch.py", "vlm.launch.py"])
def test_shipped_profile_is_applied_before_the_node(stand_in_launch, path):
    actions = run(LAUNCH_DIR / path, environment={})
    assert _environment_sets(actions) == [(FASTDDS, str(SHIPPED_PROFILE))]
    kinds = [type(a).__name__ for _, a in actions]
    assert kinds.index("SetEnvironmentVariable") < kinds.index("Node")


def _prefix_with_rmw(root: Path, version: str) -> str:
    share = root / "share" / "rmw_fastrtps_cpp"
    share.mkdir(parents=True)
    (share / "package.xml").write_text(f"<package><name>rmw_fastrtps_cpp</name><version>{version}</version></package>")
    return str(root)


@pytest.mark.parametrize("rmw,variable", [("6.2.7", FASTRTPS_PROFILE_VARIABLE), ("8.4.3", FASTRTPS_PROFILE_VARIABLE),
                                          ("9.3.3", FASTDDS_PROFILE_VARIABLE)])
def test_the_profile_goes_under_the_variable_the_installed_fast_dds_reads(stand_in_launch, tmp_path, rmw, variable):
    """Fast DDS 2.x (rmw_fastrtps 6 in Humble, 8 in Jazzy) ignores FASTDDS_DEFAULT_PROFILES_FILE without a word;
    Fast DDS 3 (rmw_fastrtps 9, Kilted) reads only that one."""
    actions = run(LAUNCH_DIR / "vla.launch.py", environment={"AMENT_PREFIX_PATH": _prefix_with_rmw(tmp_path, rmw)})
    assert _environment_sets(actions) == [(variable, str(SHIPPED_PROFILE))]


@pytest.mark.parametrize("variable", [FASTDDS_PROFILE_VARIABLE, FASTRTPS_PROFILE_VARIABLE])
def test_profile_in_the_environment_is_kept(stand_in_launch, variable):
    actions = run(LAUNCH_DIR / "vla.launch.py", environment={variable: "/etc/my_profile.xml"})
    assert _environment_sets(actions) == []


def _profile_log_lines(actions):
    return [resolve(a.msg, None) for _, a in actions if isinstance(a, LogInfo) and FASTDDS in resolve(a.msg, None)]


def test_an_empty_profile_cannot_be_typed():
    with pytest.raises(RuntimeError, match="malformed launch argument 'fastdds_profile:='"):
        command_line_arguments("ros2 launch synflux_ros vla.launch.py fastdds_profile:=")


@pytest.mark.parametrize("typed,delivered", [
    ("fastdds_profile:=none", "none"),
    ("fastdds_profile:=None", "None"),
    ("fastdds_profile:=\"''\"", "''"),
    ("fastdds_profile:='\"\"'", '""'),
    ("fastdds_profile:=\\'\\'", "''"),
    ("fastdds_profile:=''", ""),  # the shell makes this fastdds_profile:=, which ros2 launch refuses
])
@pytest.mark.parametrize("file", ["vla.launch.py", "vlm.launch.py", "synflux.launch.py", "planner.launch.py"])
def test_typed_none_leaves_the_environment(stand_in_launch, file, typed, delivered):
    command = f"ros2 launch synflux_ros {file} {typed}"
    if delivered == "":
        with pytest.raises(RuntimeError, match="malformed"):
            command_line_arguments(command)
        return
    assert command_line_arguments(command)[1] == {"fastdds_profile": delivered}
    user = {"ROS_DOMAIN_ID": "7"}
    actions = run_command(command, environment=user)
    assert _environment_sets(actions) == [] and _profile_log_lines(actions) == []
    found = nodes(actions)
    both = file in ("synflux.launch.py", "planner.launch.py")
    assert set(found) == ({"vla_node", "vlm_node"} if both else {file.split(".")[0] + "_node"})
    assert all(n.launch_environment == user for n in found.values())


@pytest.mark.parametrize("file", ["vla.launch.py", "synflux.launch.py"])
def test_typed_profile_path_reaches_the_nodes(stand_in_launch, tmp_path, file):
    profile = tmp_path / "my profiles" / "fast dds.xml"
    profile.parent.mkdir()
    profile.write_text(SHIPPED_PROFILE.read_text())
    for typed in (f"fastdds_profile:={shlex.quote(str(profile))}", f'fastdds_profile:="{profile}"',
                  f"'fastdds_profile:={profile}'"):
        actions = run_command(f"ros2 launch synflux_ros {file} {typed}", environment={})
        assert _environment_sets(actions) == [(FASTDDS, str(profile))], typed
        assert all(n.launch_environment[FASTDDS] == str(profile) for n in nodes(actions).values())
    actions = run_command(f"ros2 launch synflux_ros {file} fastdds_profile:=shipped", environment={})
    assert _environment_sets(actions) == [(FASTDDS, str(SHIPPED_PROFILE))]


def test_synflux_applies_the_profile_once_for_both_nodes(stand_in_launch):
    actions = run_command("ros2 launch synflux_ros synflux.launch.py", environment={})
    assert [f for f, a in actions if isinstance(a, SetEnvironmentVariable)] == ["synflux.launch.py"]
    assert _profile_log_lines(actions) == [f"{FASTDDS}={SHIPPED_PROFILE} (fastdds_profile)"]
    kinds = [type(a).__name__ for _, a in actions]
    assert kinds.index("SetEnvironmentVariable") < kinds.index("Node")
    found = nodes(actions)
    assert set(found) == {"vla_node", "vlm_node"}
    assert all(n.launch_environment == {FASTDDS: str(SHIPPED_PROFILE)} for n in found.values())


@pytest.mark.parametrize("file", ["vla.launch.py", "synflux.launch.py"])
def test_missing_profile_fails_at_launch(stand_in_launch, tmp_path, file):
    with pytest.raises(FileNotFoundError, match="fastdds_profile.*none leaves the environment"):
        run_command(f"ros2 launch synflux_ros {file} fastdds_profile:={tmp_path / 'none.xml'}", environment={})


# ----------------------------------------------------------------------------- README
def test_readme_lists_every_launch_argument(stand_in_launch):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Launch arguments", 1)[-1].split("\n## ", 1)[0]
    for path in LAUNCH_FILES:
        missing = [n for n in declared(load_launch_file(path).generate_launch_description())
                   if f"`{n}`" not in section]
        assert not missing, f"README's launch-argument table does not name {missing} of {path.name}"


# ----------------------------------------------------------------------------- test registration
def test_cmake_registers_every_launch_test_isolated():
    cmake = (ROOT / "CMakeLists.txt").read_text(encoding="utf-8")
    testing = cmake.split("if(BUILD_TESTING)", 1)[1]
    for path in sorted((ROOT / "test" / "launch").glob("test_*.py")):
        assert re.search(rf"add_ros_isolated_launch_test\(\s*test/launch/{re.escape(path.name)}\b", testing), \
            f"{path.name} is not registered as an isolated launch test"
    assert re.search(r"add_launch_test\([^)]*RUNNER\s+\"\$\{ament_cmake_ros_DIR\}/run_test_isolated\.py\"",
                     testing)
    for directory in ("unit", "integration"):
        assert re.search(rf"ament_add_ros_isolated_pytest_test\(\s*{directory}\s+test/{directory}\b", testing)
    assert not re.search(r"^\s*ament_add_pytest_test\(", testing, flags=re.M), "a pytest run without isolation"
    assert "find_package(ament_cmake_ros REQUIRED)" in testing


# ----------------------------------------------------------------------------- package.xml
def _manifest():
    root = ET.parse(ROOT / "package.xml").getroot()
    return {tag: [e for e in root.findall(tag)] for tag in (
        "depend", "exec_depend", "test_depend", "build_depend", "buildtool_depend")}


def _module_of(key: str) -> str:
    """The Python module a rosdep key or ROS package provides."""
    if key.startswith("python3-"):
        return {"yaml": "yaml", "pil": "PIL"}.get(key[len("python3-"):], key[len("python3-"):].replace("-", "_"))
    return key


def _imports(paths, module_level=False) -> set[str]:
    """Top-level names of the modules ``paths`` import (only their module-level imports if asked)."""
    found = set()
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in (tree.body if module_level else ast.walk(tree)):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found


def _optional(paths) -> set[str]:
    """Modules the tests import through pytest.importorskip (they skip without them)."""
    found = set()
    for path in paths:
        found.update(m.split(".")[0] for m in re.findall(r"importorskip\(\s*['\"]([\w.]+)", path.read_text()))
    return found


TEST_SOURCES = sorted((ROOT / "test").rglob("*.py"))
LOCAL_TEST_MODULES = {p.stem for p in TEST_SOURCES}


def test_every_test_depend_is_used():
    cmake = (ROOT / "CMakeLists.txt").read_text(encoding="utf-8")
    used = _imports(TEST_SOURCES) | set(re.findall(r"find_package\((\w+)", cmake.split("if(BUILD_TESTING)", 1)[1]))
    unused = [e.text for e in _manifest()["test_depend"] if _module_of(e.text) not in used]
    assert not unused, f"test_depend entries nothing in test/ or the test CMake uses: {unused}"


def test_pytest_is_pinned_below_9():
    pytest_dep = [e for e in _manifest()["test_depend"] if e.text == "python3-pytest"]
    assert pytest_dep and pytest_dep[0].get("version_lt") == "9"
    requirements = (ROOT / "requirements-ros.txt").read_text(encoding="utf-8").split()
    assert "pytest<9" in requirements


def test_what_tests_and_nodes_import_is_declared():
    manifest = _manifest()
    declared_modules = {_module_of(e.text) for tag in ("depend", "exec_depend", "test_depend")
                        for e in manifest[tag]}
    stdlib = set(sys.stdlib_module_names)
    # Imports inside test functions are the optional build-time ones (torch, safetensors, ...).
    test_needs = (_imports(TEST_SOURCES, module_level=True) - stdlib - _optional(TEST_SOURCES)
                  - LOCAL_TEST_MODULES - {"synflux_ros"})
    assert not test_needs - declared_modules, f"tests import undeclared {sorted(test_needs - declared_modules)}"
    node_sources = sorted((ROOT / "synflux_ros" / "nodes").glob("*.py"))
    node_needs = _imports(node_sources) - stdlib - {"synflux_ros"}
    assert not node_needs - declared_modules, f"nodes import undeclared {sorted(node_needs - declared_modules)}"


# ----------------------------------------------------------------------------- with ROS 2's launch
def test_with_the_real_launch_api():
    if importlib.util.find_spec("launch") is None or importlib.util.find_spec("launch_ros") is None:
        pytest.skip("launch/launch_ros are not installed; the launch tests run on a full ROS 2 install "
                    "(colcon test)")
    from launch import LaunchContext
    from launch.actions import DeclareLaunchArgument as RealDeclare, OpaqueFunction as RealOpaque
    from launch.utilities import perform_substitutions
    from launch_ros.actions import Node as RealNode

    common = common_module()
    expected = {"vla.launch.py": [a.name for a in common.VLA_ARGUMENTS],
                "vlm.launch.py": [a.name for a in common.VLM_ARGUMENTS],
                "synflux.launch.py": [a.name for a in common.SYNFLUX_ARGUMENTS],
                "planner.launch.py": [a.name for a in common.PLANNER_ARGUMENTS],
                "sim.launch.py": [a.name for a in load_launch_file(LAUNCH_DIR / "sim.launch.py").SIM_ARGUMENTS]}
    for path in LAUNCH_FILES:
        description = load_launch_file(path).generate_launch_description()
        assert [a.name for a in description.get_launch_arguments()] == expected[path.name], path.name
        context = LaunchContext()
        for entity in description.entities:
            if isinstance(entity, RealDeclare):
                context.launch_configurations[entity.name] = perform_substitutions(context, entity.default_value)
        produced = []
        for entity in description.entities:
            if isinstance(entity, RealOpaque):
                produced += entity.execute(context) or []
        if path.name == "synflux.launch.py":
            assert len(produced) == 2
        elif path.name in ("sim.launch.py", "planner.launch.py"):
            assert sum(isinstance(a, RealNode) for a in produced) == 2, path.name
        else:
            assert sum(isinstance(a, RealNode) for a in produced) == 1, path.name
