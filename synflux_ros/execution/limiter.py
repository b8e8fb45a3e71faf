"""The joint limiter: every command within ``execution.limits``, all of them at once, in a stated priority.

ROS-free; positions in the joints' units, times in seconds. The guarantee and its priority:
:class:`JointLimiter` and docs/execution.md."""
from __future__ import annotations

from collections import Counter

import numpy as np

from ..core.config import ExecutionConfig



def _per_joint(values, n: int, default: float) -> np.ndarray:
    return np.asarray(values, np.float64) if values else np.full(n, default)


class JointLimiter:
    """The limits of ``execution.limits``, enforced together on every command of period ``dt``.

    Each output ``c`` (after the previous command ``p`` moving at ``v``; ``w = (c - p) / dt``) satisfies, per
    joint, in this priority (a lower one gives way where they cannot all hold, and that is counted):

    1. ``|w| <= max_velocity`` and the change of speed within ``max_acceleration * dt`` (speeding up) or
       ``max_deceleration * dt`` (slowing down): no command ever jumps;
    2. braking in time: ``p + w dt + w^2 / (2 max_deceleration)`` stays within the position limits, so the joint
       can always stop before a limit without braking harder (and never stops dead at it); a command whose
       previous one was inside the limits stays inside. A joint started outside (enable with
       ``outside_at_enable: move_inside``) does not move further out and comes back at the limits of 1;
    3. ``|c - measured| <= max_relative_target`` against the position measured in that tick, braking in time
       for the window's edges too (an arm held by an obstacle stops dead; the command must stop inside);
    4. the change of acceleration within ``max_jerk * dt`` where 1-3 leave room.

    Within what these allow, the command follows the target (clamped to the position limits): it moves with
    the target and closes the gap to it braking in time, so that it never passes a target that stops.
    """

    def __init__(self, cfg: ExecutionConfig, dt: float):
        lim = cfg.limits
        n = len(cfg.joints)
        self.dt = dt
        self.lo = _per_joint(lim.position_min, n, -np.inf)
        self.hi = _per_joint(lim.position_max, n, np.inf)
        self.vmax = _per_joint(lim.max_velocity, n, np.inf)
        self.amax = _per_joint(lim.max_acceleration, n, np.inf)
        self.dmax = _per_joint(lim.max_deceleration, n, np.inf) if lim.max_deceleration else self.amax.copy()
        self.jmax = _per_joint(lim.max_jerk, n, np.inf)
        r = lim.max_relative_target
        self.rel = (np.full(n, r[0]) if len(r) == 1 else np.asarray(r, np.float64)) if r else np.full(n, np.inf)
        self.last: np.ndarray | None = None
        self.velocity = np.zeros(n)
        self.accel = np.zeros(n)
        self.target: np.ndarray | None = None  # the previous tick's target (its motion is followed)
        # with max_jerk, braking starts earlier by the time the deceleration takes to build up
        self._lag = np.where(np.isfinite(self.jmax) & np.isfinite(self.dmax),
                             self.dmax / (2.0 * np.where(np.isfinite(self.jmax), self.jmax, 1.0)), 0.0)

    def copy(self, dt: float) -> "JointLimiter":
        other = object.__new__(JointLimiter)
        other.__dict__.update(self.__dict__)
        other.dt, other.velocity, other.accel = dt, self.velocity.copy(), self.accel.copy()
        other.last = None if self.last is None else self.last.copy()
        other.target = None if self.target is None else self.target.copy()
        return other

    def reset(self, position: np.ndarray | None) -> None:
        """Start from ``position`` (where the arm is when commands are enabled, even outside the limits) at rest."""
        self.last = None if position is None else np.asarray(position, np.float64).copy()
        self.velocity[:] = 0.0
        self.accel[:] = 0.0
        self.target = None

    def outside(self, position: np.ndarray, tolerance: float = 0.0) -> np.ndarray:
        """Joints outside their position limits by more than ``tolerance`` of their range."""
        span = self.hi - self.lo
        margin = tolerance * np.where(np.isfinite(span), span, 0.0)
        return (position < self.lo - margin) | (position > self.hi + margin)

    def brake_speed(self, distance: np.ndarray, rate: np.ndarray | None = None, lag=0.0) -> np.ndarray:
        """The highest speed towards a point ``distance`` ahead (>= 0) from which the joint still stops there,
        braking at max_deceleration (0 where the point is behind), starting ``lag`` seconds after the next tick.
        With ``rate`` (max_jerk) the same one derivative up: the highest acceleration towards a speed
        ``distance`` away that still settles there."""
        d = np.maximum(distance, 0.0)
        with np.errstate(invalid="ignore", over="ignore"):
            a, dt = self.dmax if rate is None else rate, self.dt + lag
            speed = np.where(np.isfinite(a), a * (np.sqrt(dt * dt + 2.0 * d / np.where(np.isfinite(a), a, 1.0)) - dt),
                             d / dt)
        return np.where(np.isinf(d), np.inf, speed)

    def _limit_speeds(self, p: np.ndarray, measured: np.ndarray | None, lag=0.0):
        """(b_lo, b_hi, r_lo, r_hi) from the command ``p``: the speeds towards the lower and upper position limit
        from which the joint still stops at them, and the speed range that still stops within the relative
        window around ``measured`` (None, None without one), braking at max_deceleration ``lag`` s late."""
        b_lo, b_hi = self.brake_speed(p - self.lo, lag=lag), self.brake_speed(self.hi - p, lag=lag)
        if measured is None or not np.isfinite(self.rel).any():
            return b_lo, b_hi, None, None
        return (b_lo, b_hi, -self.brake_speed(p - (measured - self.rel), lag=lag),
                self.brake_speed(measured + self.rel - p, lag=lag))

    def _kinematic(self, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Speeds reachable from ``v`` in one tick: accelerating by max_acceleration, slowing by max_deceleration
        (through zero only as far as either allows), within max_velocity."""
        up, down = self.amax * self.dt, self.dmax * self.dt
        through = np.minimum(up, down)
        lower = np.where(v >= down, v - down, np.where(v > 0, np.maximum(v - down, -through), v - up))
        upper = np.where(-v >= down, v + down, np.where(v < 0, np.minimum(v + down, through), v + up))
        return np.maximum(lower, -self.vmax), np.minimum(upper, self.vmax)

    def __call__(self, target: np.ndarray, measured: np.ndarray | None, counts: Counter,
                 stop_at_target: bool = False) -> np.ndarray:
        """The command towards ``target``; ``stop_at_target`` (a fixed target: hold, safe_action) brakes in
        time to arrive there at rest instead of passing it."""
        x = np.clip(target, self.lo, self.hi)
        if not np.array_equal(x, target):
            counts["position_limit"] += 1
        if self.last is None:  # enabled without a joint state: nothing to limit against yet
            self.last = x.astype(np.float64)
            self.velocity[:] = 0.0
            self.accel[:] = 0.0
            self.target = x.copy()
            return self.last.copy()
        p, v, dt = self.last, self.velocity, self.dt
        w_lo, w_hi = self._kinematic(v)
        b_lo, b_hi, r_lo, r_hi = self._limit_speeds(p, measured)
        # 2. braking in time for the position limits (not further out where the joint is already outside)
        lo2, hi2 = np.maximum(w_lo, -b_lo), np.minimum(w_hi, b_hi)
        unmet = lo2 > hi2
        if unmet.any():  # cannot brake in time within 1 (a joint started outside): 1 wins, braking its hardest
            counts["braking_unmet"] += 1
            hardest = np.where(b_hi < w_lo, w_lo, w_hi)
            lo2, hi2 = np.where(unmet, hardest, lo2), np.where(unmet, hardest, hi2)
        # 3. the relative window around the measured position, braking in time for its edges as for position
        # limits (the arm may stop dead, held by an obstacle: the command must be able to stop inside the window)
        if r_lo is not None:
            lo3, hi3 = np.maximum(lo2, r_lo), np.minimum(hi2, r_hi)
            apart = lo3 > hi3
            if apart.any():  # the arm is held or pushed away faster than 1 allows following: 1 and 2 win
                nearest = np.clip(np.where(r_hi < lo2, r_hi, r_lo), lo2, hi2)
                lo3, hi3 = np.where(apart, nearest, lo3), np.where(apart, nearest, hi3)
        else:
            lo3, hi3 = lo2, hi2
        # follow the target's own motion and close the gap to it braking in time, so that the command does not
        # pass a target that stops (no overshoot, no hunting around a still target)
        follow = not stop_at_target and self.target is not None
        speed = (x - self.target) / dt if follow else np.zeros_like(x)
        gap = (self.target if follow else x) - p
        want = speed + np.clip(gap / dt, -self.brake_speed(-gap, lag=self._lag),
                               self.brake_speed(gap, lag=self._lag))
        self.target = x
        lo4, hi4 = self._jerk_band(lo3, hi3, counts)
        smooth = self._smooth(want, measured)
        w = np.clip(smooth, lo4, hi4)
        if np.any(w != np.clip(smooth, lo3, hi3)):
            counts["jerk_limit"] += 1
        moved = w != want
        if moved.any():
            self._count(counts, want, w, w_lo, w_hi, b_lo, b_hi, r_lo, r_hi)
        cmd = self._advance(w)
        if measured is not None and np.any(np.abs(cmd - measured) > self.rel + 1e-12):
            counts["relative_target_unmet"] += 1  # 1 and 2 won: the arm moved away faster than they follow
        return cmd

    def _advance(self, w: np.ndarray) -> np.ndarray:
        """Move the command at speed ``w`` for one tick; a command that was inside the position limits stays
        inside (rounding never takes it out)."""
        p = self.last
        cmd = p + w * self.dt
        cmd = np.where(self.outside(p), cmd, np.clip(cmd, self.lo, self.hi))
        velocity = (cmd - p) / self.dt
        self.accel = (velocity - self.velocity) / self.dt
        self.velocity = velocity
        self.last = cmd
        return cmd.copy()

    def _smooth(self, want: np.ndarray, measured: np.ndarray | None = None) -> np.ndarray:
        """With max_jerk, the speed to command on the way to ``want``: ``want`` within the speeds that brake in
        time for the position limits and the relative window (braking started early by the time the
        deceleration takes to build up), approached with an acceleration from which max_jerk still brings the
        acceleration to 0 on arrival (no overshoot, no oscillation of the speed)."""
        if not self.has_jerk:
            return want
        b_lo, b_hi, r_lo, r_hi = self._limit_speeds(self.last, measured, self._lag)
        hi, lo = np.minimum(self.vmax, b_hi), np.maximum(-self.vmax, -b_lo)
        if r_lo is not None:
            hi, lo = np.minimum(hi, r_hi), np.maximum(lo, r_lo)
        goal = np.where(lo <= hi, np.clip(want, lo, hi), want)
        gap = goal - self.velocity
        reach = self.brake_speed(np.abs(gap), self.jmax)  # the highest acceleration that settles at the goal
        return self.velocity + np.clip(gap / self.dt, -reach, reach) * self.dt

    @property
    def has_jerk(self) -> bool:
        return bool(np.isfinite(self.jmax).any())

    def _jerk_band(self, lo: np.ndarray, hi: np.ndarray, counts: Counter) -> tuple[np.ndarray, np.ndarray]:
        """4. max_jerk: the acceleration changes by at most max_jerk * dt where 1-3 leave room; where they do
        not (braking for a limit, a hold), 1-3 win at the speed nearest the jerk's band (``jerk_unmet``)."""
        if not self.has_jerk:
            return lo, hi
        ahead = self.velocity + self.accel * self.dt
        step = self.jmax * self.dt * self.dt
        j_lo, j_hi = ahead - step, ahead + step
        lo4, hi4 = np.maximum(lo, j_lo), np.minimum(hi, j_hi)
        apart = lo4 > hi4
        if apart.any():
            counts["jerk_unmet"] += 1
            nearest = np.where(j_hi < lo, lo, hi)
            lo4, hi4 = np.where(apart, nearest, lo4), np.where(apart, nearest, hi4)
        return lo4, hi4

    def _count(self, counts, want, w, w_lo, w_hi, b_lo, b_hi, r_lo, r_hi) -> None:
        """Name the limits that changed the command (each counted once per tick)."""
        eps = 1e-12
        if np.any((want > self.vmax + eps) & (w >= self.vmax - eps)) or \
                np.any((want < -self.vmax - eps) & (w <= -self.vmax + eps)):
            counts["velocity_limit"] += 1
        if np.any(((w >= w_hi - eps) & (w_hi < self.vmax - eps) & (want > w)) |
                  ((w <= w_lo + eps) & (w_lo > -self.vmax + eps) & (want < w))):
            counts["acceleration_limit"] += 1
        if np.any(((w >= b_hi - eps) & (want > w)) | ((w <= -b_lo + eps) & (want < w))):
            counts["braking"] += 1
        if r_lo is not None and np.any(((w >= r_hi - eps) & (want > w)) | ((w <= r_lo + eps) & (want < w))):
            counts["max_relative_target"] += 1

    def stop(self, counts: Counter | None = None) -> np.ndarray | None:
        """Brake to rest within the limits (the watchdog's hold): each tick the speed closest to 0 that
        max_deceleration (and max_jerk, where braking in time leaves room) reaches; braking in time (2) keeps it
        inside the position limits."""
        if self.last is None:
            return None
        self.target = None
        w_lo, w_hi = self._kinematic(self.velocity)
        if not self.has_jerk:  # slowing down as hard as allowed is always within 2
            return self._advance(np.clip(0.0, w_lo, w_hi))
        p = self.last
        b_lo, b_hi, _, _ = self._limit_speeds(p, None)
        lo, hi = np.maximum(w_lo, -b_lo), np.minimum(w_hi, b_hi)
        unmet = lo > hi  # a joint started outside: 1 alone
        lo, hi = self._jerk_band(np.where(unmet, w_lo, lo), np.where(unmet, w_hi, hi), Counter() if counts is None
                                 else counts)
        return self._advance(np.clip(self._smooth(np.zeros_like(p)), lo, hi))

    def hold(self) -> np.ndarray | None:
        """Repeat the last command and stop (on_timeout: hold_exact)."""
        self.velocity[:] = 0.0
        self.accel[:] = 0.0
        self.target = None
        return None if self.last is None else self.last.copy()
