"""Qwen3-VL time to first token with one image, on onnxruntime (CPU here), through the chat runtime.

    python -m synflux_ros.bench.image_chat [--work build/bench] [--threads 2] [--repeats 5]

A Qwen3-VL-shaped model with random weights (``config/vlm_qwen3.yaml`` at bench widths: text 512 wide, 8
layers, M-RoPE; vision tower 256 wide, 4 blocks, 3 DeepStack maps, 448x448 -> 196 image tokens) is
exported once to ``--work``. Each round times, as ``vlm_node`` serves them:

* ``image turn``: a new session, one 448x448 image and a short prompt: the vision encoder, then the prefill
  of the conversation (image tokens with their 3-D positions and DeepStack maps), up to the first token;
* ``vision encoder``: the vision graph alone on the same image;
* ``text turn``: a new session, the same prompt without the image;
* ``follow-up turn``: a text turn after the image turn in the same session (the image's cache reused).

Medians over the rounds (the turns take turns within a round). CPU timing, not device timing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from ..core.config import load_config
from ..tools.harness import config_path
from ..runtimes.vlm import ChatRequest, VLMRuntime

WIDTHS = dict(llm=dict(num_layers=8, hidden_dim=512, num_heads=8, num_kv_heads=4, head_dim=64,
                       intermediate_size=1536, vocab_size=32000, mrope_section=[12, 10, 10],
                       prefill_buckets=[64, 256], decode_buckets=[512], max_seq_len=512, kv_dtype="float32"),
              vision=dict(hidden_dim=256, num_layers=4, num_heads=4, intermediate_size=1024,
                          deepstack_layers=[1, 2, 3]))
PROMPT = "What is on the table in front of the robot?"


def graph_set(work: str) -> str:
    out = os.path.join(work, "qwen3vl-h512-l8")
    if not os.path.isfile(os.path.join(out, "manifest.json")):
        from ..buildtool.export import build
        cfg = load_config(config_path("vlm_qwen3.yaml")).with_overrides(name="qwen3vl-h512-l8", **WIDTHS)
        build(cfg, out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="build/bench")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    gdir = graph_set(os.path.abspath(args.work))
    cfg = load_config(os.path.join(gdir, "config.yaml"))
    cfg = cfg.with_overrides(executor={"backend": "onnxruntime", "graph_dir": gdir,
                                       "options": {**cfg.executor.options, "intra_op_num_threads": args.threads}},
                             session={"max_sessions": 3})
    rt = VLMRuntime(cfg)
    image = np.random.default_rng(0).integers(0, 256, (480, 640, 3), np.uint8)
    rows = {k: [] for k in ("image turn", "vision encoder", "text turn", "follow-up turn")}
    prompt_tokens = {}
    try:
        for r in range(args.repeats + 1):  # the first round warms up
            first = rt.chat(ChatRequest("img", PROMPT, images=[image], reset=True, max_new_tokens=1,
                                        temperature=0.0))
            t0 = time.perf_counter()
            rt.vision.features(image)
            vision_ms = (time.perf_counter() - t0) * 1e3
            text = rt.chat(ChatRequest("txt", PROMPT, reset=True, max_new_tokens=1, temperature=0.0))
            follow = rt.chat(ChatRequest("img", "And where is the cup?", max_new_tokens=1, temperature=0.0))
            if r:
                rows["image turn"].append(first.ttft_ms)
                rows["vision encoder"].append(vision_ms)
                rows["text turn"].append(text.ttft_ms)
                rows["follow-up turn"].append(follow.ttft_ms)
            prompt_tokens = {"image turn": f"{first.prompt_tokens} prefilled",
                             "text turn": f"{text.prompt_tokens} prefilled",
                             "follow-up turn": f"{follow.prompt_tokens} prefilled, {follow.cached_tokens} reused",
                             "vision encoder": f"{cfg.vision.num_tokens} image tokens, "
                                               f"{cfg.vision.num_deepstack} DeepStack maps"}
    finally:
        rt.close()
    print(f"\n[image chat] {cfg.name} on onnxruntime, {args.threads} threads: time to first token, median of "
          f"{args.repeats} (CPU timing, not device timing)")
    for name, values in rows.items():
        print(f"    {name:<16}{statistics.median(values):10.1f} ms   {prompt_tokens[name]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
