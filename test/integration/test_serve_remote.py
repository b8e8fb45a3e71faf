"""vla_node with executor.backend remote, over real DDS, against synflux-serve on loopback (onnxruntime): its
chunks are the local runtime's for the same frames, the network is a stage of its diagnostics, and with the
server stopped the node keeps serving and counts the frames that fail, saying why."""
from __future__ import annotations

import numpy as np
import pytest
import yaml

from synflux_ros.core.config import load_config
from synflux_ros.runtimes.vla import VLARuntime
from synflux_ros.tools import harness as testing
from synflux_ros.tools.harness import rgb_image

from ros_clients import Harness, stamp_ns

pytestmark = pytest.mark.serve
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (make serve-venv)")
from synflux_ros.tools.serve_process import ServeProcess  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from synflux_ros.buildtool.export import build
    d = tmp_path_factory.mktemp("serve_remote")
    with open(testing.config_path("vla_demo_orin.yaml"), encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    raw["executor"] = {"backend": "onnxruntime", "graph_dir": str(d / "graphs"),
                       "options": {"intra_op_num_threads": 1}}
    local = d / "local.yaml"
    local.write_text(yaml.safe_dump(raw))
    build(load_config(str(local)), str(d / "graphs"))
    srv = ServeProcess(str(local), ["--replicas", "1", "--num-cpus", "2", "--object-store-mib", "100"],
                       str(d / "serve.log"))
    raw["executor"] = {"backend": "remote"}
    raw["remote"] = {"url": f"ws://127.0.0.1:{srv.port}/", "compression": "raw", "resize": False,
                     "request_timeout": 10.0, "backoff_min": 0.2, "backoff_max": 1.0}
    remote = d / "remote.yaml"
    remote.write_text(yaml.safe_dump(raw))
    yield srv, str(local), str(remote)
    code = srv.stop()
    assert code == 0, f"synflux-serve exited with {code} on SIGINT:\n{srv.output()}"


def pixels(msg) -> np.ndarray:
    return np.frombuffer(bytes(msg.data), np.uint8).reshape(msg.height, msg.width, 3)


def test_a_remote_model_gives_the_local_runtime_s_chunks(served, start_node, client):
    srv, local, remote = served
    start_node("vla_node", {"config": remote, "diagnostics_period": 0.2}, namespace="/remote")
    h = Harness(client, "/remote")
    h.wait_connected()
    frames = {}

    def frame(seq, stamp):
        msg = rgb_image(448, 448, seq, stamp)
        frames[stamp] = pixels(msg)
        return msg

    h.publish_until_chunks(3, frame)
    runtime = VLARuntime(load_config(local))
    try:
        for chunk in h.chunks:
            want = runtime.infer(frames[stamp_ns(chunk.header)], seq=chunk.frame_seq).actions
            got = np.asarray(chunk.actions, np.float32).reshape(chunk.horizon, chunk.action_dim)
            np.testing.assert_allclose(got, want, atol=1e-5)
            assert chunk.head_ms > 0 and chunk.head_device == f"remote ws://127.0.0.1:{srv.port}/"
    finally:
        runtime.close()
    d = h.diag_where(lambda d: "stage_network_median_ms" in d and int(d["frames_published"]) >= 3)
    assert float(d["stage_network_median_ms"]) >= 0 and d["stage_network_device"].startswith("remote ws://")
    assert d["backend"] == "remote"


def test_jpeg_frames_fitted_to_the_model_travel(served, start_node, client, tmp_path):
    srv, local, remote = served
    raw = yaml.safe_load(open(remote, encoding="utf-8"))
    raw["remote"].update(compression="jpeg", resize=True, jpeg_quality=85)
    path = tmp_path / "jpeg.yaml"
    path.write_text(yaml.safe_dump(raw))
    start_node("vla_node", {"config": str(path), "diagnostics_period": 0.2}, namespace="/jpeg")
    h = Harness(client, "/jpeg")
    h.wait_connected()
    h.publish_until_chunks(2, lambda s, t: rgb_image(720, 1280, s, t))
    for chunk in h.chunks:
        assert chunk.horizon == 16 and np.all(np.isfinite(chunk.actions))


def test_with_the_server_stopped_the_node_keeps_serving_and_counts_the_failures(served, start_node, client):
    srv, local, remote = served
    start_node("vla_node", {"config": remote, "diagnostics_period": 0.2}, namespace="/orphan")
    h = Harness(client, "/orphan")
    h.wait_connected()
    h.publish_until_chunks(1, lambda s, t: rgb_image(448, 448, s, t))
    assert srv.stop() == 0
    image = rgb_image(448, 448, 1, 10**9 * 500)
    d = h.publish_until_diag(image, lambda d: int(d["frames_failed"]) >= 3, timeout=60)
    assert "failed in network" in d["last_error"] and f"127.0.0.1:{srv.port}" in d["last_error"], d["last_error"]
    assert int(d["frames_received"]) >= int(d["frames_published"]) + int(d["frames_failed"])
