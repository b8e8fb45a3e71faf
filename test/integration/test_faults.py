"""Faults below the nodes: a device error mid-run, NaN/Inf outputs, broken graph files, a graph
directory removed while serving. Each gives a clear error naming the stage or the file; a failed frame
is counted and nothing of it is published; the node keeps serving (or fails at configure, exit code 1)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time

import numpy as np
import pytest

from synflux_ros.tools.harness import rgb_image, spin_until

from ros_clients import Harness  # noqa: E402
from ros_clients import ChatClient, ok  # noqa: E402


def counts(d: dict) -> dict:
    return {k: int(d[f"frames_{k}"]) for k in ("received", "published", "dropped", "rejected", "failed", "in_flight")}


def stream(h: Harness, client, n: int, period: float = 0.06, limit: int = 300):
    """Publish frames until the node has received at least ``n`` (the image topic is best effort: on a
    loaded machine some are lost in transport, and they are not the node's to count)."""
    for i in range(limit):
        h.image_pub.publish(rgb_image(448, 448, i, 10**9 * (i + 1)))
        spin_until(client, lambda: False, period)
        if i + 1 >= n and h.diags and int(h.diags[-1]["frames_received"]) >= n:
            return
    raise AssertionError(f"the node received fewer than {n} of {limit} frames: {h.diags[-1:]}")


@pytest.mark.parametrize("fault,stage,needle", [
    (dict(graph="prefill", kind="raise", every=3), "backbone", "injected device fault in graph 'prefill_"),
    (dict(graph="action_expert", kind="nan", every=41, first=3), "head",
     "graph 'action_expert_160' output 'velocity' holds"),
    (dict(graph="vision_encoder", kind="inf", every=4), "vision", "non-finite values (NaN/Inf)"),
])
def test_device_faults_fail_the_frame_and_the_node_keeps_serving(start_node, client, make_config, fault, stage,
                                                                 needle):
    cfg = make_config("vla_demo_orin.yaml", executor={"options": {"faults": [fault]}})
    start_node("vla_node", {"config": cfg, "diagnostics_period": 0.2}, namespace="/faulty")
    h = Harness(client, "/faulty")
    h.wait_connected()
    stream(h, client, 25)
    # settled: every received frame accounted for, and the chunks counted as published all arrived
    d = h.diag_where(lambda d: int(d["frames_failed"]) >= 2 and int(d["frames_in_flight"]) == 0 and
                     int(d["frames_received"]) >= 25 and int(d["frames_published"]) == len(h.chunks), timeout=20)
    c = counts(d)
    assert c["received"] == c["published"] + c["dropped"] + c["rejected"] + c["failed"]
    assert c["published"] >= 5, c
    assert f"failed in {stage}" in d["last_error"] and needle in d["last_error"], d["last_error"]
    # none of the published chunks twice, none with a non-finite value
    assert len({ch.header.stamp.sec for ch in h.chunks}) == len(h.chunks)
    assert all(np.all(np.isfinite(np.asarray(ch.actions))) for ch in h.chunks)


def test_a_device_fault_in_a_chat_turn_is_reported_and_the_next_turn_works(start_node, client, make_config):
    cfg = make_config("vlm_demo.yaml", executor={"options": {"faults": [
        dict(graph="decode", kind="nan", first=40, every=10**6)]}})
    start_node("vlm_node", {"config": cfg}, namespace="/faulty_chat")
    c = ChatClient(client, "/faulty_chat")
    ok(c.chat("a", "hello there", temperature=0.0))  # 31 decode steps: below the fault
    bad = c.chat("a", "and now?", temperature=0.0)  # the 40th decode step returns NaN
    assert not bad.success and "non-finite" in bad.error and "decode_" in bad.error, bad.error
    assert bad.reply == ""
    again = ok(c.chat("a", "and now?", temperature=0.0))
    # the failed turn left nothing in the conversation: the retry continues the first turn, as a
    # session that never failed does
    fresh = ok(c.chat("b", "hello there", temperature=0.0))
    assert fresh.prompt_tokens <= again.cached_tokens
    same = ok(c.chat("b", "and now?", temperature=0.0))
    assert again.reply == same.reply and again.generated_tokens == same.generated_tokens
    assert again.cached_tokens + again.prompt_tokens == same.cached_tokens + same.prompt_tokens


def test_bad_fault_options_fail_at_configure(start_node, make_config):
    cfg = make_config("vla_demo_orin.yaml", executor={"options": {"faults": [dict(graph="prefill", kind="boom")]}})
    p = start_node("vla_node", {"config": cfg}, namespace="/bad_faults")
    assert wait_exit(p) == 1
    assert "faults[0].kind: 'boom'" in p.output()


# ---------------------------------------------------------------------------------------- graph files
needs_onnx_build = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("onnxruntime") is None,
    reason="synflux-build needs torch and the onnxruntime backend onnxruntime (make test installs both)")


def wait_exit(p, timeout=30.0) -> int | None:
    deadline = time.monotonic() + timeout
    while p.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    return p.proc.poll()


@pytest.fixture()
def vla_graphs(demo_graphs):
    return demo_graphs["vla_demo_orin"]


@pytest.fixture()
def graph_copy(vla_graphs, tmp_path):
    d = tmp_path / "graphs"
    shutil.copytree(vla_graphs, d)
    return d


def truncate(path):
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)


def garble(path):
    with open(path, "r+b") as fh:
        fh.seek(0)
        fh.write(os.urandom(256))


def drop_field(path):
    manifest = json.loads(path.read_text())
    del manifest["graphs"][1]["inputs"]
    path.write_text(json.dumps(manifest))


@needs_onnx_build
@pytest.mark.parametrize("name,damage,needle", [
    ("prefill_96.onnx", truncate, "prefill_96.onnx"),
    ("action_expert_160.onnx", garble, "action_expert_160.onnx"),
    ("weights.bin", truncate, "weights.bin"),
    ("manifest.json", drop_field, "manifest.json: graphs[1] ('embed_96') has no field 'inputs'"),
])
def test_a_broken_graph_set_fails_at_configure_naming_the_file(graph_copy, start_node, name, damage, needle):
    damage(graph_copy / name)
    p = start_node("vla_node", {"config": str(graph_copy / "config.yaml")}, namespace="/broken")
    assert wait_exit(p) == 1, p.output()[-2000:]
    out = p.output()
    assert needle in out and "vla_node" in out, out[-3000:]
    assert "Traceback" not in out


@needs_onnx_build
def test_graph_dir_removed_while_serving(graph_copy, start_node, client):
    """Graphs and weights are loaded at configure: removing the directory does not stop a running node."""
    start_node("vla_node", {"config": str(graph_copy / "config.yaml"), "diagnostics_period": 0.2},
               namespace="/removed")
    h = Harness(client, "/removed")
    h.wait_connected()
    h.publish_until_chunks(2, lambda s, t: rgb_image(448, 448, s, t))
    shutil.rmtree(graph_copy)
    h.publish_until_chunks(3, lambda s, t: rgb_image(448, 448, s, t))
    d = h.diag_where(lambda d: int(d["frames_published"]) >= 5)
    assert d["frames_failed"] == "0"


def test_a_device_call_that_outlives_the_stop_is_not_freed_under(start_node, client, make_config):
    """A stage still in a device call when stopping gives up waiting must keep its executor: freeing it
    under the call crashes the process. The node exits 0 and says why the model was not freed."""
    import signal
    cfg = make_config("vla_demo_orin.yaml", executor={"latency_ms": {"action_expert": 900.0}})
    p = start_node("vla_node", {"config": cfg, "diagnostics_period": 0.2}, namespace="/stuck")
    h = Harness(client, "/stuck")
    h.wait_connected()
    # the head runs 10 steps of 0.9 s: once a frame is in flight, give it time to reach the head, then stop
    h.publish_until_diag(rgb_image(448, 448, 0, 10**9), lambda d: int(d["frames_in_flight"]) >= 1)
    spin_until(client, lambda: False, 1.5)
    p.proc.send_signal(signal.SIGINT)
    assert p.proc.wait(30) == 0, p.output()[-3000:]
    out = p.output()
    assert "still in a device call" in out and "freed at process exit" in out, out[-3000:]
    assert "terminate called" not in out
