"""Both nodes on graph sets compiled for rk3588 (synflux-build --backend rknn), running in rknn-toolkit2's
simulator through the rknn executor. The demo configs are shrunk to one prefill and one decode bucket: the
simulator builds every graph again when a node starts (a few seconds per graph), and the full demo sets are
covered graph by graph in test/unit/test_rknn_backend.py. Needs the RKNN venv (`make rknn-venv`)."""
from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("torch", reason="synflux-build needs torch (make test installs it)")

from synflux_ros.backends.rknn import default_simulator_pythons  # noqa: E402
from synflux_ros.build.export import build  # noqa: E402
from synflux_ros.core.config import load_config  # noqa: E402
from synflux_ros.nodes.testing import rgb_image  # noqa: E402

from test_vla_node import Harness, stamp_ns  # noqa: E402
from test_vlm_node import ChatClient, ok  # noqa: E402

if not any(os.path.isfile(p) for p in default_simulator_pythons()):
    pytest.skip(f"no rknn-toolkit2 venv at {' or '.join(default_simulator_pythons())} (run `make rknn-venv`)",
                allow_module_level=True)

SHRUNK = {
    "vla_demo_orin.yaml": dict(llm={"prefill_buckets": [160], "decode_buckets": [256], "max_seq_len": 256}),
    "vlm_demo.yaml": dict(llm={"prefill_buckets": [32], "decode_buckets": [256], "max_seq_len": 256}),
}


@pytest.fixture(scope="module")
def rknn_configs(make_config, tmp_path_factory):
    """The shrunk demo configs exported and compiled for rk3588; name -> the graph set's config.yaml."""
    out = {}
    for name, sections in SHRUNK.items():
        d = tmp_path_factory.mktemp(name.replace(".yaml", "") + "_rknn")
        build(load_config(make_config(name, **sections)), str(d), backend="rknn", target="rk3588")
        out[name] = d / "config.yaml"
    return out


def test_vla_node_on_rknn_simulator(rknn_configs, start_node, client):
    p = start_node("vla_node", {"config": str(rknn_configs["vla_demo_orin.yaml"]), "diagnostics_period": 0.2},
                   namespace="/rk")
    h = Harness(client, "/rk")
    h.wait_connected(timeout=90)
    stamps = h.publish_until_chunks(2, lambda s, t: rgb_image(448, 448, s, t), timeout=60)
    c = h.chunks[-1]
    assert (c.horizon, c.action_dim) == (16, 7) and stamp_ns(c.header) in stamps
    assert np.all(np.isfinite(c.actions))
    assert c.vision_device == c.backbone_device == c.head_device == "rknn:rk3588-simulator"
    # diagnostics lag the chunks by up to a period: wait for one published after the chunks
    d = h.diag_where(lambda d: d["backend"] == "rknn" and int(d["frames_published"]) >= 1)
    assert int(d["frames_published"]) >= 1
    assert "on 'rknn'" in p.output()


def test_vlm_node_on_rknn_simulator_two_turns(rknn_configs, start_node, client):
    start_node("vlm_node", {"config": str(rknn_configs["vlm_demo.yaml"])}, namespace="/rk_chat")
    chat = ChatClient(client, "/rk_chat")
    first = ok(chat.chat("s", "Describe the table.", max_new_tokens=8))
    second = ok(chat.chat("s", "And the cup?", max_new_tokens=8))
    assert first.cached_tokens == 0 and second.cached_tokens > 0
    assert second.generated_tokens >= 1
