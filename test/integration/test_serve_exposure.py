"""What a synflux-serve on one machine exposes: every socket of its process tree (Ray's GCS, raylet, workers,
agents, the proxy, the replicas) listens on loopback only; every route but /healthz wants the key; a websocket
message over the limits gets the refusal that names the limit and the size (the server's own limit: openpi's
``request refused``; Ray's proxy's 16 MiB: a close 1009 whose reason names both)."""
from __future__ import annotations

import ipaddress
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import yaml

from synflux_ros.tools import harness as testing

pytestmark = pytest.mark.serve
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (make serve-venv)")
psutil = pytest.importorskip("psutil")
from synflux_ros.core.config import PROXY_WS_MAX_BYTES  # noqa: E402
from synflux_ros.runtimes import wire  # noqa: E402
from synflux_ros.tools.serve_process import ServeProcess  # noqa: E402

KEY = "k" * 24
LIMIT = 4 * 2**20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve_exposure")
    with open(testing.config_path("vla_demo_orin.yaml"), encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    raw.setdefault("serve", {})["max_message_bytes"] = LIMIT
    cfg = d / "vla.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    (d / "key").write_text(KEY)
    srv = ServeProcess(str(cfg), ["--replicas", "1", "--num-cpus", "2", "--object-store-mib", "100",
                                  "--api-key-file", str(d / "key")], str(d / "serve.log"), key=KEY)
    yield srv
    assert srv.stop() == 0, srv.output()


def listening(pid: int) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket of ``pid`` and its descendants."""
    out = []
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            conns = proc.net_connections(kind="tcp")
            name = " ".join(proc.cmdline()[:3])[:120]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out += [(c.laddr.ip, c.laddr.port, name) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1, as gRPC reports a 127.0.0.1 socket
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def test_the_loopback_check_sees_what_is_exposed():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("::ffff:10.0.0.5")


def test_nothing_of_ray_listens_beyond_loopback(server):
    sockets = listening(server.proc.pid)
    assert any(port == server.port for _, port, _ in sockets), sockets  # the proxy is in the tree
    assert len({name for _, _, name in sockets}) >= 3, sockets  # GCS, raylet, workers: the tree was seen
    exposed = [s for s in sockets if not is_loopback(s[0])]
    assert not exposed, "listening beyond loopback:\n" + "\n".join(map(str, exposed))


def get(server, path: str, key: str | None) -> tuple[int, bytes]:
    req = urllib.request.Request(server.url(path), headers={"Authorization": f"Api-Key {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_every_route_but_healthz_wants_the_key(server):
    assert get(server, "/healthz", None) == (200, b"OK\n")
    status, body = get(server, "/status", None)
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    status, body = get(server, "/status", KEY)
    assert status == 200 and json.loads(body)["model"]


def _refusal(server, size: int):
    """Send an observation of about ``size`` bytes; the text frame and the close (code, reason) that follow."""
    from websockets.exceptions import ConnectionClosed
    ws, _ = server.connect()
    side = int(np.sqrt(size / 3))
    image = np.zeros((side, side, 3), np.uint8)
    try:
        ws.send(wire.pack({"observation/image": image, "prompt": "pick"}))
        text = ws.recv(timeout=60)
        ws.recv(timeout=60)
    except ConnectionClosed as exc:
        text = locals().get("text")
        return text, exc.rcvd.code if exc.rcvd else None, exc.rcvd.reason if exc.rcvd else ""
    finally:
        ws.close()
    raise AssertionError(f"the server answered an observation of {size} bytes: {text!r}")


def test_a_message_over_the_server_s_limit_is_refused_naming_both(server):
    text, code, _ = _refusal(server, LIMIT + 2**20)
    assert code == 1011 and text.startswith("request refused: message of ")
    assert f"exceeds the limit of {LIMIT}" in text


def test_a_message_over_the_proxy_s_limit_is_closed_naming_both(server):
    text, code, reason = _refusal(server, PROXY_WS_MAX_BYTES + 2**20)
    assert text is None, text  # the replica never saw the message
    # The proxy sends its close frame and closes the connection at once: a client still sending the rest of
    # its message may see the reset before the frame (code None). When the frame arrives, it names both.
    assert code in (1009, None), (code, reason)
    if code == 1009:
        assert f"exceeds limit of {PROXY_WS_MAX_BYTES} bytes" in reason
    status = json.loads(get(server, "/status", KEY)[1])
    assert status["requests_too_big"] >= 1  # the replica was told 1009 by the proxy, and counted it
    ws, meta = server.connect()  # and the server keeps serving
    ws.close()
    assert meta["replica"]
