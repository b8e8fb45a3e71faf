"""The per-backend timing bench on a small graph set: every backend that loads it gets a figure per graph;
one that cannot is reported, not dropped."""
from __future__ import annotations

import pytest

pytest.importorskip("onnxruntime", reason="the onnxruntime backend needs onnxruntime")

from synflux_ros.bench.backends import runnable, time_graphs  # noqa: E402


def test_every_runnable_backend_is_timed_on_the_same_graphs(demo_graphs):
    backends = runnable(["onnxruntime", "openvino", "no_such_backend"])
    assert "onnxruntime" in backends and "no_such_backend" not in backends
    not_loaded = {}
    times = time_graphs(str(demo_graphs["vlm_demo"]), backends + ["mock"], 1, not_loaded)
    assert not not_loaded
    assert set(times) == set(backends) | {"mock"}
    for per in times.values():
        assert list(per) == ["vision_encoder", "prefill_32", "decode_1024"]
        assert all(ms > 0 for ms in per.values())
