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

Figures are printed with the ratio to the target; wall-clock figures vary on a shared machine.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import numpy as np
import yaml

from ..tools.harness import NodeProcess, client_node, config_path, ros_env, stream_camera


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="measurement time per benchmark")
    args = ap.parse_args(argv)
    env = ros_env()
    with client_node("synflux_bench", env) as node:
        results = [overhead(node, env, args.seconds), throughput(node, env, args.seconds),
                   throughput(node, env, args.seconds, {"vision_encoder": "mock:NPU"}, "[3] split placement:")]
    print(f"\n{sum(results)} of {len(results)} targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
