"""What a robot installs is enough: every node and entry point imports, and the nodes serve, with only the base
requirements importable (requirements-ros.txt and what it requires; test/base_only.py refuses the rest, as a venv
made from requirements-ros.txt alone would)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from synflux_ros.tools.harness import rgb_image

from ros_clients import ChatClient, Harness, ok  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BASE_ONLY = str(ROOT / "test" / "base_only.py")
ENTRY_POINTS = sorted(p for p in (ROOT / "scripts").iterdir() if p.is_file() and "from synflux_ros" in p.read_text())


def entry_module(script: Path) -> str:
    return re.search(r"^from (synflux_ros[\w.]*) import main", script.read_text(), re.M).group(1)


@pytest.mark.parametrize("script", ENTRY_POINTS, ids=lambda p: p.name)
def test_every_entry_point_imports_with_the_base_requirements(tmp_path, script):
    probe = tmp_path / "probe.py"
    probe.write_text(f"import importlib\nimportlib.import_module({entry_module(script)!r})\nprint('imported')\n")
    out = subprocess.run([sys.executable, BASE_ONLY, str(probe)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "imported" in out.stdout, out.stderr[-3000:]


def test_the_base_requirements_leave_out_the_build_and_serving_stacks(tmp_path):
    """The stand-in refuses what requirements-ros.txt does not bring: without it the tests above prove nothing."""
    probe = tmp_path / "probe.py"
    probe.write_text("for name in ('torch', 'onnxruntime', 'transformers', 'ray', 'mujoco', 'numpy', 'rclpy'):\n"
                     "    try:\n"
                     "        __import__(name)\n"
                     "        print(name, 'imported')\n"
                     "    except ModuleNotFoundError:\n"
                     "        print(name, 'refused')\n")
    out = subprocess.run([sys.executable, BASE_ONLY, str(probe)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    said = dict(line.split() for line in out.stdout.splitlines())
    assert said == {"torch": "refused", "onnxruntime": "refused", "transformers": "refused", "ray": "refused",
                    "mujoco": "refused", "numpy": "imported", "rclpy": "imported"}


def test_the_nodes_serve_with_the_base_requirements(start_node, client):
    vla = start_node("vla_node", {"config": "vla_demo_orin.yaml", "executor": "mock"}, namespace="/base_vla",
                     launcher=(BASE_ONLY,))
    vlm = start_node("vlm_node", {"config": "vlm_demo.yaml", "executor": "mock"}, namespace="/base_vlm",
                     launcher=(BASE_ONLY,))
    h = Harness(client, "/base_vla")
    h.wait_connected(timeout=60.0)
    h.publish_until_chunks(2, lambda s, t: rgb_image(448, 448, s, t))
    assert all(np.all(np.isfinite(c.actions)) for c in h.chunks)
    assert ok(ChatClient(client, "/base_vlm").chat("s", "Describe the scene.")).reply
    for p in (vla, vlm):
        assert "base_only: only the base requirements" in p.output()
