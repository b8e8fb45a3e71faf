"""synflux-serve with TLS from a certificate file (wss:// and https://, openpi's client trusting the certificate),
and the chat endpoint under malformed and mutated JSON, staying up."""
from __future__ import annotations

import http.client
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from synflux_ros.tools import harness as testing
from tls_certs import self_signed

pytestmark = pytest.mark.serve
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (make serve-venv)")
from synflux_ros.tools.serve_process import ServeProcess  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OPENPI_PY = REPO / ".venv-openpi" / "bin" / "python"
CLIENT = REPO / "test" / "reference" / "openpi_client_run.py"


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_tls")
    cert, key = self_signed(d)
    srv = ServeProcess(testing.config_path("vla_demo_orin.yaml"),
                       ["--replicas", "1", "--num-cpus", "2", "--object-store-mib", "100", "--tls-cert", cert,
                        "--tls-key", key], str(d / "serve.log"), ca_file=cert)
    srv.cert, srv.dir = cert, d
    yield srv
    assert srv.stop() == 0, srv.output()


def test_the_endpoint_serves_https_only_to_clients_that_trust_it(tls_server):
    """(The websocket itself, wss://, is driven by openpi's client below, in a process of its own.)"""
    import socket
    import ssl
    import urllib.request
    https = urllib.request.urlopen(tls_server.url("/healthz"), timeout=10, context=tls_server.ssl)
    assert https.read() == b"OK\n"
    # plain HTTP on the TLS port gets no answer a client would take
    conn = http.client.HTTPConnection("127.0.0.1", tls_server.port, timeout=10)
    with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
        conn.request("GET", "/healthz")
        response = conn.getresponse()
        assert response.status != 200
        raise ConnectionError(f"answered {response.status}")
    # a client that does not trust the certificate refuses the server
    with socket.create_connection(("127.0.0.1", tls_server.port), timeout=10) as raw:
        with pytest.raises(ssl.SSLCertVerificationError):
            ssl.create_default_context().wrap_socket(raw, server_hostname="127.0.0.1")


def test_openpi_s_client_over_wss(tls_server, tmp_path):
    if not OPENPI_PY.exists():
        pytest.skip("openpi's client is not installed (make openpi-venv)")
    np.save(tmp_path / "img.npy", np.zeros((64, 64, 3), np.uint8))
    job = {"host": f"wss://127.0.0.1:{tls_server.port}", "port": None, "out": str(tmp_path),
           "requests": [{"observation/image": str(tmp_path / "img.npy"), "prompt": "pick up the red block"}]}
    (tmp_path / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "SSL_CERT_FILE": tls_server.cert}  # how an operator makes Python trust a private CA
    proc = subprocess.run([str(OPENPI_PY), str(CLIENT), str(tmp_path / "job.json")], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert "error" not in result and np.load(tmp_path / "actions_0.npy").shape == (16, 7)


def test_vla_node_on_the_served_model_over_wss_trusts_its_ca_file(tls_server, start_node, client, tmp_path):
    """executor.backend remote over wss://: with remote.ca_file the node trusts the server's certificate and
    chunks come; without it the system's trust store refuses the server and each frame fails saying so."""
    import yaml
    from synflux_ros.tools.harness import rgb_image
    from ros_clients import Harness
    raw = yaml.safe_load(open(testing.config_path("vla_demo_orin.yaml"), encoding="utf-8"))
    raw["executor"] = {"backend": "remote"}
    raw["remote"] = {"url": f"wss://127.0.0.1:{tls_server.port}/", "ca_file": tls_server.cert, "compression": "raw",
                     "resize": False, "request_timeout": 10.0, "backoff_min": 0.2, "backoff_max": 1.0}
    (tmp_path / "wss.yaml").write_text(yaml.safe_dump(raw))
    del raw["remote"]["ca_file"]
    (tmp_path / "untrusting.yaml").write_text(yaml.safe_dump(raw))
    start_node("vla_node", {"config": str(tmp_path / "wss.yaml")}, namespace="/wss")
    start_node("vla_node", {"config": str(tmp_path / "untrusting.yaml"), "diagnostics_period": 0.2},
               namespace="/untrusting")
    trusted = Harness(client, "/wss")
    trusted.wait_connected()
    trusted.publish_until_chunks(2, lambda s, t: rgb_image(448, 448, s, t))
    assert all(c.horizon == 16 for c in trusted.chunks)
    refused = Harness(client, "/untrusting")
    refused.wait_connected()
    d = refused.publish_until_diag(rgb_image(448, 448, 1, 10**9), lambda d: int(d["frames_failed"]) >= 2, timeout=60)
    assert "CERTIFICATE_VERIFY_FAILED" in d["last_error"] and d["frames_published"] == "0", d["last_error"]


# ---------------------------------------------------------------------------------------- chat under fuzz

@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_fuzz")
    srv = ServeProcess(testing.config_path("vlm_demo.yaml"), ["--replicas", "1", "--num-cpus", "2",
                                                                "--object-store-mib", "100"], str(d / "serve.log"))
    yield srv
    assert srv.stop() == 0, srv.output()


def post(server, body: bytes, content_type="application/json") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": content_type})
    r = conn.getresponse()
    return r.status, r.read()


GOOD = {"model": "vlm-demo", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.mark.parametrize("body", [
    b"", b"{", b"[]", b"null", b'"text"', b"\xff\xfe\x00", b'{"messages": "hello"}', b'{"messages": [null]}',
    b'{"messages": [{"role": "user"}]}', b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e400}',
    b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
    b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
    b'{"messages": [{"role": "user", "content": "x"}], "stream_options": 3}',
    b'{"messages": [{"role": "user", "content": "x"}], "n": true}',
    b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}]}',
    json.dumps({"messages": [{"role": "user", "content": "x"}] * 5000}).encode(),
], ids=lambda b: repr(b[:40]))
def test_malformed_json_is_refused_and_the_server_keeps_serving(chat_server, body):
    status, reply = post(chat_server, body)
    assert 400 <= status < 500, (status, reply[:300])
    error = json.loads(reply)["error"]
    assert error["message"] and error["type"]
    status, reply = post(chat_server, json.dumps(GOOD).encode())
    assert status == 200, reply[:300]


def test_mutated_json_never_takes_the_server_down(chat_server):
    good = json.dumps(GOOD).encode()
    rng = np.random.default_rng(11)
    for i in range(40):
        data = bytearray(good)
        for pos in rng.integers(0, len(data), 3):
            data[pos] = int(rng.integers(32, 127))
        status, reply = post(chat_server, bytes(data))
        assert status in (200, 400, 404), (i, status, reply[:300])
        assert status == 200 or "error" in json.loads(reply), (i, reply[:300])
    assert chat_server.healthy()
