"""The test helpers keep a ROS_DOMAIN_ID the caller set (a test runner's isolated domain, or a robot's own
domain on purpose) and pick one only when none is set."""
from __future__ import annotations

import pytest

pytest.importorskip("rclpy", reason="rclpy is not installed (run `make test`, which sets up .venv)")

from synflux_ros.tools import harness as testing  # noqa: E402


def test_domain_from_the_environment_is_kept(monkeypatch):
    monkeypatch.setenv("ROS_DOMAIN_ID", "42")
    assert testing.choose_domain_id() == "42"
    assert testing.ros_env()["ROS_DOMAIN_ID"] == "42"


def test_explicit_domain_wins(monkeypatch):
    monkeypatch.setenv("ROS_DOMAIN_ID", "42")
    assert testing.ros_env(domain_id=7)["ROS_DOMAIN_ID"] == "7"


@pytest.mark.parametrize("value", [None, "", "  "])
def test_domain_is_picked_when_none_is_set(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("ROS_DOMAIN_ID", raising=False)
    else:
        monkeypatch.setenv("ROS_DOMAIN_ID", value)
    picked = {int(testing.ros_env()["ROS_DOMAIN_ID"]) for _ in range(20)}
    assert all(1 <= d <= 101 for d in picked)
