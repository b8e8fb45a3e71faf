"""A backend added without touching synflux_ros: the toy backend in test/plugins registers its executor and
its build step through entry points (``synflux_ros.executors``, ``synflux_ros.builders``); synflux-build
--backend toy runs its step with its own flag, and vla_node with ``executor:=toy`` loads what it built."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ros_clients import Harness
from synflux_ros.tools.harness import config_path, executable, rgb_image

PLUGINS = str(Path(__file__).resolve().parents[1] / "plugins")


def plugin_env(base: dict | None = None) -> dict:
    env = dict(base if base is not None else os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PLUGINS, env.get("PYTHONPATH", "")) if p)
    return env


def synflux_build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, executable("synflux-build"), *args], capture_output=True, text=True,
                          env=plugin_env(), timeout=600)


@pytest.fixture(scope="module")
def toy_set(tmp_path_factory):
    # the toy step runs after synflux-build's ONNX export, which needs torch (absent from the torch-free lane)
    pytest.importorskip("torch", reason="synflux-build needs torch (make test installs it)")
    out = tmp_path_factory.mktemp("toy") / "graphs"
    res = synflux_build("--config", config_path("vla_demo_orin.yaml"), "--out", str(out), "--backend", "toy",
                        "--toy-level", "3")
    assert res.returncode == 0, res.stderr + res.stdout
    return out, res


def test_synflux_build_runs_the_plugins_build_step_with_its_flag(toy_set):
    out, res = toy_set
    marker = json.loads((out / "toy.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert marker["level"] == 3 and marker["graphs"] == [g["name"] for g in manifest["graphs"]]
    assert manifest["backend"] == "toy" and "toy.json written (level 3)" in res.stdout
    helped = synflux_build("--help")
    assert helped.returncode == 0 and "--backend toy" in helped.stdout and "--toy-level" in helped.stdout


def test_a_plugins_flag_with_another_backend_is_refused(tmp_path):
    res = synflux_build("--config", config_path("vla_demo_orin.yaml"), "--out", str(tmp_path / "x"),
                        "--toy-level", "2")
    assert res.returncode == 2 and "--toy-level is for --backend toy, not 'onnxruntime'" in res.stderr
    assert not (tmp_path / "x").exists()  # refused before anything was exported


def test_quantized_weights_go_only_to_a_backend_whose_step_takes_them(tmp_path):
    res = synflux_build("--config", config_path("vla_demo_orin.yaml"), "--out", str(tmp_path / "q"),
                        "--backend", "toy", "--weights", "int8")
    assert res.returncode == 2 and "--weights int8: --backend 'toy' compiles float32 graph sets only" in res.stderr
    assert not (tmp_path / "q").exists()  # refused before anything was exported


def test_without_the_plugin_the_name_is_unknown(tmp_path):
    res = subprocess.run([sys.executable, executable("synflux-build"), "--config", config_path("vla_demo_orin.yaml"),
                          "--out", str(tmp_path / "y"), "--backend", "toy"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2 and "no graph builder for backend 'toy'" in res.stderr


def test_vla_node_runs_on_the_plugin_executor(toy_set, ros_env, start_node, client):
    out, _ = toy_set
    p = start_node("vla_node", {"config": str(out / "config.yaml"), "executor": "toy", "graph_dir": str(out),
                                "diagnostics_period": 0.2}, namespace="/toy", env=plugin_env(ros_env))
    h = Harness(client, "/toy")
    h.wait_connected()
    h.publish_until_chunks(2, lambda s, t: rgb_image(448, 448, s, t))
    assert h.chunks and all(c.horizon == 16 for c in h.chunks[-2:])
    h.diag_where(lambda d: d.get("backend") == "toy")
    assert p.alive()


def test_vla_node_refuses_a_set_the_plugin_did_not_build(demo_graphs, ros_env, start_node):
    p = start_node("vla_node", {"config": str(demo_graphs["vla_demo_orin"] / "config.yaml"), "executor": "toy",
                                "graph_dir": str(demo_graphs["vla_demo_orin"])}, namespace="/toy_refused",
                   env=plugin_env(ros_env))
    assert p.proc.wait(60) == 1, p.output()[-3000:]  # a node whose model cannot load exits at start-up
    assert "toy.json not found (build with synflux-build --backend toy)" in p.output()
