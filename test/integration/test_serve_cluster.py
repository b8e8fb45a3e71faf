"""synflux-serve joining a running Ray cluster (``ray start --head``, then ``--address``), and the Serve config
file it writes run by Ray's own ``serve run`` on that cluster: both serve the policy."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from synflux_ros.tools import harness as testing

pytestmark = pytest.mark.serve
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (make serve-venv)")
from synflux_ros.runtimes import wire  # noqa: E402
from synflux_ros.tools.serve_process import ServeProcess, free_port  # noqa: E402

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A one-node Ray cluster as `ray start --head` makes it (in the foreground, so that it is stopped here
    without touching any other Ray on the machine)."""
    d = tmp_path_factory.mktemp("ray_cluster")
    port = free_port()
    # Ray's token authentication, with the cluster's own token (every member reads it from this file)
    (d / "token").write_text(os.urandom(32).hex())
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(d / "token")}
    log = open(d / "ray.log", "w")
    # its sockets under a short dir: a deep basetemp would pass the 107 bytes of an AF_UNIX path
    temp_dir = tempfile.mkdtemp(prefix="synflux-ray-", dir="/tmp")
    proc = subprocess.Popen([str(BIN / "ray"), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                             f"--temp-dir={temp_dir}",
                             f"--object-store-memory={100 * 2**20}", "--include-dashboard=false",
                             "--disable-usage-stats", f"--ray-client-server-port={free_port()}",
                             f"--node-manager-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 90
        # the address it announces: Ray binds its head to the machine's address (the traffic stays on it)
        while f":{port}'" not in (d / "ray.log").read_text():
            assert proc.poll() is None, (d / "ray.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "ray start --head did not come up in 90 s"
            time.sleep(0.5)
        address = (d / "ray.log").read_text().split("ray start --address='", 1)[1].split("'", 1)[0]
        yield address, d, env
    finally:
        stop(proc)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def stop(proc, sig=signal.SIGTERM) -> None:
    """Signal the process alone, then kill what is left of its group; kill it too when it outlives a minute.
    Signalled together, the group's GCS went first and `ray start` waited 30 s to drain its node through it."""
    proc.send_signal(sig)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # nothing of the group outlived it


def one_chunk(server) -> np.ndarray:
    ws, meta = server.connect()
    ws.send(wire.pack({"observation/image": np.zeros((64, 64, 3), np.uint8)}))
    actions = wire.unpack(ws.recv(timeout=60), 1 << 24)["actions"]
    ws.close()
    assert meta["model"] == "vla-demo-orin"
    return actions


def test_synflux_serve_joins_a_cluster_and_serve_run_runs_its_config_file(cluster):
    address, d, env = cluster
    srv = ServeProcess(testing.config_path("vla_demo_orin.yaml"),
                       ["--address", address, "--write-config", str(d / "serve.yaml")], str(d / "serve.log"), env=env)
    try:
        first = one_chunk(srv)
    finally:
        assert srv.stop() == 0, srv.output()
    assert not srv.healthy()  # its application is gone; the cluster stays
    # Ray's own tool, on the file synflux-serve wrote
    log = open(d / "serve-run.log", "w")
    proc = subprocess.Popen([str(BIN / "serve"), "run", "--address", address, str(d / "serve.yaml")],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not srv.healthy():
            assert proc.poll() is None, (d / "serve-run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (d / "serve-run.log").read_text()[-3000:]
            time.sleep(0.5)
        np.testing.assert_array_equal(one_chunk(srv), first)
    finally:
        stop(proc, signal.SIGINT)
        log.close()
