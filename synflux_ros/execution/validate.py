"""Whole-chunk validation (``execution.validate``): a chunk's steps, velocity, acceleration and jerk checked
before it enters the plan."""
from __future__ import annotations

import numpy as np

from .plan import ChunkRefused


class ChunkInvalid(ChunkRefused):
    """A chunk over ``execution.validate``'s thresholds."""


def validate_chunk(actions: np.ndarray, period: float, check, joints) -> tuple[np.ndarray, str]:
    """``execution.validate`` on a chunk [steps, joints] of positions ``period`` apart: (the chunk, "") when it
    holds, (the clipped chunk, what was clipped) with ``on_violation: clip`` for steps and velocity, else
    ChunkRefused naming the worst joint and step. Differences of order 1, 2 and 3 give velocity, acceleration
    and jerk."""
    n = actions.shape[1]

    def per_joint(values):
        return np.full(n, values[0]) if len(values) == 1 else np.asarray(values, np.float64)
    step = np.full(n, np.inf)
    if check.max_step:
        step = np.minimum(step, per_joint(check.max_step))
    if check.max_velocity:
        step = np.minimum(step, per_joint(check.max_velocity) * period)
    clipped = ""
    diffs = np.diff(actions, axis=0)
    over = np.abs(diffs) > step * (1 + 1e-9)
    if over.any():
        if check.on_violation == "clip":
            out = actions.copy()
            for i in range(1, len(out)):  # re-integrated: each step at most `step` from the clipped one before
                out[i] = out[i - 1] + np.clip(out[i] - out[i - 1], -step, step)
            actions, clipped = out, f"{int(over.sum())} steps clipped"
        else:
            i, j = np.unravel_index(np.argmax(np.abs(diffs) / step), diffs.shape)
            raise ChunkInvalid(f"chunk jumps {abs(diffs[i, j]):.4g} between steps {i} and {i + 1} of joint "
                               f"{joints[j]!r}, over execution.validate's {step[j]:.4g} a step (max_step, "
                               f"max_velocity x step_period)")
    for order, name, unit in ((2, "max_acceleration", "s^2"), (3, "max_jerk", "s^3")):
        limit = getattr(check, name)
        if not limit or len(actions) <= order:
            continue
        rate = np.diff(actions, n=order, axis=0) / period ** order
        ratio = np.abs(rate) / per_joint(limit)
        if ratio.max() > 1 + 1e-9:
            i, j = np.unravel_index(np.argmax(ratio), ratio.shape)
            raise ChunkInvalid(f"chunk's {name[4:]} {abs(rate[i, j]):.4g} units/{unit} at step {i + order - 1} of "
                               f"joint {joints[j]!r} is over execution.validate.{name} {per_joint(limit)[j]:.4g}")
    return actions, clipped
