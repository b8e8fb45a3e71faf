"""Which distribution's names the environment half of ros_compat picks, from installed package.xml versions."""
from __future__ import annotations

from pathlib import Path

import pytest

from synflux_ros.nodes import ros_compat


def prefix(root: Path, **versions) -> str:
    for package, version in versions.items():
        share = root / "share" / package
        share.mkdir(parents=True)
        (share / "package.xml").write_text(f"<package format='3'>\n  <name>{package}</name>\n"
                                           f"  <version>{version}</version>\n</package>\n")
    return str(root)


@pytest.mark.parametrize("rclpy,rmw,distro,profile,discovery", [
    ("3.3.15", "6.2.7", "humble", ("FASTRTPS_DEFAULT_PROFILES_FILE",), {"ROS_LOCALHOST_ONLY": "1"}),
    ("7.1.5", "8.4.3", "jazzy", ("FASTRTPS_DEFAULT_PROFILES_FILE",),
     {"ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}),
    ("9.1.2", "9.3.3", "kilted", ("FASTDDS_DEFAULT_PROFILES_FILE",), {"ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}),
])
def test_each_distribution_gets_its_own_names(tmp_path, rclpy, rmw, distro, profile, discovery):
    env = {"AMENT_PREFIX_PATH": prefix(tmp_path, rclpy=rclpy, rmw_fastrtps_cpp=rmw)}
    assert ros_compat.ros_distro(env) == distro
    assert ros_compat.fastdds_profile_variables(env) == profile
    assert ros_compat.localhost_only_env(env) == discovery


def test_ros_distro_from_the_setup_script_wins(tmp_path):
    env = {"AMENT_PREFIX_PATH": prefix(tmp_path, rclpy="7.1.5"), "ROS_DISTRO": "humble"}
    assert ros_compat.ros_distro(env) == "humble"
    assert ros_compat.localhost_only_env(env) == {"ROS_LOCALHOST_ONLY": "1"}


def test_unknown_versions_set_both_names(tmp_path, monkeypatch):
    monkeypatch.setattr(ros_compat.sys, "prefix", str(tmp_path / "nothing"))
    env = {"AMENT_PREFIX_PATH": str(tmp_path / "empty")}
    assert ros_compat.ros_distro(env) is None and ros_compat.fastdds_major(env) is None
    assert ros_compat.fastdds_profile_variables(env) == ros_compat.PROFILE_VARIABLES
    assert set(ros_compat.localhost_only_env(env)) == {"ROS_AUTOMATIC_DISCOVERY_RANGE", "ROS_LOCALHOST_ONLY"}


def test_a_profile_the_user_set_is_kept_under_either_name(tmp_path):
    for name in ros_compat.PROFILE_VARIABLES:
        env = {"AMENT_PREFIX_PATH": prefix(tmp_path / name, rmw_fastrtps_cpp="8.4.3"), name: "/mine.xml"}
        ros_compat.set_fastdds_profile(env, "/shipped.xml")
        assert [env.get(n) for n in ros_compat.PROFILE_VARIABLES].count("/shipped.xml") == 0


class OldExecutor:  # Humble's and Jazzy 7.1.6's signature
    def shutdown(self, timeout_sec=None):
        return ("old", timeout_sec)


class NewExecutor:  # rclpy 7.1.12's
    def shutdown(self, timeout_sec=None, wait_for_threads=True):
        return ("new", timeout_sec, wait_for_threads)


def test_executor_shutdown_passes_wait_for_threads_only_where_it_is_taken():
    assert ros_compat.executor_shutdown(OldExecutor, OldExecutor(), 2.0) == ("old", 2.0)
    assert ros_compat.executor_shutdown(NewExecutor, NewExecutor(), 2.0, False) == ("new", 2.0, False)
