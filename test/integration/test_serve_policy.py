"""synflux-serve as a process: Ray Serve on loopback with 2 replicas of a VLA on onnxruntime, driven by openpi's
own client (``openpi_client.websocket_client_policy`` in .venv-openpi) and by raw websockets.

The model: the demo VLA with a DROID-style robot state (7 joints + gripper, normalised) and DROID's observation
keys; the reference is the in-process runtime on the same graph set, frames and noise."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from synflux_ros.core.config import load_config
from synflux_ros.model.heads.rtc import RTCGuidance
from synflux_ros.model.normalization import Normalizer
from synflux_ros.runtimes.vla import VLARuntime
from synflux_ros.tools import harness as testing

pytestmark = pytest.mark.serve
pytest.importorskip("websockets.sync.client", reason="make serve-venv")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (make serve-venv)")
from synflux_ros.runtimes import wire  # noqa: E402
from synflux_ros.tools.serve_process import ServeProcess  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OPENPI_PY = REPO / ".venv-openpi" / "bin" / "python"
CLIENT = REPO / "test" / "reference" / "openpi_client_run.py"
KEY = "k" * 8 + "-serve-test-key-0123"
MAX_PIXELS = 500_000
STATE_KEYS = ["observation/joint_position", "observation/gripper_position"]
IMAGE_KEY = "observation/exterior_image_1_left"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from synflux_ros.buildtool.export import build
    d = tmp_path_factory.mktemp("serve")
    with open(testing.config_path("vla_demo_orin.yaml"), encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    raw["vision"]["max_input_pixels"] = MAX_PIXELS
    raw["action"].update(state_dim=8, state_joints=[f"joint_{i}" for i in range(1, 8)] + ["gripper"],
                         state_norm={"mode": "mean_std", "mean": [0.0] * 8, "std": [2.0] * 8},
                         action_norm={"mode": "mean_std", "mean": [0.1] * 7, "std": [0.5] * 7})
    raw["executor"] = {"backend": "onnxruntime", "options": {"intra_op_num_threads": 1}}
    raw["serve"] = {"images": {"image": IMAGE_KEY}, "state": STATE_KEYS, "max_message_bytes": 3 * 2**20}
    cfg = d / "droid.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    build(load_config(str(cfg)), str(d / "graphs"))
    (d / "key").write_text(KEY + "\n")
    # at most 3 robots a replica: Ray's router alone may put every connection on one replica
    srv = ServeProcess(str(cfg), ["--graph-dir", str(d / "graphs"), "--replicas", "2", "--num-cpus", "2",
                                  "--object-store-mib", "100", "--api-key-file", str(d / "key"),
                                  "--max-ongoing-requests", "3", "--write-config", str(d / "serve.yaml")],
                       str(d / "serve.log"), key=KEY)
    srv.graphs, srv.dir = str(d / "graphs"), d
    yield srv
    code = srv.stop()
    assert code == 0, f"synflux-serve exited with {code} on SIGINT:\n{srv.output()}"


def frames(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        yield (rng.integers(0, 256, (180, 320, 3), dtype=np.uint8),  # DROID's camera size
               rng.uniform(-1, 1, 7), rng.uniform(0, 1, 1))


def run_openpi_client(tmp_path, server, requests, key=KEY):
    if not OPENPI_PY.exists():
        pytest.skip("openpi's client is not installed (make openpi-venv)")
    job = {"host": "127.0.0.1", "port": server.port, "out": str(tmp_path), "requests": requests,
           "nested": ["rtc/prev_chunk", "rtc/inference_delay"]}  # obs["rtc"]["prev_chunk"], ...
    if key:
        job["api_key"] = key
    (tmp_path / "job.json").write_text(json.dumps(job))
    proc = subprocess.run([str(OPENPI_PY), str(CLIENT), str(tmp_path / "job.json")], capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "result.json").read_text())


def save(tmp_path, name, arr) -> str:
    path = tmp_path / f"{name}.npy"
    np.save(path, arr)
    return str(path)


def test_openpi_client_gets_the_in_process_runtime_s_actions(server, tmp_path):
    prompts = ["pick up the red block", "pick up the red block", "open the drawer"]
    reqs, inputs = [], []
    for i, (img, joints, grip) in enumerate(frames(3)):
        reqs.append({IMAGE_KEY: save(tmp_path, f"img{i}", img), STATE_KEYS[0]: save(tmp_path, f"j{i}", joints),
                     STATE_KEYS[1]: save(tmp_path, f"g{i}", grip), "prompt": prompts[i]})
        inputs.append((img, np.concatenate([joints, grip]).astype(np.float32), prompts[i]))
    got = run_openpi_client(tmp_path, server, reqs)
    assert "error" not in got, got["error"]
    meta = got["metadata"]
    assert (meta["action_horizon"], meta["action_dim"], meta["head"]) == (16, 7, "flow_matching")
    assert meta["cameras"] == {"image": IMAGE_KEY} and meta["state"] == STATE_KEYS and meta["rtc"] is True

    cfg = load_config(server.config).with_overrides(executor={"graph_dir": server.graphs})
    runtime = VLARuntime(cfg)
    try:
        for i, (img, state, prompt) in enumerate(inputs):
            runtime.set_instruction(prompt)
            want = runtime.infer(img, seq=i, state=state).actions
            actions = np.load(tmp_path / f"actions_{i}.npy")
            assert actions.dtype == np.float32 and actions.shape == (16, 7)
            np.testing.assert_allclose(actions, want, atol=1e-5, err_msg=f"frame {i}")
    finally:
        runtime.close()
    timings = got["results"]
    assert all(r["server_timing"]["infer_ms"] > 0 and r["policy_timing"]["head_ms"] > 0 for r in timings)
    assert "prev_total_ms" not in timings[0]["server_timing"] and timings[1]["server_timing"]["prev_total_ms"] > 0


def test_real_time_chunking_across_the_wire(server, tmp_path):
    """A request carries the previous chunk's leftover (robot units, as sent) and the delay: the chunk equals
    the in-process runtime's guided by the same leftover in the model's action space."""
    (img0, j0, g0), (img1, j1, g1) = frames(2, seed=5)
    first = {IMAGE_KEY: save(tmp_path, "a", img0), STATE_KEYS[0]: save(tmp_path, "b", j0),
             STATE_KEYS[1]: save(tmp_path, "c", g0), "prompt": "pick up the red block"}
    got = run_openpi_client(tmp_path, server, [first])
    chunk = np.load(tmp_path / "actions_0.npy")
    leftover = chunk[3:]
    second = {IMAGE_KEY: save(tmp_path, "d", img1), STATE_KEYS[0]: save(tmp_path, "e", j1),
              STATE_KEYS[1]: save(tmp_path, "f", g1), "rtc/prev_chunk": save(tmp_path, "g", leftover),
              "rtc/inference_delay": 2}
    job_dir = tmp_path / "second"
    job_dir.mkdir()
    got = run_openpi_client(job_dir, server, [first, second])
    assert "error" not in got, got["error"]
    guided = np.load(job_dir / "actions_1.npy")

    cfg = load_config(server.config).with_overrides(executor={"graph_dir": server.graphs})
    rtc = cfg.execution.rtc
    runtime = VLARuntime(cfg)
    try:
        state = np.concatenate([j1, g1]).astype(np.float32)
        plain = runtime.infer(img1, seq=1, state=state).actions
        guide = RTCGuidance(prev_chunk=Normalizer(cfg.action.action_norm).forward(leftover), inference_delay=2,
                            execution_horizon=rtc.execution_horizon, schedule=rtc.schedule,
                            max_guidance_weight=rtc.max_guidance_weight, flavour=rtc.guidance)
        want = runtime.infer(img1, seq=1, state=state, rtc=guide).actions
    finally:
        runtime.close()
    np.testing.assert_allclose(guided, want, atol=1e-5)
    assert np.abs(guided - plain).max() > 1e-3  # the guidance changed the chunk


def test_a_connection_without_the_key_is_refused(server):
    from websockets.exceptions import InvalidStatus
    for key in ("", "k" * 8 + "-serve-test-key-0124", KEY[:-1]):
        with pytest.raises(InvalidStatus) as err:
            server.connect(key)
        assert err.value.response.status_code == 403
    ws, meta = server.connect()
    ws.close()
    assert meta["model"] == "vla-demo-orin"


def good_request(seed=0) -> dict:
    img, joints, grip = next(frames(1, seed))
    return {IMAGE_KEY: img, STATE_KEYS[0]: joints, STATE_KEYS[1]: grip, "prompt": "pick up the red block"}


def bad_array(dtype="|O", shape=(2,), data=b"\x00" * 16):
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": list(shape)}


BAD_REQUESTS = [
    (b"\xc1\x00", "not a msgpack message"),
    ("a text frame", "expected a binary msgpack message"),
    (lambda: {**good_request(), IMAGE_KEY: bad_array()}, "only booleans, integers and floats"),
    (lambda: {**good_request(), IMAGE_KEY: bad_array("|u1", (180, 320, 3))}, "needs 172800 bytes"),
    (lambda: {k: v for k, v in good_request().items() if k != IMAGE_KEY}, "no image at 'observation/exterior"),
    (lambda: {**good_request(), IMAGE_KEY: np.zeros((180, 320, 3), np.float32)}, "expected a uint8 image"),
    (lambda: {**good_request(), IMAGE_KEY: np.zeros((800, 800, 3), np.uint8)}, f"limit of {MAX_PIXELS} pixels"),
    (lambda: {**good_request(), STATE_KEYS[0]: np.zeros(6)}, "hold 7 values, the model takes 8"),
    (lambda: {**good_request(), STATE_KEYS[1]: np.array([np.nan])}, "state: holds NaN or Inf"),
    (lambda: {**good_request(), "prompt": 7}, "prompt (prompt): expected a string"),
    (lambda: {**good_request(), "prompt": "x" * 5000}, "instruction has 5000 characters"),
    (lambda: {**good_request(), "rtc": {"prev_chunk": np.zeros((4, 5)), "inference_delay": 1}},
     "rtc prev_chunk: expected a [steps, 7] array"),
    (lambda: {**good_request(), "rtc": {"prev_chunk": np.zeros((4, 7)), "inference_delay": -1}},
     "rtc inference_delay: expected a non-negative integer"),
    (lambda: {"pad": np.zeros(4 * 2**20, np.uint8)}, "exceeds the limit of 3145728"),
]


@pytest.mark.parametrize("bad,needle", BAD_REQUESTS, ids=[n for _, n in BAD_REQUESTS])
def test_a_bad_request_is_refused_with_the_reason_and_the_server_keeps_serving(server, bad, needle):
    from websockets.exceptions import ConnectionClosedError
    ws, _ = server.connect()
    message = bad() if callable(bad) else bad
    ws.send(message if isinstance(message, (bytes, str)) else wire.pack(message))
    reply = ws.recv(timeout=60)
    assert isinstance(reply, str) and "request refused" in reply and needle in reply, reply
    with pytest.raises(ConnectionClosedError) as closed:
        ws.recv(timeout=30)
    assert closed.value.rcvd.code == 1011
    ws, _ = server.connect()
    ws.send(wire.pack(good_request()))
    result = wire.unpack(ws.recv(timeout=60), 1 << 24)
    ws.close()
    assert result["actions"].shape == (16, 7) and np.all(np.isfinite(result["actions"]))
    assert server.healthy()


def test_mutated_messages_never_take_the_server_down(server):
    good = wire.pack(good_request())
    rng = np.random.default_rng(3)
    for i in range(12):
        data = bytearray(good)
        for pos in rng.integers(0, 200, 6):  # the header region: keys, types, lengths, dtype and shape
            data[pos] = rng.integers(0, 256)
        ws, _ = server.connect()
        ws.send(bytes(data))
        reply = ws.recv(timeout=60)
        ws.close()
        # either refused with a reason or, where the mutation left a valid request, answered
        assert isinstance(reply, str) and reply.startswith(("request refused", "inference failed")) or \
            wire.unpack(reply, 1 << 24)["actions"].shape == (16, 7), (i, reply)
    assert server.healthy()


def test_concurrent_robots_spread_over_the_replicas(server):
    conns = [server.connect() for _ in range(6)]
    replicas = {meta["replica"] for _, meta in conns}
    for ws, _ in conns:
        ws.send(wire.pack(good_request()))
    results = [wire.unpack(ws.recv(timeout=60), 1 << 24) for ws, _ in conns]
    for ws, _ in conns:
        ws.close()
    assert len(replicas) == 2, replicas
    # the first frame of every connection has the same noise: same request, same chunk on either replica
    for r in results[1:]:
        np.testing.assert_allclose(r["actions"], results[0]["actions"], atol=1e-6)


def test_the_written_serve_config_is_ray_s_schema(server):
    from ray.serve.schema import ServeDeploySchema
    written = yaml.safe_load((server.dir / "serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(written) if hasattr(ServeDeploySchema, "model_validate") else \
        ServeDeploySchema.parse_obj(written)
    app = schema.applications[0]
    assert app.import_path == "synflux_ros.serve.app:build_app" and app.args["config"] == server.config
    assert app.deployments[0].num_replicas == 2
