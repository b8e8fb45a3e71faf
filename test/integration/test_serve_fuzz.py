"""synflux-serve under requests built from a grammar of its two protocols, not random bytes only: openpi's
msgpack-numpy observations and OpenAI's chat bodies, each valid request mutated where a client can go wrong (a
field's type swapped, deep nesting, huge numbers, lone surrogates, zero and huge dimensions, wrong dtypes,
unknown fields). Every answer is a result, or the protocol's refusal (openpi's ``request refused: ...`` then close
1011; a 4xx with OpenAI's error body), never a server error; and the replicas are the same processes after.
Seeded, so a failure reproduces."""
from __future__ import annotations

import http.client
import json
import random

import numpy as np
import pytest

from synflux_ros.tools import harness as testing

pytestmark = pytest.mark.serve
pytest.importorskip("ray.serve", reason="Ray Serve is not installed (make serve-venv)")
import msgpack  # noqa: E402

from synflux_ros.tools.serve_process import ServeProcess  # noqa: E402

KEY = "fuzz-test-key-0123456789"
CHAT_BODIES = 150
POLICY_FRAMES = 60


def _weird_values(rng: random.Random):
    """Values of every JSON type, and the ones that broke parsers before."""
    return rng.choice([
        None, True, False, 0, -7, 1, 2**31, 10**400, -10**400, 1e308, -0.0, 0.5, float("inf"), float("nan"),
        "", "x", "\ud800", "a\udfffb", "\u0000", "🤖" * 50, [], [1, "a"], {}, {"\ud800": 1}, {"type": "text"},
        [[[[[]]]]],
    ])


def _valid_chat(rng: random.Random) -> dict:
    body = {"model": rng.choice([None, "vlm-demo"]), "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": rng.choice([None, 4, 8]), "temperature": rng.choice([None, 0.0, 0.7]),
            "stream": rng.choice([False, True])}
    if rng.random() < 0.3:
        body["messages"].insert(0, {"role": "system", "content": "Be brief."})
    return {k: v for k, v in body.items() if v is not None}


def _mutate_chat(rng: random.Random, body: dict):
    """One fault of a client in ``body`` (returns the body to send: a dict, or raw text)."""
    kind = rng.randrange(9)
    if kind == 0:  # a field's type swapped
        body[rng.choice(sorted(body) + ["n", "top_p", "stream_options", "stop"])] = _weird_values(rng)
    elif kind == 1:  # a message's field swapped
        msg = rng.choice(body["messages"])
        msg[rng.choice(["role", "content", "name"])] = _weird_values(rng)
    elif kind == 2:  # content parts of every kind
        body["messages"][-1]["content"] = [
            rng.choice([{"type": "text", "text": _weird_values(rng)}, {"type": _weird_values(rng)},
                        {"type": "image_url", "image_url": {"url": rng.choice(["data:,", "data:image/png;base64,@@",
                                                                               "http://x/y.png", "data:image/png;"
                                                                               "base64,iVBORw0KGgo="])}},
                        _weird_values(rng)]) for _ in range(rng.randrange(1, 4))]
    elif kind == 3:  # an unknown field, with odd names
        body[rng.choice(["\ud800", "x" * 300, "messages ", "🤖"])] = 1
    elif kind == 4:  # deep nesting
        depth = rng.choice([100, 5000, 100000])
        return '{"messages": ' + "[" * depth + "]" * depth + "}"
    elif kind == 5:  # huge numbers as raw JSON
        name = rng.choice(["max_tokens", "temperature", "n", "top_p", "max_completion_tokens"])
        return json.dumps(body)[:-1] + f', "{name}": 1' + "0" * rng.choice([20, 400, 5000]) + "}"
    elif kind == 6:  # no text, many images
        body["messages"][-1]["content"] = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}] * 40
    elif kind == 7:  # not a JSON object at all
        return rng.choice(["[]", "null", "1", '"s"', "{", "\xff", ""])
    else:  # a valid request
        pass
    return body


def _post(port: int, body, stream: bool) -> tuple[int, bytes, str]:
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else \
        json.dumps(body).encode("utf-8", "surrogatepass")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/chat/completions", raw, {"Content-Type": "application/json",
                                                           "Authorization": f"Bearer {KEY}"})
        r = conn.getresponse()
        return r.status, r.read(), r.getheader("content-type", "")
    finally:
        conn.close()


def _replica(server, headers) -> str:
    import urllib.request
    req = urllib.request.Request(server.url("/status"), headers=headers)
    return json.loads(urllib.request.urlopen(req, timeout=30).read())["replica"]


def _keyed_server(tmp_path_factory, config: str):
    """synflux-serve with the key, one replica, for one module; stopped cleanly at its end."""
    d = tmp_path_factory.mktemp("serve_fuzz")
    (d / "key").write_text(KEY)
    srv = ServeProcess(testing.config_path(config), ["--replicas", "1", "--num-cpus", "2", "--object-store-mib",
                                                     "100", "--api-key-file", str(d / "key")],
                       str(d / "serve.log"), key=KEY)
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    yield from _keyed_server(tmp_path_factory, "vlm_demo.yaml")


def test_chat_bodies_from_the_grammar_get_results_or_openai_errors(chat_server):
    auth = {"Authorization": f"Bearer {KEY}"}
    replica = _replica(chat_server, auth)
    rng = random.Random(20261128)
    seen = set()
    for i in range(CHAT_BODIES):
        body = _mutate_chat(rng, _valid_chat(rng))
        stream = isinstance(body, dict) and body.get("stream") is True
        status, raw, ctype = _post(chat_server.port, body, stream)
        seen.add(status)
        what = f"request {i}: {str(body)[:300]!r} -> {status} {raw[:300]!r}"
        assert 200 <= status < 500, what
        if status >= 400:
            error = json.loads(raw)["error"]
            assert isinstance(error["message"], str) and error["message"] and error["type"], what
        elif "text/event-stream" in ctype:
            events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", what
            assert all("error" not in json.loads(e) for e in events[:-1]), what  # refusals come before the 200
        else:
            assert json.loads(raw)["object"] == "chat.completion", what
    assert {200, 400} <= seen
    assert _replica(chat_server, auth) == replica  # the same process served them all


# ---------------------------------------------------------------------------------------------------- policy
POLICY_KEY_IMAGE = "observation/image"


def _array(arr: np.ndarray) -> dict:
    return {b"__ndarray__": True, b"data": arr.tobytes(), b"dtype": arr.dtype.str, b"shape": list(arr.shape)}


def _frame(rng: random.Random) -> bytes:
    """An observation with one fault (or none), packed by hand so that faults the packer would stop get out."""
    image = np.zeros((rng.choice([32, 64]), 48, 3), np.uint8)
    obs: dict = {POLICY_KEY_IMAGE: _array(image), "prompt": "pick up the cube"}
    kind = rng.randrange(10)
    if kind == 0:  # zero and huge dimensions
        shape = rng.choice([[0, 0, 3], [0, 48, 3], [2**40, 2**40, 3], [2**63, 2, 3], [-1, 3, 3], [1] * 9])
        obs[POLICY_KEY_IMAGE] = {b"__ndarray__": True, b"data": b"", b"dtype": "|u1", b"shape": shape}
    elif kind == 1:  # wrong dtypes
        obs[POLICY_KEY_IMAGE] = {b"__ndarray__": True, b"data": b"\0" * 16, b"dtype": rng.choice(
            ["<f8", "|O", "|V8", "<U2", "|S4", "bogus", 7]), b"shape": [2, 2, 1]}
    elif kind == 2:  # the image's type swapped
        obs[POLICY_KEY_IMAGE] = _weird_values(rng) if rng.random() < 0.5 else b"not a jpeg"
    elif kind == 3:  # the prompt's type swapped, or a lone surrogate in it (invalid UTF-8 on the wire)
        obs["prompt"] = rng.choice([7, [], {}, None, b"\xed\xa0\x80", 2**64 - 1])
    elif kind == 4:  # RTC out of range
        obs["rtc"] = {"prev_chunk": _array(np.zeros((16, 7), np.float32)),
                      "inference_delay": rng.choice([10**9, -1, 1.5, "3", 2**63])}
    elif kind == 5:  # deep nesting
        nest: object = 1
        for _ in range(rng.choice([50, 600])):
            nest = [nest]
        obs["extra"] = nest
    elif kind == 6:  # a scalar that does not fit its dtype
        obs["state"] = {b"__npgeneric__": True, b"data": rng.choice([300, -1, 1.5]), b"dtype": "|u1"}
    elif kind == 7:  # not a map
        return msgpack.packb(rng.choice([[1, 2], "text", 3, None]))
    elif kind == 8:  # an image over the config's pixel limit
        obs[POLICY_KEY_IMAGE] = {b"__ndarray__": True, b"data": b"", b"dtype": "|u1", b"shape": [5000, 5000, 3]}
    try:  # strings as a client's bytes, lone surrogates included (invalid UTF-8 on the wire)
        return msgpack.packb(obs, use_bin_type=True, unicode_errors="surrogatepass")
    except (OverflowError, TypeError, ValueError):  # what msgpack cannot hold at all (10**400)
        return msgpack.packb({POLICY_KEY_IMAGE: _array(image), "prompt": 10**18}, use_bin_type=True)


@pytest.fixture(scope="module")
def policy_server(tmp_path_factory):
    yield from _keyed_server(tmp_path_factory, "vla_demo_orin.yaml")


def test_policy_frames_from_the_grammar_get_results_or_openpi_refusals(policy_server):
    from websockets.exceptions import ConnectionClosed
    auth = {"Authorization": f"Api-Key {KEY}"}
    replica = _replica(policy_server, auth)
    rng = random.Random(1128)
    answers = {"result": 0, "refused": 0}
    ws = None
    for i in range(POLICY_FRAMES):
        if ws is None:
            ws, _ = policy_server.connect()
        frame = _frame(rng)
        ws.send(frame)
        reply = ws.recv(timeout=60)
        what = f"frame {i}: {frame[:200]!r} -> {reply[:300]!r}"
        if isinstance(reply, bytes):
            answers["result"] += 1
            continue
        assert reply.startswith("request refused: "), what
        answers["refused"] += 1
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=60)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011, what
        ws.close()
        ws = None
    if ws is not None:
        ws.close()
    assert answers["result"] and answers["refused"], answers
    assert _replica(policy_server, auth) == replica


@pytest.mark.parametrize("body,status,needle", [
    ("[" * 100_000, 400, "nested deeper than the parser's limit"),
    ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + "0" * 400 + "}", 400,
     "max_tokens: an integer of"),
    ('{"messages": [{"role": "user", "content": "hi"}], "temperature": 1' + "0" * 400 + "}", 400, "temperature"),
    ('{"messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}', 400, "unknown parameter"),
    ('{"messages": [{"role": "user", "content": [{"type": "\\udfff"}]}]}', 400, "expected a text or an image_url"),
    # refused before the 200 of a stream, not as an error event after it
    ('{"messages": [{"role": "user", "content": "hi"}], "stream": true, "max_tokens": -7}', 400,
     "max_new_tokens -7 is out of range"),
    ('{"messages": [{"role": "user", "content": "  "}], "stream": true}', 400, "prompt is empty"),
])
def test_the_requests_that_were_server_errors_are_client_errors(chat_server, body, status, needle):
    got, raw, ctype = _post(chat_server.port, body, stream=False)
    assert got == status and "application/json" in ctype, (got, raw[:300])
    error = json.loads(raw)["error"]
    assert needle in error["message"], error
