"""synflux-build --check: per graph, does it compile on a backend and which operators are unsupported."""
from __future__ import annotations

import shutil

import pytest

pytest.importorskip("torch", reason="synflux-build needs torch (make test installs it)")

from synflux_ros.buildtool.check import check_graph_set, report  # noqa: E402
from synflux_ros.buildtool.export import main as synflux_build  # noqa: E402
from synflux_ros.core.contract import graph_set  # noqa: E402
from synflux_ros.core.config import load_config  # noqa: E402
from synflux_ros.tools.harness import config_path  # noqa: E402


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_a_healthy_set_compiles_everywhere(demo_graphs, backend):
    pytest.importorskip(backend)
    rows = check_graph_set(str(demo_graphs["vla_demo_orin"]), backend)
    assert [r.graph for r in rows] == [g.name for g in graph_set(load_config(config_path("vla_demo_orin.yaml")))]
    assert all(r.ok for r in rows), report(rows, backend)


def test_a_graph_that_does_not_compile_is_named_and_the_others_still_checked(demo_graphs, tmp_path):
    pytest.importorskip("openvino")
    d = tmp_path / "set"
    shutil.copytree(demo_graphs["vlm_demo"], d)
    (d / "decode_512.onnx").write_bytes(b"not an onnx file")
    rows = {r.graph: r for r in check_graph_set(str(d), "openvino")}
    assert not rows["decode_512"].compiles and "decode_512.onnx" in rows["decode_512"].error
    assert all(r.ok for name, r in rows.items() if name != "decode_512")
    text = report(list(rows.values()), "openvino")
    assert "decode_512" in text and "NO" in text and f"{len(rows) - 1} of {len(rows)} graphs" in text


def test_the_command_exits_1_when_a_graph_fails(tmp_path, capsys):
    out = tmp_path / "graphs"
    assert synflux_build(["--config", config_path("vlm_demo.yaml"), "--out", str(out), "--check"]) == 0
    assert "graphs compile on onnxruntime with every operator supported" in capsys.readouterr().out
    (out / "embed_32.onnx").write_bytes(b"\x00")
    assert synflux_build(["--config", config_path("vlm_demo.yaml"), "--out", str(out), "--check", "onnxruntime"]) == 1
