"""The package's rooms and the direction of their imports (README "Architecture").

Every module of ``synflux_ros`` is parsed (imports inside functions count too) and each import is
checked against the room it lives in: imports point down, rclpy and the ROS message packages appear
only in ``nodes/``, and nothing a robot runs imports torch, the other build/benchmark libraries or the
build-time rooms (a backend's build step excepted: it runs in synflux-build).
"""
from __future__ import annotations

import ast
import importlib.util
import os

import pytest

import synflux_ros

# ROOMS, ROS_ROOMS and RUN_TIME_ROOMS stay literals: docs/gen_architecture.py reads them (without importing this
# file) to write the rooms of docs/architecture.md.
ROOMS = {
    # room: rooms it may import (besides itself)
    "core": set(),
    "graphset": {"core"},
    "model": {"core"},
    "graphkit": {"core", "graphset", "model"},
    "backends": {"core", "graphset", "graphkit"},
    "runtimes": {"core", "graphset", "backends", "model"},
    "execution": {"core", "model"},
    "sim": {"core"},
    "nodes": {"core", "model", "runtimes", "execution", "sim", "msg", "srv"},
    "buildtool": {"core", "graphset", "graphkit", "backends", "model", "runtimes"},
    "serve": {"core", "graphset", "backends", "model", "runtimes"},
    "tools": {"core", "graphset", "graphkit", "backends", "model", "runtimes", "execution", "sim", "buildtool",
              "serve", "nodes", "msg", "srv"},
    "bench": {"core", "graphset", "graphkit", "backends", "model", "runtimes", "execution", "buildtool", "serve",
              "nodes", "tools", "msg", "srv"},
}
BUILD_TIME_ROOMS = {"graphkit", "buildtool"}
"""Rooms that need torch: run-time code imports them no more than it imports torch."""
ROS_PACKAGES = {"rclpy", "rcl_interfaces", "sensor_msgs", "std_msgs", "std_srvs", "trajectory_msgs",
                "diagnostic_msgs", "lifecycle_msgs", "builtin_interfaces", "ament_index_python", "rosgraph_msgs"}
ROS_ROOMS = {"nodes", "tools"}  # tools/ drives nodes over DDS (demo, test harness); a robot runs nodes/ only
BUILD_TIME = {"torch", "transformers", "safetensors", "onnxruntime_genai", "accelerate", "gguf"}
RUN_TIME_ROOMS = {"core", "graphset", "backends", "model", "runtimes", "execution", "sim", "nodes", "serve"}


def is_backend_build_step(module: str) -> bool:
    """Whether ``module`` is a backend folder's build step (backends/<name>/build*.py, compile.py): it runs in
    synflux-build, so it may import torch and graphkit; every other file of a backend is run-time."""
    parts = module.split(".")
    return len(parts) == 4 and parts[1] == "backends" and (parts[3].startswith("build") or parts[3] == "compile")


def module_imports(path: str, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a source file."""
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.level and not node.module:  # from . import x: x may be a module
                out += [(node.lineno, f"{target}.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, target))
    return out


def violations(path: str, module: str) -> list[str]:
    parts = module.split(".")
    room = parts[1] if len(parts) > 1 and not path.endswith(os.sep + "synflux_ros" + os.sep + "__init__.py") \
        else ""
    if room and room not in ROOMS:
        return [f"{module}: room {room!r} is not in the architecture (add it to ROOMS, then run "
                f"python docs/gen_architecture.py)"]
    found = []
    for line, name in module_imports(path, module):
        top = name.split(".")[0]
        where = f"{os.path.relpath(path, os.path.dirname(PACKAGE_DIR))}:{line}"
        if top == "synflux_ros":
            target = name.split(".")[1] if "." in name else ""
            if target.startswith("__"):  # synflux_ros.__version__: the package's own metadata
                continue
            if target and target != room and target not in ROOMS.get(room, set()):
                found.append(f"{where}: {room or 'synflux_ros'} imports {name} (upward or sideways)")
            elif target in BUILD_TIME_ROOMS and room in RUN_TIME_ROOMS and not is_backend_build_step(module):
                found.append(f"{where}: run-time code imports {name}")
        elif top in ROS_PACKAGES and room not in ROS_ROOMS:
            found.append(f"{where}: {name} imported outside nodes/")
        elif top in BUILD_TIME and room in RUN_TIME_ROOMS and not is_backend_build_step(module):
            found.append(f"{where}: run-time code imports {name}")
    return found


PACKAGE_DIR = os.path.dirname(synflux_ros.__file__)


def package_modules():
    for root, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "msg", "srv")]
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))[:-3].replace(os.sep, ".")
                yield path, rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def test_every_import_points_down():
    modules = list(package_modules())
    assert len(modules) > 30
    assert {m.split(".")[1] for _, m in modules if m.count(".")} == set(ROOMS)
    problems = [v for path, module in modules for v in violations(path, module)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("room,source,needle", [
    ("core", "from ..runtimes.vla import VLARuntime\n", "upward"),
    ("model", "def f():\n    from ..backends.mock.executor import MockExecutor\n", "upward"),
    ("core", "from ..graphset.reader import read_manifest\n", "upward"),
    ("graphset", "from ..backends import build_executor\n", "upward"),
    ("backends.tensorrt", "from ...buildtool.export import build\n", "upward"),
    ("backends.tensorrt", "from ...graphkit.builder import BuildError\n", "run-time code imports"),
    ("graphkit", "from ..backends import build_executor\n", "upward"),
    ("graphkit.torch_models", "from ...buildtool.export import OPSET\n", "upward"),
    ("serve", "from ..graphkit.feeds import seeded_feeds\n", "sideways"),
    ("backends.tensorrt", "import torch\n", "run-time code imports torch"),
    ("bench", "import torch\nfrom ..graphset import reader\nfrom ..tools.harness import ros_env\n"
              "from ..nodes.vla_node import main\nimport rclpy\n", "outside nodes/"),
    ("runtimes", "import rclpy\n", "outside nodes/"),
    ("backends", "from sensor_msgs.msg import Image\n", "outside nodes/"),
    ("runtimes", "import torch\n", "run-time code imports torch"),
    ("execution", "from ..runtimes.vla import VLARuntime\n", "sideways"),
    ("execution", "import rclpy\n", "outside nodes/"),
    ("nodes", "from ..buildtool.export import build\n", "upward"),
    ("nodes", "from ..tools.harness import config_path\n", "upward"),
    ("buildtool", "from ..nodes import vla_node\n", "upward"),
    ("backends", "from ..buildtool import check\n", "upward"),
])
def test_the_check_catches_a_wrong_import(tmp_path, room, source, needle):
    path = tmp_path / "mod.py"
    path.write_text(source)
    found = violations(str(path), f"synflux_ros.{room}.mod")
    assert len(found) == 1 and needle in found[0], found


def test_allowed_imports_pass(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text("import numpy\nfrom ..core.executor import Executor\nfrom . import sibling\n"
                    "from ..model.backbone import LLMBackbone\n")
    assert violations(str(path), "synflux_ros.runtimes.mod") == []


def test_a_backend_build_step_may_use_graphkit_and_torch(tmp_path):
    path = tmp_path / "build_onnx.py"
    path.write_text("import torch\nfrom ...graphkit.builder import BuildError\nfrom .plan import SPAN_INPUT\n"
                    "from ...graphset import writer\n")
    assert violations(str(path), "synflux_ros.backends.tensorrt.build_onnx") == []
    assert len(violations(str(path), "synflux_ros.backends.tensorrt.executor")) == 2  # torch and graphkit


def test_a_backend_build_step_may_not_import_the_build_command(tmp_path):
    """The build command (synflux-build, synflux-validate) chooses backends from the registry: a build step that
    imported it would close a loop, so the direction rule holds for build steps too."""
    path = tmp_path / "build.py"
    path.write_text("from ...buildtool.validate import seeded_feeds\n")
    found = violations(str(path), "synflux_ros.backends.rknn.build")
    assert len(found) == 1 and "upward" in found[0], found


def test_tools_may_drive_nodes_over_ros(tmp_path):
    path = tmp_path / "harness.py"
    path.write_text("import rclpy\nfrom sensor_msgs.msg import Image\nfrom ..nodes.params import PACKAGE\n")
    assert violations(str(path), "synflux_ros.tools.harness") == []


def test_the_architecture_page_is_written_from_these_rooms():
    """docs/gen_architecture.py reads this file's literals, without importing it, for docs/architecture.md."""
    path = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "docs", "gen_architecture.py")
    spec = importlib.util.spec_from_file_location("gen_architecture", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    rules = gen.layer_rules(__file__)
    assert (rules["ROOMS"], rules["ROS_ROOMS"], rules["RUN_TIME_ROOMS"]) == (ROOMS, ROS_ROOMS, RUN_TIME_ROOMS)
    assert [line.split("|")[1].strip() for line in gen.rooms_block(rules) if line.startswith("| `")] == \
        [f"`{room}/`" for room in ROOMS]
