"""Between the model and the arm: enable state, watchdog and limits around a :class:`ChunkPlan`.

One :meth:`Controller.tick` per control period gives the command to send (None while disabled). Chunks arrive
from the pipeline's thread and joint states from the subscriber's, so every method takes the lock. Every
intervention is counted by name (:attr:`Controller.counts`) for ``/diagnostics``. The limits and their
priority: :class:`JointLimiter`. A hold (the watchdog) brakes to rest within them (``on_timeout: hold``),
repeats the last command (``hold_exact``) or goes to ``safe_action`` arriving at rest. Details:
docs/execution.md.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from ..core.config import ExecutionConfig
from .limiter import JointLimiter
from .plan import CLOCK_SKEW_S, ChunkPlan, ChunkRefused, Offer
from .robot_state import NoFreshState, StampedBuffer
from .validate import ChunkInvalid, validate_chunk

ENABLE_TOLERANCE = 1e-3
"""Share of a joint's range it may be measured outside its position limits and still be enabled under
``outside_at_enable: refuse`` (a gripper closed on an object, sensor noise at a hard stop); the command then
comes back inside as with ``move_inside``."""
STATE_HISTORY = 400
"""Joint states kept for delta actions (matched to frames by stamp)."""



@dataclass
class Status:
    """What the controller does now: ``running``, ``holding`` or ``disabled``, and why."""
    state: str = "disabled"
    reason: str = "not enabled yet"


class Controller:
    """Chunks in, one command per control tick out, within the limits; see the module docstring."""

    def __init__(self, cfg: ExecutionConfig, step_period: float, horizon: int, clock_skew: float = CLOCK_SKEW_S):
        """``clock_skew``: how far ahead of the node's clock a frame's or a joint state's stamp may lie
        (:data:`.plan.CLOCK_SKEW_S`; :data:`.plan.SIM_CLOCK_SKEW_S` on simulated time)."""
        self.cfg = cfg
        self.joints = tuple(cfg.joints)
        self.dt = 1.0 / cfg.control_rate_hz
        self.plan = ChunkPlan(cfg, step_period, horizon, clock_skew)
        self.filter = JointLimiter(cfg, self.dt)
        self.counts: Counter = Counter()
        self.status = Status()
        self.enabled = False
        self.last_chunk_at: float | None = None  # node clock when the last chunk was accepted
        self.last_offer: Offer | None = None
        self._state: np.ndarray | None = None
        self._state_at: float | None = None  # node clock at receipt
        self._states = StampedBuffer(max(cfg.state_timeout, 1.0), STATE_HISTORY, "joint state", "joint_states",
                                     "execution.state_timeout")
        self._delta = np.asarray(cfg.delta_mask, bool) if any(cfg.delta_mask) else None
        self._safe = np.asarray(cfg.safe_action, np.float64) if cfg.on_timeout == "safe_action" else None
        self._hold_kind = ""
        self.hold_reaction_s = float("nan")  # the last timeout's hold: its tick minus the moment it expired
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ inputs
    def on_joint_state(self, stamp: float, names, positions, now: float) -> None:
        """A ``sensor_msgs/JointState`` stamped ``stamp`` (0 = unstamped) arriving at ``now`` (node clock);
        ValueError (nothing stored) when a commanded joint is missing or not finite, or the stamp lies more than
        ``clock_skew`` ahead of the node's clock. Its age is counted from its stamp (from its arrival
        when unstamped): a state measured long ago and delivered late is stale."""
        skew = self.plan.clock_skew
        if stamp > now + skew:
            self.counts["states_from_the_future"] += 1
            raise ValueError(f"stamped {stamp - now:.3f} s ahead of this node's clock (more than {skew} s: the "
                             f"clocks are not in sync)")
        index = {n: i for i, n in enumerate(names)}
        missing = [j for j in self.joints if j not in index]
        if missing:
            raise ValueError(f"no position for commanded joint(s) {missing}")
        if len(positions) < len(names):
            raise ValueError(f"{len(positions)} positions for {len(names)} names")
        q = np.array([positions[index[j]] for j in self.joints], np.float64)
        if not np.isfinite(q).all():
            raise ValueError(f"non-finite position for {[j for j, v in zip(self.joints, q) if not np.isfinite(v)]}")
        with self._lock:
            self._state, self._state_at = q, (stamp if stamp > 0 else now)
            if self._delta is not None and stamp > 0:
                self._states.add(stamp, q)

    def on_chunk(self, actions: np.ndarray, t_obs: float, now: float, raw: np.ndarray | None = None) -> Offer:
        """Merge a chunk [horizon, joints] from a frame stamped ``t_obs``; ChunkRefused says why one is not
        executed (the plan in force goes on)."""
        actions = np.array(actions, np.float64)  # a copy: the caller's chunk is never changed
        if actions.ndim != 2 or actions.shape[1] != len(self.joints):
            self.counts["chunks_refused"] += 1
            raise ChunkRefused(f"chunk of shape {actions.shape}, expected [steps, {len(self.joints)}]")
        bad = ~np.isfinite(actions)
        if bad.any() or (raw is not None and not np.isfinite(raw).all()):
            self.counts["chunks_refused"] += 1
            self.counts["chunks_non_finite"] += 1
            where = np.argwhere(bad)
            at = (f" (first at step {where[0][0]}, joint {self.joints[where[0][1]]!r})" if len(where) else
                  " in its model-space values")
            raise ChunkRefused(f"chunk has {int(bad.sum())} non-finite value(s){at}")
        with self._lock:
            try:
                if self._delta is not None:
                    state, _ = self._states.at(t_obs)
                    actions = actions.copy()
                    actions[:, self._delta] += state[self._delta]
                actions, clipped = validate_chunk(actions, self.plan.period, self.cfg.validate, self.joints)
                if clipped:
                    self.counts["chunks_clipped"] += 1
                offer = self.plan.offer(actions, t_obs, now, raw if self.cfg.guides_inference else None)
            except (ChunkRefused, NoFreshState) as exc:
                self.counts["chunks_refused"] += 1
                if isinstance(exc, ChunkInvalid):
                    self.counts["chunks_invalid"] += 1
                else:
                    self.counts["chunks_late" if "horizon" in str(exc) else "chunks_unplaced"] += 1
                if isinstance(exc, NoFreshState):
                    raise ChunkRefused(f"delta actions need the joint state of the frame: {exc}") from None
                raise
            self.counts["chunks_accepted"] += 1
            self.last_chunk_at, self.last_offer = now, offer
            return offer

    # ------------------------------------------------------------------ enable
    def enable(self, now: float) -> str:
        """Start commanding from the measured position, at rest; ValueError when the joint state needed is stale,
        or a joint is outside its position limits and ``limits.outside_at_enable`` is ``refuse``. Enabling while
        enabled changes nothing (the command goes on from where it is, never jumping to the measured position)."""
        with self._lock:
            if self.enabled:
                self.counts["enable_while_enabled"] += 1
                return "already enabled"
            stale = self._state_stale(now)
            if stale:
                raise ValueError(f"cannot enable: {stale}")
            if self._state is not None:
                out = np.flatnonzero(self.filter.outside(self._state, ENABLE_TOLERANCE))
                if len(out) and self.cfg.limits.outside_at_enable == "refuse":
                    i = int(out[0])
                    raise ValueError(
                        f"cannot enable: joint {self.joints[i]!r} is at {self._state[i]:.4g}, outside its position "
                        f"limits [{self.filter.lo[i]:.4g}, {self.filter.hi[i]:.4g}] (move it inside, or set "
                        f"execution.limits.outside_at_enable: move_inside to let the command bring it back within "
                        f"the velocity and acceleration limits)")
                if np.any(self.filter.outside(self._state)):
                    self.counts["enabled_outside_limits"] += 1
            self.filter.reset(self._state)
            self.enabled = True
            self.status = Status("running", "enabled")
            return "enabled" + ("" if self._state is not None else " (no joint state: the first command is not "
                                                                      "rate-limited)")

    def disable(self, reason: str) -> None:
        with self._lock:
            self.enabled = False
            self.status = Status("disabled", reason)

    # ------------------------------------------------------------------ the control tick
    def _state_stale(self, now: float) -> str:
        if self.cfg.state_timeout <= 0:
            return ""
        if self._state_at is None:
            return "no joint state received for the commanded joints"
        age = now - self._state_at
        if age > self.cfg.state_timeout:
            return (f"the joint state is {age:.2f} s old by its stamp (execution.state_timeout "
                    f"{self.cfg.state_timeout} s)")
        return ""

    def _hold(self, kind: str, why: str, expired_at: float | None = None, now: float = 0.0) -> np.ndarray | None:
        """Hold (or move to the safe action); a hold of a new ``kind`` is counted once, as ``hold_<kind>``, and
        for a timeout that expired at ``expired_at`` the reaction time is kept (:attr:`hold_reaction_s`)."""
        if self.status.state != "holding" or self._hold_kind != kind:
            self.counts["watchdog_holds"] += 1
            self.counts[f"hold_{kind}"] += 1
            if expired_at is not None:
                self.hold_reaction_s = now - expired_at
        self._hold_kind = kind
        self.status = Status("holding", why)
        self.counts["ticks_held"] += 1
        if self._safe is not None and self.filter.last is not None:  # arrives at rest, without overshoot
            return self.filter(self._safe, None, self.counts, stop_at_target=True)
        if self.cfg.on_timeout == "hold_exact":  # the robot's controller brakes by itself
            return self.filter.hold()
        return self.filter.stop(self.counts)

    def tick(self, now: float) -> np.ndarray | None:
        """The command for ``now``: None while disabled (or before anything can be commanded)."""
        with self._lock:
            if not self.enabled:
                return None
            stale = self._state_stale(now)
            if stale:
                expired = None if self._state_at is None else self._state_at + self.cfg.state_timeout
                return self._hold("stale_state", stale, expired, now)
            if self.last_chunk_at is None:
                return self._hold("no_chunk", "no chunk yet")
            if self.cfg.chunk_timeout > 0 and now - self.last_chunk_at > self.cfg.chunk_timeout:
                return self._hold("chunk_timeout", f"no fresh chunk for {now - self.last_chunk_at:.2f} s "
                                                   f"(execution.chunk_timeout {self.cfg.chunk_timeout} s)",
                                  self.last_chunk_at + self.cfg.chunk_timeout, now)
            target = self.plan.sample(now)
            if target is None:
                return self._hold("ran_out", f"the last chunk ran out {now - self.plan.end_time():.2f} s ago")
            self.status = Status("running", f"executing, delay {self.last_offer.delay_steps} steps")
            self.counts["ticks_commanded"] += 1
            return self.filter(target, self._state, self.counts)

    # ------------------------------------------------------------------ requests and trajectories
    def wants_chunk(self, now: float) -> bool:
        """``execution.request: threshold``: True when less than ``chunk_size_threshold`` of a chunk is left."""
        if self.cfg.request == "every_frame":
            return True
        with self._lock:
            return self.plan.steps_left(now) < self.cfg.chunk_size_threshold * self.plan.horizon

    def rtc_guidance(self, t_obs: float):
        """The Real-Time Chunking guidance for a frame stamped ``t_obs`` (None without a previous chunk)."""
        from ..model.heads.rtc import RTCGuidance
        with self._lock:
            prev = self.plan.leftover(t_obs)
            if prev is None:
                return None
            rtc = self.cfg.rtc
            return RTCGuidance(prev_chunk=prev, inference_delay=self.plan.inference_delay(),
                               execution_horizon=rtc.execution_horizon, schedule=rtc.schedule,
                               max_guidance_weight=rtc.max_guidance_weight, flavour=rtc.guidance)

    def trajectory(self, now: float) -> list[tuple[float, np.ndarray]]:
        """(seconds from ``now``, positions) for ``joint_trajectory``: the plan's rows at least one control period
        plus ``lookahead`` ahead of ``now`` (so that none is in the past when the controller takes the message,
        which joint_trajectory_controller would drop or jerk to), passed through a copy of the limits from the
        last command, so the first point continues from it; empty while disabled or holding."""
        with self._lock:
            if not self.enabled or self.status.state != "running":
                return []
            f = self.filter.copy(self.plan.period)
            scratch: Counter = Counter()
            out = []
            first = now + self.dt + self.cfg.lookahead
            for t, row in zip(self.plan.times, self.plan.actions):
                if t >= first - 1e-9:
                    if f.last is not None:
                        f.dt = t - now if not out else t - (now + out[-1][0])
                    out.append((t - now, f(row, self._state, scratch)))
            return out


class ControlLoop:
    """``send(controller.tick(clock()))`` once per control period, in a thread of its own.

    Paced on an absolute schedule of the monotonic clock, so ticks neither drift nor bunch: a tick that comes
    late (the process was busy) is counted in :attr:`late_ticks` with the largest lateness, and the next one
    keeps the schedule; one more than a period late skips the missed ticks rather than firing them at once.
    ``clock`` gives the time the controller works in (the node's ROS clock); ``send`` gets each command that
    is not None; ``on_error`` any exception of a tick (the loop goes on)."""

    def __init__(self, controller: Controller, clock, send, on_error=None, on_start=None, keep: int = 6000):
        self.controller, self.clock, self.send, self.on_error = controller, clock, send, on_error
        self.on_start = on_start  # called first in the loop's thread (its scheduling and cores)
        self.period = controller.dt
        self.ticks = self.late_ticks = self.skipped_ticks = 0
        self.max_late_s = 0.0
        self._lateness = np.zeros(keep)  # seconds each of the last ``keep`` ticks started after its time
        self.halted = False  # set (from a signal handler) to send nothing more, whatever the controller says
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="synflux-control", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def lateness(self) -> np.ndarray:
        """Seconds each of the last ticks (up to ``keep``) started after its scheduled time."""
        return self._lateness[:min(self.ticks, self._lateness.size)].copy()

    def _run(self) -> None:
        if self.on_start is not None:
            self.on_start()
        next_at = time.monotonic()
        while not self._stop.is_set():
            late = time.monotonic() - next_at
            self._lateness[self.ticks % self._lateness.size] = max(0.0, late)
            if late > 0.5 * self.period:
                self.late_ticks += 1
                self.max_late_s = max(self.max_late_s, late)
            try:
                cmd = None if self.halted else self.controller.tick(self.clock())
                if cmd is not None and not self.halted:
                    self.send(cmd)
            except Exception as exc:  # noqa: BLE001 - a failing tick is reported, the loop keeps the schedule
                if self.on_error is not None:
                    self.on_error(exc)
            self.ticks += 1
            next_at += self.period
            now = time.monotonic()
            if now - next_at > self.period:  # more than a tick behind: skip the missed ones
                missed = int((now - next_at) / self.period)
                self.skipped_ticks += missed
                next_at += missed * self.period
            self._stop.wait(max(0.0, next_at - time.monotonic()))
