"""`make demo`: both nodes, a synthetic camera, action chunks and a chat.

Starts ``vla_node`` and ``vlm_node`` as processes (as ``synflux.launch.py`` would), publishes a moving test
pattern at 10 Hz with an instruction and prints the action chunks with their latencies, holds a three-turn
chat (later turns reuse the session's KV cache), then stops both. Without arguments the nodes run their demo
configs; ``make demo`` and ``make demo-onnx`` pass others. Each section names the model, the backend and
whether the weights are trained (random weights give meaningless outputs).
"""
from __future__ import annotations

import argparse
import sys
import time

import os

import numpy as np
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from sensor_msgs.msg import Image
from std_msgs.msg import String

from ..graphset import reader as graphset
from ..core.config import load_config
from ..msg import ActionChunk
from ..srv import Chat, EndSession
from .harness import (NodeProcess, call_service, config_path, rgb_image, ros_env, spin_until, use_env,
                      run_with_nodes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--executor", default="", help="backend for both nodes (default: each config's own)")
    ap.add_argument("--vla-config", default="vla_demo_orin.yaml")
    ap.add_argument("--vlm-config", default="vlm_demo.yaml")
    ap.add_argument("--frames", type=int, default=20, help="camera frames to publish (10 Hz)")
    args = ap.parse_args(argv)

    env = ros_env()
    use_env(env)
    common = {"executor": args.executor}
    print(f"starting vla_node ({args.vla_config}) and vlm_node ({args.vlm_config}), "
          f"ROS_DOMAIN_ID={env['ROS_DOMAIN_ID']}")
    vla = NodeProcess("vla_node", {"config": args.vla_config, **common}, env=env)
    vlm = NodeProcess("vlm_node", {"config": args.vlm_config, **common}, env=env)
    procs = [vla, vlm]
    return run_with_nodes("synflux_demo", procs, 60, lambda node: (
        run_vla(node, args.frames, describe(args.vla_config, args.executor))
        and run_chat(node, args.vlm_config, describe(args.vlm_config, args.executor))))


def describe(config: str, executor: str) -> str:
    """What a node runs, said plainly: the model, the backend and whether its weights are trained."""
    path = config if os.path.isfile(config) else config_path(config)
    cfg = load_config(path)
    backend = executor or cfg.executor.backend
    if backend == "mock":
        return f"{cfg.name} on the mock executor: outputs are not meaningful"
    source = (graphset.find_manifest(os.path.dirname(path)) or {}).get("source") or {}
    origin = (source.get("gguf") or {}).get("path") or source.get("hf_dir") or ""
    trained = f"trained weights from {os.path.basename(origin)}" if str(source.get("weights", "")).startswith("hf:") \
        else "random weights: outputs are not meaningful"
    return f"{cfg.name} on {backend}, {trained}"


def run_vla(node, frames: int, what: str) -> bool:
    chunks = []
    latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
    image_pub = node.create_publisher(Image, "image", qos_profile_sensor_data)
    instr_pub = node.create_publisher(String, "instruction", latched)
    node.create_subscription(ActionChunk, "action_chunk", chunks.append, 50)
    spin_until(node, lambda: image_pub.get_subscription_count() > 0, 20)
    instr_pub.publish(String(data="put the red block in the bowl"))
    print(f"\n== VLA ({what}): camera 448x448 rgb8 at 10 Hz, instruction 'put the red block in the bowl' ==")
    print(f"{'frame':>5} {'stamp':>16} {'chunk':>7}  first step (7 values)                       "
          f"{'vis':>5} {'llm':>5} {'head':>5} {'total ms':>8}")
    shown = 0
    t0 = time.time()
    for i in range(frames):
        stamp = int((t0 + i * 0.1) * 1e9)
        image_pub.publish(rgb_image(448, 448, i, stamp, frame_id="camera"))
        spin_until(node, lambda: False, 0.1)
        for c in chunks[shown:]:
            first = " ".join(f"{v:+.2f}" for v in c.actions[:c.action_dim])
            print(f"{c.frame_seq:>5} {c.header.stamp.sec % 1000:>6}.{c.header.stamp.nanosec:09d} "
                  f"{c.horizon:>3}x{c.action_dim:<3}  {first:<44} {c.vision_ms:5.1f} {c.backbone_ms:5.1f} "
                  f"{c.head_ms:5.1f} {c.latency_ms:8.2f}")
        shown = len(chunks)
    spin_until(node, lambda: False, 0.5)
    if not chunks:
        print("no action chunks received", file=sys.stderr)
        return False
    lat = np.median([c.latency_ms for c in chunks])
    print(f"{len(chunks)} chunks for {frames} frames, median receipt-to-publish latency {lat:.2f} ms")
    return True


def run_chat(node, config: str, what: str) -> bool:
    chat = node.create_client(Chat, "chat")
    end = node.create_client(EndSession, "end_session")
    print(f"\n== VLM ({what}): three turns in session 'demo' ==")
    vision = load_config(config if os.path.isfile(config) else config_path(config)).vision is not None
    if vision:
        turns = [("What do you see?", [rgb_image(224, 224, 1)]), ("Where is the red block?", []),
                 ("Summarise in one sentence.", [])]
    else:
        turns = [("What is the capital of France? Answer in one sentence.", []),
                 ("And the capital of Germany?", []), ("Which of the two cities is larger?", [])]
    for prompt, images in turns:
        r = call_service(node, chat, Chat.Request(session_id="demo", prompt=prompt, images=images,
                                                  temperature=-1.0), 60)
        if not r.success:
            print(f"chat failed: {r.error}", file=sys.stderr)
            return False
        print(f"user: {prompt}{' [+1 image]' if images else ''}")
        print(f"  assistant: {r.reply!r}")
        print(f"  prompt {r.prompt_tokens} tokens, reused from cache {r.cached_tokens}, generated "
              f"{r.generated_tokens}, first token {r.ttft_ms:.1f} ms, total {r.total_ms:.1f} ms")
    r = call_service(node, end, EndSession.Request(session_id="demo"), 30)
    print(f"end_session('demo'): success={r.success}")
    return r.success


if __name__ == "__main__":
    raise SystemExit(main())
