"""The joint limiter in a fuzzed closed loop with the MuJoCo arm (``make bench-control`` runs it after
bench.control): hostile chunks (far outside the limits, flipping sign, huge, non-finite), joints held by an
obstacle or pushed, enable and disable at random, for ``--ticks`` control ticks. Every command is checked against
the limiter's invariant (docs/execution.md, "Limits"): its violations must be 0. Also the limiter's cost per
tick, and a plot of a braking approach to a position limit and of an enable from outside the limits.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from ..core.config import ExecutionConfig, LimitsConfig, load_config
from ..execution.controller import Controller
from ..tools.limiter_loop import fuzz
from .control import append_rows, row

BENCH = "bench.limiter: the joint limiter in a fuzzed MuJoCo closed loop (7 joints, 100 Hz)"
COMMAND = "python -m synflux_ros.bench.limiter"
T0 = 100.0  # the clock's start (a stamp of 0 means unstamped)


def arm_limits(base: LimitsConfig) -> LimitsConfig:
    """The sim arm's configured limits (config/vla_sim_arm.yaml) with acceleration, deceleration, jerk and a
    relative window added, so that every limit is exercised."""
    n = len(base.max_velocity)
    return LimitsConfig(position_min=base.position_min, position_max=base.position_max,
                        max_velocity=base.max_velocity, max_acceleration=(8.0,) * (n - 1) + (1.0,),
                        max_deceleration=(6.0,) * (n - 1) + (0.8,), max_jerk=(400.0,) * (n - 1) + (40.0,),
                        max_relative_target=(0.15,),
                        outside_at_enable="move_inside")


def traces(cfg: ExecutionConfig, step_period: float, horizon: int) -> dict:
    """Two scenes for the plot: full speed towards joint_1's upper limit; an enable with joint_2 outside."""
    c = Controller(cfg, step_period, horizon)
    q = np.zeros(len(cfg.joints))
    q[-1] = 0.02
    c.on_joint_state(T0, list(cfg.joints), list(q), T0)
    c.enable(T0)
    hi = cfg.limits.position_max[0]
    brake = []
    for k in range(400):
        t = T0 + k / cfg.control_rate_hz
        c.on_joint_state(t, list(cfg.joints), list(c.filter.last if c.filter.last is not None else q), t)
        if k % 5 == 0:
            target = q.copy()
            target[0] = hi + 5.0
            c.on_chunk(np.tile(target, (horizon, 1)), t, t)
        brake.append((t, c.tick(t)[0]))
    c2 = Controller(cfg, step_period, horizon)
    q2 = q.copy()
    q2[1] = cfg.limits.position_max[1] + 0.3  # moved by hand beyond its limit
    c2.on_joint_state(T0, list(cfg.joints), list(q2), T0)
    c2.enable(T0)
    enable = []
    for k in range(200):
        t = T0 + k / cfg.control_rate_hz
        c2.on_joint_state(t, list(cfg.joints), list(c2.filter.last), t)
        if k % 5 == 0:
            c2.on_chunk(np.tile(q, (horizon, 1)), t, t)
        enable.append((t, c2.tick(t)[1]))
    return {"brake": np.array(brake), "brake_limit": hi, "enable": np.array(enable),
            "enable_limit": cfg.limits.position_max[1]}


def plot(tr: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(11, 6), sharex="col")
    for col, (key, limit, title) in enumerate((("brake", tr["brake_limit"], "full speed towards a position limit"),
                                               ("enable", tr["enable_limit"], "enabled 0.3 rad outside its limit"))):
        t, x = tr[key][:, 0] - T0, tr[key][:, 1]
        v = np.gradient(x, t)
        axes[0, col].plot(t, x, label="command")
        axes[0, col].axhline(limit, color="r", ls="--", label="position limit")
        axes[0, col].set_title(title)
        axes[0, col].set_ylabel("position (rad)")
        axes[0, col].legend()
        axes[1, col].plot(t, v)
        axes[1, col].set_ylabel("velocity (rad/s)")
        axes[1, col].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"    plot: {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m synflux_ros.bench.limiter", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ticks", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default="", help="model YAML whose execution section is used (default: "
                    "the sim arm's, config/vla_sim_arm.yaml)")
    ap.add_argument("--plot", default="", help="write the braking and enable plot here (PNG)")
    ap.add_argument("--jsonl", default="", help="append the result rows to this JSON-lines file")
    args = ap.parse_args(argv)
    from ..tools.harness import config_path
    model = load_config(args.config or config_path("vla_sim_arm.yaml"))
    base = model.execution
    cfg = ExecutionConfig(joints=base.joints, control_rate_hz=base.control_rate_hz, chunk_timeout=0.3,
                          state_timeout=0.25, limits=arm_limits(base.limits))
    step, horizon = model.action.step_period, model.action.action_horizon
    print(f"[1] fuzzed closed loop: {args.ticks} ticks with the MuJoCo arm, seed {args.seed}")
    t0 = time.monotonic()
    res = fuzz(args.ticks, args.seed, cfg, step, horizon)
    took = time.monotonic() - t0
    bad, counts, us = res["violations"], res["counts"], res["tick_us"]
    total = sum(bad.values())
    print(f"    invariant violations: {total} {dict(bad) or ''} (must be 0)")
    print(f"    commanded {counts['ticks_commanded']}, held {counts['ticks_held']}; interventions: "
          + ", ".join(f"{k} {counts[k]}" for k in ("position_limit", "velocity_limit", "acceleration_limit",
                                                    "jerk_limit", "braking", "max_relative_target",
                                                    "relative_target_unmet", "braking_unmet", "jerk_unmet",
                                                    "chunks_refused")))
    print(f"    a commanded tick (controller and limiter): median {np.median(us):.1f} us, p99 {np.percentile(us, 99):.1f} us; "
          f"the loop took {took:.1f} s")
    rows = [row("invariant violations over a fuzzed closed loop", total, "commands",
                f"{args.ticks} ticks, seed {args.seed}; relative_target_unmet {counts['relative_target_unmet']} "
                f"(pushes and held joints), braking_unmet {counts['braking_unmet']}, jerk_unmet "
                f"{counts['jerk_unmet']} of {counts['ticks_commanded'] + counts['ticks_held']}", command=COMMAND,
                benchmark=BENCH),
            row("commanded controller tick with the limiter, median (p99)", f"{np.median(us):.1f} ({np.percentile(us, 99):.1f})",
                "us", "7 joints, numpy", command=COMMAND, benchmark=BENCH)]
    if args.plot:
        plot(traces(cfg, step, horizon), args.plot)
    if args.jsonl:
        append_rows(args.jsonl, rows)
    return 0 if total == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
