"""vlm_node bounds each request before working on it: the prompt by its UTF-8 size
(``session.max_prompt_bytes``), each image by its pixel count (``vision.max_input_pixels``) before it is
decoded, and the image count before any image is looked at. Each refusal names the field and the limit."""
from __future__ import annotations

import pytest

from synflux_ros.tools.harness import rgb_image

from ros_clients import ChatClient, ok

pytest.importorskip("rclpy")


@pytest.fixture()
def limited(start_node, client, make_config):
    cfg = make_config("vlm_demo.yaml", vision={"max_input_pixels": 32 * 32})
    start_node("vlm_node", {"config": cfg}, namespace="/limits")
    return ChatClient(client, "/limits")


def test_a_prompt_beyond_the_byte_limit_is_refused_by_size(limited):
    r = limited.chat("s", "\u20ac" * 21846)  # 21846 characters, 65538 bytes
    assert not r.success
    assert r.error == "prompt has 65538 bytes, over the limit of 65536 bytes (session.max_prompt_bytes)"
    r = limited.chat("s", "x" * 65536)  # within the byte limit: refused later, by the context
    assert not r.success and "context" in r.error and "max_prompt_bytes" not in r.error
    ok(limited.chat("s", "hello", max_new_tokens=2))


def test_an_image_beyond_the_pixel_limit_is_refused_before_it_is_decoded(limited):
    r = limited.chat("s", "what is this?", images=[rgb_image(32, 32), rgb_image(32, 33)])
    assert not r.success
    assert r.error == ("images[1]: width 33 x height 32 = 1056 pixels exceeds the limit of 1024 pixels "
                       "(vision.max_input_pixels)")
    # the size is judged from the header fields: the data of this one does not match them at all
    huge = rgb_image(4, 4)
    huge.height, huge.width, huge.step = 100_000, 100_000, 300_000
    r = limited.chat("s", "what is this?", images=[huge])
    assert not r.success and "10000000000 pixels exceeds the limit of 1024" in r.error
    assert "data length" not in r.error
    ok(limited.chat("s", "what is this?", images=[rgb_image(32, 32)], max_new_tokens=2))


def test_the_image_count_is_checked_before_any_image(limited):
    bad = rgb_image(4, 4)
    bad.encoding = "16UC1"
    r = limited.chat("s", "look", images=[bad] * 5)
    assert not r.success
    assert r.error == "5 images attached, at most 4 per turn (session.max_images_per_turn)"
