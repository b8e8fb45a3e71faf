"""π0 / π0.5 / SmolVLA / GR00T N1.7 action-chunk latency through ``vla_node`` (onnxruntime, CPU here) next to
LeRobot (0.4.4, or 0.6.1 for GR00T N1.7 or with --ref-python .venv-lerobot06/bin/python) on the same weights.

    python -m synflux_ros.bench.pi0 --ref-python .venv-pi0ref/bin/python --ref-script test/reference/lerobot_pi0.py \\
        [--work build/bench] [--threads 2] [--chunks 20] [--cameras base,wrist] [--size tiny|small] [--policy pi05]
    python -m synflux_ros.bench.pi0 --policy smolvla --ref-script test/reference/lerobot_smolvla.py ...
    python -m synflux_ros.bench.pi0 --policy groot --size small|wide --ref-python .venv-lerobot06/bin/python \
        --ref-script test/reference/lerobot_groot.py ...

A π0 (or π0.5, or SmolVLA) with random weights (:data:`SIZES`) is made and saved by LeRobot itself (``make pi0ref-venv``),
imported with ``synflux-build --from-hf`` and served by ``vla_node``; frames are sent one at a time, each after
the previous chunk arrived, so the figures are latencies. LeRobot's time is ``predict_action_chunk`` on
the same checkpoint and thread count, from ``test/reference/lerobot_pi0.py run --time`` (``lerobot_groot.py run
--time`` for GR00T N1.7, with its stages) in its own venv and process (:mod:`.peer`): when it fails, its row says why and the target is not judged. Target: receipt-to-publish
latency <= 0.5x LeRobot's time per chunk, for each thread-pool setting of ``--pools``. More in
docs/benchmarks/commands.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np
import yaml

from ..model.normalization import PI05_PROMPT
from .peer import PeerFailure, failed_row, run_json

SIZES = {
    # 224x224 images (256 tokens per camera), PaliGemma-shaped Gemma 256 wide: compute-bound on a CPU
    "small": {"vlm_width": 256, "depth": 4, "vlm_mlp_dim": 1024, "expert_width": 128, "expert_mlp_dim": 512,
              "num_heads": 8, "num_kv_heads": 1, "head_dim": 32, "vision_width": 192, "vision_depth": 4,
              "vision_heads": 4, "vision_mlp_dim": 768, "image_size": 224, "state_dim": 8, "action_dim": 7,
              "chunk_size": 50, "num_inference_steps": 10, "seed": 0},
    # the parity test's model (56x56 images, 16 tokens; Gemma 64 wide, 2 layers): per-call overhead dominates
    "tiny": {"vlm_width": 64, "depth": 2, "vlm_mlp_dim": 128, "expert_width": 48, "expert_mlp_dim": 96,
             "num_heads": 8, "num_kv_heads": 1, "head_dim": 16, "vision_width": 32, "vision_depth": 2,
             "vision_heads": 4, "vision_mlp_dim": 64, "image_size": 56, "state_dim": 8, "action_dim": 7,
             "chunk_size": 50, "num_inference_steps": 10, "seed": 0},
}
SMOLVLA_SIZES = {
    # 256x256 images, 16 px patches shuffled by 2 (64 tokens per camera, as SmolVLA's 512 px by 4), a
    # SmolVLM-shaped Llama 256 wide (4 heads of 64, 2 KV heads) and an expert 0.75 its width
    "small": {"vlm_width": 256, "num_vlm_layers": 8, "vlm_mlp_dim": 1024, "num_heads": 4, "num_kv_heads": 2,
              "head_dim": 64, "vocab_size": 1024, "vision_width": 192, "vision_depth": 4, "vision_heads": 4,
              "vision_mlp_dim": 768, "image_size": 256, "patch_size": 16, "scale_factor": 2, "state_dim": 8,
              "action_dim": 7, "chunk_size": 50, "num_steps": 10, "seed": 0},
    # the parity test's model (48x48 images, 9 tokens; Llama 48 wide, 4 layers): per-call overhead dominates
    "tiny": {"vlm_width": 48, "num_vlm_layers": 4, "vlm_mlp_dim": 96, "num_heads": 4, "num_kv_heads": 2,
             "head_dim": 16, "vocab_size": 512, "vision_width": 32, "vision_depth": 2, "vision_heads": 4,
             "vision_mlp_dim": 64, "image_size": 48, "patch_size": 8, "scale_factor": 2, "state_dim": 8,
             "action_dim": 7, "chunk_size": 50, "num_steps": 10, "seed": 0},
}
"""SmolVLA's sizes (``lerobot_smolvla.py make-checkpoint`` options)."""
GROOT_SIZES = {
    # Two cameras of 240x320 (64 tokens each after the 256x256 resize, as the real model's), a Qwen3-VL 256 wide
    # (4 heads of 64, 2 KV heads) cut at layer 4 of 6, a DiT of 6 blocks x 4 heads of 32: compute-bound on a CPU
    "small": {"vision_depth": 4, "vision_hidden": 192, "vision_heads": 4, "vision_mlp": 768,
              "deepstack_indexes": [0, 1, 2], "text_layers": 6, "select_layer": 4, "text_hidden": 256,
              "text_heads": 4, "text_kv_heads": 2, "head_dim": 64, "text_mlp": 1024, "mrope_section": [12, 10, 10],
              "vl_layers": 2, "vl_heads": 4, "vl_head_dim": 64, "dit_layers": 6, "dit_heads": 4,
              "dit_head_dim": 32, "hidden_size": 128, "max_state_dim": 24, "max_action_dim": 20,
              "action_horizon": 16, "num_inference_timesteps": 4, "seed": 0},
    # GR00T N1.7's real widths (Cosmos-Reason2-2B's vision 1024 and text 2048, VL self-attention 32 x 64, DiT 32
    # heads x 48, 132-wide state and actions, 40 steps ahead, 4 denoising steps) with few layers and a small
    # vocabulary
    "wide": {"vision_depth": 2, "vision_hidden": 1024, "vision_heads": 16, "vision_mlp": 4096,
             "deepstack_indexes": [0, 1], "text_layers": 2, "select_layer": 2, "text_hidden": 2048,
             "text_heads": 16, "text_kv_heads": 8, "head_dim": 128, "text_mlp": 6144, "mrope_section": [24, 20, 20],
             "vl_layers": 1, "vl_heads": 32, "vl_head_dim": 64, "dit_layers": 4, "dit_heads": 32,
             "dit_head_dim": 48, "hidden_size": 1024, "max_state_dim": 132, "max_action_dim": 132,
             "action_horizon": 40, "num_inference_timesteps": 4, "seed": 0},
}
"""GR00T N1.7's sizes (``lerobot_groot.py make-checkpoint`` options; its cameras, 240x320 images, state 7 and
actions 6 are that script's defaults)."""
GROOT_CAMERA = (240, 320)
GROOT_PREFILL = 160
"""The GR00T prompt's length: 2 x 64 image tokens and the chat around INSTRUCTION (the checkpoint's tokenizer)."""
JOINTS = [f"joint_{i}" for i in range(8)]
INSTRUCTION = "pick up the red block and put it in the bowl"
TARGET = 0.5
POOLS = ("session", "shared")
CPU_OPTIONS = {
    # The onnxruntime settings for a CPU (docs/backends/onnxruntime.md): weights prepacked for ORT's matrix
    # kernels (saved once under optimized_model_dir and mapped; otherwise the products pack their weights on
    # every call, the expert's in each denoising step), RMSNorm, residual + RMSNorm and the rotary embedding as
    # ORT's fused kernels, and attention over the prefix's keys up to its length (no padded key masked).
    "prepack": True,
    "fusions": ["rms_norm", "skip_rms_norm", "rotary", "padded_keys"],
}


def _reference(args, *argv: str) -> dict:
    """``lerobot_pi0.py`` in the LeRobot venv, its JSON answer; :class:`PeerFailure` when it fails."""
    return run_json([args.ref_python, args.ref_script, *argv], f"LeRobot {argv[0]}", timeout=3600,
                    env={"OMP_NUM_THREADS": str(args.threads)})


REF_SCRIPTS = {"pi0": "lerobot_pi0.py", "pi05": "lerobot_pi0.py", "smolvla": "lerobot_smolvla.py",
               "groot": "lerobot_groot.py"}
POLICY_SIZES = {"pi0": SIZES, "pi05": SIZES, "smolvla": SMOLVLA_SIZES, "groot": GROOT_SIZES}


def sizes(args) -> dict:
    return POLICY_SIZES[args.policy][args.size]


def joints(args) -> list:
    return JOINTS[:7] if args.policy == "groot" else JOINTS


def camera_shape(args) -> tuple[int, int]:
    """(height, width) of the images sent to both."""
    return GROOT_CAMERA if args.policy == "groot" else (sizes(args)["image_size"],) * 2


def tokens_per_camera(args) -> int:
    d = sizes(args)
    if args.policy == "groot":
        return (256 // 16 // 2) ** 2
    if args.policy == "smolvla":
        return (d["image_size"] // d["patch_size"] // d["scale_factor"]) ** 2
    return (d["image_size"] // 14) ** 2


def base_config(path: str, args) -> str:
    """What the import keeps from the config: the joint names and the executor, and (SmolVLA) what SmolVLM's
    config fixes that the shapes do not (heads, epsilons); the rest comes from the checkpoint, the sizes here only
    make the base config valid."""
    if args.policy == "groot":
        return groot_base_config(path, args)
    d, side = sizes(args), sizes(args)["image_size"]
    vision = {"resolution": [side, side], "tile_size": [side, side], "tokens_per_tile": tokens_per_camera(args),
              "hidden_dim": d["vision_width"], "num_layers": d["vision_depth"], "num_heads": d["vision_heads"],
              "intermediate_size": d["vision_mlp_dim"]}
    llm = {"hidden_dim": d["vlm_width"], "num_heads": d["num_heads"], "head_dim": d["head_dim"],
           "prefill_buckets": [512], "decode_buckets": [1024], "max_seq_len": 1024}
    if args.policy == "smolvla":
        vision["patch_size"] = d["patch_size"]
        llm.update(num_layers=d["num_vlm_layers"], num_kv_heads=d["num_kv_heads"], vocab_size=d["vocab_size"],
                   rms_norm_eps=1e-5, architecture="llama")
    else:
        vision["patch_size"] = 14
        llm.update(num_layers=d["depth"], num_kv_heads=1, vocab_size=257152, architecture="gemma")
    raw = {"name": f"{args.policy}-bench", "mode": "vla", "vision": vision, "llm": llm,
           "action": {"head_type": "flow_matching", "action_dim": 32, "action_horizon": d["chunk_size"],
                      "state_dim": 32, "state_joints": JOINTS, "state_max_age": 0.5},
           "executor": {"backend": "onnxruntime"}}
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh)
    return path


def groot_base_config(path: str, args) -> str:
    """GR00T N1.7's base config: the image size the model reads (256x256, 64 tokens a camera), the Qwen3-VL
    architecture, a prefill bucket of the prompt's length, the 7 joint names; the import takes the rest."""
    raw = {"name": "groot-bench", "mode": "vla",
           "vision": {"resolution": [256, 256], "tile_size": [256, 256], "tokens_per_tile": tokens_per_camera(args),
                      "architecture": "qwen3_vl", "batch_cameras": not args.per_camera},
           "llm": {"num_layers": 1, "hidden_dim": 8, "num_heads": 1, "vocab_size": 512,
                   "prefill_buckets": [GROOT_PREFILL, GROOT_PREFILL + 32], "decode_buckets": [GROOT_PREFILL + 32],
                   "max_seq_len": GROOT_PREFILL + 32},
           "action": {"head_type": "flow_matching", "action_dim": 1, "action_horizon": 1, "state_dim": 7,
                      "state_joints": joints(args)},
           "executor": {"backend": "onnxruntime"}}
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh)
    return path


def _stem(args) -> str:
    """The path prefix of this policy's, size's and cameras' files in the work directory."""
    per_camera = "-per-camera" if args.per_camera else ""
    return os.path.join(args.work, f"{args.policy}-bench-{args.size}-{'-'.join(args.cameras)}{per_camera}")


def prepare(args) -> tuple[str, str]:
    """(checkpoint dir, graph set dir): the LeRobot checkpoint and its synflux graph set, made once."""
    stem = _stem(args)
    ckpt = stem + "-lerobot"
    if not os.path.isfile(os.path.join(ckpt, "model.safetensors")):
        options = sizes(args) if args.policy in ("smolvla", "groot") else {**SIZES[args.size], "policy": args.policy}
        _reference(args, "make-checkpoint", "--out", ckpt, "--cameras", ",".join(args.cameras),
                   "--options", json.dumps(options))
    graphs = stem + "-graphs"
    # synflux-build brings the graph set up to date: a set built from the same config and sources is kept
    from ..buildtool.export import main as build
    if build(["--config", base_config(stem + "-base.yaml", args), "--out", graphs, "--from-hf", ckpt]):
        raise RuntimeError("synflux-build failed")
    return ckpt, graphs


def node_config(args, graphs: str, pool: str) -> str:
    """The node config of the graph set ``graphs`` with onnxruntime thread pool ``pool`` (written beside it)."""
    with open(os.path.join(graphs, "config.yaml"), encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    raw["executor"]["graph_dir"] = graphs
    options = raw["executor"].setdefault("options", {})
    options["intra_op_num_threads"] = args.threads
    options["thread_pool"] = pool
    options.update(CPU_OPTIONS)
    stem = _stem(args)
    options["optimized_model_dir"] = stem + "-ort"
    if pool == "session":
        # Spinning worker threads (as torch's OpenMP ones do) speed up an action-expert step on its own, but with
        # a pool per graph the pools that spin after their call take the cores from the next graph's and a whole
        # chunk gets slower. Off by default; the shared pool spins.
        options["allow_spinning"] = args.spinning
    # The checkpoint ships no tokenizer (LeRobot's is downloaded from the Hub): the byte-level one stands in
    # (its ids are not PaliGemma's, the instruction's length is about the same), so no <bos> special exists.
    # GR00T's checkpoint has its tokenizer, named relative to the graph set (this config is written beside it).
    if args.policy != "groot":
        raw["tokenizer"]["instruction_bos"] = ""
    elif raw["tokenizer"].get("path") and not os.path.isabs(raw["tokenizer"]["path"]):
        raw["tokenizer"]["path"] = os.path.join(graphs, raw["tokenizer"]["path"])
    path = f"{stem}-node-{pool}.yaml"
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh)
    return path


def synflux_chunks(args, node_cfg: str) -> list:
    """ActionChunks for ``args.chunks`` frames (after 3 warm-up ones), each sent after the previous chunk."""
    from ..tools.harness import NodeProcess, chunks_one_at_a_time, client_node, ros_env

    env = ros_env()
    rng = np.random.default_rng(0)
    images = {c: rng.integers(0, 256, (*camera_shape(args), 3), np.uint8) for c in args.cameras}
    with client_node("bench_pi0", env) as node, \
            NodeProcess("vla_node", {"config": node_cfg, "default_instruction": INSTRUCTION}, env=env,
                        remaps={"__ns": "/bench_pi0"}) as proc:
        if not proc.wait_output("configured", 120):
            raise RuntimeError(proc.output()[-3000:])
        # the next frame goes when the chunk arrived, or after the timeout: well over a chunk's time
        return chunks_one_at_a_time(node, "/bench_pi0", images, joints(args), args.chunks, timeout=60.0)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref-python", required=True, help="python of the LeRobot reference venv (make pi0ref-venv; "
                                                        "make lerobot06-venv for --policy groot)")
    ap.add_argument("--ref-script", required=True, help="test/reference/lerobot_pi0.py (lerobot_smolvla.py for "
                                                        "--policy smolvla, lerobot_groot.py for --policy groot)")
    ap.add_argument("--work", default="build/bench")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--cameras", help="comma-separated camera names (1 or 2; default base, for groot base,wrist: "
                                      "its checkpoint's)")
    ap.add_argument("--size", default="small", help="tiny or small; for groot small or wide")
    ap.add_argument("--policy", default="pi0", choices=sorted(REF_SCRIPTS),
                    help="pi05: π0.5 (adaptive-RMSNorm expert, the state in the prompt); smolvla: SmolVLA; groot: "
                         "GR00T N1.7 (LeRobot 0.6.1)")
    ap.add_argument("--spinning", action="store_true",
                    help="with a pool per graph, onnxruntime's threads spin between kernels instead of sleeping")
    ap.add_argument("--pools", default=",".join(POOLS),
                    help="onnxruntime thread_pool settings to time, in turn (session: a pool per graph, the "
                         "default; shared: one spinning pool for the process)")
    ap.add_argument("--per-camera", action="store_true",
                    help="groot: its vision encoder called once per camera (vision.batch_cameras: false, as for "
                         "rknn) instead of once for both")
    args = ap.parse_args(argv)
    if args.per_camera and args.policy != "groot":
        ap.error("--per-camera: for --policy groot only (the other policies' vision runs per camera)")
    if args.size not in POLICY_SIZES[args.policy]:
        ap.error(f"--size: --policy {args.policy} has {', '.join(sorted(POLICY_SIZES[args.policy]))}")
    cameras = args.cameras or ("base,wrist" if args.policy == "groot" else "base")
    args.cameras = [c for c in cameras.split(",") if c]
    if args.policy == "groot" and args.cameras != ["base", "wrist"]:
        ap.error("--cameras: the GR00T N1.7 checkpoint has the cameras base,wrist")
    script = REF_SCRIPTS[args.policy]
    if os.path.basename(args.ref_script) != script:
        ap.error(f"--ref-script: --policy {args.policy} is compared with test/reference/{script}")
    args.pools = [p for p in args.pools.split(",") if p]
    if not args.pools or set(args.pools) - set(POOLS):
        ap.error(f"--pools: choose from {', '.join(POOLS)}")
    args.work = os.path.abspath(args.work)
    return args


def reference_inputs(args, path: str) -> str:
    """The frame LeRobot times (the images vla_node gets, the state at 0.1, a fixed noise), written to ``path``."""
    d = sizes(args)
    rng = np.random.default_rng(0)
    images = {f"observation.images.{c}": rng.integers(0, 256, (*camera_shape(args), 3), np.uint8)
              for c in args.cameras}
    if args.policy == "groot":
        noise = rng.standard_normal((1, d["action_horizon"], d["max_action_dim"])).astype(np.float32)
        np.savez(path, state=np.full(7, 0.1, np.float32), noise=noise, task=np.array(INSTRUCTION), **images)
        return path
    # the byte-level stand-in's ids of the prompt vla_node builds (π0.5: with the state's 32 bins), so that both
    # run a prefix of the same length
    prompt = (PI05_PROMPT.format(instruction=INSTRUCTION, state=" ".join(["128"] * 32)) if args.policy == "pi05"
              else INSTRUCTION + "\n")
    np.savez(path, lang_tokens=np.frombuffer(prompt.encode(), np.uint8).astype(np.int64),
             state=np.full(len(JOINTS), 0.1, np.float32),
             noise=rng.standard_normal((d["chunk_size"], 32)).astype(np.float32), **images)
    return path


def describe(args) -> str:
    """The model's shape, one line."""
    d = sizes(args)
    if args.policy == "groot":
        return (f"Qwen3-VL vision {d['vision_hidden']}x{d['vision_depth']}, text {d['text_hidden']}x"
                f"{d['select_layer']}, VL {d['vl_layers']}, DiT {d['dit_heads'] * d['dit_head_dim']}x"
                f"{d['dit_layers']}, 2 camera(s) of {GROOT_CAMERA[0]}x{GROOT_CAMERA[1]} (64 tokens each), "
                f"horizon {d['action_horizon']}, {d['num_inference_timesteps']} steps, "
                f"{'a vision call per camera' if args.per_camera else 'one vision call for both'}")
    model = (f"Llama {d['vlm_width']}x{d['num_vlm_layers']}, expert {int(d['vlm_width'] * 0.75)}"
             if args.policy == "smolvla" else f"Gemma {d['vlm_width']}x{d['depth']}, expert {d['expert_width']}")
    side = d["image_size"]
    return (f"{model}, {len(args.cameras)} camera(s) of {side}x{side} ({tokens_per_camera(args)} tokens each), "
            f"chunk {d['chunk_size']}, {steps_of(args)} steps")


def steps_of(args) -> int:
    d = sizes(args)
    return d.get("num_inference_steps") or d.get("num_steps") or d["num_inference_timesteps"]


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    if not os.path.isfile(args.ref_python):
        print(f"[pi0] skipped: {args.ref_python} not found (make pi0ref-venv)", file=sys.stderr)
        return 1
    ckpt, graphs = prepare(args)
    runs = {pool: synflux_chunks(args, node_config(args, graphs, pool)) for pool in args.pools}
    inputs = reference_inputs(args, os.path.join(args.work, f"{args.policy}-bench-{args.size}-inputs.npz"))
    try:
        ref = _reference(args, "run", "--checkpoint", ckpt, "--inputs", inputs, "--time", str(args.chunks),
                         "--threads", str(args.threads))
    except PeerFailure as exc:
        ref = failed_row("LeRobot predict_action_chunk", exc)
    steps = steps_of(args)
    print(f"\n[{args.policy} {args.size}] {describe(args)}; "
          f"{args.threads} threads, median of {args.chunks} chunks (CPU timing, not device timing)")
    if "failed" in ref:
        lerobot = None
        from .llm import print_failed
        print_failed(ref, "    ")
    else:
        lerobot = float(ref["median_ms"])
        print(f"    LeRobot predict_action_chunk {lerobot:7.1f} ms (min {ref['min_ms']:.1f}, max {ref['max_ms']:.1f})"
              + ("".join(f"   {k} {ref[f'{k}_median_ms']:6.1f} ms" for k in ("vision", "backbone", "head")
                         if f"{k}_median_ms" in ref)))
    for pool, chunks in runs.items():
        med = {k: statistics.median(getattr(c, k) for c in chunks)
               for k in ("vision_ms", "backbone_ms", "head_ms", "latency_ms")}
        label = "shared pool (spinning)" if pool == "shared" else \
            f"pool per graph ({'spinning' if args.spinning else 'not spinning'})"
        judged = (f"= {med['latency_ms'] / lerobot:.2f}x LeRobot (target <= {TARGET}x) "
                  f"{'PASS' if med['latency_ms'] / lerobot <= TARGET else 'FAIL'}") if lerobot else \
            f"(target <= {TARGET}x LeRobot) could not be judged: LeRobot failed"
        print(f"    vla_node on onnxruntime, {label}: vision {med['vision_ms']:6.1f} ms   prefix "
              f"{med['backbone_ms']:6.1f} ms   denoise {med['head_ms']:6.1f} ms ({med['head_ms'] / steps:5.2f} ms/step)"
              f"   receipt->publish {med['latency_ms']:6.1f} ms   {judged}")
        if lerobot and "vision_median_ms" in ref:
            print("        ours / LeRobot per stage: " + "   ".join(
                f"{k} {med[f'{k}_ms'] / ref[f'{k}_median_ms']:.2f}x" for k in ("vision", "backbone", "head")
                if ref[f"{k}_median_ms"] > 0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
