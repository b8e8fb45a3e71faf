"""One side of a camera-frame transport measurement: ``pub`` streams rgb8 frames, ``sub`` counts them.

Run as two processes by ``python -m synflux_ros.bench.dds_transport``, each with the Fast DDS settings of
its side in its environment. Both use sensor-data QoS (best effort, keep last 5), as vla_node and most
camera drivers do. Each frame carries its sequence number in ``frame_id`` and its send time in the stamp;
the subscriber counts complete frames and their latency and prints one JSON line when its standard input
closes (the measuring process closes it once the publisher is done).
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np
import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.qos import qos_profile_sensor_data
from sensor_msgs.msg import Image

TOPIC = "dds_probe/image"


def _frame(height: int, width: int) -> Image:
    msg = Image()
    msg.height, msg.width, msg.encoding, msg.is_bigendian, msg.step = height, width, "rgb8", 0, width * 3
    msg.data = (np.arange(height * width * 3, dtype=np.uint32) % 251).astype(np.uint8).tobytes()
    return msg


def publish(height: int, width: int, rate_hz: float, count: int, match_timeout: float) -> dict:
    node = rclpy.create_node("dds_probe_pub")
    pub = node.create_publisher(Image, TOPIC, qos_profile_sensor_data)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    deadline = time.monotonic() + match_timeout
    while pub.get_subscription_count() < 1 and time.monotonic() < deadline:
        executor.spin_once(timeout_sec=0.05)
    matched = pub.get_subscription_count() >= 1
    # The subscriber's side of discovery finishes a little after ours: frames sent before it has matched
    # the writer are dropped by it, not by the transport.
    settle = time.monotonic() + 1.0
    while time.monotonic() < settle:
        executor.spin_once(timeout_sec=0.05)
    msg = _frame(height, width)
    period = 1.0 / rate_hz
    start = time.monotonic()
    sent = 0
    for i in range(count if matched else 0):
        wait = start + i * period - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        msg.header.frame_id = str(i)
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(time.time_ns(), 10**9)
        pub.publish(msg)
        sent += 1
    elapsed = time.monotonic() - start
    executor.remove_node(node)
    node.destroy_node()
    return {"matched": matched, "sent": sent, "seconds": round(elapsed, 3)}


def subscribe(height: int, width: int, timeout: float) -> dict:
    node = rclpy.create_node("dds_probe_sub")
    expected = height * width * 3
    latencies, frames, partial = [], set(), [0]

    def on_image(msg: Image) -> None:
        now = time.time_ns()
        if msg.height != height or msg.width != width or len(msg.data) != expected:
            partial[0] += 1
            return
        frames.add(msg.header.frame_id)
        latencies.append((now - (msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec)) / 1e6)

    node.create_subscription(Image, TOPIC, on_image, qos_profile_sensor_data)
    done = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        done.set()
    threading.Thread(target=wait_for_eof, daemon=True).start()
    print("ready", flush=True)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    deadline = time.monotonic() + timeout
    while not done.is_set() and time.monotonic() < deadline:
        executor.spin_once(timeout_sec=0.05)
    executor.remove_node(node)
    node.destroy_node()
    return {"received": len(frames), "partial": partial[0], "latency_ms": latencies}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("side", choices=["pub", "sub"])
    ap.add_argument("--height", type=int, required=True)
    ap.add_argument("--width", type=int, required=True)
    ap.add_argument("--rate", type=float, default=30.0, help="frames per second (pub)")
    ap.add_argument("--count", type=int, default=90, help="frames to send (pub)")
    ap.add_argument("--timeout", type=float, default=60.0, help="give up after this many seconds")
    args = ap.parse_args(argv)
    rclpy.init()
    try:
        if args.side == "pub":
            result = publish(args.height, args.width, args.rate, args.count, args.timeout)
        else:
            result = subscribe(args.height, args.width, args.timeout)
    finally:
        rclpy.try_shutdown()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
