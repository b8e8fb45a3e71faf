"""Every shipped config builds with synflux-build (real-size ones shrunk to demo size: same architecture,
heads layout, buckets, KV dtype and heads, small widths) and runs through its node on onnxruntime."""
from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import yaml

pytest.importorskip("torch", reason="synflux-build needs torch (make test installs it)")
pytest.importorskip("onnxruntime", reason="the onnxruntime backend needs onnxruntime")

from synflux_ros.core.config import load_config  # noqa: E402
from synflux_ros.nodes.testing import config_path, rgb_image, share_dir  # noqa: E402
from synflux_ros.build.export import build  # noqa: E402

from test_vla_node import Harness  # noqa: E402
from test_vlm_node import ChatClient, ok  # noqa: E402

CONFIGS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(share_dir() or "", "config", "*.yaml")))


def demo_size(raw: dict) -> dict:
    """Shrink a real-size config's widths; keep its structure (architecture, buckets, heads, dtypes)."""
    llm = raw["llm"]
    if llm["hidden_dim"] <= 256:
        return raw
    llm.update(num_layers=2, hidden_dim=64, num_heads=4, num_kv_heads=min(llm.get("num_kv_heads", 4), 2),
               head_dim=16, intermediate_size=128, vocab_size=1024)
    vis = raw["vision"]
    vis.update(hidden_dim=32, num_layers=1, num_heads=2, intermediate_size=64)
    if vis.get("deepstack_layers"):
        vis["deepstack_layers"] = [0]
    act = raw.get("action")
    if act:
        act.update(expert_hidden_dim=32, expert_intermediate_size=64)
        if act.get("token_vocab_size"):
            act["token_vocab_size"] = 1000
    if raw.get("text", {}).get("eos_token_ids"):
        raw["text"]["eos_token_ids"] = [1000, 1001]
    return raw


@pytest.mark.parametrize("name", CONFIGS)
def test_config_builds_and_runs_on_its_node(name, tmp_path, start_node, client):
    with open(config_path(name), encoding="utf-8") as fh:
        raw = demo_size(yaml.safe_load(fh))
    src = tmp_path / name
    src.write_text(yaml.safe_dump(raw))
    out = tmp_path / "graphs"
    build(load_config(str(src)), str(out))
    cfg = load_config(str(out / "config.yaml"))
    assert cfg.executor.backend == "onnxruntime"
    ns = "/" + name.replace(".yaml", "")
    if cfg.mode == "vla":
        start_node("vla_node", {"config": str(out / "config.yaml")}, namespace=ns)
        h = Harness(client, ns)
        h.wait_connected(timeout=60)
        h.publish_until_chunks(1, lambda s, t: rgb_image(480, 640, s, t), timeout=60, period=0.5)
        c = h.chunks[-1]
        assert (c.horizon, c.action_dim) == (cfg.action.action_horizon, cfg.action.action_dim)
        actions = np.array(c.actions)
        assert actions.size == c.horizon * c.action_dim and np.all(np.isfinite(actions))
        if cfg.action.head_type == "autoregressive" and cfg.action.norm_q01:
            lo, hi = np.array(cfg.action.norm_q01), np.array(cfg.action.norm_q99)
            a = actions.reshape(c.horizon, c.action_dim)[:, :6]
            assert np.all(a >= lo[:6] - 1e-6) and np.all(a <= hi[:6] + 1e-6)
    else:
        start_node("vlm_node", {"config": str(out / "config.yaml")}, namespace=ns)
        c = ChatClient(client, ns)
        r1 = ok(c.chat("s", "What is in front of the robot?", images=[rgb_image(96, 128, 1)],
                       max_new_tokens=4, temperature=0.0))
        r2 = ok(c.chat("s", "And behind it?", max_new_tokens=4, temperature=0.0))
        assert r1.generated_tokens >= 1 and r2.cached_tokens > 0
