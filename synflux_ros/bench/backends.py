"""Per-backend graph timings: the vision encoder, one prefill bucket and one decode step of the same graph
set on every backend that runs on this machine (``make bench``).

::

    python -m synflux_ros.bench.backends [--work DIR] [--backends onnxruntime openvino] [--repeats 5]

The graph set is a random-weight VLM (hidden 512, 8 layers, vocabulary 32000) exported once into
``--work``. Every backend loads it with its default options; the backends take turns call by call, and
each figure is the median of ``--repeats`` rounds of 20 calls, so a slow spell of a shared machine hits
all of them alike. Each row says what kind of timing it is: on these machines every backend runs on the
CPU or in a vendor simulator, so none of the figures is a device timing. The target printed is OpenVINO's
decode step against onnxruntime's on the same graphs (at most 1.2x).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import numpy as np

from ..backends import EXECUTORS, BackendUnavailableError, UnknownBackendError, resolve_executor_class
from ..core.config import load_config
from ..tools.harness import config_path
from ..runtimes.base import create_executor
from ..graphkit.feeds import seeded_feeds

WIDTHS = dict(num_layers=8, hidden_dim=512, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1536,
              vocab_size=32000)
TIMING_KIND = {"mock": "no device (arithmetic stand-in)", "onnxruntime": "CPU timing, not device timing",
               "openvino": "CPU timing, not device timing", "qnn": "x86 HTP simulator timing, not device timing",
               "rknn": "x86 simulator timing, not device timing"}
CALLS = 20
DECODE_TARGET = 1.2


def graph_set(work: str) -> str:
    """The benchmark graph set, exported on first use."""
    out = os.path.join(work, "vlm-h512-l8")
    if os.path.isfile(os.path.join(out, "manifest.json")):
        return out
    from ..buildtool.export import build
    base = load_config(config_path("vlm_demo.yaml"))
    cfg = base.with_overrides(llm=WIDTHS, name="vlm-h512-l8")
    build(cfg, out)
    return out


def runnable(names) -> list[str]:
    """The backends among ``names`` that are registered and whose SDK is importable here."""
    ok = []
    for name in names:
        try:
            resolve_executor_class(name)
        except (UnknownBackendError, BackendUnavailableError, ImportError):
            continue
        ok.append(name)
    return ok


def time_graphs(graph_dir: str, backends: list[str], repeats: int, not_loaded: dict) -> dict[str, dict[str, float]]:
    """Median ms per call of the vision encoder, the smallest prefill bucket and the largest decode span.
    A backend that cannot load this graph set (e.g. it needs a compiled form) goes to ``not_loaded``."""
    cfg = load_config(os.path.join(graph_dir, "config.yaml"))
    graphs = ["vision_encoder", f"prefill_{cfg.llm.prefill_buckets[0]}", f"decode_{cfg.llm.decode_buckets[-1]}"]
    executors, feeds = {}, {}
    try:
        for b in backends:
            try:
                ex = create_executor(cfg.with_overrides(executor={"backend": b, "graph_dir": graph_dir,
                                                                  "options": {}}))
            except Exception as exc:  # reported with the figures, the other backends still run
                not_loaded[b] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                continue
            executors[b] = ex
            kv = ex.alloc_tensor("bench/past_kv", cfg.llm.kv_shape, cfg.llm.kv_dtype)
            feeds[b] = {g: seeded_feeds(ex.graphs[g], cfg, np.random.default_rng(i), kv) for i, g in enumerate(graphs)}
            for g in graphs:  # warm-up: first-run checks, lazy allocations, caches
                ex.run(g, feeds[b][g])
        samples = {b: {g: [] for g in graphs} for b in executors}
        for _ in range(repeats):
            for g in graphs:
                for b in executors:  # take turns
                    t0 = time.perf_counter()
                    for _ in range(CALLS):
                        executors[b].run(g, feeds[b][g])
                    samples[b][g].append((time.perf_counter() - t0) * 1e3 / CALLS)
        return {b: {g: statistics.median(v) for g, v in per.items()} for b, per in samples.items()}
    finally:
        for ex in executors.values():
            ex.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="build/bench", help="directory for the exported graph set (reused)")
    ap.add_argument("--backends", nargs="*", default=[b for b in EXECUTORS if b != "mock"],
                    help="backends to time (those whose SDK is missing are skipped)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if importlib.util.find_spec("torch") is None:
        print("the benchmark graph set is exported with synflux-build, which needs torch", file=sys.stderr)
        return 2
    backends = runnable(args.backends)
    skipped = sorted(set(args.backends) - set(backends))
    gdir = graph_set(os.path.abspath(args.work))
    not_loaded: dict[str, str] = {}
    times = time_graphs(gdir, backends, args.repeats, not_loaded)
    graphs = list(next(iter(times.values())))
    print(f"\n[backends] {os.path.basename(gdir)}: median ms per call ({args.repeats} rounds of {CALLS}, "
          f"backends taking turns)")
    print(f"    {'backend':<12}" + "".join(f"{g:>16}" for g in graphs) + "   timing")
    for b, per in times.items():
        print(f"    {b:<12}" + "".join(f"{per[g]:16.3f}" for g in graphs) + f"   {TIMING_KIND.get(b, '')}")
    if skipped:
        print(f"    not run here (SDK not installed): {', '.join(skipped)}")
    for b, why in not_loaded.items():
        print(f"    {b}: not timed on this graph set ({why})")
    results = []
    if "openvino" in times and "onnxruntime" in times:
        decode = graphs[-1]
        ratio = times["openvino"][decode] / times["onnxruntime"][decode]
        results.append(ratio <= DECODE_TARGET)
        print(f"    openvino {decode} against onnxruntime: {ratio:.2f}x (target <= {DECODE_TARGET}x) "
              f"{'PASS' if results[-1] else 'FAIL'}")
    print(f"\n{sum(results)} of {len(results)} backend targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
