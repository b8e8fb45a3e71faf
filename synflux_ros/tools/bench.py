"""synflux-bench: one-batch latency of a graph set, and the same measurement for transformers and
onnxruntime-genai on the same checkpoint, in the same process, with the same threads.

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
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..core.kv_cache import KVCachePool
from ..models.config import ModelConfig, from_dict, load_config
from ..models.graphs import select_bucket
from ..models.llm_backbone import LLMBackbone
from ..runtime.factory import create_executor

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


# ------------------------------------------------------------------------------------------- synflux
def graph_config(graph_dir: str, threads: int) -> ModelConfig:
    path = os.path.join(graph_dir, "config.yaml")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: build the graph set with synflux-build first")
    cfg = load_config(path)
    opts = dict(cfg.executor.options)
    opts["intra_op_num_threads"] = threads
    return cfg.with_overrides(executor={"backend": "onnxruntime", "graph_dir": os.path.abspath(graph_dir),
                                        "options": opts})


def bench_synflux(graph_dir: str, input_lens, output_len: int, threads: int, repeats: int = 3) -> list[dict]:
    cfg = graph_config(graph_dir, threads)
    ex = create_executor(cfg)
    pool = KVCachePool(ex, 1, cfg.llm.kv_shape, cfg.llm.kv_dtype, "bench_kv")
    ex.freeze()
    llm = LLMBackbone(cfg, ex)
    slot = pool.tensor(0)
    rows = []
    for n in input_lens:
        if n + output_len > cfg.llm.max_seq_len:
            raise ValueError(f"input {n} + output {output_len} exceed the graph set's context {cfg.llm.max_seq_len}")
        ids = synthetic_ids(n, cfg.llm.vocab_size)
        best = None
        for _ in range(repeats + 1):  # first run warms up
            t0 = time.perf_counter()
            logits = llm.prefill(slot, 0, llm.embed(ids))
            t1 = time.perf_counter()
            pos = n
            for _ in range(output_len - 1):
                logits = llm.decode(slot, pos, int(np.argmax(logits)))
                pos += 1
            t2 = time.perf_counter()
            if best is None or (t2 - t1) < best[1]:
                best = (t1 - t0, t2 - t1)
        buckets = f"prefill_{select_bucket(cfg.llm.prefill_buckets, min(n, cfg.llm.prefill_buckets[-1]))}/" \
                  f"decode_{select_bucket(cfg.llm.decode_buckets, n + 1)}..{select_bucket(cfg.llm.decode_buckets, n + output_len - 1)}"
        rows.append(_row("synflux", n, output_len, best[0], best[1], threads, buckets))
    ex.close()
    return rows


# ------------------------------------------------------------------------------------------- transformers
def bench_transformers(ckpt: str, input_lens, output_len: int, threads: int, repeats: int = 3) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    rows = []
    for n in input_lens:
        ids = torch.from_numpy(synthetic_ids(n, model.config.vocab_size))[None]
        best = None
        with torch.inference_mode():
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                model(ids, use_cache=True)
                t1 = time.perf_counter()
                model.generate(ids, do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len,
                               attention_mask=torch.ones_like(ids), pad_token_id=0)
                t2 = time.perf_counter()
                prefill = t1 - t0
                decode = max((t2 - t1) - prefill, 1e-9)
                if best is None or decode < best[1]:
                    best = (prefill, decode)
        rows.append(_row("transformers", n, output_len, best[0], best[1], threads))
    return rows


# ------------------------------------------------------------------------------------------- onnxruntime-genai
def build_genai(ckpt: str, out: str) -> str:
    if os.path.isfile(os.path.join(out, "genai_config.json")):
        return out
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", ckpt, "-o", out, "-p", "fp32",
           "-e", "cpu"]
    print(f"  building onnxruntime-genai model: {' '.join(cmd)}", flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stdout.splitlines()[-20:])
        raise RuntimeError(f"onnxruntime-genai model builder failed (exit {done.returncode}):\n{tail}")
    return out


def bench_genai(genai_dir: str, input_lens, output_len: int, threads: int, repeats: int = 3) -> list[dict]:
    import onnxruntime_genai as og
    cfg_path = os.path.join(genai_dir, "genai_config.json")
    with open(cfg_path, encoding="utf-8") as fh:
        gcfg = json.load(fh)
    so = gcfg["model"]["decoder"].setdefault("session_options", {})
    if so.get("intra_op_num_threads") != threads:
        so["intra_op_num_threads"] = threads
        with open(cfg_path, "w", encoding="utf-8") as fh:
            json.dump(gcfg, fh, indent=2)
    model = og.Model(genai_dir)
    rows = []
    for n in input_lens:
        ids = synthetic_ids(n, gcfg["model"]["vocab_size"]).astype(np.int32)
        best = None
        for _ in range(repeats + 1):
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=n + output_len, do_sample=False)
            gen = og.Generator(model, params)
            t0 = time.perf_counter()
            gen.append_tokens(ids)  # prefill
            t1 = time.perf_counter()
            for _ in range(output_len - 1):
                gen.generate_next_token()
            t2 = time.perf_counter()
            if best is None or (t2 - t1) < best[1]:
                best = (t1 - t0, t2 - t1)
            del gen
        rows.append(_row("onnxruntime-genai", n, output_len, best[0], best[1], threads))
    return rows


# ------------------------------------------------------------------------------------------- bounds
def memory_bandwidth(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Read bandwidth (bytes/s) of ``threads`` threads summing disjoint parts of a large array."""
    a = np.ones(mib * 2**20 // 8, np.float64)
    parts = np.array_split(a, threads)
    best = None
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
    return a.nbytes / best


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
_MEMORY_PROBE = r"""
import json, sys
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
from synflux_ros.tools.bench import graph_config
from synflux_ros.runtime.factory import create_executor
import onnxruntime
base = status("VmRSS:")
ex = create_executor(graph_config(sys.argv[1], int(sys.argv[2])))
print(json.dumps({"rss_peak_growth": status("VmHWM:") - base, "rss_growth": status("VmRSS:") - base,
                  "graphs": len(ex.graphs), "weights": ex.weights_bytes}))
"""


def graph_set_memory(graph_dir: str, threads: int) -> dict:
    """Peak RSS growth of a fresh process that loads every graph of a set, against the weights' size."""
    out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, os.path.abspath(graph_dir), str(threads)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------- turn-8 TTFT
def ttft_turns(graph_dir: str, threads: int, turns: int = 8, prompt_chars: int = 48, max_new: int = 16) -> dict:
    from ..runtime.vlm_runtime import ChatRequest, VLMRuntime
    res = {}
    for reuse in (True, False):
        cfg = graph_config(graph_dir, threads).with_overrides(session={"reuse_kv_cache": reuse, "max_sessions": 1})
        rt = VLMRuntime(cfg)
        prompt = ("The robot arm moves the red block. " * 10)[:prompt_chars]
        ttfts, prompt_tokens = [], []
        for t in range(turns):
            r = rt.chat(ChatRequest("bench", prompt, max_new_tokens=max_new, temperature=0.0))
            ttfts.append(r.ttft_ms)
            prompt_tokens.append(r.prompt_tokens)
        res["reuse" if reuse else "recompute"] = {"ttft_ms": ttfts, "prompt_tokens": prompt_tokens}
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
                "prefill_buckets": sorted({64, input_len}), "decode_buckets": sorted({span, context}),
                "max_seq_len": context},
        "text": {"max_new_tokens": output_len},
        "executor": {"backend": "onnxruntime"},
    })


def compare(ckpt: str, work: str, input_lens, output_len: int, threads: int, jsonl=None) -> dict:
    from .build import build
    name = os.path.basename(os.path.normpath(ckpt))
    gdir = os.path.join(work, f"{name}.synflux")
    build(bench_graph_config(max(input_lens), output_len), gdir, hf_dir=ckpt, threads=threads)
    genai = build_genai(ckpt, os.path.join(work, f"{name}.genai"))
    rows = (bench_synflux(gdir, input_lens, output_len, threads) + bench_transformers(ckpt, input_lens, output_len,
            threads) + bench_genai(genai, input_lens, output_len, threads))
    for r in rows:
        r["model"] = name
        if jsonl:
            jsonl.write(json.dumps(r) + "\n")
    print(f"\n  {name}: one batch, {threads} threads, fp32")
    print(f"  {'engine':<18} {'input':>5} {'prefill ms':>11} {'decode ms/tok':>14} {'tok/s':>8}  bucket")
    for r in rows:
        print(f"  {r['engine']:<18} {r['input_len']:>5} {r['prefill_ms']:>11.2f} {r['decode_ms_per_token']:>14.2f} "
              f"{r['tokens_per_s']:>8.1f}  {r['bucket']}")
    by = {(r["engine"], r["input_len"]): r for r in rows}
    ratios = {}
    for n in input_lens:
        s = by[("synflux", n)]["decode_ms_per_token"]
        ratios[n] = {"vs_genai": s / by[("onnxruntime-genai", n)]["decode_ms_per_token"],
                     "vs_transformers": s / by[("transformers", n)]["decode_ms_per_token"]}
        print(f"  decode ratio at input {n}: synflux/genai {ratios[n]['vs_genai']:.2f}x, "
              f"synflux/transformers {ratios[n]['vs_transformers']:.2f}x")
    return {"rows": rows, "ratios": ratios, "graph_dir": gdir}


def suite(work: str, threads: int, input_len: int, output_len: int, jsonl=None) -> int:
    os.makedirs(work, exist_ok=True)
    met = []
    results = {}
    for name in REFERENCE_MODELS:
        ckpt = make_reference_checkpoint(name, os.path.join(work, name))
        results[name] = compare(ckpt, work, [input_len], output_len, threads, jsonl)
    tiny = results["qwen3-tiny"]["ratios"][input_len]
    mid = results["qwen3-h1024-l8"]["ratios"][input_len]
    print("\n== targets ==")
    met.append(mid["vs_genai"] <= 1.2)
    print(f"  hidden-1024 8-layer decode vs onnxruntime-genai: {mid['vs_genai']:.2f}x (target <= 1.2x) "
          f"{'PASS' if met[-1] else 'FAIL'}")
    met.append(tiny["vs_transformers"] <= 0.5)
    print(f"  tiny decode vs transformers: {tiny['vs_transformers']:.2f}x (target <= 0.5x) "
          f"{'PASS' if met[-1] else 'FAIL'}")
    bw = memory_bandwidth(threads)
    ckpt = os.path.join(work, "qwen3-h1024-l8")
    wbytes = weight_bytes_per_token(ckpt)
    bound_ms = wbytes / bw * 1e3
    ours = next(r for r in results["qwen3-h1024-l8"]["rows"] if r["engine"] == "synflux")["decode_ms_per_token"]
    met.append(ours <= 1.3 * bound_ms)
    print(f"  memory bandwidth {bw / 1e9:.1f} GB/s ({threads} threads), weights read per token "
          f"{wbytes / 2**20:.0f} MiB -> bound {bound_ms:.1f} ms/token; synflux {ours:.1f} ms/token = "
          f"{ours / bound_ms:.2f}x the bound (target <= 1.3x) {'PASS' if met[-1] else 'FAIL'}")
    mem = graph_set_memory(results["qwen3-h1024-l8"]["graph_dir"], threads)
    print(f"  weights once: loading all {mem['graphs']} graphs of qwen3-h1024-l8 grows peak RSS by "
          f"{mem['rss_peak_growth'] / 2**20:.0f} MiB for {mem['weights'] / 2**20:.0f} MiB of weights "
          f"({mem['rss_peak_growth'] / mem['weights']:.2f}x)")
    from .build import build
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
    print(f"\n{sum(met)} of {len(met)} targets met")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="synflux-bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--graphs", help="graph set directory (synflux-build --out)")
    mode.add_argument("--compare", action="store_true", help="compare with transformers and onnxruntime-genai")
    mode.add_argument("--suite", action="store_true", help="the reference targets (builds everything in --work)")
    ap.add_argument("--hf", help="with --compare: local Hugging Face checkpoint")
    ap.add_argument("--work", default="build/bench", help="directory for built models (reused between runs)")
    ap.add_argument("--input-len", type=int, action="append", help="prompt length (repeatable; default 128)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--jsonl", help="append JSONL rows to this file")
    args = ap.parse_args(argv)
    input_lens = args.input_len or [128]
    jsonl = open(args.jsonl, "a", encoding="utf-8") if args.jsonl else None
    try:
        if args.graphs:
            for r in bench_synflux(args.graphs, input_lens, args.output_len, args.threads):
                print(json.dumps(r))
                if jsonl:
                    jsonl.write(json.dumps(r) + "\n")
        elif args.compare:
            if not args.hf:
                ap.error("--compare needs --hf CHECKPOINT_DIR")
            compare(args.hf, args.work, input_lens, args.output_len, args.threads, jsonl)
        else:
            return suite(args.work, args.threads, input_lens[0], args.output_len, jsonl)
    finally:
        if jsonl:
            jsonl.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
