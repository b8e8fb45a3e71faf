"""vlm_node as a process, driven over real DDS through the chat and end_session services."""
from __future__ import annotations

import uuid

import pytest

from synflux_ros.tools import harness as testing
from synflux_ros.tools.harness import call_service, lifecycle_probe, rgb_image
from synflux_ros.srv import Chat

from ros_clients import TIMEOUT, ChatClient, ok  # noqa: E402


@pytest.fixture()
def vlm(start_node, client):
    start_node("vlm_node", {"config": "vlm_demo.yaml", "executor": "mock"}, namespace="/chat1")
    return ChatClient(client, "/chat1")


@pytest.fixture(scope="module")
def shared_vlm(ros_env):
    """One node for the cases that each check the node keeps serving after them."""
    import rclpy
    node = rclpy.create_node(f"test_shared_{uuid.uuid4().hex[:8]}")
    with testing.NodeProcess("vlm_node", {"config": "vlm_demo.yaml", "executor": "mock"}, env=ros_env,
                             remaps={"__ns": "/shared"}) as proc:
        yield ChatClient(node, "/shared")
        assert proc.alive(), proc.output()[-3000:]
    node.destroy_node()


def test_multi_turn_reuses_cache_and_matches_recompute(vlm, start_node, client, make_config):
    ref_cfg = make_config("vlm_demo.yaml", session={"reuse_kv_cache": False})
    start_node("vlm_node", {"config": ref_cfg}, namespace="/reference")
    ref = ChatClient(client, "/reference")
    image = rgb_image(120, 160, 3)
    turns = [dict(prompt="Describe the scene.", images=[image]), dict(prompt="What is on the left?"),
             dict(prompt="And now, in one word?", temperature=0.8, top_p=0.9)]
    previous = 0
    for i, turn in enumerate(turns):
        a = ok(vlm.chat("kitchen", **turn))
        b = ok(ref.chat("kitchen", **turn))
        assert a.reply == b.reply and a.generated_tokens == b.generated_tokens, f"turn {i + 1} differs"
        # the same conversation: prefilled after the reused prefix, or all of it
        assert a.cached_tokens + a.prompt_tokens == b.prompt_tokens
        assert b.cached_tokens == 0
        if i == 0:
            assert a.cached_tokens == 0
        else:
            # everything up to the previous reply (image rows included) was reused
            assert a.cached_tokens >= previous > 0
        previous = b.prompt_tokens
        assert a.generated_tokens > 0 and a.ttft_ms > 0 and a.total_ms >= a.ttft_ms


def test_sessions_are_isolated(vlm):
    first_a = ok(vlm.chat("a", "Hello robot"))
    ok(vlm.chat("a", "Tell me more about the table"))
    first_b = ok(vlm.chat("b", "Hello robot"))
    assert first_b.cached_tokens == 0
    assert first_b.reply == first_a.reply and first_b.generated_tokens == first_a.generated_tokens
    # reset drops a session's history: the same first turn again
    again = ok(vlm.chat("a", "Hello robot", reset=True))
    assert again.cached_tokens == 0 and again.reply == first_a.reply


def test_ending_a_session_frees_its_slot(start_node, client, make_config):
    cfg = make_config("vlm_demo.yaml", session={"max_sessions": 2, "eviction": "refuse"})
    start_node("vlm_node", {"config": cfg}, namespace="/small")
    c = ChatClient(client, "/small")
    ok(c.chat("s1", "hi"))
    ok(c.chat("s2", "hi"))
    refused = c.chat("s3", "hi")
    assert not refused.success and "slots are in use" in refused.error
    ok(c.end("s1"))
    ok(c.chat("s3", "hi"))
    again = c.chat("s1", "hi")  # s1 is gone and both slots are taken again
    assert not again.success


def test_least_recently_used_session_is_evicted(start_node, client, make_config):
    cfg = make_config("vlm_demo.yaml", session={"max_sessions": 2, "eviction": "lru"})
    start_node("vlm_node", {"config": cfg}, namespace="/lru")
    c = ChatClient(client, "/lru")
    ok(c.chat("s1", "hi"))
    ok(c.chat("s2", "hi"))
    ok(c.chat("s1", "again"))  # s2 is now the least recently used
    ok(c.chat("s3", "hi"))  # evicts s2
    assert ok(c.chat("s1", "third")).cached_tokens > 0
    assert ok(c.chat("s2", "back")).cached_tokens == 0  # s2 starts over


def test_unknown_session_is_refused(vlm):
    r = vlm.end("never-started")
    assert not r.success and "unknown session 'never-started'" in r.error


@pytest.mark.parametrize("kw,needle", [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt="   "), "prompt is empty"),
    (dict(session_id=""), "session_id is empty"),
    (dict(prompt="x" * 3000), "context"),
    (dict(max_new_tokens=100000), "max_new_tokens 100000"),
    (dict(max_new_tokens=1010), "max_new_tokens 1010 does not fit"),
    (dict(temperature=500.0), "temperature 500"),
    (dict(temperature=float("nan")), "temperature nan"),
    (dict(top_p=2.0), "top_p 2"),
    (dict(images=[rgb_image(8, 8, encoding="mono8")] * 5), "at most 4"),
])
def test_bad_requests_get_clear_errors_and_the_node_keeps_serving(shared_vlm, kw, needle):
    args = dict(session_id="s", prompt="hello")
    args.update(kw)
    r = shared_vlm.chat(args.pop("session_id"), args.pop("prompt"), **args)
    assert not r.success and needle in r.error, r.error
    assert r.reply == ""
    ok(shared_vlm.chat("s", "hello", reset=True))


@pytest.mark.parametrize("change,needle", [
    (dict(encoding="16UC1"), "unsupported encoding '16UC1'"),
    (dict(data=b"\x01" * 10), "does not match"),
    (dict(height=0, data=b""), "zero"),
])
def test_bad_images_get_clear_errors(shared_vlm, change, needle):
    img = rgb_image(32, 32)
    for k, v in change.items():
        setattr(img, k, v)
    r = shared_vlm.chat("s", "what is this?", images=[img])
    assert not r.success and "images[0]" in r.error and needle in r.error, r.error
    ok(shared_vlm.chat("s", "what is this?", images=[rgb_image(32, 32)], reset=True))


def test_left_out_limits_mean_the_configs_values(start_node, client, make_config):
    """A caller who leaves temperature/top_p/max_new_tokens out gets the config's sampling, not greedy."""
    cfg = make_config("vlm_demo.yaml", text={"do_sample": True, "temperature": 1.5, "top_p": 1.0,
                                             "max_new_tokens": 24})
    start_node("vlm_node", {"config": cfg}, namespace="/sampling")
    c = ChatClient(client, "/sampling")
    assert Chat.Request().temperature < 0 and Chat.Request().max_new_tokens == 0 and Chat.Request().top_p <= 0
    default = ok(c.chat("a", "tell me a story"))
    explicit = ok(c.chat("a", "tell me a story", reset=True, temperature=1.5, top_p=1.0, max_new_tokens=24))
    greedy = ok(c.chat("a", "tell me a story", reset=True, temperature=0.0))
    assert default.reply == explicit.reply and default.generated_tokens == explicit.generated_tokens
    assert default.reply != greedy.reply


def test_a_reply_holding_nul_arrives_whole(shared_vlm):
    """ROS strings end at U+0000: the node sends U+2400 in its place instead of cutting the reply."""
    from synflux_ros.core.config import load_config
    from synflux_ros.runtimes.vlm import ChatRequest, VLMRuntime
    rt = VLMRuntime(load_config(testing.config_path("vlm_demo.yaml")))
    try:
        for i in range(400):  # the mock's replies are a deterministic function of the prompt
            prompt = f"prompt number {i}"
            expected = rt.chat(ChatRequest(f"nul-{i}", prompt)).reply
            if "\x00" in expected:
                break
        else:
            pytest.fail("no mock reply with U+0000 among 400 prompts")
    finally:
        rt.close()
    r = ok(shared_vlm.chat(f"nul-{i}", prompt))
    assert r.reply == expected.replace("\x00", "\u2400")


def test_lifecycle_transitions(start_node, client):
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState, GetState
    start_node("vlm_node", {"autostart": False}, namespace="/managed")
    get_state = client.create_client(GetState, "/managed/vlm_node/get_state")
    change = client.create_client(ChangeState, "/managed/vlm_node/change_state")

    def state():
        return call_service(client, get_state, GetState.Request(), TIMEOUT, idempotent=True).current_state.label

    def transition(tid):
        request = ChangeState.Request(transition=Transition(id=tid))
        assert call_service(client, change, request, TIMEOUT, probe=lifecycle_probe()).success

    assert state() == "unconfigured"
    transition(Transition.TRANSITION_CONFIGURE)
    assert state() == "inactive"
    c = ChatClient(client, "/managed")
    r = c.chat("s", "hello")
    assert not r.success and "not active" in r.error
    transition(Transition.TRANSITION_ACTIVATE)
    ok(c.chat("s", "hello"))
    transition(Transition.TRANSITION_DEACTIVATE)
    assert "not active" in c.chat("s", "hello").error
    transition(Transition.TRANSITION_CLEANUP)
    assert state() == "unconfigured"
    transition(Transition.TRANSITION_CONFIGURE)  # the model loads again after cleanup
    transition(Transition.TRANSITION_ACTIVATE)
    assert ok(c.chat("s", "hello")).cached_tokens == 0  # sessions did not survive cleanup


def test_diagnostics_report_sessions(vlm, client):
    from diagnostic_msgs.msg import DiagnosticArray
    from synflux_ros.tools.harness import spin_until
    ok(vlm.chat("d1", "hello"))
    seen = []
    client.create_subscription(DiagnosticArray, "/diagnostics", lambda m: seen.extend(
        {kv.key: kv.value for kv in st.values} for st in m.status if st.name.startswith("/chat1/vlm_node:")), 10)
    assert spin_until(client, lambda: any(d["sessions_open"] == "1" and d["turns_served"] == "1" for d in seen), 10)
    assert seen[-1]["backend"] == "mock" and seen[-1]["sessions_max"] == "4"


def test_system_prompt_over_the_service(vlm):
    first = ok(vlm.chat("sys", "Hello robot", system_prompt="Answer in one word.", max_new_tokens=3))
    plain = ok(vlm.chat("nosys", "Hello robot", max_new_tokens=3))
    # the system message is part of the rendered conversation
    assert first.prompt_tokens > plain.prompt_tokens
    assert ok(vlm.chat("sys", "Again", system_prompt="Answer in one word.", max_new_tokens=3)).cached_tokens > 0
    refused = vlm.chat("sys", "Again", system_prompt="Answer at length.")
    assert not refused.success and "applies when a session starts or resets" in refused.error
    again = ok(vlm.chat("sys", "Again", system_prompt="Answer at length.", reset=True, max_new_tokens=3))
    assert again.cached_tokens == 0


def test_a_text_only_model_serves_text_and_refuses_images(start_node, client, make_config):
    cfg = make_config("vlm_demo.yaml", vision=None)
    start_node("vlm_node", {"config": cfg, "executor": "mock"}, namespace="/textonly")
    chat = ChatClient(client, "/textonly")
    assert ok(chat.chat("t", "Hello robot", max_new_tokens=3)).generated_tokens > 0
    refused = chat.chat("t", "What is this?", images=[rgb_image(32, 32, 1)])
    assert not refused.success and "text-only model" in refused.error
    assert ok(chat.chat("t", "Still there?", max_new_tokens=3)).cached_tokens > 0
