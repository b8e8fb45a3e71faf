"""OpenAI chat requests onto the VLM runtime (synflux_ros.serve.chat), without a server."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from synflux_ros.runtimes.sessions import PastMessage
from synflux_ros.serve import chat

PIL = pytest.importorskip("PIL.Image")


def png_url(h=20, w=30, seed=0) -> tuple[str, np.ndarray]:
    img = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PIL.fromarray(img).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), img


def test_a_conversation_becomes_the_history_and_the_new_turn():
    url, img = png_url()
    body = {"model": "m", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "what"}, {"type": "text", "text": "is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a cube"}]},
        {"role": "user", "content": "sure?"}],
        "max_completion_tokens": 9, "temperature": 0.5, "top_p": 0.9, "stream": True,
        "stream_options": {"include_usage": True}, "user": "ignored", "presence_penalty": 0}
    req, stream, usage = chat.parse(body, "sid", "m", 10_000)
    assert (stream, usage) == (True, True)
    assert (req.session_id, req.prompt, req.images, req.system) == ("sid", "sure?", [], "be brief")
    assert (req.max_new_tokens, req.temperature, req.top_p) == (9, 0.5, 0.9)
    user, assistant = req.history
    assert user.role == "user" and user.text == "what\nis it?" and np.array_equal(user.images[0], img)
    assert assistant == PastMessage("assistant", "a cube")


@pytest.mark.parametrize("body,needle,status", [
    ([], "expected a JSON object", 400),
    ({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 0.5}, "frequency_penalty: not", 400),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools: not supported", 400),
    ({"messages": [{"role": "user", "content": "x"}], "best_of": 2}, "best_of: unknown parameter", 400),
    ({"messages": [{"role": "user", "content": "x"}], "model": "other"}, "does not exist here", 404),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}, "max_tokens: expected an integer", 400),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": "high"}, "top_p: expected a number", 400),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream: expected true or false", 400),
    ({"messages": [{"role": "user", "content": 5}]}, "expected a string or a list of parts", 400),
    ({"messages": [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]},
                   {"role": "user", "content": "x"}]}, "expected a text part, got image_url", 400),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "data:image/png;base64,@@"}]}]},
     "not valid base64", 400),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "data:image/png,raw"}]}]},
     "expected a base64 data: URL", 400),
    # numbers no float holds: refused by name, not an OverflowError (a 500)
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**400}, "max_tokens: an integer of", 400),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -10**30}, "temperature: -1000", 400),
    ({"messages": [{"role": "user", "content": "x"}], "n": 10**20}, "n: 100000000000000000000 is out of range", 400),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": float("inf")}, "top_p: expected a number", 400),
    # lone surrogates the client sent are echoed escaped (UTF-8 cannot hold them)
    ({"messages": [{"role": "user", "content": "x"}], "\ud800": 1}, "\\ud800: unknown parameter", 400),
    ({"messages": [{"role": "user", "content": [{"type": "a\udfff"}]}]}, "got a\\udfff", 400),
])
def test_bad_requests_are_refused_by_name(body, needle, status):
    with pytest.raises(chat.APIError) as err:
        chat.parse(body, "sid", "m", 10_000)
    assert needle in str(err.value) and err.value.status == status
    assert err.value.body()["error"]["message"] == str(err.value)
    json.dumps(err.value.body(), ensure_ascii=False).encode("utf-8")  # the body can be sent


def test_an_image_over_the_pixel_limit_is_refused_before_it_is_decoded():
    url, _ = png_url(200, 300)
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    with pytest.raises(chat.APIError, match="exceeds the limit of 1000 pixels"):
        chat.parse(body, "sid", "m", 1000)


def test_streamed_pieces_join_into_the_reply():
    text = "héllo wörld ✓"
    data = text.encode()
    # one byte a token: multi-byte characters are held back until they are whole
    chunks = chat.Chunks("m", lambda ids: bytes(ids).decode("utf-8", "replace"), eos_ids=[999])
    pieces = [chunks.text(b) for b in data] + [chunks.text(999)]
    assert "".join(pieces) + chunks.rest(text) == text
    assert all("\ufffd" not in p for p in pieces) and chunks.rest(text) == ""
    event = chunks.event({"content": "x"}, "stop")
    assert event["object"] == "chat.completion.chunk" and event["choices"][0]["finish_reason"] == "stop"
