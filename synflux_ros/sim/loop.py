"""The physics thread (ROS-free): steps a :class:`.robot.SimRobot`, applies the newest command, calls periodic
hooks on simulated time.

Callers from other threads only store a target under a lock (:meth:`SimLoop.command`); the physics thread
takes it before its next step. With ``real_time`` the loop keeps simulated time on the wall clock (it sleeps
when ahead; when it is more than ``max_lag_s`` behind, it drops the backlog and counts a lag reset rather than
racing to catch up); without, it steps as fast as it can.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from .robot import CommandError, SimRobot


@dataclass
class Tick:
    """``callback(robot)`` every ``1 / rate_hz`` of simulated time, in the physics thread."""
    rate_hz: float
    callback: Callable[[SimRobot], None]


RATE_WINDOW_S = 1.0
"""The physics rate is measured over this much wall time."""


class SimLoop:
    def __init__(self, robot: SimRobot, real_time: bool = True, ticks=(), max_lag_s: float = 0.1,
                 name: str = "sim-physics"):
        self.robot = robot
        self.real_time = real_time
        self.ticks = list(ticks)
        self.max_lag_s = max_lag_s
        self._lock = threading.Lock()
        self._pending = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._name = name
        self.steps = 0
        self.lag_resets = 0
        self.commands = 0
        self.refused = 0
        self.clamped = 0
        self.last_refusal = ""
        self._samples = deque()  # (wall s, steps, sim s)
        self.error = ""

    # ------------------------------------------------------------------ called from other threads
    def command(self, values) -> str:
        """Store a joint target for the next step; "" when taken, else why it was refused (the last target is
        held). Targets outside a joint's range are clamped to it and counted."""
        try:
            target, clamped = self.robot.check_command(values)
        except CommandError as exc:
            with self._lock:
                self.refused += 1
                self.last_refusal = str(exc)
            return str(exc)
        with self._lock:
            self.commands += 1
            self.clamped += clamped
            self._pending = target
        return ""

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            alive = self._thread.is_alive()
            self._thread = None if not alive else self._thread
            return not alive
        return True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def counters(self) -> dict:
        """Commands taken, refused and clamped so far, and the reason of the last refusal."""
        with self._lock:
            return dict(commands=self.commands, refused=self.refused, clamped=self.clamped,
                        last_refusal=self.last_refusal)

    def rates(self) -> tuple[float, float]:
        """(physics steps per wall second, simulated seconds per wall second) over the last second."""
        with self._lock:
            if len(self._samples) < 2:
                return 0.0, 0.0
            (w0, s0, t0), (w1, s1, t1) = self._samples[0], self._samples[-1]
        span = w1 - w0
        return ((s1 - s0) / span, (t1 - t0) / span) if span > 0 else (0.0, 0.0)

    # ------------------------------------------------------------------ the physics thread
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # reported in diagnostics; the thread ends
            self.error = f"{type(exc).__name__}: {exc}"

    def _loop(self) -> None:
        robot, dt = self.robot, self.robot.timestep
        due = [robot.time + 1.0 / t.rate_hz for t in self.ticks]
        wall0, steps0 = time.monotonic(), 0
        next_sample = wall0
        while not self._stop.is_set():
            if self.real_time:
                now = time.monotonic()
                behind = (now - wall0) / dt - steps0  # steps owed to the wall clock
                if behind < 1.0:
                    time.sleep((1.0 - behind) * dt)
                    continue
                if behind * dt > self.max_lag_s:
                    self.lag_resets += 1
                    wall0, steps0 = now - dt, 0
            with self._lock:
                target, self._pending = self._pending, None
            if target is not None:
                robot.set_target(target)
            robot.step()
            steps0 += 1
            self.steps += 1
            t = robot.time
            for i, tick in enumerate(self.ticks):
                if t >= due[i] - 1e-9:
                    due[i] += 1.0 / tick.rate_hz
                    if due[i] <= t:  # a rate above the physics rate: at most once a step
                        due[i] = t + 1.0 / tick.rate_hz
                    tick.callback(robot)
            now = time.monotonic()
            if now >= next_sample:
                next_sample = now + 0.05
                with self._lock:
                    self._samples.append((now, self.steps, t))
                    while self._samples and self._samples[0][0] < now - RATE_WINDOW_S:
                        self._samples.popleft()
