"""The Fast DDS profile reaches Fast DDS: the variable the harness and the launch files set is the one the installed
Fast DDS reads (FASTRTPS_DEFAULT_PROFILES_FILE on Fast DDS 2.x, Humble and Jazzy; FASTDDS_DEFAULT_PROFILES_FILE on
Fast DDS 3), shown with a broken XML file, which Fast DDS reports only when it reads the file."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from synflux_ros.nodes import ros_compat
from synflux_ros.tools import harness

NODE = ("import rclpy\n"
        "rclpy.init()\n"
        "node = rclpy.create_node('profile_probe')\n"
        "node.destroy_node()\n"
        "rclpy.shutdown()\n"
        "print('node created')\n")
PARSE_ERROR = "XMLPARSER Error"
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Fast DDS colours its log lines


def _run_with(env: dict) -> str:
    out = subprocess.run([sys.executable, "-c", NODE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "node created" in out.stdout, out.stdout + out.stderr
    return ANSI.sub("", out.stdout + out.stderr)


@pytest.fixture()
def bare_env(tmp_path):
    """The node environment of the tests with no profile variable set."""
    env = {k: v for k, v in harness.ros_env(log_dir=str(tmp_path / "log")).items()
           if k not in ros_compat.PROFILE_VARIABLES}
    broken = tmp_path / "broken.xml"
    broken.write_text("<?xml version='1.0'?><profiles><participant profile_name='x'")
    return env, str(broken)


def test_the_harness_sets_the_shipped_profile_under_the_variable_fast_dds_reads(tmp_path):
    env = harness.ros_env(log_dir=str(tmp_path / "log"))
    chosen = ros_compat.fastdds_profile_variables(env)
    assert all(env[v] == harness.config_path("fastdds_shm.xml") for v in chosen)
    assert PARSE_ERROR not in _run_with(env)  # the shipped profile parses


def test_a_broken_profile_under_the_chosen_variable_is_reported(bare_env):
    env, broken = bare_env
    ros_compat.set_fastdds_profile(env, broken)
    assert PARSE_ERROR in _run_with(env)


def test_the_other_variable_is_not_read_by_the_installed_fast_dds(bare_env):
    """Why the choice matters: the variable of the other Fast DDS major version is ignored without a word."""
    env, broken = bare_env
    chosen = ros_compat.fastdds_profile_variables(env)
    if len(chosen) != 1:
        pytest.skip("the installed Fast DDS version could not be told (both variables are set)")
    other = next(v for v in ros_compat.PROFILE_VARIABLES if v not in chosen)
    env[other] = broken
    assert PARSE_ERROR not in _run_with(env)
