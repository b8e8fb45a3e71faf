"""Chunk execution on the small π0: switch jumps and command steps per merge mode, what Real-Time
Chunking costs, and the MuJoCo loop's command stream and watchdog.

    python -m synflux_ros.bench.control --ref-python .venv-pi0ref/bin/python \\
        --ref-script test/reference/lerobot_pi0.py [--work build/bench] [--threads 2] [--plot PNG] [--jsonl PATH]
    python -m synflux_ros.bench.control --quick       # a tiny config on the mock: no peers, no ROS

The chunks come from :meth:`VLARuntime.infer` and a :class:`Controller` executes them on a simulated clock
(:func:`simulate`): one frame every ``--every`` steps, its chunk arriving ``d`` steps later. The checkpoint
and graph set are those of :mod:`.pi0` (plus the ``action_expert_vjp`` graphs); LeRobot runs in its own
process (:mod:`.peer`). What each figure means and the targets: docs/benchmarks/commands.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import yaml

from ..core.config import ExecutionConfig, LimitsConfig, RTCConfig, load_config
from ..execution.controller import Controller
from . import pi0
from .peer import PeerFailure, failed_row

DELAYS = (2, 4, 8)
MODES = ("replace", "weighted_average", "temporal_ensemble", "rtc/lerobot", "rtc/vjp")
CONTROL_RATE_HZ = 100.0
EXECUTION_HORIZON = 10
"""RTC's execution horizon, and the steps between two frames (``--every``) unless told otherwise."""
TARGETS = {"rtc_jump": 0.25, "lerobot_time": 0.5, "vjp_time": 2.0}
BENCH_SWITCH = "bench.control: switch jumps and command steps, {model}, simulated clock"
BENCH_TIME = "bench.control: RTC chunk time, small π0"
BENCH_LOOP = "bench.control: MuJoCo arm and vla_node (mock) over DDS"
MACHINE = "2-core x86_64 VM, no GPU"
TOL = 1e-9


# ------------------------------------------------------------------------------------------------ inputs
class Frames:
    """Frame ``k``: a synthetic image (a coloured square drifting over a gradient, a new position each frame)
    and a slowly varying robot state (a sine per joint); the same for every mode and delay."""

    def __init__(self, side: int, state_dim: int, every_s: float):
        self.side, self.state_dim, self.every_s = side, state_dim, every_s
        y, x = np.mgrid[0:side, 0:side] / max(side - 1, 1)
        self.background = np.stack([200 * x, 200 * y, 120 + 0 * x], axis=-1)

    def image(self, k: int) -> np.ndarray:
        img = self.background.copy()
        r = self.side // 6
        cx = int((0.5 + 0.35 * math.cos(0.4 * k)) * (self.side - 2 * r)) + r
        cy = int((0.5 + 0.35 * math.sin(0.3 * k)) * (self.side - 2 * r)) + r
        img[cy - r:cy + r, cx - r:cx + r] = (230, 40, 40)
        return img.astype(np.uint8)

    def state(self, k: int) -> np.ndarray | None:
        if not self.state_dim:
            return None
        t = k * self.every_s
        j = np.arange(self.state_dim)
        return (0.3 * np.sin(2 * np.pi * 0.2 * t + j)).astype(np.float32)


class Chunks:
    """Chunks of frames from a runtime: (actions [horizon, joints], raw [horizon, action_dim]); unguided ones
    are computed once and shared by the modes and delays."""

    def __init__(self, runtime, frames: Frames):
        self.rt, self.frames = runtime, frames
        self.state_dim = runtime.cfg.action.state_dim  # the robot's joints, zero-padded as π0 pads them
        self._plain: dict[int, tuple] = {}
        self.calls = 0

    def __call__(self, k: int, rtc=None) -> tuple[np.ndarray, np.ndarray]:
        if rtc is None and k in self._plain:
            return self._plain[k]
        self.calls += 1
        f = self.rt.infer(self.frames.image(k), seq=k, state=self.state(k), rtc=rtc)
        out = (np.asarray(f.actions, np.float64), np.asarray(f.raw_actions, np.float32))
        if rtc is None:
            self._plain[k] = out
        return out

    def state(self, k: int) -> np.ndarray | None:
        q = self.frames.state(k)
        if q is None or not self.state_dim:
            return None
        return np.concatenate([q, np.zeros(self.state_dim - len(q), np.float32)])


def limits_for(chunks: Chunks, count: int, step_period: float) -> LimitsConfig:
    """Limits that bind now and then: position limits at the 2nd and 98th percentile of the unguided chunks'
    values per joint, and a speed limit at the 99th percentile of their speed within a chunk."""
    acts = np.stack([chunks(k)[0] for k in range(count)])  # [frames, horizon, joints]
    flat = acts.reshape(-1, acts.shape[-1])
    lo, hi = np.percentile(flat, 2, axis=0), np.percentile(flat, 98, axis=0)
    speed = np.abs(np.diff(acts, axis=1)).reshape(-1, acts.shape[-1]) / step_period
    vmax = np.maximum(np.percentile(speed, 99, axis=0), 1e-3)
    return LimitsConfig(position_min=tuple(map(float, lo)), position_max=tuple(map(float, hi)),
                        max_velocity=tuple(map(float, vmax)))


# ------------------------------------------------------------------------------------------ the simulation
@dataclass
class Run:
    """One mode at one delay: the commands per tick and what happened at each chunk switch."""
    mode: str
    delay: int
    times: np.ndarray = None
    commands: np.ndarray = None
    plan: np.ndarray = None  # the plan sampled at each tick, before the limits
    switch_times: list = field(default_factory=list)
    offer_jumps: list = field(default_factory=list)  # Offer.disagreement of each chunk after the first
    executed_jumps: list = field(default_factory=list)  # the plan at the switch time, after minus before
    executed_rows: list = field(default_factory=list)  # the same per joint
    counts: dict = field(default_factory=dict)
    limits_ok: bool = True
    limits_why: str = ""

    def summary(self) -> dict:
        steps = np.abs(np.diff(self.commands, axis=0)).max(axis=1) if len(self.commands) > 1 else np.zeros(1)
        plan_steps = np.abs(np.diff(self.plan, axis=0)).max(axis=1) if len(self.plan) > 1 else np.zeros(1)
        return {"mode": self.mode, "delay": self.delay, "switches": len(self.offer_jumps),
                "jump_mean": float(np.mean(self.offer_jumps)) if self.offer_jumps else 0.0,
                "jump_max": float(np.max(self.offer_jumps)) if self.offer_jumps else 0.0,
                "executed_jump_mean": float(np.mean(self.executed_jumps)) if self.executed_jumps else 0.0,
                "tick_step_max": float(steps.max()), "plan_step_max": float(plan_steps.max()),
                "limits_ok": self.limits_ok, "limits_why": self.limits_why,
                "interventions": {k: v for k, v in self.counts.items()
                                  if k in ("position_limit", "velocity_limit")}}


def execution_config(mode: str, joints: int, limits: LimitsConfig) -> ExecutionConfig:
    base, _, flavour = mode.partition("/")
    return ExecutionConfig(joints=tuple(f"joint_{i}" for i in range(joints)), mode=base,
                           control_rate_hz=CONTROL_RATE_HZ, state_timeout=0.0, chunk_timeout=1.0, limits=limits,
                           rtc=RTCConfig(guidance=flavour or "lerobot", execution_horizon=EXECUTION_HORIZON))


def simulate(chunks: Chunks, mode: str, delay: int, frames: int, every: int, step_period: float, horizon: int,
             limits: LimitsConfig) -> Run:
    """Drive a Controller on a simulated clock: frame k at ``t0 + k * every`` steps asks for a chunk (with
    ``rtc`` modes, guided by the plan in force at that moment, as vla_node takes the guidance when the head
    starts), which arrives ``delay`` steps later; one tick per control period from the first frame to
    ``every`` steps after the last arrival."""
    joints = len(limits.position_min)
    cfg = execution_config(mode, joints, limits)
    ctl = Controller(cfg, step_period, horizon)
    t0, dt = 1.0, 1.0 / CONTROL_RATE_HZ
    ctl.enable(t0)
    run = Run(mode, delay)
    pending: list[tuple[float, float, np.ndarray, np.ndarray]] = []  # (arrival, t_obs, actions, raw)
    next_frame = 0
    end = t0 + ((frames - 1) * every + delay + every) * step_period
    n_ticks = int(round((end - t0) / dt)) + 1
    times, cmds, plan = [], [], []
    for n in range(n_ticks):
        now = t0 + n * dt
        while pending and pending[0][0] <= now + TOL:
            arrival, t_obs, actions, raw = pending.pop(0)
            before = ctl.plan.sample(arrival)
            offer = ctl.on_chunk(actions, t_obs, arrival, raw)
            if offer.delay_steps != delay:
                raise RuntimeError(f"{mode}: chunk placed at step {offer.delay_steps}, expected {delay}")
            if before is not None:
                run.offer_jumps.append(offer.disagreement)
                run.executed_rows.append(np.abs(ctl.plan.sample(arrival) - before))
                run.executed_jumps.append(float(run.executed_rows[-1].max()))
                run.switch_times.append(arrival)
        while next_frame < frames and t0 + next_frame * every * step_period <= now + TOL:
            t_obs = t0 + next_frame * every * step_period
            rtc = ctl.rtc_guidance(t_obs) if cfg.guides_inference else None
            actions, raw = chunks(next_frame, rtc)
            pending.append((t_obs + delay * step_period, t_obs, actions, raw))
            next_frame += 1
        target = ctl.plan.sample(now)
        cmd = ctl.tick(now)
        if cmd is not None and target is not None:
            times.append(now)
            cmds.append(cmd)
            plan.append(target)
    run.times, run.commands, run.plan = np.array(times), np.array(cmds), np.array(plan)
    run.counts = dict(ctl.counts)
    run.limits_ok, run.limits_why = check_limits(run.commands, limits, dt)
    return run


def check_limits(cmds: np.ndarray, limits: LimitsConfig, dt: float) -> tuple[bool, str]:
    """True when every command lies within the position limits and no step between two ticks is faster than
    the speed limit; else False and the first violation."""
    lo, hi = np.asarray(limits.position_min), np.asarray(limits.position_max)
    out = (cmds < lo - TOL) | (cmds > hi + TOL)
    if out.any():
        i, j = np.argwhere(out)[0]
        return False, f"tick {i}, joint {j}: {cmds[i, j]:.4f} outside [{lo[j]:.4f}, {hi[j]:.4f}]"
    if limits.max_velocity and len(cmds) > 1:
        speed = np.abs(np.diff(cmds, axis=0)) / dt
        fast = speed > np.asarray(limits.max_velocity) * (1 + 1e-9) + TOL
        if fast.any():
            i, j = np.argwhere(fast)[0]
            return False, f"tick {i + 1}, joint {j}: {speed[i, j]:.4f}/s above {limits.max_velocity[j]:.4f}/s"
    return True, ""


def sweep(chunks: Chunks, frames: int, every: int, step_period: float, horizon: int, modes=MODES,
          delays=DELAYS) -> tuple[dict, LimitsConfig]:
    """Every mode at every delay on the same frames and limits: {(mode, delay): Run}."""
    limits = limits_for(chunks, frames, step_period)
    runs = {}
    for d in delays:
        if d >= every:
            raise ValueError(f"delay {d} steps: a frame every {every} steps would have two chunks in flight")
        for mode in modes:
            runs[(mode, d)] = simulate(chunks, mode, d, frames, every, step_period, horizon, limits)
    return runs, limits


# ----------------------------------------------------------------------------------------------- timings
def rtc_case(chunks: Chunks, delay: int = 4):
    """A guidance for frame 1 from frame 0's chunk: its leftover after ``delay`` steps, as the plan would have it."""
    from ..model.heads.rtc import RTCGuidance
    raw = chunks(0)[1][delay:]
    return raw, {flavour: RTCGuidance(prev_chunk=raw, inference_delay=delay, execution_horizon=EXECUTION_HORIZON,
                                      schedule="linear", max_guidance_weight=10.0, flavour=flavour)
                 for flavour in ("lerobot", "vjp")}


def chunk_times(chunks: Chunks, repeats: int, vjp: bool) -> dict:
    """Median milliseconds of a whole chunk (vision, prefix, denoising) unguided and with each RTC flavour,
    the three taken in turn so that the machine's drift touches each alike."""
    _, guides = rtc_case(chunks)
    kinds = ["plain", "lerobot"] + (["vjp"] if vjp else [])
    times = {k: [] for k in kinds}
    heads = {k: [] for k in kinds}
    img, state = chunks.frames.image(1), chunks.state(1)
    for i in range(repeats + 1):
        for k in kinds:
            t = time.perf_counter()
            f = chunks.rt.infer(img, seq=1, state=state, rtc=None if k == "plain" else guides[k])
            if i:  # the first round warms up
                times[k].append((time.perf_counter() - t) * 1e3)
                heads[k].append(f.timings["head_ms"])
    out = {k: statistics.median(v) for k, v in times.items()}
    out.update({f"{k}_min": min(v) for k, v in times.items()})
    out.update({f"{k}_head": statistics.median(v) for k, v in heads.items()})
    return out


def lerobot_times(args, ckpt: str, chunks: Chunks, cfg) -> dict:
    """LeRobot's predict_action_chunk, plain and with RTC (the same leftover, delay and schedule), on the
    checkpoint the graph set came from, with ``--threads`` torch threads, in its own process."""
    raw, _ = rtc_case(chunks)
    d = pi0.SIZES[args.size]
    inputs = os.path.join(args.work, f"control-{args.size}-inputs.npz")
    noise = chunks.rt.head.initial_noise(cfg.action.seed + 1)[0]
    np.savez(inputs, lang_tokens=np.frombuffer(pi0.INSTRUCTION.encode() + b"\n", np.uint8).astype(np.int64),
             state=chunks.frames.state(1), noise=noise, prev=raw,
             **{f"observation.images.{c}": chunks.frames.image(1) for c in args.cameras})
    cases = os.path.join(args.work, f"control-{args.size}-rtc.json")
    with open(cases, "w", encoding="utf-8") as fh:
        json.dump([{"prev_chunk": "prev", "inference_delay": 4, "execution_horizon": EXECUTION_HORIZON,
                    "schedule": "LINEAR", "max_guidance_weight": 10.0}], fh)
    if d["image_size"] != chunks.frames.side:
        raise ValueError("the frames do not match the checkpoint's image size")
    return pi0._reference(args, "run", "--checkpoint", ckpt, "--inputs", inputs, "--rtc", cases,
                          "--time", str(args.repeats), "--threads", str(args.threads))


# --------------------------------------------------------------------------------------------- runtimes
def prepare(args) -> tuple[str, str]:
    """(checkpoint dir, graph set dir): π0's bench checkpoint and a graph set of it with the action_expert_vjp
    graphs (built with execution.rtc.guidance vjp; the plain graphs are in it too)."""
    ckpt, _ = pi0.prepare(args)
    stem = pi0._stem(args)
    base = pi0.base_config(stem + "-base-vjp.yaml", args)
    with open(base, encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    raw["execution"] = {"mode": "rtc", "rtc": {"guidance": "vjp"}}
    with open(base, "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh)
    graphs = stem + "-graphs-vjp"
    from ..buildtool.export import main as build
    if build(["--config", base, "--out", graphs, "--from-hf", ckpt]):
        raise RuntimeError("synflux-build failed for the vjp graph set")
    return ckpt, graphs


def pi0_runtime(args, graphs: str):
    """The runtime on ``graphs`` with π0 bench's onnxruntime settings (shared pool, ``--threads``)."""
    from ..runtimes.vla import VLARuntime
    path = pi0.node_config(args, graphs, "shared")
    mine = pi0._stem(args) + "-control.yaml"
    os.replace(path, mine)
    cfg = load_config(mine)
    rt = VLARuntime(cfg)
    rt.set_instruction(pi0.INSTRUCTION)
    return cfg, rt


QUICK_CONFIG = {
    # a tiny flow-matching VLA for the mock backend (--quick): one 56x56 camera, a 32-step chunk of 7 joints
    "name": "control-quick", "mode": "vla",
    "vision": {"resolution": [56, 56], "tile_size": [56, 56], "tokens_per_tile": 16},
    "llm": {"num_layers": 2, "hidden_dim": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 512,
            "prefill_buckets": [64], "decode_buckets": [96], "max_seq_len": 96},
    "action": {"head_type": "flow_matching", "action_dim": 7, "action_horizon": 32, "step_period": 0.02,
               "num_denoise_steps": 10, "seed": 0},
    "execution": {"mode": "rtc", "rtc": {"guidance": "vjp"}},  # puts the vjp graphs in the mock's contract
    "executor": {"backend": "mock"},
}


def mock_runtime(work: str):
    """The mock backend on :data:`QUICK_CONFIG` (--quick)."""
    from ..runtimes.vla import VLARuntime
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, "control-quick.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(QUICK_CONFIG, fh)
    cfg = load_config(path)
    return cfg, VLARuntime(cfg)


# --------------------------------------------------------------------------------------------- reporting
def row(metric: str, value, unit: str, note: str = "", reference: str | None = None, ratio=None,
        command: str = "make bench-control", benchmark: str = BENCH_TIME) -> dict:
    return {"date": datetime.date.today().isoformat(), "machine": MACHINE, "benchmark": benchmark, "metric": metric,
            "value": value, "unit": unit, "reference": reference,
            "ratio": None if ratio is None else round(float(ratio), 3), "command": command, "note": note}


def print_sweep(runs: dict, limits: LimitsConfig, every: int, step_period: float, frames: int,
                model: str) -> list[dict]:
    print(f"\n[control] {frames} frames, one every {every} steps of {step_period * 1e3:.0f} ms, control at "
          f"{CONTROL_RATE_HZ:.0f} Hz; limits: position [2nd, 98th] percentile of the unguided chunks' values, "
          f"speed their 99th percentile (action units, per s)")
    print(f"    {'mode':<18} {'d':>2} {'switch jump mean':>17} {'max':>7} {'executed':>9} {'tick step max':>14} "
          f"{'(plan)':>7}  {'clamped pos/vel':>15}  limits")
    summaries = {}
    for (mode, d), run in sorted(runs.items(), key=lambda kv: (kv[0][1], MODES.index(kv[0][0]))):
        s = summaries[(mode, d)] = run.summary()
        iv = s["interventions"]
        print(f"    {mode:<18} {d:>2} {s['jump_mean']:17.4f} {s['jump_max']:7.4f} {s['executed_jump_mean']:9.4f} "
              f"{s['tick_step_max']:14.4f} {s['plan_step_max']:7.4f}  "
              f"{iv.get('position_limit', 0):>7}/{iv.get('velocity_limit', 0):<7}  "
              f"{'PASS' if s['limits_ok'] else 'FAIL ' + s['limits_why']}")
    rows = []
    for (mode, d), s in summaries.items():
        ref = summaries.get(("replace", d))
        ratio = s["jump_mean"] / ref["jump_mean"] if ref and ref["jump_mean"] > 0 and mode != "replace" else None
        rows.append(row(f"{mode}, d = {d}: mean switch jump", round(s["jump_mean"], 4), "action units",
                        note=f"max {s['jump_max']:.4f}; executed jump mean {s['executed_jump_mean']:.4f}; max step "
                             f"between ticks {s['tick_step_max']:.4f} (plan {s['plan_step_max']:.4f}); limits "
                             f"{'held' if s['limits_ok'] else 'BROKEN'}",
                        reference=None if ratio is None else f"replace: {ref['jump_mean']:.4f}", ratio=ratio,
                        benchmark=BENCH_SWITCH.format(model=model)))
    return rows


def plot(runs: dict, path: str, delay: int, every: int, step_period: float) -> str:
    """One joint's commands around a few chunk switches, a panel per mode; returns the path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    replace = runs[("replace", delay)]
    # the joint whose switches stand out most from its own motion between them
    own = np.median(np.abs(np.diff(replace.plan, axis=0)), axis=0) + 1e-9
    joint = int(np.argmax(np.mean(replace.executed_rows, axis=0) / own))
    sw = replace.switch_times
    lo_t, hi_t = sw[min(2, len(sw) - 1)] - every * step_period, sw[min(6, len(sw) - 1)] + every * step_period
    modes = [m for m in MODES if (m, delay) in runs]
    fig, axes = plt.subplots(len(modes), 1, figsize=(9, 1.9 * len(modes)), sharex=True, sharey=True)
    for ax, mode in zip(np.atleast_1d(axes), modes):
        r = runs[(mode, delay)]
        keep = (r.times >= lo_t) & (r.times <= hi_t)
        ax.plot((r.times[keep] - lo_t) * 1e3, r.commands[keep, joint], lw=1.2, label="joint_command")
        ax.plot((r.times[keep] - lo_t) * 1e3, r.plan[keep, joint], lw=0.8, ls=":", color="grey",
                label="plan before the limits")
        for t in r.switch_times:
            if lo_t <= t <= hi_t:
                ax.axvline((t - lo_t) * 1e3, color="tab:red", lw=0.6, ls="--")
        s = r.summary()
        ax.set_title(f"{mode}: mean switch jump {s['jump_mean']:.3f}", fontsize=9, loc="left")
        ax.set_ylabel(f"joint {joint}", fontsize=8)
    np.atleast_1d(axes)[0].legend(fontsize=7, loc="upper right")
    np.atleast_1d(axes)[-1].set_xlabel(f"ms (chunk switches dashed; delay {delay} steps)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def append_rows(path: str, rows: list[dict]) -> None:
    """Append benchmark rows (docs/benchmarks/results.jsonl's fields) to a JSON-lines file."""
    with open(path, "a", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"    {len(rows)} rows appended to {path}")


def judge(ok: bool | None) -> str:
    return "not judged" if ok is None else ("met" if ok else "NOT MET")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref-python", default=".venv-pi0ref/bin/python", help="python of the LeRobot venv")
    ap.add_argument("--ref-script", default="test/reference/lerobot_pi0.py")
    ap.add_argument("--work", default="build/bench")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--size", default="small", choices=sorted(pi0.SIZES))
    ap.add_argument("--cameras", default="base")
    ap.add_argument("--frames", type=int, default=24, help="frames per mode and delay")
    ap.add_argument("--every", type=int, default=EXECUTION_HORIZON, help="steps between two frames")
    ap.add_argument("--repeats", type=int, default=10, help="chunks timed per kind")
    ap.add_argument("--loop-seconds", type=float, default=10.0, help="the MuJoCo loop's run (0: skip it)")
    ap.add_argument("--plot", default="", help="PNG of one joint's commands per mode (default: WORK/control.png)")
    ap.add_argument("--jsonl", help="append the rows (docs/benchmarks/results.jsonl's fields) to this file")
    ap.add_argument("--label", default="", help="appended to each row's metric, e.g. 'run 1 of 2'")
    ap.add_argument("--quick", action="store_true", help="a tiny config on the mock backend: the simulated clock "
                                                         "only (no timings, no LeRobot, no MuJoCo)")
    args = ap.parse_args(argv)
    args.cameras = [c for c in args.cameras.split(",") if c]
    args.work = os.path.abspath(args.work)
    args.policy = "pi0"  # bench.pi0's checkpoint and graph set of π0 (its files are named by policy)
    os.makedirs(args.work, exist_ok=True)
    if args.quick:
        cfg, rt = mock_runtime(args.work)
        side = cfg.vision.resolution[0]
    else:
        if not os.path.isfile(args.ref_python):
            print(f"[control] {args.ref_python} not found (make pi0ref-venv)", file=sys.stderr)
            return 1
        ckpt, graphs = prepare(args)
        cfg, rt = pi0_runtime(args, graphs)
        side = pi0.SIZES[args.size]["image_size"]
    joints = len(cfg.action.state_joints) or cfg.action.state_dim
    frames = Frames(side, joints, args.every * cfg.action.step_period)
    chunks = Chunks(rt, frames)
    rows: list[dict] = []
    targets: list[tuple[str, bool | None, str]] = []
    try:
        runs, limits = sweep(chunks, args.frames, args.every, cfg.action.step_period, cfg.action.action_horizon)
        rows += print_sweep(runs, limits, args.every, cfg.action.step_period, args.frames,
                            "tiny config on the mock" if args.quick else f"{args.size} π0")
        d4 = {m: runs[(m, 4)].summary()["jump_mean"] for m in MODES}
        best = min(("rtc/lerobot", "rtc/vjp"), key=lambda m: d4[m])
        ratio = d4[best] / d4["replace"] if d4["replace"] > 0 else None
        targets.append((f"better RTC flavour's mean switch jump <= {TARGETS['rtc_jump']}x replace's at d = 4",
                        None if ratio is None else ratio <= TARGETS["rtc_jump"],
                        f"{best} {d4[best]:.4f} / replace {d4['replace']:.4f} = "
                        f"{'n/a' if ratio is None else f'{ratio:.3f}x'}"))
        broken = [f"{m} d={d}: {r.limits_why}" for (m, d), r in runs.items() if not r.limits_ok]
        targets.append(("no command outside the limits", not broken,
                        f"{len(runs)} runs, {sum(len(r.commands) for r in runs.values())} commands"
                        + (f"; {broken[0]}" if broken else "")))
        try:
            png = plot(runs, args.plot or os.path.join(args.work, "control.png"), 4, args.every,
                       cfg.action.step_period)
            print(f"    plot: {png}")
        except ImportError as exc:
            print(f"    no plot: {exc} (make bench-control installs matplotlib from requirements-bench.txt)")

        if not args.quick:
            t = chunk_times(chunks, args.repeats, vjp=True)
            try:
                ref = lerobot_times(args, ckpt, chunks, cfg)
            except PeerFailure as exc:
                ref = failed_row("LeRobot predict_action_chunk (RTC)", exc)
            print(f"\n[control] chunk time, median of {args.repeats} ({args.threads} threads, onnxruntime shared "
                  f"pool; CPU timing, not device timing)")
            print(f"    synflux plain {t['plain']:7.1f} ms   rtc lerobot {t['lerobot']:7.1f} ms   "
                  f"rtc vjp {t['vjp']:7.1f} ms ({t['vjp'] / t['plain']:.2f}x plain)")
            print(f"    of which denoising: plain {t['plain_head']:7.1f} ms   rtc lerobot {t['lerobot_head']:7.1f} "
                  f"ms   rtc vjp {t['vjp_head']:7.1f} ms ({t['vjp_head'] / t['plain_head']:.2f}x plain)")
            vjp_ok = t["vjp"] / t["plain"] <= TARGETS["vjp_time"]
            rows.append(row("synflux chunk, rtc vjp", round(t["vjp"], 1), "ms", reference=f"synflux plain chunk: "
                            f"{t['plain']:.1f} ms", ratio=t["vjp"] / t["plain"],
                            note=f"target <= {TARGETS['vjp_time']}x; denoising alone {t['vjp_head']:.1f} vs "
                                 f"{t['plain_head']:.1f} ms; median of {args.repeats}, {args.threads} threads"))
            targets.append((f"vjp flavour's chunk time <= {TARGETS['vjp_time']}x our plain chunk", vjp_ok,
                            f"{t['vjp']:.1f} / {t['plain']:.1f} ms = {t['vjp'] / t['plain']:.2f}x"))
            if "failed" in ref:
                from .llm import print_failed
                print_failed(ref, "    ")
                targets.append((f"lerobot flavour's chunk time <= {TARGETS['lerobot_time']}x LeRobot's RTC", None,
                                f"LeRobot failed: {ref['failed']}"))
            else:
                # LeRobot's calls run in a block of their own, not interleaved with ours: on a machine shared
                # with other work the fastest call of each side is the figure the other work touches least,
                # so the target is judged on those; the medians are printed beside them.
                lr, lr_min = float(ref["rtc_median_ms"]), float(ref["rtc_min_ms"])
                print(f"    LeRobot predict_action_chunk plain {ref['median_ms']:7.1f} ms   with RTC {lr:7.1f} ms "
                      f"(torch {args.threads} threads)")
                print(f"    fastest of {args.repeats}: synflux rtc lerobot {t['lerobot_min']:7.1f} ms   LeRobot RTC "
                      f"{lr_min:7.1f} ms (medians: {t['lerobot'] / lr:.2f}x)")
                r = t["lerobot_min"] / lr_min
                rows.append(row("synflux chunk, rtc lerobot (fastest of the calls)", round(t["lerobot_min"], 1), "ms",
                                reference=f"LeRobot 0.4.4 RTC chunk: {lr_min:.1f} ms", ratio=r,
                                note=f"target <= {TARGETS['lerobot_time']}x; medians {t['lerobot']:.1f} and {lr:.1f} "
                                     f"ms ({t['lerobot'] / lr:.2f}x); LeRobot plain {ref['median_ms']:.1f} ms; "
                                     f"{args.repeats} calls each, {args.threads} threads"))
                targets.append((f"lerobot flavour's chunk time <= {TARGETS['lerobot_time']}x LeRobot's RTC chunk",
                                r <= TARGETS["lerobot_time"], f"fastest {t['lerobot_min']:.1f} / {lr_min:.1f} ms = "
                                                              f"{r:.2f}x (medians {t['lerobot'] / lr:.2f}x)"))
            if args.loop_seconds > 0:
                loop = mujoco_loop(args)
                rows += loop_rows(loop, targets)
    finally:
        rt.close()

    print("\n[control] targets (this run)")
    for what, ok, detail in targets:
        print(f"    {judge(ok):<10} {what}: {detail}")
    if args.label:
        for r in rows:
            r["metric"] += f", {args.label}"
    if args.jsonl:
        append_rows(args.jsonl, rows)
    return 0


# -------------------------------------------------------------------------------------------- the loop
def mujoco_loop(args) -> dict:
    """The MuJoCo arm and vla_node (mock, config/vla_sim_arm.yaml) as processes over DDS
    (:mod:`..tools.control_loop`); a dict with ``failed`` when it cannot run here."""
    try:
        import mujoco  # noqa: F401
        from ..tools.control_loop import measure
    except ImportError as exc:
        return {"failed": f"not available: {exc}"}
    try:
        return measure(args.loop_seconds, args.work)
    except Exception as exc:  # a loop that does not start loses its rows, not the table's
        return {"failed": f"{type(exc).__name__}: {exc}"}


def loop_rows(m: dict, targets: list) -> list[dict]:
    bench = BENCH_LOOP
    print("\n[control] MuJoCo loop (sim_robot_node + vla_node on the mock, processes over DDS)")
    if "failed" in m:
        print(f"    failed: {m['failed']}")
        targets.append(("watchdog holds within one control tick", None, m["failed"]))
        return []
    tick = 1e3 / m["control_rate_hz"]
    print(f"    {m['commands']} joint_command in {m['seconds']:.1f} s ({m['commands'] / m['seconds']:.1f} Hz); stalls "
          f"(gaps > 2 ticks) seen here: {m['stalls']}, largest gap {m['largest_gap_ms']:.1f} ms; in vla_node "
          f"{m['node_ticks_late']} of {m['node_ticks']} ticks more than half a tick late, the latest by "
          f"{m['node_max_late_ms']:.1f} ms")
    print(f"    tracking delay (commanded -> measured, least-squares lag, mean over {m['tracked_joints']} joints): "
          f"{m['tracking_delay_ms']:.1f} ms")
    held = m.get("hold_after_timeout_ms")
    reaction = m.get("hold_reaction_ms", float("nan"))
    print(f"    watchdog: frames stopped; vla_node held {reaction:.1f} ms after its chunk_timeout expired (its own "
          f"clock: the expiry to the holding tick); here the first held command arrived "
          f"{'never' if held is None else f'{held:+.1f} ms'} after the last chunk's arrival plus the timeout "
          f"({m['chunk_timeout_s']} s; includes DDS both ways); one tick = {tick:.1f} ms; vla_node says "
          f"{m['hold_reason']!r}, holds {m['holds']}")
    judged = reaction == reaction  # not NaN: the node reported a timeout hold
    targets.append(("watchdog holds within one control tick", reaction <= tick if judged else None,
                    f"{reaction:.1f} ms (tick {tick:.1f} ms)" if judged else "no timeout hold reported"))
    note = f"{m['seconds']:.0f} s, {m['control_rate_hz']:.0f} Hz commands"
    return [row("joint_command stalls (gaps > 2 ticks)", m["stalls"], "", benchmark=bench,
                note=f"largest gap {m['largest_gap_ms']:.1f} ms, as received; in vla_node {m['node_ticks_late']} "
                     f"of {m['node_ticks']} ticks over half a tick late (at most {m['node_max_late_ms']:.1f} ms); "
                     f"{note}"),
            row("mean tracking delay, commanded to measured", round(m["tracking_delay_ms"], 1), "ms", benchmark=bench,
                note=f"least-squares lag over {m['tracked_joints']} joints; {note}"),
            row("watchdog: hold after the chunk_timeout expired (vla_node's clock)",
                round(reaction, 1) if judged else "none", "ms", benchmark=bench,
                note=f"target <= one tick ({tick:.0f} ms); chunk_timeout {m['chunk_timeout_s']} s; "
                     f"vla_node: {m['hold_reason']}"),
            row("watchdog: first held command here after the last chunk's arrival plus the timeout",
                "none" if held is None else round(held, 1), "ms", benchmark=bench,
                note="end to end: includes the chunk's and the command's trip over DDS")]


if __name__ == "__main__":
    raise SystemExit(main())
