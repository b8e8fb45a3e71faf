"""The joint limiter in a closed loop with the MuJoCo arm, fuzzed (bench.limiter): the loop lives here because
it drives the simulator (tools/ may import sim/, the benchmarks may not)."""
from __future__ import annotations

import time
from collections import Counter

import numpy as np

from ..core.config import ExecutionConfig
from ..execution.controller import Controller
from ..execution.plan import ChunkRefused

EPS = 1e-9
T0 = 100.0  # the clock's start (a stamp of 0 means unstamped)


def violations(lim, prev_cmd, prev_v, cmd, measured, rel_unmet: bool, prev_a=None, jerk_unmet: bool = False) \
        -> Counter:
    """The invariant's breaches by one command (an empty Counter when it holds); ``prev_a`` (the previous
    command's acceleration) checks max_jerk, except on a tick that counted ``jerk_unmet``."""
    bad: Counter = Counter()
    w = (cmd - prev_cmd) / lim.dt
    if np.any(np.abs(w) > lim.vmax * (1 + 1e-9) + EPS):
        bad["velocity"] += 1
    dv = w - prev_v
    slowing = (np.sign(prev_v) != 0) & (np.sign(dv) == -np.sign(prev_v)) & (np.abs(w) <= np.abs(prev_v))
    bound = np.where(slowing, lim.dmax, np.maximum(lim.amax, lim.dmax)) * lim.dt
    if np.any(np.abs(dv) > bound * (1 + 1e-9) + EPS):
        bad["acceleration"] += 1
    if prev_a is not None and not jerk_unmet and \
            np.any(np.abs(dv / lim.dt - prev_a) > lim.jmax * lim.dt * (1 + 1e-9) + EPS / lim.dt):
        bad["jerk"] += 1
    inside = (prev_cmd >= lim.lo - EPS) & (prev_cmd <= lim.hi + EPS)
    if np.any(inside & ((cmd < lim.lo - EPS) | (cmd > lim.hi + EPS))):
        bad["position"] += 1
    if not rel_unmet and np.any(np.abs(cmd - measured) > lim.rel + 1e-9):
        bad["relative_target"] += 1
    return bad


def fuzz(ticks: int, seed: int, cfg: ExecutionConfig, step_period: float, horizon: int) -> dict:
    """The closed loop: returns the violations, the controller's counts and the limiter's time per tick."""
    from ..sim.robot import SimRobot
    robot = SimRobot(joint_names=cfg.joints, physics_rate_hz=500.0, render=False)
    substeps = int(round(500.0 / cfg.control_rate_hz))
    c = Controller(cfg, step_period, horizon)
    lim = c.filter
    rng = np.random.default_rng(seed)
    n = len(cfg.joints)
    bad: Counter = Counter()
    tick_s: list[float] = []
    held: dict[int, float] = {}  # joint -> the position an obstacle holds it at
    t, prev = 0.0, None
    for k in range(ticks):
        t = T0 + k / cfg.control_rate_hz
        measured = robot.positions()
        for j, at in list(held.items()):
            measured[j] = at
            if rng.random() < 0.01:
                del held[j]
        if rng.random() < 0.002:  # an obstacle stops a joint where it is
            j = int(rng.integers(n))
            held[j] = measured[j]
        if rng.random() < 0.001:  # a push (or a measurement jump)
            measured = measured + rng.normal(0, 0.2, n)
        c.on_joint_state(t, list(cfg.joints), list(measured), t)
        event = rng.random()
        if event < 0.002:
            c.disable("fuzz")
            prev = None
        elif event < 0.006:
            try:
                c.enable(t)
            except ValueError:
                pass
        if k % 5 == 0:
            kind = rng.random()
            chunk = measured + rng.normal(0, 1, (horizon, n)) * 10.0 ** rng.integers(-2, 3)
            if kind < 0.1:
                chunk *= -1
            elif kind < 0.13:
                chunk[int(rng.integers(horizon)), int(rng.integers(n))] = rng.choice([np.nan, np.inf])
            try:
                c.on_chunk(chunk, t, t)
            except ChunkRefused:
                pass
        before = Counter(c.counts)
        t0 = time.perf_counter()
        cmd = c.tick(t)
        if cmd is not None:  # the cost of a commanded tick (a disabled one returns at once)
            tick_s.append(time.perf_counter() - t0)
        if cmd is None:
            prev = None
        else:
            if prev is not None:
                bad.update(violations(lim, prev[0], prev[1], cmd, measured,
                                      c.counts["relative_target_unmet"] > before["relative_target_unmet"], prev[2],
                                      c.counts["jerk_unmet"] > before["jerk_unmet"]))
            prev = (cmd, lim.velocity.copy(), lim.accel.copy())
            target, _ = robot.check_command(cmd)
            robot.set_target(target)
        robot.step(substeps)
    return {"violations": bad, "counts": Counter(c.counts), "tick_us": np.array(tick_s) * 1e6, "ticks": ticks}


