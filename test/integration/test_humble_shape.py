"""The nodes on Humble's API shape: no Humble rclpy exists on PyPI, so the node processes run on Jazzy's rclpy cut
down to what Humble's has (test/humble_shape.py, from the API recorded in test/data/ros_api): they serve, drive
the arm's joints and exit 0 at SIGINT, and the shape really takes Iron's names away."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from synflux_ros.tools.harness import rgb_image

from ros_clients import JOINTS, ChatClient, Harness, ok  # noqa: E402

SHAPE = str(Path(__file__).resolve().parents[1] / "humble_shape.py")
HUMBLE = (SHAPE,)


def test_the_shape_takes_iron_s_names_away(tmp_path):
    """What the package once used and Humble lacks fails under the shape, as it would on a Humble robot."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import inspect\n"
        "from rclpy.executors import MultiThreadedExecutor\n"
        "try:\n"
        "    from rclpy.event_handler import SubscriptionEventCallbacks\n"
        "    print('event_handler imported')\n"
        "except ImportError:\n"
        "    print('no event_handler')\n"
        "from rclpy.qos_event import SubscriptionEventCallbacks\n"
        "print('wait_for_threads' in inspect.signature(MultiThreadedExecutor.shutdown).parameters)\n"
        "import rclpy\n"
        "rclpy.init()\n"
        "ex = MultiThreadedExecutor()\n"
        "try:\n"
        "    ex.shutdown(timeout_sec=1.0, wait_for_threads=True)\n"
        "except TypeError as exc:\n"
        "    print('refused:', exc)\n"
        "rclpy.shutdown()\n")
    out = subprocess.run([sys.executable, SHAPE, str(probe)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "no event_handler" and lines[1] == "False", out.stdout
    assert lines[2].startswith("refused:") and "wait_for_threads" in lines[2], out.stdout
    assert "humble_shape: removed" in out.stderr


def test_vla_node_serves_and_commands_on_humble_s_api(start_node, client):
    p = start_node("vla_node", {"config": "vla_demo_orin.yaml", "executor": "mock", "diagnostics_period": 0.2,
                                "publish_joint_trajectory": True, "joint_names": JOINTS},
                   namespace="/humble_vla", launcher=HUMBLE)
    h = Harness(client, "/humble_vla")
    h.wait_connected(timeout=60.0)
    h.publish_until_chunks(3, lambda s, t: rgb_image(448, 448, s, t))
    assert all(np.all(np.isfinite(c.actions)) for c in h.chunks)
    assert "humble_shape: removed" in p.output()
    # the instruction subscriptions' event callbacks came through the compat module (rclpy.qos_event here)
    assert "Traceback" not in p.output(), p.output()[-3000:]


def test_vlm_node_chats_on_humble_s_api(start_node, client):
    p = start_node("vlm_node", {"config": "vlm_demo.yaml", "executor": "mock"}, namespace="/humble_vlm",
                   launcher=HUMBLE)
    chat = ChatClient(client, "/humble_vlm")
    first = ok(chat.chat("s", "Describe the scene."))
    second = ok(chat.chat("s", "And now?"))
    assert second.cached_tokens > 0 and first.reply
    assert "humble_shape: removed" in p.output()
