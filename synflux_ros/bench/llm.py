"""synflux-bench: one-batch latency of a graph set, and the same measurement for transformers and
onnxruntime-genai on the same checkpoint, with the same threads (each of them in a process of its own,
:mod:`.peer`, the engines taking turns).

Semantics (one batch, synthetic token ids): for each input length, one prefill of the prompt, then
``output_len - 1`` decode steps (greedy). Each engine gives a JSONL row::

    {"engine": "synflux", "input_len": 128, "output_len": 32, "prefill_ms": ..., "decode_ms_per_token": ...,
     "tokens_per_s": ..., "bucket": "prefill_128/decode_256", "threads": 2}

Commands::

    synflux-bench --graphs DIR [--input-len 128 ...] [--output-len 32] [--threads 2] [--jsonl out.jsonl]
    synflux-bench --compare --hf CKPT --work DIR [...]      # builds the graph set and the genai model
    synflux-bench --suite --work DIR                        # the two reference checkpoints, bandwidth
                                                            # bound and turn-8 time to first token
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np

from ..core.kv_cache import KVCachePool
from ..core.config import ModelConfig, from_dict, load_config
from ..core.contract import select_bucket
from ..model.backbone import LLMBackbone
from ..runtimes.base import create_executor
from .peer import FailedPeer, PeerEngine, PeerFailure, call, exit_cause, failed_row

# Reference checkpoints of the targets (random weights, Qwen3 architecture).
REFERENCE_MODELS = {
    "qwen3-tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=64, intermediate_size=768),
    "qwen3-h1024-l8": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                           head_dim=128, intermediate_size=3072),
}
VOCAB = 151936
TTFT_CONTEXT = 1024  # room for the 8-turn time-to-first-token measurement


def _row(engine, n_in, n_out, prefill_s, decode_s, threads, bucket=""):
    per_tok = decode_s / max(n_out - 1, 1)
    return {"engine": engine, "input_len": n_in, "output_len": n_out, "prefill_ms": round(prefill_s * 1e3, 3),
            "decode_ms_per_token": round(per_tok * 1e3, 3),
            "tokens_per_s": round((n_out - 1) / decode_s, 2) if decode_s > 0 else 0.0,
            "bucket": bucket, "threads": threads}


def synthetic_ids(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, min(vocab, 30000), n).astype(np.int64)


# ------------------------------------------------------------------------------------------- engines
# Each engine measures one batch: ``once(ids, output_len) -> (prefill_s, decode_s)``. The comparison runs
# the engines' repeats round-robin, so that a slow spell of a shared machine hits every engine alike. The
# peers (transformers, onnxruntime-genai, llama.cpp) run as PeerEngines: the classes below in a child each.

def graph_config(graph_dir: str, threads: int, options: dict | None = None) -> ModelConfig:
    """The graph set's config on the onnxruntime executor with ``threads`` intra-op threads and
    ``options`` (executor options) on top of its own."""
    path = os.path.join(graph_dir, "config.yaml")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: build the graph set with synflux-build first")
    cfg = load_config(path)
    opts = {**cfg.executor.options, **(options or {})}
    opts["intra_op_num_threads"] = threads
    return cfg.with_overrides(executor={"backend": "onnxruntime", "graph_dir": os.path.abspath(graph_dir),
                                        "options": opts})


class SynfluxEngine:
    """synflux's runtime as a benchmark engine."""

    def __init__(self, graph_dir: str, threads: int, options: dict | None = None, name: str = "synflux"):
        self.name = name
        self.cfg = cfg = graph_config(graph_dir, threads, options)
        self.ex = create_executor(cfg)
        pool = KVCachePool(self.ex, 1, cfg.llm.kv_shape, cfg.llm.kv_dtype, "bench_kv")
        self.ex.freeze()
        self.llm = LLMBackbone(cfg, self.ex)
        self.slot = pool.tensor(0)
        self.vocab = cfg.llm.vocab_size

    def check(self, n: int, output_len: int) -> None:
        if n + output_len > self.cfg.llm.max_seq_len:
            raise ValueError(f"input {n} + output {output_len} exceed the graph set's context "
                             f"{self.cfg.llm.max_seq_len}")

    def bucket(self, n: int, output_len: int) -> str:
        llm = self.cfg.llm
        return (f"prefill_{select_bucket(llm.prefill_buckets, min(n, llm.prefill_buckets[-1]))}/"
                f"decode_{select_bucket(llm.decode_buckets, n + 1)}.."
                f"{select_bucket(llm.decode_buckets, n + output_len - 1)}")

    def once(self, ids: np.ndarray, output_len: int):
        t0 = time.perf_counter()
        logits = self.llm.prefill(self.slot, 0, self.llm.embed(ids))
        t1 = time.perf_counter()
        pos = len(ids)
        for _ in range(output_len - 1):
            logits = self.llm.decode(self.slot, pos, int(np.argmax(logits)))
            pos += 1
        return t1 - t0, time.perf_counter() - t1

    def close(self) -> None:
        self.ex.close()


class TransformersEngine:
    """transformers ``generate`` as a benchmark engine."""
    name = "transformers"

    def __init__(self, ckpt: str, threads: int):
        import torch
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        self.vocab = self.model.config.vocab_size

    def once(self, ids: np.ndarray, output_len: int):
        """One ``generate`` call, timed inside: a logits processor stamps the time at every step, so the
        prefill is the time to the first stamp and the decode the time between the first and the last
        (``output_len - 1`` forward passes with the cache, and generate's own work per token)."""
        from transformers import LogitsProcessorList
        torch = self.torch
        x = torch.from_numpy(ids)[None]
        stamps: list[float] = []

        def stamp(input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

        with torch.inference_mode():
            t0 = time.perf_counter()
            self.model.generate(x, do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len,
                                attention_mask=torch.ones_like(x), pad_token_id=0,
                                logits_processor=LogitsProcessorList([stamp]))
        if len(stamps) != output_len:
            raise RuntimeError(f"transformers generate ran {len(stamps)} steps, expected {output_len}")
        return stamps[0] - t0, stamps[-1] - stamps[0]

    def close(self) -> None:
        self.model = None


class GenaiEngine:
    """onnxruntime-genai (model built offline by its builder) as a benchmark engine."""
    name = "onnxruntime-genai"

    def __init__(self, genai_dir: str, threads: int):
        import onnxruntime_genai as og
        cfg_path = os.path.join(genai_dir, "genai_config.json")
        with open(cfg_path, encoding="utf-8") as fh:
            gcfg = json.load(fh)
        so = gcfg["model"]["decoder"].setdefault("session_options", {})
        if so.get("intra_op_num_threads") != threads:
            so["intra_op_num_threads"] = threads
            with open(cfg_path, "w", encoding="utf-8") as fh:
                json.dump(gcfg, fh, indent=2)
        self.og = og
        self.model = og.Model(genai_dir)
        self.vocab = gcfg["model"]["vocab_size"]

    def once(self, ids: np.ndarray, output_len: int):
        og = self.og
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(ids) + output_len, do_sample=False)
        gen = og.Generator(self.model, params)
        t0 = time.perf_counter()
        gen.append_tokens(ids.astype(np.int32))  # prefill
        t1 = time.perf_counter()
        for _ in range(output_len - 1):
            gen.generate_next_token()
        t2 = time.perf_counter()
        del gen
        return t1 - t0, t2 - t1

    def close(self) -> None:
        self.model = None


def transformers_peer(ckpt: str, threads: int) -> PeerEngine:
    return PeerEngine("synflux_ros.bench.llm:TransformersEngine", {"ckpt": ckpt, "threads": threads}, "transformers")


def genai_peer(genai_dir: str, threads: int, name: str = "onnxruntime-genai") -> PeerEngine:
    return PeerEngine("synflux_ros.bench.llm:GenaiEngine", {"genai_dir": genai_dir, "threads": threads}, name)


def measure(engines, input_lens, output_len: int, threads: int, repeats: int = 3, probes=()) -> list[dict]:
    """One row per engine and input length: the best of ``repeats`` runs (after one warm-up run), the
    engines taking turns run by run; each of ``probes`` (:class:`BandwidthProbe`) samples once per turn.
    A peer that fails (:class:`PeerFailure`) leaves the turns and gets a row saying why (``failed``)."""
    rows = []
    failed = {e.name: e.failure for e in engines if getattr(e, "failure", None)}
    for n in input_lens:
        for e in engines:
            if hasattr(e, "check"):
                e.check(n, output_len)
        best: dict[str, tuple] = {}
        for _ in range(repeats + 1):
            for e in engines:
                if e.name in failed:
                    continue
                try:
                    prefill, decode = e.once(synthetic_ids(n, e.vocab), output_len)
                except PeerFailure as exc:
                    failed[e.name] = exc
                    continue
                if e.name not in best or decode < best[e.name][1]:
                    best[e.name] = (prefill, decode)
            for p in probes:
                p.sample()
        for e in engines:
            if e.name in failed:
                rows.append(failed_row(e.name, failed[e.name], input_len=n, output_len=output_len, threads=threads))
                continue
            bucket = e.bucket(n, output_len) if hasattr(e, "bucket") else ""
            rows.append(_row(e.name, n, output_len, *best[e.name], threads, bucket))
    return rows


def decode_ms(rows) -> dict:
    """``{engine: decode ms per token}`` of the rows that were measured (failed rows left out)."""
    return {r["engine"]: r["decode_ms_per_token"] for r in rows if "failed" not in r}


def failures(rows) -> dict:
    """``{engine: "cause"}`` of the failed rows."""
    return {r["engine"]: r["failed"] for r in rows if "failed" in r}


def print_failed(r: dict, indent: str = "  ") -> None:
    """A failed row as the tables print it: the engine, why, and the child's last stderr lines."""
    print(f"{indent}{r['engine']:<28} FAILED: {r['failed']}")
    for line in r.get("stderr_tail", [])[-3:]:
        print(f"{indent}    | {line[:160]}")


def print_table(rows, columns) -> None:
    """The rows under a header: the engine, then ``columns`` ((header, key, width, format spec) each); a
    failed row says why instead."""
    print(f"  {'engine':<28}" + "".join(f" {h:>{w}}" for h, _, w, _ in columns))
    for r in rows:
        if "failed" in r:
            print_failed(r)
        else:
            print(f"  {r['engine']:<28}" + "".join(f" {format(r[k], spec):>{w}}" for _, k, w, spec in columns))


@contextmanager
def jsonl_file(path: str | None):
    """The JSONL file rows are appended to, or None without a path."""
    fh = open(path, "a", encoding="utf-8") if path else None
    try:
        yield fh
    finally:
        if fh:
            fh.close()


def bench_synflux(graph_dir: str, input_lens, output_len: int, threads: int, repeats: int = 3) -> list[dict]:
    engine = SynfluxEngine(graph_dir, threads)
    try:
        return measure([engine], input_lens, output_len, threads, repeats)
    finally:
        engine.close()


# ------------------------------------------------------------------------------------------- onnxruntime-genai
def build_genai(ckpt: str, out: str, precision: str = "fp32") -> str:
    """onnxruntime-genai's model builder on the checkpoint (``precision``: fp32 or int4; CPU), once;
    :class:`PeerFailure` when it fails."""
    if os.path.isfile(os.path.join(out, "genai_config.json")):
        return out
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", ckpt, "-o", out, "-p", precision,
           "-e", "cpu"]
    print(f"  building onnxruntime-genai model: {' '.join(cmd)}", flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise PeerFailure("onnxruntime-genai model builder", exit_cause(done.returncode), done.stdout.splitlines()[-8:])
    return out


# ------------------------------------------------------------------------------------------- bounds
def memory_bandwidth(threads: int, mib: int = 512, repeats: int = 5) -> dict:
    """Read bandwidth (bytes/s) with ``threads`` threads, two ways, over ``mib`` MiB (far beyond the
    caches):

    * ``dot``: a float32 array split into a part per thread, each thread reading its part once (numpy's
      BLAS dot product of the part with itself: vectorised, one stream per thread, as a matrix-vector
      product streams its weights);
    * ``gemv``: ONNX Runtime's one-row MatMul streaming a float32 [K, N] matrix, the kernel of a decode
      step, with ``threads`` intra-op threads (the weight as stored and prepacked, the faster counts).

    ``bound`` is the larger: the decode-time bound uses the fastest read rate seen on this machine, so
    no engine can beat it by reading the weights faster than the probes did.
    """
    a = np.ones(mib * 2**20 // 4, np.float32)
    parts = np.array_split(a, threads)
    best = None
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(lambda x: np.dot(x, x), parts))
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
    res = {"dot": a.nbytes / best}
    del a, parts
    res["gemv"] = _gemv_bandwidth(threads, mib, repeats)
    res["bound"] = max(res["dot"], res["gemv"])
    return res


class BandwidthProbe:
    """:func:`memory_bandwidth` sampled between engine runs (``measure(..., probes=[...])``): ``best`` keeps
    the fastest rate of each kind, so the bound is measured in the same spells of a shared machine as the
    engines it bounds."""

    def __init__(self, threads: int, mib: int = 256, repeats: int = 3):
        self.threads, self.mib, self.repeats = threads, mib, repeats
        self.best: dict[str, float] = {}

    def sample(self) -> None:
        for kind, rate in memory_bandwidth(self.threads, self.mib, self.repeats).items():
            self.best[kind] = max(rate, self.best.get(kind, 0.0))


def _gemv_bandwidth(threads: int, mib: int, repeats: int) -> float:
    """The faster of a one-row MatMul against a [K, N] weight fed as an input (read as stored, like
    shared weights) and stored as a constant (which ONNX Runtime prepacks)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    k = 4096
    n = mib * 2**20 // (4 * k)
    w = np.random.default_rng(0).standard_normal((k, n), dtype=np.float32)
    x = np.ones((1, k), np.float32)
    best = None
    for constant in (False, True):
        inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])]
        if not constant:
            inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [k, n]))
        graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "gemv", inputs,
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                                  [numpy_helper.from_array(w, "w")] if constant else [])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        del model, graph
        feeds = {"x": x} if constant else {"x": x, "w": w}
        sess.run(None, feeds)
        for _ in range(repeats):
            t0 = time.perf_counter()
            sess.run(None, feeds)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        del sess
    return w.nbytes / best


def weight_bytes_per_token(ckpt: str) -> int:
    """Bytes of weights a decode step reads: every matrix once (the embedding table only as lm_head)."""
    from safetensors import safe_open
    total = 0
    tied = json.load(open(os.path.join(ckpt, "config.json"), encoding="utf-8")).get("tie_word_embeddings", False)
    for name in sorted(os.listdir(ckpt)):
        if not name.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(ckpt, name), "np") as fh:
            for key in fh.keys():
                if "embed_tokens" in key and not tied:
                    continue  # a gather of one row per token
                t = fh.get_slice(key)
                total += int(np.prod(t.get_shape())) * 4  # fp32 graphs
    return total


# ------------------------------------------------------------------------------------------- memory
def _status(key: str, path: str = "/proc/self/status") -> int:
    with open(path, encoding="ascii") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(f"{key} not in {path}")


def memory_probe(graph_dir: str, threads: int, options: dict) -> dict:
    """:func:`graph_set_memory`'s measurement, in the fresh process it runs in."""
    import onnxruntime  # noqa: F401  (loaded before the baseline)
    from ..graphkit.feeds import seeded_feeds

    base, base_pss = _status("VmRSS:"), _status("Pss:", "/proc/self/smaps_rollup")
    cfg = graph_config(graph_dir, threads, options)
    ex = create_executor(cfg)
    loaded = _status("Pss:", "/proc/self/smaps_rollup") - base_pss
    kv = ex.alloc_tensor("kv", cfg.llm.kv_shape, cfg.llm.kv_dtype)
    rng = np.random.default_rng(0)
    for meta in ex.graphs.values():  # every graph once: mapped weights are read, kernels' buffers made
        ex.run(meta.name, seeded_feeds(meta, cfg, rng, kv))
    rss = _status("VmRSS:")  # before the peak: the kernel reports a peak of at least the RSS at its reading
    return {"rss_peak_growth": _status("VmHWM:") - base, "rss_growth": rss - base,
            "pss_growth": _status("Pss:", "/proc/self/smaps_rollup") - base_pss, "pss_growth_loaded": loaded,
            "graphs": len(ex.graphs), "weights_file": os.path.getsize(os.path.join(graph_dir, "weights.bin"))}


def graph_set_memory(graph_dir: str, threads: int, options: dict | None = None) -> dict:
    """Memory growth (peak and final RSS, and PSS: shared file pages counted once) of a fresh process that
    loads every graph of a set with the given executor options and runs each once (so that mapped weights
    are read; one KV slot and the activations are included), ``pss_growth_loaded`` after loading alone,
    and the size of the set's weights file."""
    return call("synflux_ros.bench.llm:memory_probe", {"graph_dir": os.path.abspath(graph_dir), "threads": threads,
                                                        "options": options or {}}, "the memory probe")


# ------------------------------------------------------------------------------------------- turn-8 TTFT
def ttft_turns(graph_dir: str, threads: int, turns: int = 8, prompt_chars: int = 48, max_new: int = 16,
               repeats: int = 3) -> dict:
    """Time to first token of each turn of a ``turns``-turn chat, with the session's KV cache reused and
    with the history recomputed. The conversation runs ``repeats`` times (a new session each time), the two
    modes taking turns; each turn's figure is its best."""
    from ..runtimes.vlm import ChatRequest, VLMRuntime
    modes = {"reuse": True, "recompute": False}
    runtimes = {name: VLMRuntime(graph_config(graph_dir, threads).with_overrides(
        session={"reuse_kv_cache": reuse, "max_sessions": repeats})) for name, reuse in modes.items()}
    prompt = ("The robot arm moves the red block. " * 10)[:prompt_chars]
    res = {name: {"ttft_ms": [float("inf")] * turns, "prompt_tokens": [0] * turns, "cached_tokens": [0] * turns}
           for name in modes}
    try:
        for rep in range(repeats):
            for name, rt in runtimes.items():
                for t in range(turns):
                    r = rt.chat(ChatRequest(f"bench-{rep}", prompt, max_new_tokens=max_new, temperature=0.0))
                    res[name]["ttft_ms"][t] = min(res[name]["ttft_ms"][t], r.ttft_ms)
                    res[name]["prompt_tokens"][t] = r.prompt_tokens  # prefilled this turn
                    res[name]["cached_tokens"][t] = r.cached_tokens
    finally:
        for rt in runtimes.values():
            rt.close()
    return res


# ------------------------------------------------------------------------------------------- suite
def make_reference_checkpoint(name: str, out: str) -> str:
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=True,
                      **REFERENCE_MODELS[name])
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    return out


def bench_graph_config(input_len: int, output_len: int, context: int = 0) -> ModelConfig:
    """A VLM config whose buckets fit one benchmark prompt: one decode span of the next power of two, which
    is also the context unless ``context`` asks for more (the model dimensions come from the checkpoint).
    With a context larger than the span, decode graphs slice their span out of the cache, which costs a
    copy per layer in onnxruntime; the decode figures use the tight context."""
    n = input_len + output_len
    span = 1 << (n - 1).bit_length()
    context = max(context, span)
    return from_dict({
        "name": "bench", "mode": "vlm",
        "vision": {"resolution": [224, 224], "tile_size": [224, 224], "tokens_per_tile": 16},
        "llm": {"num_layers": 1, "hidden_dim": 64, "num_heads": 1, "vocab_size": VOCAB,
                "prefill_buckets": sorted({min(64, context), input_len}), "decode_buckets": sorted({span, context}),
                "max_seq_len": context},
        "text": {"max_new_tokens": output_len},
        "executor": {"backend": "onnxruntime"},
    })


SYNFLUX_VARIANTS = ("synflux", "synflux-prepacked")


def prepacked_options(work: str, name: str) -> dict:
    """Executor options of the ``synflux-prepacked`` rows: ONNX Runtime's optimised graphs with their
    prepacked weights saved once (``optimized_model_dir``) and mapped by every session."""
    return {"optimized_model_dir": os.path.join(work, f"{name}.ort"), "prepack": True}


def compare(ckpt: str, work: str, input_lens, output_len: int, threads: int, jsonl=None, probes=(),
            repeats: int = 5) -> dict:
    """The checkpoint through synflux (default executor options, and prepacked), transformers and
    onnxruntime-genai; rows, and each synflux variant's decode ratios to the other two (None where that
    peer failed)."""
    from ..buildtool.export import build
    name = os.path.basename(os.path.normpath(ckpt))
    gdir = os.path.join(work, f"{name}.synflux")
    build(bench_graph_config(max(input_lens), output_len), gdir, hf_dir=ckpt, threads=threads)
    engines = []
    try:
        try:
            genai = genai_peer(build_genai(ckpt, os.path.join(work, f"{name}.genai")), threads)
        except PeerFailure as exc:
            genai = FailedPeer("onnxruntime-genai", exc)
        engines += [SynfluxEngine(gdir, threads),
                    SynfluxEngine(gdir, threads, prepacked_options(work, name), "synflux-prepacked"),
                    transformers_peer(ckpt, threads), genai]
        rows = measure(engines, input_lens, output_len, threads, repeats, probes)
    finally:
        for e in engines:
            e.close()
    for r in rows:
        r["model"] = name
        if jsonl:
            jsonl.write(json.dumps(r) + "\n")
    print(f"\n  {name}: one batch, {threads} threads, fp32 (engines take turns run by run; best of {repeats})")
    print_table(rows, (("input", "input_len", 5, "d"), ("prefill ms", "prefill_ms", 11, ".2f"),
                       ("decode ms/tok", "decode_ms_per_token", 14, ".2f"), ("tok/s", "tokens_per_s", 8, ".1f"),
                       (" bucket", "bucket", 0, "")))
    ratios = {}
    for n in input_lens:
        by = decode_ms(r for r in rows if r["input_len"] == n)
        ratios[n] = {}
        for v in SYNFLUX_VARIANTS:
            ratios[n][v] = {key: by[v] / by[ref] if ref in by else None
                            for key, ref in (("vs_genai", "onnxruntime-genai"), ("vs_transformers", "transformers"))}
            print(f"  decode ratio at input {n}: " + ", ".join(
                f"{v}/{ref} " + (f"{ratios[n][v][key]:.2f}x" if ratios[n][v][key] is not None else "not measured")
                for key, ref in (("vs_genai", "genai"), ("vs_transformers", "transformers"))))
    return {"rows": rows, "ratios": ratios, "graph_dir": gdir, "name": name}


def _both(ratios: dict, key: str) -> str:
    return ", ".join(f"{v} {ratios[v][key]:.2f}x" for v in SYNFLUX_VARIANTS)


def verdict(met: bool | None) -> str:
    """PASS, FAIL, or that the target could not be judged (None: its reference failed)."""
    return "could not be judged" if met is None else "PASS" if met else "FAIL"


def count_targets(met: list) -> str:
    """The summary line of a list of verdicts (True, False, or None for not judged)."""
    unjudged = sum(m is None for m in met)
    return f"{sum(m is True for m in met)} of {len(met)} targets met" + (
        f", {unjudged} could not be judged (a peer failed)" if unjudged else "")


def _ratio_target(ratios: dict, key: str, limit: float, what: str, peer: str, failed: dict) -> bool | None:
    """Prints and returns the verdict of ``min over variants of ratios[v][key] <= limit``."""
    if any(ratios[v][key] is None for v in SYNFLUX_VARIANTS):
        print(f"  {what}: could not be judged ({peer} failed: {failed.get(peer, 'no row')})")
        return None
    met = min(ratios[v][key] for v in SYNFLUX_VARIANTS) <= limit
    print(f"  {what}: {_both(ratios, key)} (target <= {limit}x) {verdict(met)}")
    return met


def suite(work: str, threads: int, input_len: int, output_len: int, jsonl=None, repeats: int = 5) -> int:
    """The decode targets on two reference checkpoints: against onnxruntime-genai and transformers, against
    the memory-bandwidth bound, weights held once, and the turn-8 time to first token. A target counts as
    met when the better synflux configuration meets it (``synflux-prepacked`` is the documented CPU
    deployment setting); both are printed."""
    os.makedirs(work, exist_ok=True)
    met = []
    results = {}
    probe = BandwidthProbe(threads)
    for name in REFERENCE_MODELS:
        ckpt = make_reference_checkpoint(name, os.path.join(work, name))
        # the bound's probe samples between the runs of the model it bounds
        results[name] = compare(ckpt, work, [input_len], output_len, threads, jsonl,
                                [probe] if name == "qwen3-h1024-l8" else (), repeats)
    tiny = results["qwen3-tiny"]["ratios"][input_len]
    mid = results["qwen3-h1024-l8"]["ratios"][input_len]
    print("\n== targets ==")
    met.append(_ratio_target(mid, "vs_genai", 1.2, "hidden-1024 8-layer decode vs onnxruntime-genai",
                             "onnxruntime-genai", failures(results["qwen3-h1024-l8"]["rows"])))
    met.append(_ratio_target(tiny, "vs_transformers", 0.5, "tiny decode vs transformers", "transformers",
                             failures(results["qwen3-tiny"]["rows"])))
    bw = probe.best
    ckpt = os.path.join(work, "qwen3-h1024-l8")
    wbytes = weight_bytes_per_token(ckpt)
    bound_ms = wbytes / bw["bound"] * 1e3
    by_engine = decode_ms(results["qwen3-h1024-l8"]["rows"])
    met.append(min(by_engine[v] for v in SYNFLUX_VARIANTS) <= 1.3 * bound_ms)
    engines = ", ".join(f"{e} {by_engine[e]:.1f} ms = {by_engine[e] / bound_ms:.2f}x"
                        for e in (*SYNFLUX_VARIANTS, "onnxruntime-genai", "transformers") if e in by_engine)
    print(f"  memory bandwidth {bw['bound'] / 1e9:.1f} GB/s ({threads} threads; best between the runs above of "
          f"numpy dot {bw['dot'] / 1e9:.1f}, onnxruntime GEMV {bw['gemv'] / 1e9:.1f}), weights read per token "
          f"{wbytes / 2**20:.0f} MiB -> bound {bound_ms:.1f} ms/token (at the GEMV rate "
          f"{wbytes / bw['gemv'] * 1e3:.1f}); {engines} (target <= 1.3x) {'PASS' if met[-1] else 'FAIL'}")
    mid_dir = results["qwen3-h1024-l8"]["graph_dir"]
    for label, options in (("synflux", {}), ("synflux-prepacked", prepacked_options(work, "qwen3-h1024-l8"))):
        mem = graph_set_memory(mid_dir, threads, options)
        print(f"  weights once ({label}): loading all {mem['graphs']} graphs of qwen3-h1024-l8 grows peak RSS by "
              f"{mem['rss_peak_growth'] / 2**20:.0f} MiB and PSS by {mem['pss_growth'] / 2**20:.0f} MiB for "
              f"{mem['weights_file'] / 2**20:.0f} MiB of weights ({mem['pss_growth'] / mem['weights_file']:.2f}x)")
    from ..buildtool.export import build
    ttft_dir = os.path.join(work, "qwen3-tiny.ttft.synflux")
    build(bench_graph_config(input_len, output_len, TTFT_CONTEXT), ttft_dir, hf_dir=os.path.join(work, "qwen3-tiny"),
          threads=threads)
    tt = ttft_turns(ttft_dir, threads)
    reuse, rec = tt["reuse"]["ttft_ms"], tt["recompute"]["ttft_ms"]
    ratio = reuse[-1] / reuse[0]
    met.append(ratio <= 1.2)
    print(f"  time to first token, {len(reuse)} turns of {tt['reuse']['prompt_tokens'][-1]} new tokens (tiny model):"
          f" turn 1 {reuse[0]:.1f} ms, turn {len(reuse)} {reuse[-1]:.1f} ms with cache reuse = {ratio:.2f}x "
          f"(target <= 1.2x) {'PASS' if met[-1] else 'FAIL'}; recomputing the history: turn {len(rec)} "
          f"{rec[-1]:.1f} ms = {rec[-1] / rec[0]:.2f}x")
    print(f"\n{count_targets(met)}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="synflux-bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--graphs", help="graph set directory (synflux-build --out)")
    mode.add_argument("--compare", action="store_true", help="compare with transformers and onnxruntime-genai")
    mode.add_argument("--suite", action="store_true",
                      help="the decode, memory and time-to-first-token targets on two reference checkpoints "
                           "(builds everything in --work)")
    ap.add_argument("--hf", help="with --compare: local Hugging Face checkpoint")
    ap.add_argument("--work", default="build/bench", help="directory for built models (reused between runs)")
    ap.add_argument("--input-len", type=int, action="append", help="prompt length (repeatable; default 128)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--jsonl", help="append JSONL rows to this file")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed runs per engine after a warm-up run; each row is the best (default 5)")
    args = ap.parse_args(argv)
    input_lens = args.input_len or [128]
    with jsonl_file(args.jsonl) as jsonl:
        if args.graphs:
            for r in bench_synflux(args.graphs, input_lens, args.output_len, args.threads, args.repeats):
                print(json.dumps(r))
                if jsonl:
                    jsonl.write(json.dumps(r) + "\n")
        elif args.compare:
            if not args.hf:
                ap.error("--compare needs --hf CHECKPOINT_DIR")
            compare(args.hf, args.work, input_lens, args.output_len, args.threads, jsonl, repeats=args.repeats)
        else:
            return suite(args.work, args.threads, input_lens[0], args.output_len, jsonl, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
