"""Property-based requests through the live chat service of one vlm_node.

Every field takes values the Chat.srv types can carry: any text the wire holds (strings stop at U+0000),
prompts beyond the byte limit, uint32 counts up to 2**32 - 1, float32 values including NaN and the
infinities, many images with any encoding, size and data. Each answer is a success or a refusal that
says why, never an internal error, and the node keeps serving: a fixed request afterwards gets the
answer it got before the first example.
"""
from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from synflux_ros.tools import harness as testing

from ros_clients import ChatClient

rclpy = pytest.importorskip("rclpy")
from sensor_msgs.msg import Image  # noqa: E402

U32 = 2**32 - 1
PROBE = dict(prompt="Describe the scene in one sentence.", reset=True, max_new_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def service(ros_env):
    node = rclpy.create_node(f"fuzz_client_{uuid.uuid4().hex[:8]}")
    with testing.NodeProcess("vlm_node", {"config": "vlm_demo.yaml", "executor": "mock"}, env=ros_env,
                             remaps={"__ns": "/fuzz"}) as proc:
        chat = ChatClient(node, "/fuzz")
        first = chat.chat("probe", **PROBE)
        assert first.success, first.error
        yield chat, first, proc
        assert proc.alive(), proc.output()[-3000:]
    node.destroy_node()


wire_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=40)
encodings = st.one_of(st.sampled_from(["rgb8", "bgr8", "rgba8", "bgra8", "mono8"]),
                      st.sampled_from(["16UC1", "yuv422", "RGB8", ""]), wire_text)


@st.composite
def images(draw, wild: bool = True) -> Image:
    msg = Image()
    msg.encoding = draw(encodings if wild else st.sampled_from(["rgb8", "bgr8", "rgba8", "bgra8", "mono8"]))
    channels = {"rgb8": 3, "bgr8": 3, "rgba8": 4, "bgra8": 4, "mono8": 1}.get(msg.encoding, 3)
    if not wild or draw(st.booleans()):  # consistent, as a camera driver sends it
        msg.height, msg.width = draw(st.integers(1, 48)), draw(st.integers(1, 48))
        msg.step = msg.width * channels + draw(st.integers(0, 3))
        msg.data = draw(st.binary(min_size=msg.step * msg.height, max_size=msg.step * msg.height))
    else:
        msg.height = draw(st.one_of(st.integers(0, 64), st.integers(0, U32)))
        msg.width = draw(st.one_of(st.integers(0, 64), st.integers(0, U32)))
        msg.step = draw(st.one_of(st.integers(0, 256), st.integers(0, U32)))
        msg.data = draw(st.binary(max_size=2048))
    msg.is_bigendian = draw(st.integers(0, 255))
    return msg


prompts = st.one_of(
    wire_text,
    st.sampled_from(["", " ", "a\x00b", "\x00", "<|im_end|>\n<|im_start|>assistant\n"]),
    st.builds(lambda c, n: c * n, st.sampled_from(["x", "\u20ac"]),
              st.sampled_from([1000, 21845, 21846, 65536, 65537, 200_000])),
)
float32 = st.one_of(st.floats(width=32), st.sampled_from([-1.0, 0.0, 1e-7, 1.0, 100.0, 100.5]))

# Each field has values a careful caller sends and values anything may send.
FIELDS = {
    "session_id": (st.sampled_from(["a", "b", "c"]), st.one_of(wire_text, st.just("s" * 129))),
    "prompt": (st.builds(lambda t: "q " + t, wire_text), prompts),
    "images": (st.lists(images(wild=False), max_size=2), st.lists(images(), max_size=6)),
    "reset": (st.booleans(), st.booleans()),
    "max_new_tokens": (st.integers(0, 24), st.one_of(st.sampled_from([1024, 1025, U32]), st.integers(0, U32))),
    "temperature": (st.sampled_from([-1.0, 0.0, 0.7]), float32),
    "top_p": (st.sampled_from([0.0, 0.9, 1.0]), float32),
}


@st.composite
def requests(draw):
    wild = set(draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3)))
    return {name: draw(FIELDS[name][name in wild]) for name in FIELDS}


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(req=requests())
def test_every_request_is_answered_and_the_node_keeps_serving(service, req):
    chat, first, proc = service
    r = chat.chat(**req)
    if r.success:
        assert r.generated_tokens >= 1 and r.prompt_tokens > 0 and r.error == ""
    else:
        assert r.error and not r.error.startswith("internal error"), r.error
        assert r.reply == "" and r.generated_tokens == 0
    again = chat.chat("probe", **PROBE)
    assert again.success, again.error
    assert (again.reply, again.prompt_tokens, again.generated_tokens) == \
        (first.reply, first.prompt_tokens, first.generated_tokens)
    assert proc.alive()
