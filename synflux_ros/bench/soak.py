"""`make soak`: vla_node under a long camera stream; frame accounting, chunk latency and memory growth.

One ``vla_node`` (demo config, mock executor with simulated stage latencies: vision encoder 10 ms, prefill
30 ms, 10 action-expert steps of 2 ms) gets 448x448 rgb8 frames at each rate of ``--rates`` in turn
(default 30 Hz, then 60 Hz), ``--frames`` frames per rate (default 20,000: about 11 + 6 minutes). Per rate it
prints, from the node's ``/diagnostics`` (published every ``--diagnostics-period`` s) and the chunks
received:

* frames published by the camera, received by the node (the difference was lost in transport), chunks
  published, frames dropped (newest frame wins), rejected and failed;
* whether the node's accounting closes: received == published + dropped + rejected + failed + received
  while inactive + in flight, with nothing in flight once the stream has drained (target);
* no rejected or failed frames (target);
* chunk latency (frame receipt to chunk publication, ``ActionChunk.latency_ms``) p50 and p99;
* the node process's resident memory (VmRSS, sampled every ``--sample-s`` s) after a warm-up of
  ``--warmup-s`` s (at most a quarter of the rate's time) and at the end of the rate; target: growth
  within 5 MiB. On long runs the trend after the warm-up (MiB/min) is printed too.

At the end the node is stopped with SIGINT, which must end it with exit code 0 and no thread left
running (target). Prints the number of targets met; the exit code is 0 when all are.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np
import yaml

from ..nodes.diagnostics import subscribe_diagnostics
from ..nodes.process import LIVE_THREADS_MESSAGE
from ..tools.harness import NodeProcess, client_node, config_path, ros_env, spin_until, stream_camera

NAMESPACE = "/soak"
STAGE_LATENCY_MS = {"vision_encoder": 10.0, "prefill": 30.0, "action_expert": 2.0}
RSS_GROWTH_TARGET_MIB = 5.0
TREND_MIN_S = 120.0
"""The RSS trend (least-squares slope) is printed when the rate ran this long after its warm-up."""
COUNTS = ("frames_received", "frames_published", "frames_dropped", "frames_rejected", "frames_failed",
          "frames_while_inactive", "frames_no_state")


def rss_kib(pid: int) -> int:
    """Resident set size of a process (VmRSS in /proc/<pid>/status), KiB."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


class RssSampler:
    """Samples a process's VmRSS every ``period`` seconds from a thread: (monotonic s, KiB) pairs."""

    def __init__(self, pid: int, period: float):
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period)

    def sample(self) -> int:
        try:
            value = rss_kib(self.pid)
        except (OSError, RuntimeError):  # the process has ended
            return 0
        self.samples.append((time.monotonic(), value))
        return value

    def first_after(self, t: float) -> int:
        """The first sample taken at or after monotonic time ``t`` (0 when there is none)."""
        return next((kib for ts, kib in self.samples if ts >= t), 0)

    def between(self, t0: float, t1: float) -> list[int]:
        return [kib for ts, kib in self.samples if t0 <= ts <= t1]

    def slope_mib_per_min(self, t0: float, t1: float) -> float:
        """Least-squares slope of the samples between ``t0`` and ``t1`` (nan with fewer than 3)."""
        pts = [(ts, kib) for ts, kib in self.samples if t0 <= ts <= t1]
        if len(pts) < 3:
            return float("nan")
        t, k = np.array(pts, dtype=float).T
        return float(np.polyfit(t, k, 1)[0]) * 60.0 / 1024.0

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class NodeDiagnostics:
    """The newest /diagnostics values of the node under ``ns`` and when they arrived."""

    def __init__(self, node, ns: str):
        self.prefix = f"{ns}/vla_node:"
        self.values: dict[str, str] = {}
        self.received_at = 0.0
        self.sub = subscribe_diagnostics(node, self._on_status)

    def _on_status(self, name: str, values: dict[str, str]):
        if name.startswith(self.prefix):
            self.values, self.received_at = values, time.monotonic()

    def counts(self) -> dict[str, int]:
        return {k: int(self.values.get(k, 0)) for k in COUNTS + ("frames_in_flight",)}

    def number(self, key: str) -> float:
        return float(self.values.get(key, "nan"))

    def wait_fresh(self, node, after: float, timeout: float, drained: bool = True) -> bool:
        """Spin until values published after monotonic time ``after`` arrive (with nothing in flight when
        ``drained``)."""
        return spin_until(node, lambda: self.received_at > after and (
            not drained or int(self.values.get("frames_in_flight", -1)) == 0), timeout)


def write_config(latency_ms: dict) -> tuple[str, dict]:
    """The demo VLA config on the mock executor with simulated stage latencies: (path, config as a dict)."""
    with open(config_path("vla_demo_orin.yaml"), encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    raw["executor"]["backend"] = "mock"
    raw["executor"]["latency_ms"] = dict(latency_ms)
    path = os.path.join(tempfile.mkdtemp(prefix="synflux_soak_"), "vla_soak.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh)
    return path, raw


def mib(kib: int) -> float:
    return kib / 1024.0


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def soak_rate(node, proc: NodeProcess, diag: NodeDiagnostics, rss: RssSampler, rate: float, frames: int,
              warmup_s: float) -> list[bool]:
    """Stream ``frames`` frames at ``rate`` Hz and print the figures of this rate; returns the targets met."""
    before = diag.counts()
    seconds = (frames + 0.5) / rate  # stream_camera publishes int(seconds * rate) frames
    camera = int(seconds * rate)
    start = time.monotonic()
    chunks, _, _ = stream_camera(node, NAMESPACE, rate, seconds, warmup=0)
    streamed = time.monotonic()
    rates = {k: diag.number(k) for k in ("receive_rate_hz", "camera_rate_hz", "delivery_ratio",
                                         "latency_median_ms")}
    if not diag.wait_fresh(node, streamed, 30.0):
        raise RuntimeError(f"no drained /diagnostics from the node within 30 s: {diag.values}\n"
                           f"{proc.output()[-3000:]}")
    end_kib = rss.sample()
    after = diag.counts()
    d = {k: after[k] - before[k] for k in COUNTS}
    in_flight = after["frames_in_flight"]
    accounted = d["frames_published"] + d["frames_dropped"] + d["frames_rejected"] + d["frames_failed"] \
        + d["frames_while_inactive"] + d["frames_no_state"] + in_flight
    balanced = d["frames_received"] == accounted and in_flight == 0
    clean = d["frames_rejected"] == 0 and d["frames_failed"] == 0 and d["frames_no_state"] == 0
    warm = min(warmup_s, (streamed - start) / 4)
    warm_kib = rss.first_after(start + warm)
    phase = rss.between(start + warm, streamed) + [end_kib]
    growth = mib(end_kib - warm_kib)
    rss_ok = bool(warm_kib and end_kib) and growth <= RSS_GROWTH_TARGET_MIB
    lat = np.array([c.latency_ms for c in chunks]) if chunks else np.array([np.nan])

    print(f"\n[{rate:g} Hz] {camera} frames of 448x448 rgb8 in {streamed - start:.0f} s")
    print(f"    camera published         {camera}")
    print(f"    node received            {d['frames_received']}  ({camera - d['frames_received']} lost in transport)")
    print(f"    chunks published         {d['frames_published']}  (received here: {len(chunks)})")
    print(f"    dropped / rejected / failed / while inactive   {d['frames_dropped']} / {d['frames_rejected']} / "
          f"{d['frames_failed']} / {d['frames_while_inactive']}")
    print(f"    in flight after drain    {in_flight}")
    print(f"    received {d['frames_received']} == published + dropped + rejected + failed + inactive + in flight "
          f"{accounted}, nothing in flight: {verdict(balanced)}")
    print(f"    no rejected or failed frames: {verdict(clean)}")
    print(f"    chunk latency (receipt -> publish)  p50 {np.percentile(lat, 50):.1f} ms  p99 "
          f"{np.percentile(lat, 99):.1f} ms  (node's median of the last 200: {rates['latency_median_ms']:.1f} ms)")
    print(f"    node rates at the end: receiving {rates['receive_rate_hz']:.1f} Hz of a {rates['camera_rate_hz']:.1f} Hz "
          f"camera (delivery ratio {rates['delivery_ratio']:.2f})")
    print(f"    node RSS after {warm:.0f} s warm-up {mib(warm_kib):.1f} MiB, end {mib(end_kib):.1f} MiB, "
          f"max {mib(max(phase)):.1f} MiB: growth {growth:+.1f} MiB "
          f"(target <= {RSS_GROWTH_TARGET_MIB:g} MiB) {verdict(rss_ok)}")
    if streamed - start - warm >= TREND_MIN_S:
        print(f"    node RSS trend after warm-up {rss.slope_mib_per_min(start + warm, streamed + 1.0):+.3f} MiB/min")
    trace = rss.between(start, streamed) + [end_kib]
    picked = trace[::max(1, len(trace) // 12)]
    if (len(trace) - 1) % max(1, len(trace) // 12):
        picked.append(trace[-1])
    print(f"    node RSS over the rate, MiB: {' '.join(f'{mib(k):.1f}' for k in picked)}")
    return [balanced, clean, rss_ok]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=20000, help="frames per rate")
    ap.add_argument("--rates", type=float, nargs="+", default=[30.0, 60.0], help="camera rates, Hz, in order")
    ap.add_argument("--warmup-s", type=float, default=180.0,
                    help="seconds of each rate before the reference RSS sample (at most a quarter of the rate's "
                         "time): the allocator's per-thread arenas grow in steps during the first minutes")
    ap.add_argument("--sample-s", type=float, default=2.0, help="seconds between RSS samples")
    ap.add_argument("--diagnostics-period", type=float, default=0.5, help="the node's diagnostics_period")
    args = ap.parse_args(argv)
    if args.frames < 1 or any(r <= 0 for r in args.rates):
        ap.error("--frames and --rates must be positive")
    env = ros_env()
    cfg, raw = write_config(STAGE_LATENCY_MS)
    steps = raw["action"]["num_denoise_steps"]
    print(f"vla_node soak: demo config, mock executor, stage latencies vision {STAGE_LATENCY_MS['vision_encoder']:g} ms, "
          f"prefill {STAGE_LATENCY_MS['prefill']:g} ms, action expert {steps} x {STAGE_LATENCY_MS['action_expert']:g} ms; "
          f"{args.frames} frames at each of {', '.join(f'{r:g}' for r in args.rates)} Hz")
    results = []
    proc = NodeProcess("vla_node", {"config": cfg, "diagnostics_period": args.diagnostics_period}, env=env,
                       remaps={"__ns": NAMESPACE})
    try:
        if not proc.wait_output("configured", 60):
            raise RuntimeError(proc.output())
        with client_node("synflux_soak", env) as node, RssSampler(proc.proc.pid, args.sample_s) as rss:
            diag = NodeDiagnostics(node, NAMESPACE)
            if not diag.wait_fresh(node, time.monotonic(), 30.0):
                raise RuntimeError(f"no /diagnostics from the node within 30 s\n{proc.output()[-3000:]}")
            print(f"node RSS after start-up {mib(rss.sample()):.1f} MiB")
            for rate in args.rates:
                results += soak_rate(node, proc, diag, rss, rate, args.frames, args.warmup_s)
                if not proc.alive():
                    raise RuntimeError(f"vla_node exited during the soak:\n{proc.output()[-3000:]}")
            node.destroy_subscription(diag.sub)
    finally:
        code = proc.stop()
        shutil.rmtree(os.path.dirname(cfg), ignore_errors=True)
    out = proc.output()
    stopped = code == 0 and LIVE_THREADS_MESSAGE not in out
    print(f"\nvla_node stopped with SIGINT: exit code {code}, "
          f"{'no thread left running' if LIVE_THREADS_MESSAGE not in out else 'threads left running'} "
          f"{verdict(stopped)}")
    results.append(stopped)
    print(f"\n{sum(results)} of {len(results)} targets met")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
