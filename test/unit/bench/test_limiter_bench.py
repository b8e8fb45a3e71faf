"""bench.limiter's invariant check catches what it exists for (the closed loop itself is `make bench-control`)."""
from __future__ import annotations

import numpy as np

from synflux_ros.bench.limiter import arm_limits
from synflux_ros.tools.limiter_loop import violations
from synflux_ros.core.config import ExecutionConfig, LimitsConfig
from synflux_ros.execution.limiter import JointLimiter

J = ("a", "b")
BASE = LimitsConfig(position_min=(-1.0, -1.0), position_max=(1.0, 1.0), max_velocity=(1.0, 1.0))


def limiter() -> JointLimiter:
    return JointLimiter(ExecutionConfig(joints=J, limits=arm_limits(BASE)), 0.01)


def test_each_breach_is_named():
    lim = limiter()
    p, v = np.array([0.5, 0.0]), np.zeros(2)
    assert not violations(lim, p, v, p + 0.0005 * np.array([1.0, 0.0]), p, False)  # 5 rad/s^2, within 8
    assert violations(lim, p, v, p + np.array([0.05, 0.0]), p, False)["velocity"] == 1  # 5 rad/s
    assert violations(lim, p, np.array([0.8, 0.0]), p, p, False)["acceleration"] == 1  # 0.8 rad/s to 0 in a tick
    at_limit = np.array([0.999, 0.0])
    assert violations(lim, at_limit, np.array([0.2, 0.0]), np.array([1.001, 0.0]), at_limit, True)["position"] == 1
    assert violations(lim, p, v, p, p + 0.5, False)["relative_target"] == 1
    assert not violations(lim, p, v, p, p + 0.5, True)  # counted as unmet by the limiter: not a breach
    a0 = np.zeros(2)  # from rest, 5 rad/s^2 in one tick: 500 rad/s^3, over joint a's 400
    assert violations(lim, p, v, p + 0.0005 * np.array([1.0, 0.0]), p, False, a0)["jerk"] == 1
    assert not violations(lim, p, v, p + 0.0005 * np.array([1.0, 0.0]), p, False, a0, jerk_unmet=True)
    assert not violations(lim, p, v, p + 0.0003 * np.array([1.0, 0.0]), p, False, a0)  # 300 rad/s^3
