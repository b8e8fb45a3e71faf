"""make bench-serve: synflux-serve on loopback against the runtime in process, on the demo VLA (onnxruntime, one
thread per replica).

1. Per-chunk overhead: one robot sending a 224x224 camera frame per request, back to back; the median round
   trip against the median ``VLARuntime.infer`` in process on the same frames (goal <= 5 ms).
2. Throughput: 4 simulated robots (a thread and a connection each, requests back to back) for ``--seconds``,
   with 1 and with 2 single-thread replicas; chunks per second (goal: 2 replicas >= 1.7x one). Measured on the
   demo VLA, whose small chunks the serving cost per message weighs on most, and on a wider VLA of the kind a
   server is for (:data:`WIDE`); the run prints each one's time a chunk in process.
3. Chat, with ``--chat-config`` (SmolLM2-135M, ``make smollm2``): 8 sessions over 2 replicas, the second turn's
   time to first token (streamed, at the client) with session affinity against Ray's default routing.

    python -m synflux_ros.bench.serve [--work build/bench] [--seconds 15] [--chat-config CFG] [--jsonl PATH]
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import threading
import time

import numpy as np
import yaml

from ..buildtool.export import build
from .control import append_rows
from ..core.config import load_config
from ..runtimes.base import resolve_graph_dir
from ..runtimes.vla import VLARuntime
from ..runtimes import wire
from ..tools import harness
from ..tools.serve_process import ServeProcess

MACHINE = "2-core x86_64 VM, no GPU"
BENCH = "bench.serve: synflux-serve (Ray Serve, openpi protocol and OpenAI's chat API) on loopback, onnxruntime"
TARGETS = {"overhead_ms": 5.0, "scaling": 1.7}
ROBOTS = 4


def row(metric, value, unit, note="", reference=None, ratio=None) -> dict:
    return {"date": datetime.date.today().isoformat(), "machine": MACHINE, "benchmark": BENCH, "metric": metric,
            "value": value, "unit": unit, "reference": reference,
            "ratio": None if ratio is None else round(float(ratio), 3), "command": "make bench-serve", "note": note}


WIDE = {"llm": {"hidden_dim": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "head_dim": 32}}
"""The wider VLA's changes to the demo's config: a backbone and action expert 256 wide with 4 layers (the vision
tower takes the width too, and keeps its 2 layers)."""


def setup(work: str, name: str = "demo", changes: dict | None = None) -> str:
    """The demo VLA (with ``changes`` merged into its config sections) on onnxruntime with single-threaded
    sessions, and its graph set; returns the config path."""
    os.makedirs(work, exist_ok=True)
    with open(harness.config_path("vla_demo_orin.yaml"), encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    for section, values in (changes or {}).items():
        raw[section] = {**raw.get(section, {}), **values}
    graphs = os.path.join(work, f"serve-graphs-{name}")
    raw["executor"] = {"backend": "onnxruntime", "graph_dir": graphs,
                       "options": {"intra_op_num_threads": 1, "inter_op_num_threads": 1}}
    path = os.path.join(work, f"serve-{name}.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh)
    build(load_config(path), graphs)  # brings the set up to date (a no-op when it is)
    return path


def frames(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(n)]


def in_process(config: str, images: list[np.ndarray], warmup: int) -> list[float]:
    runtime = VLARuntime(load_config(config))
    try:
        times = []
        for i, img in enumerate(images):
            t0 = time.perf_counter()
            runtime.infer(img, seq=i)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        return times
    finally:
        runtime.close()


def remote(server: ServeProcess, images: list[np.ndarray], warmup: int) -> tuple[list[float], list[float]]:
    """Round trips and the server's infer_ms, one connection."""
    ws, _ = server.connect()
    rtt, infer = [], []
    try:
        for i, img in enumerate(images):
            t0 = time.perf_counter()
            ws.send(wire.pack({"observation/image": img, "prompt": "pick up the red block"}))
            reply = wire.unpack(ws.recv(timeout=60), 1 << 24)
            if i >= warmup:
                rtt.append((time.perf_counter() - t0) * 1e3)
                infer.append(reply["server_timing"]["infer_ms"])
    finally:
        ws.close()
    return rtt, infer


def throughput(server: ServeProcess, seconds: float) -> tuple[float, list[int], int]:
    """Chunks per second of ROBOTS robots sending back to back, per-robot counts, and the replicas they hit."""
    img = frames(1)[0]
    msg = wire.pack({"observation/image": img, "prompt": "pick up the red block"})
    conns = [server.connect() for _ in range(ROBOTS)]
    for ws, _ in conns:  # warm every replica
        ws.send(msg)
        ws.recv(timeout=60)
    counts = [0] * ROBOTS
    stop = time.monotonic() + seconds

    def robot(k):
        ws = conns[k][0]
        while time.monotonic() < stop:
            ws.send(msg)
            ws.recv(timeout=60)
            counts[k] += 1

    threads = [threading.Thread(target=robot, args=(k,)) for k in range(ROBOTS)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    for ws, _ in conns:
        ws.close()
    return sum(counts) / elapsed, counts, len({meta["replica"] for _, meta in conns})


CHAT_SESSIONS = 8
FIRST_TURN = ("You are the assistant of a robot arm in a kitchen. " * 12 +
              "The arm has seven joints and a parallel gripper; it sees the counter through two cameras. "
              "List, in order, the steps to put the red cup from the counter into the sink.")


def chat_config(work: str, source: str) -> str:
    """The chat model with room for the sessions, one onnxruntime thread, short replies."""
    with open(source, encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    cfg = load_config(source)
    raw.setdefault("executor", {})["graph_dir"] = resolve_graph_dir(cfg) or os.path.dirname(os.path.abspath(source))
    for name in ("path", "chat_template"):  # files named relative to the source config
        if raw.get("tokenizer", {}).get(name):
            raw["tokenizer"][name] = os.path.abspath(cfg.relative_to_source(raw["tokenizer"][name]))
    raw["executor"]["options"] = {**raw["executor"].get("options", {}), "intra_op_num_threads": 1,
                                  "inter_op_num_threads": 1}
    raw.setdefault("session", {})["max_sessions"] = CHAT_SESSIONS
    raw.setdefault("text", {})["max_new_tokens"] = 4
    path = os.path.join(work, "serve-chat.yaml")
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh)
    return path


def second_turns(config: str, log: str, affinity: bool) -> tuple[list[float], list[int]]:
    """Turn-2 times to first token (ms, at the client) and cached tokens of CHAT_SESSIONS sessions."""
    from openai import OpenAI
    args = ["--replicas", "2", "--num-cpus", "2", "--object-store-mib", "100"]
    server = ServeProcess(config, args + ([] if affinity else ["--no-session-affinity"]), log)
    ttft, cached = [], []
    try:
        model = load_config(config).name
        clients = {f"s{k}": OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=120,
                                   default_headers={"x-session-id": f"s{k}"}) for k in range(CHAT_SESSIONS)}
        convos = {}
        for sid, c in clients.items():
            messages = [{"role": "user", "content": f"[{sid}] " + FIRST_TURN}]
            r = c.chat.completions.create(model=model, messages=messages)
            convos[sid] = messages + [{"role": "assistant", "content": r.choices[0].message.content},
                                      {"role": "user", "content": "And then?"}]
        for sid, c in clients.items():
            t0 = time.perf_counter()
            first = None
            for chunk in c.chat.completions.create(model=model, messages=convos[sid], stream=True,
                                                   stream_options={"include_usage": True}):
                if first is None and chunk.choices and (chunk.choices[0].delta.content or
                                                        chunk.choices[0].finish_reason):
                    first = (time.perf_counter() - t0) * 1e3
                if chunk.usage is not None:
                    cached.append(chunk.usage.prompt_tokens_details.cached_tokens)
            ttft.append(first)
    finally:
        server.stop()
    return ttft, cached


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="bench")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--chat-config", help="the chat model's config (engines/smollm2/config.yaml): measure turn-2 "
                    "time to first token with and without session affinity")
    ap.add_argument("--skip-policy", action="store_true", help="only the chat measurement")
    ap.add_argument("--jsonl", help="append the rows (docs/benchmarks/results.jsonl's fields) to this file")
    args = ap.parse_args(argv)
    config = setup(os.path.abspath(args.work))
    warmup = 10
    images = frames(args.requests + warmup)
    rows, verdicts = [], []

    log = os.path.join(os.path.abspath(args.work), "serve-bench.log")
    if not args.skip_policy:
        policy_rows(args, config, images, warmup, log, rows, verdicts)
        wide = setup(os.path.abspath(args.work), "wide", WIDE)
        scaling_rows(args, wide, in_process(wide, images[:warmup + 20], warmup), log, rows, verdicts,
                     "wide VLA (256 wide, 4 layers)")
    if args.chat_config:
        cfg = chat_config(os.path.abspath(args.work), args.chat_config)
        with_aff, hits = second_turns(cfg, log, True)
        without, misses = second_turns(cfg, log, False)
        # the mean: without affinity about half the sessions miss their cache, and a miss costs the whole prompt
        mean_with, mean_without = statistics.mean(with_aff), statistics.mean(without)
        reused = sum(1 for c in hits if c > 0), sum(1 for c in misses if c > 0)
        print(f"[serve] chat, {CHAT_SESSIONS} sessions over 2 replicas, turn 2 time to first token: with session "
              f"affinity {mean_with:.1f} ms mean ({reused[0]} of {CHAT_SESSIONS} reused their cache), without "
              f"{mean_without:.1f} ms ({reused[1]} of {CHAT_SESSIONS}): {mean_without / mean_with:.2f}x")
        rows.append(row(f"chat turn 2 time to first token, {CHAT_SESSIONS} sessions over 2 replicas, with session "
                        f"affinity (mean)", round(mean_with, 1), "ms",
                        f"without: {mean_without:.1f} ms; cache reused by {reused[0]} and {reused[1]} of "
                        f"{CHAT_SESSIONS} sessions; SmolLM2-135M on onnxruntime, one thread a replica",
                        reference="Ray's default routing", ratio=mean_with / mean_without))
    print("\n[serve] targets (this run)")
    for what, ok in verdicts:
        print(f"    {'met' if ok else 'NOT MET':<8} {what}")
    if args.jsonl:
        append_rows(args.jsonl, rows)
    return 0


def policy_rows(args, config, images, warmup, log, rows, verdicts) -> None:
    local = in_process(config, images, warmup)
    server = ServeProcess(config, ["--replicas", "1", "--num-cpus", "2", "--object-store-mib", "100"], log)
    try:
        rtt, infer = remote(server, images, warmup)
        one, one_counts, _ = throughput(server, args.seconds)
    finally:
        server.stop()
    med_local, med_rtt, med_infer = statistics.median(local), statistics.median(rtt), statistics.median(infer)
    overhead = med_rtt - med_local
    print(f"[serve] one robot, 224x224 frames, {len(rtt)} requests: round trip median {med_rtt:.2f} ms "
          f"(server infer {med_infer:.2f} ms), in process {med_local:.2f} ms: overhead {overhead:.2f} ms "
          f"(goal <= {TARGETS['overhead_ms']} ms)")
    verdicts.append(("per-chunk overhead over loopback", overhead <= TARGETS["overhead_ms"]))
    rows.append(row("per-chunk overhead over loopback against in process (224x224 frame, 1 replica)",
                    round(overhead, 2), "ms", f"round trip {med_rtt:.2f} ms median, in process {med_local:.2f} ms, "
                    f"server infer {med_infer:.2f} ms; goal <= {TARGETS['overhead_ms']} ms"))

    scaling_rows(args, config, local, log, rows, verdicts, "demo VLA", (one, one_counts))


def scaling_rows(args, config, local, log, rows, verdicts, model, one_replica=None) -> None:
    """Chunks per second of ROBOTS robots with 1 replica (``one_replica``: measured already) and with 2."""
    if one_replica is None:
        server = ServeProcess(config, ["--replicas", "1", "--num-cpus", "2", "--object-store-mib", "100"], log)
        try:
            one_replica = throughput(server, args.seconds)[:2]
        finally:
            server.stop()
    one, one_counts = one_replica
    # two robots a replica: Ray's router places each robot's connection on a replica with room
    server = ServeProcess(config, ["--replicas", "2", "--num-cpus", "2", "--object-store-mib", "100",
                                   "--max-ongoing-requests", str(ROBOTS // 2)], log)
    try:
        two, two_counts, hit = throughput(server, args.seconds)
    finally:
        server.stop()
    ratio, chunk_ms = two / one, statistics.median(local)
    print(f"[serve] {model}, {chunk_ms:.1f} ms a chunk in process; {ROBOTS} robots for {args.seconds:.0f} s: "
          f"1 replica {one:.1f} chunks/s {one_counts}, 2 replicas {two:.1f} chunks/s {two_counts} ({hit} replicas "
          f"hit): {ratio:.2f}x (goal >= {TARGETS['scaling']}x)")
    verdicts.append((f"throughput, 2 replicas against 1, {model}", ratio >= TARGETS["scaling"]))
    rows.append(row(f"throughput of {ROBOTS} robots, 2 single-thread replicas against 1, {model}", round(two, 1),
                    "chunks/s", f"{chunk_ms:.1f} ms a chunk in process; 1 replica {one:.1f} chunks/s; per robot "
                    f"{two_counts} against {one_counts}; goal >= {TARGETS['scaling']}x", reference="1 replica",
                    ratio=ratio))


if __name__ == "__main__":
    raise SystemExit(main())
