"""`make bench`: latency added by the node + pipeline, and pipeline throughput against its bound.

1. Overhead: ``vla_node`` (demo config, mock executor, no simulated latency) gets 448x448 rgb8 frames at
   30 Hz. Each ActionChunk carries receipt-to-publish latency and the time of each stage; what the node
   and pipeline add is ``latency - (vision + backbone + head)``: decoding the message, queue hand-offs,
   building and publishing the chunk. Target: median <= 2 ms.
2. Throughput: the same node with simulated device latencies of 10 / 30 / 20 ms for the three stages
   (vision encoder 10 ms; prefill 30 ms; 10 action-expert steps of 2 ms), camera at 60 Hz. Ideal rate is
   1 / max(stage) = 33.3 Hz. Target: measured rate >= 90 % of it.
3. The same with the vision encoder placed on a second executor (``executor.placement``, simulated
   ``mock:NPU``): the stages overlap across devices as they do on one.
4. Joint states: the CPU ``vla_node`` (demo config with 8 state joints, no frames) spends while a
   JointState stream of ``--state-rates`` reaches it, per message, and how many of the messages it took
   (its ``states_received``). No target: a robot's ``joint_states`` come at 100 to 1000 Hz, and what the node
   spends on them it takes from inference.

Figures are printed with the ratio to the target; wall-clock figures vary on a shared machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import yaml

from ..tools.harness import (JointStateStream, NodeProcess, client_node, config_path, ros_env, spin_until,
                             stream_camera, watch_diagnostics)


def overhead(node, env, seconds: float) -> bool:
    with NodeProcess("vla_node", {"config": "vla_demo_orin.yaml", "executor": "mock"}, env=env,
                     remaps={"__ns": "/bench_overhead"}) as p:
        if not p.wait_output("configured", 60):
            raise RuntimeError(p.output())
        chunks, _, wire = stream_camera(node, "/bench_overhead", 30.0, seconds)
    if not chunks:
        raise RuntimeError("no chunks received")
    lat = [c.latency_ms for c in chunks]
    stages = [c.vision_ms + c.backbone_ms + c.head_ms for c in chunks]
    added = [a - b for a, b in zip(lat, stages)]
    med_added = statistics.median(added)
    print("\n[1] node + pipeline overhead, 448x448 rgb8 at 30 Hz, mock executor without simulated latency")
    print(f"    chunks: {len(chunks)}")
    print(f"    receipt -> publish latency   median {statistics.median(lat):6.2f} ms  p90 "
          f"{np.percentile(lat, 90):6.2f} ms")
    print(f"    camera publish -> chunk received by a subscriber (DDS both ways) median "
          f"{statistics.median(wire):6.2f} ms")
    print(f"    stage work (vis+llm+head)    median {statistics.median(stages):6.2f} ms")
    print(f"    added by node + pipeline     median {med_added:6.2f} ms  p90 {np.percentile(added, 90):6.2f} ms"
          f"  (target <= 2 ms: {med_added / 2.0:.2f}x of budget) {'PASS' if med_added <= 2.0 else 'FAIL'}")
    return med_added <= 2.0


CAMERA_HZ = 60.0


def throughput(node, env, seconds: float, placement: dict | None = None, label: str = "[2]") -> bool:
    """Simulated 10 / 30 / 20 ms stages, camera at 60 Hz: the rate against 1/max(stage) and 1/sum."""
    with open(config_path("vla_demo_orin.yaml"), encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    steps = raw["action"]["num_denoise_steps"]
    raw["executor"]["latency_ms"] = {"vision_encoder": 10.0, "prefill": 30.0, "action_expert": 20.0 / steps}
    if placement:
        raw["executor"]["placement"] = placement
    cfg = os.path.join(tempfile.mkdtemp(prefix="synflux_bench_"), "vla_bench.yaml")
    with open(cfg, "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh)
    with NodeProcess("vla_node", {"config": cfg}, env=env, remaps={"__ns": "/bench_rate"}) as p:
        if not p.wait_output("configured", 60):
            raise RuntimeError(p.output())
        chunks, times, _ = stream_camera(node, "/bench_rate", CAMERA_HZ, seconds)
    if len(times) < 3:
        raise RuntimeError("too few chunks received")
    rate = (len(times) - 1) / (times[-1] - times[0])
    ideal = 1000.0 / 30.0
    ratio = rate / ideal
    med = lambda key: statistics.median(getattr(c, key) for c in chunks)  # noqa: E731
    where = ", ".join(f"{s} on {getattr(chunks[-1], s + '_device')}" for s in ("vision", "backbone", "head"))
    print(f"\n{label} pipeline throughput, simulated stage latencies 10 / 30 / 20 ms, camera at 60 Hz ({where})")
    print(f"    stage medians: vision {med('vision_ms'):.1f} ms, backbone "
          f"{med('backbone_ms'):.1f} ms, head {med('head_ms'):.1f} ms")
    print(f"    sequential bound 1/(sum)     {1000.0 / 60.0:6.2f} Hz")
    print(f"    pipelined bound 1/max(stage) {ideal:6.2f} Hz")
    print(f"    measured                     {rate:6.2f} Hz  = {ratio:.1%} of 1/max(stage), "
          f"{rate / (1000.0 / 60.0):.2f}x 1/sum (target >= 90% of 1/max) {'PASS' if ratio >= 0.9 else 'FAIL'}")
    return ratio >= 0.9


def _node_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat", encoding="ascii").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def joint_state_cost(node, env, seconds: float, rates) -> None:
    """[4]: vla_node's CPU while JointStates arrive at each rate of ``rates`` (0: none)."""
    with open(config_path("vla_demo_orin.yaml"), encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    joints = [f"joint_{i}" for i in range(8)]
    raw["action"].update(state_dim=8, state_joints=joints)
    cfg = os.path.join(tempfile.mkdtemp(prefix="synflux_bench_"), "vla_states.yaml")
    with open(cfg, "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh)
    received, stream = {}, None

    def on_values(values):  # the node's count, and what had been sent when it arrived
        if "states_received" in values:
            received.update(n=int(values["states_received"]), t=time.monotonic(),
                            sent=stream.sent if stream is not None else 0)

    sub = watch_diagnostics(node, "/bench_states/vla_node", on_values)
    print(f"\n[4] vla_node's CPU with a joint_states stream, no frames ({seconds:g} s a rate)")
    try:
        with NodeProcess("vla_node", {"config": cfg, "executor": "mock", "diagnostics_period": 0.25}, env=env,
                         remaps={"__ns": "/bench_states"}) as p:
            if not p.wait_output("configured", 60):
                raise RuntimeError(p.output())
            pid = p.proc.pid
            for rate in rates:
                stream = JointStateStream(node, "/bench_states/joint_states", joints, rate).start() if rate else None
                try:
                    spin_until(node, lambda: False, 1.0)  # settle
                    since = time.monotonic()
                    spin_until(node, lambda: received.get("t", 0) > since, 5.0)
                    first, cpu0, t0 = dict(received), _node_cpu_s(pid), time.monotonic()
                    spin_until(node, lambda: False, seconds)
                    cpu, wall = _node_cpu_s(pid) - cpu0, time.monotonic() - t0
                    mark = time.monotonic()
                    spin_until(node, lambda: received.get("t", 0) > mark, 5.0)
                finally:
                    if stream is not None:
                        stream.stop()
                # between two of the node's diagnostics: the states it took and those sent until each arrived
                taken, n = received.get("n", 0) - first.get("n", 0), received.get("sent", 0) - first.get("sent", 0)
                per = f", {cpu / max(taken, 1) * 1e3:.2f} ms a message taken, {taken} taken of {n} sent" if rate else ""
                print(f"    {rate:4d} Hz: {cpu / wall:6.1%} of a core{per}")
    finally:
        node.destroy_subscription(sub)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="measurement time per benchmark")
    ap.add_argument("--state-rates", default="0,100,500",
                    help="joint_states rates (Hz) of [4], comma-separated; empty: skip [4]")
    args = ap.parse_args(argv)
    rates = [int(r) for r in args.state_rates.split(",") if r.strip()]
    env = ros_env()
    with client_node("synflux_bench", env) as node:
        results = [overhead(node, env, args.seconds), throughput(node, env, args.seconds),
                   throughput(node, env, args.seconds, {"vision_encoder": "mock:NPU"}, "[3] split placement:")]
        if rates:
            joint_state_cost(node, env, args.seconds, rates)
    print(f"\n{sum(results)} of {len(results)} targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
