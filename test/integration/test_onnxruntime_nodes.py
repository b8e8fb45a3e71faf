"""The nodes on real graphs: synflux-build exports the demo configs, the nodes run them with onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
import yaml

pytest.importorskip("torch", reason="synflux-build needs torch (make test installs it)")
pytest.importorskip("onnxruntime", reason="the onnxruntime backend needs onnxruntime")

from synflux_ros.tools.harness import rgb_image  # noqa: E402

from ros_clients import Harness, stamp_ns  # noqa: E402
from ros_clients import ChatClient, ok  # noqa: E402


def test_vla_node_on_onnxruntime(demo_graphs, start_node, client):
    p = start_node("vla_node", {"config": str(demo_graphs["vla_demo_orin"] / "config.yaml"), "diagnostics_period": 0.2},
                   namespace="/ort")
    h = Harness(client, "/ort")
    h.wait_connected()
    stamps = h.publish_until_chunks(3, lambda s, t: rgb_image(448, 448, s, t))
    c = h.chunks[-1]
    assert (c.horizon, c.action_dim) == (16, 7) and stamp_ns(c.header) in stamps
    assert np.all(np.isfinite(c.actions))
    # the chunks counted: a diagnostics message published before them would still read 0
    h.diag_where(lambda d: d["backend"] == "onnxruntime" and int(d["frames_published"]) >= 1)
    assert "on 'onnxruntime'" in p.output()


def test_vlm_node_on_onnxruntime_reuse_matches_recompute(demo_graphs, start_node, client, make_config):
    cfg = str(demo_graphs["vlm_demo"] / "config.yaml")
    start_node("vlm_node", {"config": cfg}, namespace="/ort_chat")
    ref_cfg = make_config(cfg, session={"reuse_kv_cache": False})
    start_node("vlm_node", {"config": ref_cfg, "graph_dir": str(demo_graphs["vlm_demo"])},
               namespace="/ort_ref")
    a, b = ChatClient(client, "/ort_chat"), ChatClient(client, "/ort_ref")
    turns = [dict(prompt="Describe the table.", images=[rgb_image(96, 128, 2)]), dict(prompt="And the cup?"),
             dict(prompt="Thanks!")]
    for i, turn in enumerate(turns):
        ra, rb = ok(a.chat("s", **turn)), ok(b.chat("s", **turn))
        assert ra.reply == rb.reply and ra.generated_tokens == rb.generated_tokens, f"turn {i + 1}"
        assert (ra.cached_tokens > 0) == (i > 0) and rb.cached_tokens == 0


def _on_shared_pool(graph_config, tmp_path) -> str:
    """The graph set's config with every session of the node's process on one onnxruntime thread pool."""
    raw = yaml.safe_load(graph_config.read_text())
    raw["executor"].setdefault("options", {}).update({"thread_pool": "shared", "intra_op_num_threads": 2})
    path = tmp_path / graph_config.parent.name / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_nodes_on_a_shared_thread_pool(demo_graphs, start_node, client, tmp_path):
    """executor.options.thread_pool: shared: vla_node's three stage threads run their graphs on the one pool of
    the process, and vlm_node on it replies as on per-session pools, token for token."""
    vla = _on_shared_pool((demo_graphs["vla_demo_orin"] / "config.yaml"), tmp_path)
    p = start_node("vla_node", {"config": vla, "graph_dir": str(demo_graphs["vla_demo_orin"])},
                   namespace="/ort_pool")
    h = Harness(client, "/ort_pool")
    h.wait_connected()
    h.publish_until_chunks(3, lambda s, t: rgb_image(448, 448, s, t))
    assert all(np.all(np.isfinite(c.actions)) for c in h.chunks)
    assert p.alive()
    vlm = _on_shared_pool((demo_graphs["vlm_demo"] / "config.yaml"), tmp_path)
    start_node("vlm_node", {"config": vlm, "graph_dir": str(demo_graphs["vlm_demo"])}, namespace="/ort_pool_chat")
    start_node("vlm_node", {"config": str(demo_graphs["vlm_demo"] / "config.yaml")}, namespace="/ort_own_pools")
    a, b = ChatClient(client, "/ort_pool_chat"), ChatClient(client, "/ort_own_pools")
    for i, turn in enumerate([dict(prompt="Describe the table.", images=[rgb_image(96, 128, 2)]),
                              dict(prompt="And the cup?")]):
        ra, rb = ok(a.chat("s", **turn)), ok(b.chat("s", **turn))
        assert ra.reply == rb.reply and ra.generated_tokens == rb.generated_tokens > 0, f"turn {i + 1}"
