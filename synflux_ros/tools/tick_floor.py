"""How late this machine starts a periodic tick with no node around it: the floor under the command thread.

A :class:`~synflux_ros.execution.controller.ControlLoop` (the same pacing as vla_node's ``joint_command``
thread) whose controller commands nothing, in a process of its own, on the cores and at the policy given (as
``command_cpus`` / ``command_scheduling``). What it measures is what the kernel, the hypervisor and the other
processes cost a real-time thread; none of it is an interpreter lock or a node. ``bench.colocation`` runs one
beside vla_node in every phase; on a robot, run it before blaming the node:

    python -m synflux_ros.tools.tick_floor --cpus 2 --scheduling fifo:80 --seconds 60

``steal_share`` is the share of the machine's CPU time its hypervisor gave to others meanwhile (``/proc/stat``;
0 on bare metal).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

from ..core.sharing import Scheduling, apply_to_threads, parse_cpus, parse_scheduling
from ..execution.controller import ControlLoop


class _Nothing:
    """A controller that never commands: the loop's own timing is all that is measured."""

    def __init__(self, rate_hz: float) -> None:
        self.dt = 1.0 / rate_hz

    @staticmethod
    def tick(now: float) -> None:
        return None


def cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies of the whole machine so far, from ``/proc/stat`` ((0, 0) where it is missing)."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = [int(v) for v in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    fields += [0] * (8 - len(fields))
    return fields[7], sum(fields)


def measure(seconds: float, rate_hz: float = 100.0, sched: Scheduling | None = None,
            cpus: frozenset[int] = frozenset()) -> dict:
    """Run the loop for ``seconds`` in a thread of this process with ``sched`` and ``cpus`` (each None/empty:
    left as they are); its lateness, late and skipped ticks, the steal share, the policy number and cores the
    thread had, and why a setting was not applied (``warning``; the loop then ran without it)."""
    if seconds <= 0 or rate_hz <= 0:
        raise ValueError(f"seconds {seconds} and rate_hz {rate_hz} must be positive")
    applied: dict = {}

    def on_start() -> None:  # in the loop's thread: its settings, then what it got
        applied["warning"] = apply_to_threads(sched, cpus, [threading.get_native_id()]) or ""
        applied["policy"] = os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else -1
        applied["cpus"] = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

    loop = ControlLoop(_Nothing(rate_hz), time.monotonic, lambda cmd: None, on_start=on_start,
                       keep=int(seconds * rate_hz) + 2)
    steal0, total0 = cpu_times()
    loop.start()
    time.sleep(seconds)
    loop.stop()
    steal1, total1 = cpu_times()
    late = loop.lateness() * 1e3
    return {"ticks": loop.ticks, "late_p99_ms": float(np.percentile(late, 99)) if late.size else float("nan"),
            "late_max_ms": float(late.max()) if late.size else float("nan"), "ticks_late": loop.late_ticks,
            "ticks_skipped": loop.skipped_ticks,
            "steal_share": (steal1 - steal0) / (total1 - total0) if total1 > total0 else 0.0,
            "warning": applied.get("warning", "the loop did not start"), "policy": applied.get("policy", -1),
            "cpus": applied.get("cpus", [])}


class FloorProbe:
    """:func:`measure` in a child process (``python -m synflux_ros.tools.tick_floor --json``): started with
    :meth:`run_for`, its figures from :meth:`result` once its ``seconds`` are over."""

    def __init__(self, scheduling: str = "normal", cpus: str = "", rate_hz: float = 100.0) -> None:
        parse_scheduling(scheduling), parse_cpus(cpus)  # a bad value fails here, not in the child
        self.args = ["--scheduling", scheduling, "--cpus", cpus, "--rate", str(rate_hz)]
        self._proc: subprocess.Popen | None = None

    def run_for(self, seconds: float) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", __name__, "--json", "--seconds", str(seconds),
                                       *self.args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(self, timeout: float = 30.0) -> dict:
        """The child's figures; RuntimeError with its stderr when it failed."""
        out, err = self._proc.communicate(timeout=timeout)
        if self._proc.returncode:
            raise RuntimeError(f"tick_floor exited with {self._proc.returncode}: {err.strip()[-2000:]}")
        return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=100.0, help="ticks per second (execution.control_rate_hz)")
    ap.add_argument("--scheduling", default="normal", help="normal[:nice] or fifo:N / rr:N, as command_scheduling")
    ap.add_argument("--cpus", default="", help="e.g. '2' or '0,2' (empty: every core), as command_cpus")
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the sentence")
    args = ap.parse_args(argv)
    try:
        sched, cpus = parse_scheduling(args.scheduling), parse_cpus(args.cpus)
        r = measure(args.seconds, args.rate, sched, cpus or frozenset(range(os.cpu_count() or 1)))
    except ValueError as exc:  # a bad setting, or seconds/rate not positive (refused before the loop starts)
        ap.error(str(exc))
    if args.json:
        print(json.dumps(r), flush=True)
    else:
        print(f"{r['ticks']} ticks at {args.rate:g} Hz on cores {args.cpus or 'all'} ({sched}): lateness p99 "
              f"{r['late_p99_ms']:.2f} ms, worst {r['late_max_ms']:.2f} ms; {r['ticks_late']} more than half a "
              f"period late, {r['ticks_skipped']} skipped; steal {r['steal_share']:.1%}")
        if r["warning"]:
            print(f"not applied: {r['warning']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
