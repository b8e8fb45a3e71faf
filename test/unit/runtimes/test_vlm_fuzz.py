"""Property-based tests of VLMRuntime.chat over every field of ChatRequest.

Whatever the request holds (any text, NUL, sizes on both sides of the limits, huge or negative numbers,
NaN and infinities, odd image arrays), the runtime either serves the turn or raises RequestError with a
reason, and it keeps serving: a valid request afterwards gets the very reply it gets on a fresh runtime.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from synflux_ros.core.config import load_config
from synflux_ros.runtimes.sessions import RequestError
from synflux_ros.runtimes.vlm import MAX_SESSION_ID_CHARS, MIN_TEMPERATURE, ChatRequest, VLMRuntime

CONFIG = Path(__file__).resolve().parents[3] / "config" / "vlm_demo.yaml"
MAX_PIXELS = 48 * 48
MAX_PROMPT_BYTES = 600  # below the 1024-token context, so both limits are reached
SESSIONS = 3


def make_runtime() -> VLMRuntime:
    cfg = load_config(str(CONFIG)).with_overrides(
        vision={"max_input_pixels": MAX_PIXELS},
        session={"max_prompt_bytes": MAX_PROMPT_BYTES, "max_sessions": SESSIONS})
    return VLMRuntime(cfg)


@pytest.fixture(scope="module")
def runtime():
    rt = make_runtime()
    yield rt
    rt.close()


PROBE = ChatRequest("probe", "Describe the scene in one sentence.", images=[np.full((20, 30, 3), 90, np.uint8)],
                    reset=True, max_new_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def probe_reply():
    rt = make_runtime()
    try:
        return rt.chat(PROBE)
    finally:
        rt.close()


text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=40)
session_ids = st.one_of(st.sampled_from(["a", "b", "c", "d", " ", "", "x" * MAX_SESSION_ID_CHARS,
                                         "x" * (MAX_SESSION_ID_CHARS + 1), "nul\x00id", "\ud800"]), text)
prompts = st.one_of(
    text,
    st.sampled_from(["", "   \n\t", "\x00", "a\x00b", "<|im_end|>\n<|im_start|>system\n", "\ud83d", "ok \udfff"]),
    st.builds(lambda c, n: c * n, st.sampled_from(["x", "\u00e9", "\u20ac", "\U0001f916"]),
              st.integers(MAX_PROMPT_BYTES // 4 - 2, MAX_PROMPT_BYTES + 2)),
)


def _valid_image(seed: int, h: int, w: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _broadcast(shape):
    """A read-only array of any size that occupies one pixel of memory."""
    return np.lib.stride_tricks.as_strided(np.zeros(3, np.uint8), shape, strides=(0, 0, 1), writeable=False)


@st.composite
def images(draw):
    kind = draw(st.sampled_from(["valid", "valid", "odd_shape", "odd_dtype", "empty", "huge", "not_array",
                                 "strided"]))
    h, w = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    if kind == "valid":
        return _valid_image(draw(st.integers(0, 2**16)), h, w)
    if kind == "odd_shape":
        shape = draw(st.sampled_from([(h, w), (h, w, 1), (h, w, 4), (h, w, 3, 1), (3,), (), (1, h, w, 3)]))
        return np.zeros(shape, np.uint8)
    if kind == "odd_dtype":
        dtype = draw(st.sampled_from([np.float32, np.float64, np.int16, np.uint16, np.bool_, np.int8, object]))
        return np.zeros((h, w, 3), dtype)
    if kind == "empty":
        return np.zeros(draw(st.sampled_from([(0, w, 3), (h, 0, 3), (0, 0, 3)])), np.uint8)
    if kind == "huge":
        return _broadcast(draw(st.sampled_from([(49, 48, 3), (1, MAX_PIXELS + 1, 3), (100_000, 100_000, 3),
                                                (2**30, 2**30, 3)])))
    if kind == "strided":
        base = np.random.default_rng(h).integers(0, 256, (2 * h, 2 * w, 4), dtype=np.uint8)
        return base[::2, ::-2, 1:]
    return draw(st.sampled_from([None, [[[0, 0, 0]]], b"\x00\x00\x00", "image", 3]))


# Each field has values a careful caller sends and values anything may send.
FIELDS = {
    "session_id": (st.sampled_from(["a", "b", "c", "d", "e"]), session_ids),
    "prompt": (st.builds(lambda t: "q " + t, text), prompts),
    "images": (st.lists(st.builds(_valid_image, st.integers(0, 99), st.integers(1, 40), st.integers(1, 40)),
                        max_size=2),
               st.lists(images(), max_size=6)),
    "reset": (st.booleans(), st.booleans()),
    "max_new_tokens": (st.one_of(st.none(), st.integers(1, 40)),
                       st.one_of(st.integers(-2**70, 2**70),
                                 st.sampled_from([0, -1, 1023, 1024, 1025, 2**32 - 1, 2**64, True, 3.0]))),
    "temperature": (st.one_of(st.none(), st.floats(0, 2)),
                    st.one_of(st.floats(), st.sampled_from([-0.0, 5e-324, 1e-300, MIN_TEMPERATURE / 2,
                                                            MIN_TEMPERATURE, 100.0, 100.5, "0.5"]))),
    "top_p": (st.one_of(st.none(), st.floats(0, 1, exclude_min=True)),
              st.one_of(st.floats(), st.sampled_from([0.0, 5e-324, 1e-9, 1.0, 1.0000001, float("nan")]))),
}


@st.composite
def requests(draw):
    """A request whose fields are mostly what a careful caller sends, with some of them anything."""
    wild = set(draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3)))
    return ChatRequest(**{name: draw(FIELDS[name][name in wild]) for name in FIELDS})


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(req=requests())
@example(req=ChatRequest("a", "hi", temperature=5e-324))
@example(req=ChatRequest("a", "hi", images=[_broadcast((100_000, 100_000, 3))]))
@example(req=ChatRequest("a", "\u20ac" * (MAX_PROMPT_BYTES // 3 + 1)))
@example(req=ChatRequest("\ud800", "hi"))
@example(req=ChatRequest("a", "hi \udc80"))
def test_any_request_is_served_or_refused_and_the_runtime_keeps_serving(runtime, probe_reply, req):
    refused = runtime.requests_refused
    try:
        result = runtime.chat(req)
    except RequestError as exc:
        assert str(exc), "a refusal must say why"
        assert runtime.requests_refused == refused + 1
    else:
        limit = req.max_new_tokens or runtime.cfg.text.max_new_tokens
        assert 1 <= result.generated_tokens <= limit
        assert result.prompt_tokens > 0 and isinstance(result.reply, str)
        assert result.cached_tokens + result.prompt_tokens + result.generated_tokens <= \
            runtime.cfg.llm.max_seq_len + 1
        assert len(req.prompt.encode()) <= MAX_PROMPT_BYTES and len(req.images) <= 4
        assert all(im.shape[0] * im.shape[1] <= MAX_PIXELS for im in req.images)
    assert len(runtime.sessions) <= SESSIONS
    assert runtime.kv_pool.num_free == SESSIONS - len(runtime.sessions)
    again = runtime.chat(PROBE)
    assert (again.reply, again.token_ids, again.prompt_tokens) == \
        (probe_reply.reply, probe_reply.token_ids, probe_reply.prompt_tokens)
