"""Action chunks executed on the robot's clock (ROS-free; times are seconds of the node's clock).

Step ``i`` of a chunk computed from a frame stamped ``t_obs`` is the target for ``t_obs + i * step_period``.
When the chunk arrives at ``now`` it takes over from step ``d = ceil((now + lookahead - t_obs) / period)``:
the measured delay, not an assumed one. :class:`ChunkPlan` merges it with what is executing (``execution.mode``;
``auto``, which the model config resolves, acts as ``replace`` here) and samples the merged plan at any time;
:class:`Controller` (``controller.py``) turns samples into commands. The modes: docs/execution.md.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..core.config import ExecutionConfig
from .merge import Overlap, merge_for

CLOCK_SKEW_S = 0.05
"""Seconds a stamp (a frame's, a joint state's) may lie ahead of the node's clock before it is refused: clock
skew between machines."""
SIM_CLOCK_SKEW_S = 0.25
"""The same on simulated time (use_sim_time): the node's clock advances as its executor takes each /clock
message, which on a loaded machine lags the simulator's stamps by tens of milliseconds."""


class ChunkRefused(ValueError):
    """A chunk that is not executed; the message says why (the command in force is held)."""


@dataclass(frozen=True)
class Offer:
    """What became of an accepted chunk: the first step executed (``delay_steps``), the delay in seconds, the
    largest jump of the plan at the switch time (after the merge against before it: what the robot is sent)
    and the largest disagreement of the chunk's step d with the plan before it (what the model offered)."""
    delay_steps: int
    delay_s: float
    switch_jump: float
    disagreement: float = 0.0


class ChunkPlan:
    """The targets to execute: times (ascending) with one action row each, merged from chunks as
    ``execution.mode`` says (``merge.py``), sampled with linear or cubic interpolation. Not thread-safe (the controller
    holds a lock)."""

    def __init__(self, cfg: ExecutionConfig, step_period: float, horizon: int, clock_skew: float = CLOCK_SKEW_S):
        self.cfg, self.period, self.horizon = cfg, float(step_period), int(horizon)
        self.clock_skew = clock_skew
        self.times = np.zeros(0)
        self.actions = np.zeros((0, 0))
        self.raw: np.ndarray | None = None  # model-space rows beside the actions (rtc)
        self.counts = np.zeros(0, np.int64)  # predictions averaged into each row (temporal_ensemble)
        self.delays = deque(maxlen=10)  # recent delays in steps (the RTC inference delay estimate)
        self._merge = merge_for(cfg.mode)

    # ------------------------------------------------------------------ merging
    def offer(self, actions: np.ndarray, t_obs: float, now: float, raw: np.ndarray | None = None) -> Offer:
        """Merge a chunk [horizon, dim] (absolute targets) from a frame stamped ``t_obs``; ChunkRefused when it
        is late (the delay reaches the horizon), stamped in the future or unstamped."""
        n = actions.shape[0]
        if not t_obs > 0:
            raise ChunkRefused("the frame has no stamp: its chunk cannot be placed on the clock")
        late = now - t_obs
        if late < -self.clock_skew:
            raise ChunkRefused(f"the frame is stamped {-late:.3f} s ahead of this node's clock (are the clocks of "
                               f"the camera and this machine synchronised?)")
        d = max(0, math.ceil((late + self.cfg.lookahead) / self.period - 1e-9))
        if d >= n:
            raise ChunkRefused(f"the chunk arrived {late * 1e3:.0f} ms after its frame (plus "
                               f"{self.cfg.lookahead * 1e3:.0f} ms lookahead), past its horizon of {n} steps x "
                               f"{self.period * 1e3:.0f} ms")
        self.delays.append(d)
        times = t_obs + self.period * np.arange(d, n)
        new = np.array(actions[d:], np.float64)  # a copy: the merge writes into it
        new_raw = None if raw is None else np.array(raw[d:], np.float64)
        old = self.sample_rows(times)  # the plan in force at the new times (NaN past its end)
        at_switch = old is not None and np.isfinite(old[0]).all()
        disagreement = float(np.max(np.abs(new[0] - old[0]))) if at_switch else 0.0
        if old is None:
            counts = np.ones(len(times), np.int64)
        else:
            overlap = Overlap(new, old, np.isfinite(old).all(axis=1), self._counts_at(times), self.cfg, self.horizon)
            new, counts = self._merge(overlap)
        # keep the rows in force before the new chunk starts (one before now at least, for interpolation)
        keep = (self.times < times[0]) & (self.times >= now - self.period) if len(self.times) else np.zeros(0, bool)
        if len(self.times) and not keep.any() and self.times[0] < times[0]:
            keep[np.searchsorted(self.times, times[0]) - 1] = True
        self.times = np.concatenate([self.times[keep], times])
        self.actions = np.concatenate([self.actions[keep], new]) if keep.any() else new
        self.counts = np.concatenate([self.counts[keep], counts])
        if new_raw is not None:
            old_raw = self.raw[keep] if self.raw is not None and len(self.raw) == len(keep) else \
                np.zeros((int(keep.sum()), new_raw.shape[1]))
            self.raw = np.concatenate([old_raw, new_raw])
        else:
            self.raw = None
        jump = float(np.max(np.abs(new[0] - old[0]))) if at_switch else 0.0
        return Offer(d, late, jump, disagreement)

    def _counts_at(self, times: np.ndarray) -> np.ndarray:
        idx = np.clip(np.searchsorted(self.times, times - 0.5 * self.period), 0, len(self.times) - 1)
        return self.counts[idx]

    # ------------------------------------------------------------------ sampling
    def sample_rows(self, times: np.ndarray, values: np.ndarray | None = None) -> np.ndarray | None:
        """Linear interpolation of ``values`` (default: the actions) at ``times``; NaN rows outside the plan;
        None when the plan is empty."""
        values = self.actions if values is None else values
        if not len(self.times):
            return None
        out = np.full((len(times), values.shape[1]), np.nan)
        inside = (times >= self.times[0] - 1e-9) & (times <= self.times[-1] + 1e-9)
        if inside.any():
            for j in range(values.shape[1]):
                out[inside, j] = np.interp(times[inside], self.times, values[:, j])
        return out

    def sample(self, now: float) -> np.ndarray | None:
        """The target at ``now``: before the plan's first row that row, after its last row None (ran out)."""
        if not len(self.times) or now > self.times[-1] + 1e-9:
            return None
        if now <= self.times[0]:
            return self.actions[0].copy()
        k = int(np.searchsorted(self.times, now, side="right")) - 1
        k = min(k, len(self.times) - 2)
        t0, t1 = self.times[k], self.times[k + 1]
        s = (now - t0) / (t1 - t0)
        p0, p1 = self.actions[k], self.actions[k + 1]
        if self.cfg.interpolation == "linear" or len(self.times) < 3:
            return p0 + s * (p1 - p0)
        # cubic Hermite with finite-difference tangents (Catmull-Rom on a non-uniform grid)
        def tangent(i):
            a, b = max(i - 1, 0), min(i + 1, len(self.times) - 1)
            return (self.actions[b] - self.actions[a]) / (self.times[b] - self.times[a])
        h = t1 - t0
        m0, m1 = tangent(k) * h, tangent(k + 1) * h
        s2, s3 = s * s, s * s * s
        return (2 * s3 - 3 * s2 + 1) * p0 + (s3 - 2 * s2 + s) * m0 + (-2 * s3 + 3 * s2) * p1 + (s3 - s2) * m1

    def steps_left(self, now: float) -> int:
        """Rows still ahead of ``now``."""
        return int(np.count_nonzero(self.times > now))

    def end_time(self) -> float | None:
        return float(self.times[-1]) if len(self.times) else None

    def leftover(self, t_obs: float) -> np.ndarray | None:
        """Real-Time Chunking's previous chunk: the model-space plan at ``t_obs + i * period`` for the steps
        the plan still covers (None without one)."""
        if self.raw is None or not len(self.times):
            return None
        steps = int(np.floor((self.times[-1] - t_obs) / self.period + 1e-9)) + 1
        if steps <= 0:
            return None
        times = t_obs + self.period * np.arange(min(steps, self.horizon))
        rows = self.sample_rows(times, self.raw)
        rows = rows[np.isfinite(rows).all(axis=1)]
        return rows.astype(np.float32) if len(rows) else None

    def inference_delay(self) -> int:
        """Steps a chunk is expected to arrive after its frame: the largest of the recent delays (as LeRobot's
        latency tracker estimates it), 0 before any."""
        return max(self.delays) if self.delays else 0
