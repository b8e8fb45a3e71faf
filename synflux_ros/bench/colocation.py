"""`make bench-colocation`: the VLA's latency and command stream with a chat beside it on the same machine.

``vla_node`` (onnxruntime; the demo VLA, or with ``--vla pi0`` a small π0 whose chunk takes tens of ms here)
gets 448x448 frames at 10 Hz and joint states at 100 Hz and, enabled, sends ``joint_command`` at 100 Hz;
``vlm_node`` serves SmolLM2-135M (``make smollm2``) to two chat sessions kept busy. For each setting of
``--settings`` both nodes are started once and three phases run, ``--seconds`` each: the VLA alone (the chat
idle), the chat alone (no frames: the VLA's command loop holds), both. Figures per phase:

* VLA chunk latency, receipt to publish (``ActionChunk.latency_ms``), p50 and p99;
* the command thread's lateness from vla_node's ``/diagnostics`` (the last 6000 ticks: p99 and worst) and
  the ticks it skipped;
* the chat's tokens per second of its turns' own time (turns answered in the phase);
* the floor under the command thread: a bare tick in a process of its own on the same cores, one real-time
  priority below (``tools.tick_floor``), and the hypervisor's steal share; what the machine costs any thread.

Goals (docs/colocation.md), as ratios of "both" to "alone" in one run: VLA p50 <= 1.10x, p99 <= 1.15x, chat
>= 0.85x; command stream with the chat beside it: no skipped tick, p99 lateness <= 2 ms, worst <= 5 ms.
Settings (``SETTINGS``) are the parameters each node gets; ``default`` gives none.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import yaml

from ..core.sharing import parse_cpus
from ..tools.colocation import CAMERA_HZ, run_setting

ARBITER = "/dev/shm/synflux-bench-arbiter"
SETTINGS = {
    "default": ({}, {}),
    # the chat's threads run only on cores nothing else wants (Linux SCHED_IDLE, no privilege needed)
    "idle": ({}, {"model_scheduling": "idle"}),
    # the joint_command thread real-time (SCHED_FIFO 80)
    "fifo": ({"command_scheduling": "fifo:80"}, {}),
    # the accelerator arbiter alone: the chat's graph calls wait while a VLA frame is in flight
    "arbiter": ({"accelerator_arbiter": ARBITER, "arbiter_exclusive": False}, {"accelerator_arbiter": ARBITER}),
    # the cores split: the VLA (and its command thread, real-time) on core 0, the chat on the others, idle
    "partition": ({"cpus": "0", "command_scheduling": "fifo:80"}, {"cpus": f"1-{max(1, (os.cpu_count() or 2) - 1)}",
                                                                     "model_scheduling": "idle"}),
    # the VLA on every core, the chat kept to the last ones at idle (it takes what the VLA leaves there)
    "pin-chat": ({"command_scheduling": "fifo:80"}, {"cpus": f"1-{max(1, (os.cpu_count() or 2) - 1)}",
                                                     "model_scheduling": "idle"}),
    # what docs/colocation.md recommends on a CPU: all three
    "shared": ({"command_scheduling": "fifo:80", "accelerator_arbiter": ARBITER, "arbiter_exclusive": False},
               {"model_scheduling": "idle", "accelerator_arbiter": ARBITER}),
    # the same, with frames also waiting for the chat's running call (what a GPU needs)
    "shared-exclusive": ({"command_scheduling": "fifo:80", "accelerator_arbiter": ARBITER,
                          "arbiter_exclusive": True},
                         {"model_scheduling": "idle", "accelerator_arbiter": ARBITER}),
}
GOALS = {"vla_p50": 1.10, "vla_p99": 1.15, "chat": 0.85, "late_p99_ms": 2.0, "late_max_ms": 5.0}


def onnxruntime_set(work: str, config: str, name: str) -> str:
    """A node config running the shipped ``config`` (random weights) on onnxruntime, its graph set built once in
    ``work``; ``name`` names the files."""
    graphs = os.path.join(work, f"{name}-graphs")
    if not os.path.isfile(os.path.join(graphs, "manifest.json")):
        from ..buildtool.export import main as build
        from ..tools.harness import config_path
        if build(["--config", config_path(config), "--out", graphs]):
            raise RuntimeError("synflux-build failed")
    with open(os.path.join(graphs, "config.yaml"), encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    raw["executor"] = {"backend": "onnxruntime", "graph_dir": os.path.abspath(graphs)}
    path = os.path.join(work, f"{name}-colocation.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh)
    return path


def demo_vla(work: str, root: str) -> tuple[str, list[str], list[str], int]:
    """(node config, commanded joints, state joints, image side) of the demo VLA on onnxruntime."""
    path = onnxruntime_set(work, "vla_demo_orin.yaml", "vla_demo_orin")
    joints = [f"joint_{i}" for i in range(7)]
    return path, joints, joints, 448


def pi0_vla(work: str, root: str) -> tuple[str, list[str], list[str], int]:
    """The small π0 of ``bench.pi0`` (made by LeRobot in the repository's .venv-pi0ref once)."""
    from . import pi0
    args = argparse.Namespace(ref_python=os.path.join(root, ".venv-pi0ref", "bin", "python"),
                              ref_script=os.path.join(root, "test", "reference", "lerobot_pi0.py"), work=work,
                              threads=0, cameras=["base"], size="small", policy="pi0", spinning=False)
    _, graphs = pi0.prepare(args)
    path = pi0.node_config(args, graphs, "session")
    with open(path, encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    raw["executor"]["options"].pop("intra_op_num_threads", None)  # the backend's default, as the demo's
    raw["default_instruction"] = pi0.INSTRUCTION
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh)
    return path, pi0.JOINTS[:7], pi0.JOINTS, pi0.SIZES["small"]["image_size"]


def judge(alone: dict, chat: dict, both: dict) -> dict:
    """Ratios of ``both`` to the alone phases and the command stream's figures with the chat beside the VLA."""
    r = {"vla_p50": both["vla_p50_ms"] / alone["vla_p50_ms"], "vla_p99": both["vla_p99_ms"] / alone["vla_p99_ms"],
         "chat": both["chat_tok_s"] / chat["chat_tok_s"] if chat["chat_tok_s"] else float("nan"),
         "late_p99_ms": both.get("late_p99_ms", float("nan")), "late_max_ms": both.get("late_max_ms", float("nan")),
         "ticks_skipped": both.get("ticks_skipped", -1)}
    if "floor_late_max_ms" in both:  # the machine's own floor under the worst tick, for the reader; not a goal
        r["floor_late_max_ms"] = both["floor_late_max_ms"]
    r["met"] = bool(r["vla_p50"] <= GOALS["vla_p50"] and r["vla_p99"] <= GOALS["vla_p99"]
                    and r["chat"] >= GOALS["chat"] and r["late_p99_ms"] <= GOALS["late_p99_ms"]
                    and r["late_max_ms"] <= GOALS["late_max_ms"] and r["ticks_skipped"] == 0)
    return r


def demo_planner(work: str) -> str:
    """The demo VLM (random weights, with vision) on onnxruntime: the planner's model."""
    return onnxruntime_set(work, "vlm_demo.yaml", "vlm_demo")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vla", default="demo", choices=("demo", "pi0"))
    ap.add_argument("--settings", default="default,shared", help=f"comma-separated, of {', '.join(SETTINGS)}")
    ap.add_argument("--seconds", type=float, default=60.0, help="per phase (the lateness window is 6000 ticks)")
    ap.add_argument("--warmup", type=float, default=4.0)
    ap.add_argument("--root", default="..", help="the repository (engines/, .venv-pi0ref, test/); make runs "
                                                 "this from build/")
    ap.add_argument("--work", default="bench", help="where the graph sets are made, once")
    ap.add_argument("--vlm-config", help="default: <root>/engines/smollm2/config.yaml (make smollm2)")
    ap.add_argument("--planner", action="store_true", help="a fourth phase: both, with a second vlm_node (the demo "
                                                           "VLM) planning the VLA's instruction once a second")
    ap.add_argument("--camera-hz", type=float, default=CAMERA_HZ,
                    help="the frame rate (a VLA that cannot keep up queues its frames: its latency then measures "
                         "the queue)")
    ap.add_argument("--json", help="append one JSON line per setting here")
    args = ap.parse_args(argv)
    settings = [s for s in args.settings.split(",") if s]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        ap.error(f"unknown settings {unknown} (have: {', '.join(SETTINGS)})")
    if args.camera_hz <= 0:
        ap.error("--camera-hz must be positive")
    args.vlm_config = os.path.abspath(args.vlm_config or os.path.join(args.root, "engines", "smollm2", "config.yaml"))
    if not os.path.isfile(args.vlm_config):
        ap.error(f"no chat model at {args.vlm_config}: make smollm2")
    args.work = os.path.abspath(args.work)
    os.makedirs(args.work, exist_ok=True)
    vla_cfg, joints, state_joints, side = (pi0_vla if args.vla == "pi0" else demo_vla)(args.work, args.root)
    planner_cfg = demo_planner(args.work) if args.planner else None
    print(f"co-location: {args.vla} VLA at {args.camera_hz:g} Hz + SmolLM2 chat, 2 sessions; {os.cpu_count()} cores; "
          f"{args.seconds:g} s a phase")
    ok = True
    for name in settings:
        vla_params, vlm_params = SETTINGS[name]
        everywhere = os.sched_getaffinity(0)
        if vla_params.get("cpus") and vlm_params.get("cpus"):
            # the robot side (camera and joint-state drivers, here this process) off the VLA's cores, as the
            # integrator places them (docs/colocation.md); its threads inherit this
            os.sched_setaffinity(0, parse_cpus(vlm_params["cpus"]))
        try:
            rows = run_setting(vla_params, vlm_params, vla_cfg, joints, state_joints, side, args.vlm_config,
                               args.seconds, args.warmup, planner_cfg,
                               {"base/image": "image"} if args.vla == "pi0" else None,  # its camera is "base"
                               args.camera_hz)
        finally:
            os.sched_setaffinity(0, everywhere)
        missing = [row["phase"] for row in rows if "chat" not in row["phase"] and not row["chunks"]]
        if missing:
            raise RuntimeError(f"{name}: no chunks in {missing}: {rows}")
        ratios = {row["phase"]: judge(rows[0], rows[1], row) for row in rows[2:]}
        ok &= all(r["met"] for r in ratios.values())
        print(f"\n[{name}] vla_node {vla_params or '{}'}  vlm_node {vlm_params or '{}'}")
        for row in rows:
            print(f"    {row['phase']:<12}  VLA p50 {row.get('vla_p50_ms', float('nan')):7.2f} ms  p99 "
                  f"{row.get('vla_p99_ms', float('nan')):7.2f} ms ({row['chunks']} chunks)  chat "
                  f"{row['chat_tok_s']:6.1f} tok/s ({row['turns']} turns)  ticks late p99 "
                  f"{row.get('late_p99_ms', float('nan')):5.2f} ms  worst {row.get('late_max_ms', float('nan')):6.2f} ms"
                  f"  skipped {row.get('ticks_skipped', -1)}  cpu wait vla {row.get('vla_cpu_wait_share', 0):.1%}"
                  f" vlm {row.get('vlm_cpu_wait_share', 0):.1%}")
            if "floor_late_max_ms" in row:
                print(f"    {'':<12}  a bare tick on the command thread's cores: late p99 {row['floor_late_p99_ms']:.2f} ms, "
                      f"worst {row['floor_late_max_ms']:.2f} ms, skipped {row['floor_ticks_skipped']}; steal "
                      f"{row['steal_share']:.1%}" + (f" (not applied: {row['floor_warning']})" if row["floor_warning"]
                                                     else ""))
            if "stages_p50_ms" in row:
                print(f"    {'':<12}  of which in the stages: p50 {row['stages_p50_ms']:.2f} ms, p99 "
                      f"{row['stages_p99_ms']:.2f} ms; slowest chunk {row['vla_max_ms']:.1f} ms")
            if "planner_requests" in row:
                print(f"    {'':<12}  planner: {row['planner_requests']} questions, {row['planner_published']} "
                      f"subtasks published ({row['planner_unchanged']} unchanged); vla_node's instruction "
                      f"{row['vla_instruction']!r}")
        warn = rows[-1].get("vla_warnings")
        if warn:
            print(f"    vla_node warned: {warn}")
        for phase_name, r in ratios.items():
            print(f"    {phase_name}/alone: VLA p50 {r['vla_p50']:.2f}x (<= {GOALS['vla_p50']}), p99 "
                  f"{r['vla_p99']:.2f}x (<= {GOALS['vla_p99']}), chat {r['chat']:.2f}x (>= {GOALS['chat']}); "
                  f"commands: late p99 {r['late_p99_ms']:.2f} ms (<= 2), worst {r['late_max_ms']:.2f} ms (<= 5), "
                  f"skipped {r['ticks_skipped']} (0)  {'MET' if r['met'] else 'NOT MET'}"
                  + (f"; the bare tick's worst {r['floor_late_max_ms']:.2f} ms" if "floor_late_max_ms" in r else ""))
        if args.json:
            with open(args.json, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"vla": args.vla, "setting": name, "camera_hz": args.camera_hz, "rows": rows,
                                     "ratios": ratios}) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
