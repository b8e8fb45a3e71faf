"""`make bench-dds`: which Fast DDS settings get large camera frames from one process to another.

A publisher process streams rgb8 frames at 30 Hz with sensor-data QoS (as a camera driver does) and a
subscriber process (as vla_node) counts the complete ones and their latency, over loopback on one machine.
Each case gives each side its own Fast DDS settings: nothing (a driver that loads nothing), the shipped
shared-memory profile (config/fastdds_shm.xml), or ``FASTDDS_BUILTIN_TRANSPORTS=LARGE_DATA``. The table
shows frames delivered out of those sent, the ratio to the case with the profile on both sides, and the
median and 90th-percentile latency. Both processes run ``synflux_ros.tools.dds_probe``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from ..nodes import ros_compat
from ..tools.harness import config_path, ros_env

FASTDDS_VARIABLES = ("FASTDDS_DEFAULT_PROFILES_FILE", "FASTRTPS_DEFAULT_PROFILES_FILE", "FASTDDS_BUILTIN_TRANSPORTS")
SIZES = {"448x448": (448, 448), "720p": (720, 1280)}


@dataclass(frozen=True)
class Case:
    key: str
    publisher: str   # "defaults", "profile" or "large_data"
    subscriber: str
    label: str


CASES = [
    Case("a", "defaults", "defaults", "defaults on both sides"),
    Case("b", "profile", "profile", "shipped profile on both sides"),
    Case("c", "defaults", "profile", "profile on the subscriber only"),
    Case("d", "defaults", "large_data", "LARGE_DATA on the subscriber only"),
    Case("e", "large_data", "large_data", "LARGE_DATA on both sides"),
    Case("f", "profile", "defaults", "profile on the publisher only"),
]
REFERENCE = "b"


def side_env(base: dict, setting: str, profile: str) -> dict:
    """``base`` with the Fast DDS variables of one side: none of them, the profile, or LARGE_DATA."""
    env = {k: v for k, v in base.items() if k not in FASTDDS_VARIABLES}
    if setting == "profile":  # under the variable the installed Fast DDS reads (Fast DDS 2.x ignores FASTDDS_...)
        ros_compat.set_fastdds_profile(env, profile)
    elif setting == "large_data":
        env["FASTDDS_BUILTIN_TRANSPORTS"] = "LARGE_DATA"
    elif setting != "defaults":
        raise ValueError(f"unknown Fast DDS setting {setting!r} (defaults, profile, large_data)")
    return env


def last_json(text: str, what: str) -> dict:
    """The last line of ``text`` that is a JSON object (the probe's result)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                break
    raise RuntimeError(f"{what} printed no result:\n{text[-2000:]}")


def summarise(sent: int, received: int, latencies: list[float]) -> dict:
    """Delivery and latency of one case (latency None when no frame arrived)."""
    if received > sent:
        raise ValueError(f"{received} frames received of {sent} sent")
    ordered = sorted(latencies)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))] if ordered else None
    return {"sent": sent, "received": received, "delivered": received / sent if sent else 0.0,
            "median_ms": statistics.median(ordered) if ordered else None, "p90_ms": p90}


def run_case(case: Case, size: tuple[int, int], base: dict, profile: str, count: int, rate: float,
             timeout: float) -> dict:
    height, width = size
    probe = [sys.executable, "-m", "synflux_ros.tools.dds_probe"]
    shape = ["--height", str(height), "--width", str(width), "--timeout", str(timeout)]
    sub = subprocess.Popen(probe + ["sub"] + shape, env=side_env(base, case.subscriber, profile),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ready = sub.stdout.readline()
        if "ready" not in ready:
            raise RuntimeError(f"subscriber did not start: {ready}{sub.stdout.read()[-2000:]}")
        pub = subprocess.run(probe + ["pub", "--rate", str(rate), "--count", str(count)] + shape,
                             env=side_env(base, case.publisher, profile), capture_output=True, text=True,
                             timeout=timeout + count / rate + 30)
        sent = last_json(pub.stdout + pub.stderr, "publisher")
        if not sent["matched"]:
            raise RuntimeError(f"case {case.key}: publisher and subscriber never matched")
        time.sleep(1.0)  # the last frames in flight
        out, _ = sub.communicate(input="", timeout=30)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
    got = last_json(out, "subscriber")
    return summarise(sent["sent"], got["received"], got["latency_ms"])


def _ms(value) -> str:
    return "     -" if value is None else f"{value:6.1f}"


def table(results: dict) -> str:
    """Rows per size and case: delivered/sent, ratio to the reference case, median and p90 latency."""
    lines = [f"{'size':8} {'case':42} {'delivered':>11} {'vs (b)':>7} {'median':>9} {'p90':>9}"]
    for size, by_case in results.items():
        ref = by_case.get(REFERENCE)
        for case in CASES:
            r = by_case.get(case.key)
            if r is None:
                continue
            ratio = r["delivered"] / ref["delivered"] if ref and ref["delivered"] else None
            lines.append(f"{size:8} ({case.key}) {case.label:38} {r['received']:4d} of {r['sent']:3d} "
                         f"{'     -' if ratio is None else f'{ratio:6.2f}'}x {_ms(r['median_ms'])} ms "
                         f"{_ms(r['p90_ms'])} ms")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=90, help="frames per case (default 90: 3 s at 30 Hz)")
    ap.add_argument("--rate", type=float, default=30.0, help="frames per second (default 30)")
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--cases", default="".join(c.key for c in CASES), help="case letters (default all)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per process before giving up")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES] + [k for k in args.cases if k not in {c.key for c in CASES}]
    if unknown:
        ap.error(f"unknown size or case {unknown[0]!r}")
    profile = config_path("fastdds_shm.xml")
    base = ros_env()
    print(f"Fast DDS transports, rgb8 frames at {args.rate:g} Hz, best effort, loopback; "
          f"ROS_DOMAIN_ID={base['ROS_DOMAIN_ID']}; profile: {profile}")
    results: dict = {}
    for size in sizes:
        for case in CASES:
            if case.key in args.cases:
                results.setdefault(size, {})[case.key] = run_case(
                    case, SIZES[size], base, profile, args.count, args.rate, args.timeout)
                print(f"  {size} ({case.key}) {case.label}: {results[size][case.key]['received']} of "
                      f"{results[size][case.key]['sent']}", flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
