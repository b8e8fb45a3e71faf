"""VLA and VLM runtimes on the mock backend: shapes, determinism, cache reuse, sessions, validation."""
import math
import threading
from pathlib import Path

import numpy as np
import pytest

from synflux_ros.model.heads.action_tokens import ActionTokenizer
from synflux_ros.core.config import ConfigError, load_config
from synflux_ros.model.image import ImageError
from synflux_ros.runtimes.sessions import RequestError
from synflux_ros.runtimes.vla import MAX_INSTRUCTION_CHARS, Frame, VLAPipeline, VLARuntime
from synflux_ros.runtimes.vlm import ChatRequest, VLMRuntime

CONFIG_DIR = Path(__file__).resolve().parents[3] / "config"


def cfg_of(name, **overrides):
    cfg = load_config(str(CONFIG_DIR / f"{name}.yaml"))
    return cfg.with_overrides(**overrides) if overrides else cfg


def image(seed=0, h=120, w=160):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


# ================================================================== VLA

@pytest.fixture(scope="module")
def demo_vla():
    return VLARuntime(cfg_of("vla_demo_orin"))


def test_vla_demo_actions_shape_and_determinism(demo_vla):
    other = VLARuntime(cfg_of("vla_demo_orin"))
    a = demo_vla.infer(image(0), seq=3)
    b = other.infer(image(0), seq=3)
    assert a.actions.shape == (16, 7) and a.actions.dtype == np.float32
    assert np.all(np.isfinite(a.actions))
    assert np.array_equal(a.actions, b.actions)
    assert a.seq == 3 and a.instruction == "pick up the red block"
    assert a.slot is None and a.logits is None and a.image is None
    assert set(a.timings) == {"vision_ms", "backbone_ms", "head_ms"}
    assert a.prefix_len == 64 + len(("pick up the red block\n").encode())
    assert demo_vla.kv_pool.num_free == demo_vla.kv_pool.num_slots
    assert demo_vla.executor.pool.frozen


def test_vla_actions_depend_on_image_and_instruction():
    rt = VLARuntime(cfg_of("vla_demo_orin"))
    base = rt.infer(image(0)).actions
    assert np.array_equal(rt.infer(image(0)).actions, base)
    assert not np.allclose(rt.infer(image(1)).actions, base, atol=1e-3)
    rt.set_instruction("open the drawer")
    assert rt.instruction == "open the drawer"
    assert not np.allclose(rt.infer(image(0)).actions, base, atol=1e-3)


def test_vla_autoregressive_head_on_a_small_model():
    cfg = cfg_of("vla_demo_orin", action={"head_type": "autoregressive", "action_horizon": 2})
    a = VLARuntime(cfg)
    b = VLARuntime(cfg)
    fa, fb = a.infer(image(2)), b.infer(image(2))
    assert fa.actions.shape == (2, 7)
    assert np.array_equal(fa.actions, fb.actions)
    centers = ActionTokenizer(512, 256).centers
    assert np.isin(fa.actions.astype(np.float32), centers.astype(np.float32)).all()
    # 14 action tokens: the first comes from the prefill, the other 13 from decode steps.
    assert sum(st.calls for name, st in a.executor.stats.items() if name.startswith("decode_")) == 13
    assert a.kv_pool.num_free == a.kv_pool.num_slots


def test_vla_openvla_real_size():
    cfg = cfg_of("vla_openvla")
    rt = VLARuntime(cfg)
    try:
        frame = rt.infer(image(4))
        act = frame.actions
        assert act.shape == (cfg.action.action_horizon, cfg.action.action_dim) == (1, 7)
        q01 = np.asarray(cfg.action.norm_q01, np.float32)
        q99 = np.asarray(cfg.action.norm_q99, np.float32)
        mask = np.asarray(cfg.action.norm_mask)
        centers = ActionTokenizer(32000, 256).centers
        # Gripper (mask False): kept as predicted, a bin centre in [-1, 1].
        assert np.all(np.abs(act[:, ~mask]) <= 1.0)
        assert np.min(np.abs(centers - act[0, ~mask][0])) < 1e-6
        # Other dimensions: inside [q01, q99], and mapping back gives bin centres.
        assert np.all(act[:, mask] >= q01[mask] - 1e-6) and np.all(act[:, mask] <= q99[mask] + 1e-6)
        norm = 2.0 * (act[0, mask] - q01[mask]) / (q99[mask] - q01[mask]) - 1.0
        assert np.max(np.min(np.abs(centers[None, :] - norm[:, None]), axis=1)) < 1e-4
        assert rt.kv_pool.num_free == rt.kv_pool.num_slots
        assert rt.executor.stats["prefill_320"].calls == 1
        assert sum(st.calls for n, st in rt.executor.stats.items() if n.startswith("decode_")) == 6
    finally:
        rt.close()


def test_vla_pi0_real_size():
    cfg = cfg_of("vla_pi0")
    rt = VLARuntime(cfg)
    try:
        act = rt.infer(image(5), state=np.linspace(-0.5, 0.5, 32, dtype=np.float32)).actions  # pi0's state token
        assert act.shape == (50, 32)
        assert np.all(np.isfinite(act)) and np.all(np.abs(act) < 1.0)
        assert sum(st.calls for n, st in rt.executor.stats.items()
                   if n.startswith("action_expert_")) == cfg.action.num_denoise_steps
    finally:
        rt.close()


def test_set_instruction_errors(demo_vla):
    before = demo_vla.instruction
    for text in ("", "   \n\t"):
        with pytest.raises(ValueError, match="empty"):
            demo_vla.set_instruction(text)
    with pytest.raises(ValueError, match=f"limit {MAX_INSTRUCTION_CHARS}"):
        demo_vla.set_instruction("x" * (MAX_INSTRUCTION_CHARS + 1))
    # 64 vision tokens + n bytes + "\n" must fit in 256 positions.
    with pytest.raises(ValueError, match="exceeds the context of 256"):
        demo_vla.set_instruction("x" * 192)
    assert demo_vla.instruction == before
    demo_vla.set_instruction("  " + "x" * 191 + "  ")
    assert demo_vla.instruction == "x" * 191
    frame = demo_vla.infer(image(0))
    assert frame.prefix_len == 256
    demo_vla.set_instruction(before)


def test_set_instruction_counts_action_tokens():
    rt = VLARuntime(cfg_of("vla_demo_orin", action={"head_type": "autoregressive", "action_horizon": 2}))
    rt.set_instruction("x" * (191 - 14))
    with pytest.raises(ValueError, match="14 action tokens"):
        rt.set_instruction("x" * (192 - 14))


def test_runtime_mode_mismatch():
    with pytest.raises(ConfigError, match="needs a 'vla' config"):
        VLARuntime(cfg_of("vlm_demo"))
    with pytest.raises(ConfigError, match="needs a 'vlm' config"):
        VLMRuntime(cfg_of("vla_demo_orin"))


def test_vla_bad_image_does_not_leak_a_slot(demo_vla):
    with pytest.raises(ImageError):
        demo_vla.infer(np.zeros((10, 10), np.uint8))
    assert demo_vla.kv_pool.num_free == demo_vla.kv_pool.num_slots


def test_vla_pipeline_serves_frames_and_releases_slots():
    rt = VLARuntime(cfg_of("vla_demo_orin"))
    results, errors = [], []
    done = threading.Semaphore(0)

    def on_result(frame):
        results.append(frame)
        done.release()

    def on_error(frame, stage, exc):
        errors.append((frame.seq, stage, type(exc)))
        done.release()
    pipe = VLAPipeline(rt, on_result, on_error)
    pipe.start()
    try:
        for seq in range(4):
            img = np.zeros((5, 5), np.uint8) if seq == 2 else image(seq)
            pipe.submit(Frame(seq, img, meta={"stamp": seq}))
            assert done.acquire(timeout=10)
        assert [f.seq for f in results] == [0, 1, 3]
        assert [f.meta for f in results] == [{"stamp": 0}, {"stamp": 1}, {"stamp": 3}]
        assert errors == [(2, "vision", ImageError)]
        ref = VLARuntime(cfg_of("vla_demo_orin"))
        assert np.array_equal(results[2].actions, ref.infer(image(3), seq=3).actions)
        assert pipe.pipeline.wait_idle(5)
        assert rt.kv_pool.num_free == rt.kv_pool.num_slots
    finally:
        pipe.stop()


# ================================================================== VLM

def vlm(**overrides):
    return VLMRuntime(cfg_of("vlm_demo", **overrides))


def greedy(sid, prompt, **kw):
    return ChatRequest(sid, prompt, **kw)


CONVERSATION = [
    dict(prompt="hello there"),
    dict(prompt="what is in this picture?", images=[image(7, 90, 150)]),
    dict(prompt="and what colour is it?"),
]


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_cache_reuse_equals_recompute(sampling):
    extra = dict(temperature=1.0, top_p=0.95) if sampling else {}
    reuse, recompute = vlm(), vlm(session={"reuse_kv_cache": False})
    previous = 0
    for i, turn in enumerate(CONVERSATION):
        a = reuse.chat(ChatRequest("s1", **turn, **extra))
        b = recompute.chat(ChatRequest("s1", **turn, **extra))
        assert a.token_ids == b.token_ids, f"turn {i}"
        assert a.reply == b.reply
        assert (a.generated_tokens, a.stopped_by_eos) == (b.generated_tokens, b.stopped_by_eos)
        # the same conversation, prefilled from the reused prefix or from the start
        assert a.cached_tokens + a.prompt_tokens == b.prompt_tokens and b.cached_tokens == 0
        # at least everything before the previous reply is reused
        assert a.cached_tokens >= previous and (i == 0 or a.cached_tokens > 0)
        previous = b.prompt_tokens
    session = reuse.sessions.peek("s1")
    assert session.cached == len(session.tokens) == previous + a.generated_tokens - 1


def test_cached_tokens_on_second_turn():
    rt = vlm()
    r1 = rt.chat(greedy("a", "first"))
    r2 = rt.chat(greedy("a", "second"))
    assert r1.cached_tokens == 0
    # the first turn's prompt is reused; the reply is rendered as text again and reused as far as it
    # tokenizes the same
    assert r1.prompt_tokens <= r2.cached_tokens <= r1.prompt_tokens + r1.generated_tokens - 1
    assert r2.prompt_tokens > len("second")


def test_sampling_is_seeded_per_session_and_turn():
    req = dict(temperature=1.5, top_p=1.0, max_new_tokens=20)
    a, b = vlm(), vlm()
    ra = [a.chat(ChatRequest("x", "tell me a story", **req)).token_ids for _ in range(2)]
    rb = [b.chat(ChatRequest("x", "tell me a story", **req)).token_ids for _ in range(2)]
    assert ra == rb
    gr = vlm().chat(ChatRequest("x", "tell me a story", temperature=0.0, max_new_tokens=20)).token_ids
    assert ra[0] != gr  # sampling at a high temperature departs from the greedy reply


def test_sampling_seed_covers_session_turn_and_config():
    req = dict(temperature=1.5, top_p=1.0, max_new_tokens=20)
    rt = vlm()
    x1 = rt.chat(ChatRequest("x", "tell me a story", **req)).token_ids
    y1 = rt.chat(ChatRequest("y", "tell me a story", **req)).token_ids
    assert x1 != y1
    seeded = VLMRuntime(cfg_of("vlm_demo", text={"seed": 5}))
    assert seeded.chat(ChatRequest("x", "tell me a story", **req)).token_ids != x1
    # A reset restarts the turn count, so the first turn is reproduced exactly.
    rt.chat(ChatRequest("x", "tell me a story", **req))
    again = rt.chat(ChatRequest("x", "tell me a story", reset=True, **req)).token_ids
    assert again == x1


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_sessions_are_isolated(sampling):
    extra = dict(temperature=1.0, top_p=0.95) if sampling else {}
    rt = vlm()
    rt.chat(ChatRequest("A", "my name is alice", **extra))
    rt.chat(ChatRequest("A", "what is my name?", images=[image(1)], **extra))
    b = rt.chat(ChatRequest("B", "what is my name?", **extra))
    fresh = vlm().chat(ChatRequest("B", "what is my name?", **extra))
    assert b.token_ids == fresh.token_ids
    assert b.cached_tokens == 0


def test_session_on_a_reused_slot_is_isolated():
    rt = vlm(session={"max_sessions": 1})
    rt.chat(greedy("A", "some long conversation " * 10))
    rt.chat(greedy("A", "more"))
    rt.end_session("A")
    b = rt.chat(greedy("B", "hi"))  # gets A's old slot, still holding A's entries
    fresh = vlm(session={"max_sessions": 1}).chat(greedy("B", "hi"))
    assert b.token_ids == fresh.token_ids


def test_end_session_frees_the_slot():
    rt = vlm()
    first = rt.chat(greedy("A", "hello"))
    rt.chat(greedy("A", "again"))
    assert rt.kv_pool.num_free == 3
    rt.end_session("A")
    assert rt.kv_pool.num_free == 4 and "A" not in rt.sessions
    again = rt.chat(greedy("A", "hello"))
    assert again.cached_tokens == 0
    assert again.token_ids == first.token_ids
    with pytest.raises(RequestError, match="unknown session 'nope'"):
        rt.end_session("nope")
    rt.end_session("A")
    with pytest.raises(RequestError, match="unknown session 'A'"):
        rt.end_session("A")


def test_lru_eviction_evicts_least_recently_used():
    rt = vlm(session={"max_sessions": 2, "eviction": "lru"})
    assert rt.chat(greedy("A", "a1")).evicted_session is None
    assert rt.chat(greedy("B", "b1")).evicted_session is None
    rt.chat(greedy("A", "a2"))  # A is now the most recent
    c = rt.chat(greedy("C", "c1"))
    assert c.evicted_session == "B"
    assert rt.sessions.ids() == ["A", "C"]
    assert rt.sessions.evicted == 1
    b = rt.chat(greedy("B", "b1"))
    assert b.evicted_session == "A"
    assert b.cached_tokens == 0
    assert b.token_ids == vlm().chat(greedy("B", "b1")).token_ids
    assert rt.kv_pool.num_free == 0


def test_refuse_eviction_raises_request_error():
    rt = vlm(session={"max_sessions": 2, "eviction": "refuse"})
    rt.chat(greedy("A", "a1"))
    rt.chat(greedy("B", "b1"))
    with pytest.raises(RequestError, match="2 session slots are in use"):
        rt.chat(greedy("C", "c1"))
    assert rt.requests_refused == 1
    assert rt.sessions.ids() == ["A", "B"]
    assert rt.chat(greedy("A", "a2")).cached_tokens > 0
    rt.end_session("B")
    assert rt.chat(greedy("C", "c1")).evicted_session is None


BAD_REQUESTS = {
    "empty prompt": ChatRequest("s", ""),
    "blank prompt": ChatRequest("s", "  \n "),
    "empty session id": ChatRequest("", "hi"),
    "blank session id": ChatRequest("  ", "hi"),
    "long session id": ChatRequest("s" * 129, "hi"),
    "prompt longer than the context": ChatRequest("s", "x" * 1100),
    "max_new_tokens above the context": ChatRequest("s", "hi", max_new_tokens=1025),
    "negative max_new_tokens": ChatRequest("s", "hi", max_new_tokens=-1),
    "zero max_new_tokens": ChatRequest("s", "hi", max_new_tokens=0),
    "negative temperature": ChatRequest("s", "hi", temperature=-0.5),
    "zero top_p": ChatRequest("s", "hi", top_p=0.0),
    "max_new_tokens does not fit": ChatRequest("s", "x" * 980, max_new_tokens=100),
    "temperature nan": ChatRequest("s", "hi", temperature=math.nan),
    "temperature inf": ChatRequest("s", "hi", temperature=math.inf),
    "temperature above 100": ChatRequest("s", "hi", temperature=100.5),
    "top_p above 1": ChatRequest("s", "hi", top_p=1.5),
    "top_p nan": ChatRequest("s", "hi", top_p=math.nan),
    "too many images": ChatRequest("s", "hi", images=[image(i) for i in range(5)]),
    "image without channels": ChatRequest("s", "hi", images=[np.zeros((32, 32), np.uint8)]),
    "image with four channels": ChatRequest("s", "hi", images=[np.zeros((32, 32, 4), np.uint8)]),
    "float image": ChatRequest("s", "hi", images=[np.zeros((32, 32, 3), np.float32)]),
    "image that is not an array": ChatRequest("s", "hi", images=[[[0, 0, 0]]]),
    "empty image": ChatRequest("s", "hi", images=[np.zeros((0, 32, 3), np.uint8)]),
}


@pytest.fixture(scope="module")
def shared_vlm():
    return vlm()


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_requests_are_refused(shared_vlm, name):
    rt = shared_vlm
    refused, served = rt.requests_refused, rt.turns_served
    with pytest.raises(RequestError) as info:
        rt.chat(BAD_REQUESTS[name])
    assert str(info.value)
    assert rt.requests_refused == refused + 1
    assert rt.turns_served == served
    assert "s" not in rt.sessions
    assert rt.kv_pool.num_free == rt.kv_pool.num_slots


def test_bad_image_message_names_the_image(shared_vlm):
    with pytest.raises(RequestError, match=r"images\[1\]"):
        shared_vlm.chat(ChatRequest("t", "hi", images=[image(0), np.zeros((8, 8), np.uint8)]))


def test_refused_request_leaves_the_session_unchanged():
    a, b = vlm(), vlm()
    a.chat(greedy("s", "hello"))
    b.chat(greedy("s", "hello"))
    with pytest.raises(RequestError):
        a.chat(ChatRequest("s", "next", top_p=2.0))
    with pytest.raises(RequestError):
        a.chat(ChatRequest("s", "next", images=[np.zeros((4, 4), np.uint8)]))
    assert a.chat(greedy("s", "next")).token_ids == b.chat(greedy("s", "next")).token_ids


def test_context_fills_up_and_reset_recovers():
    rt = vlm()
    prompt = "y" * 400
    rt.chat(ChatRequest("s", prompt, max_new_tokens=8))
    rt.chat(ChatRequest("s", prompt, max_new_tokens=8))
    with pytest.raises(RequestError, match="reset the session"):
        rt.chat(ChatRequest("s", prompt, max_new_tokens=8))
    r = rt.chat(ChatRequest("s", prompt, max_new_tokens=8, reset=True))
    assert r.cached_tokens == 0
    assert r.token_ids == vlm().chat(ChatRequest("s", prompt, max_new_tokens=8)).token_ids


def test_sampling_defaults_and_token_budget():
    rt = vlm()
    p = rt.sampling_params(ChatRequest("s", "hi"))
    assert (p.max_new_tokens, p.temperature, p.top_p) == (32, 0.0, 0.9)
    assert set(p.eos_ids) == set(rt.tokenizer.eos_ids)
    p = rt.sampling_params(ChatRequest("s", "hi", max_new_tokens=5, temperature=0.5, top_p=0.3))
    assert (p.max_new_tokens, p.temperature, p.top_p) == (5, 0.5, 0.3)
    sampled = VLMRuntime(cfg_of("vlm_demo", text={"do_sample": True, "temperature": 0.8}))
    assert sampled.sampling_params(ChatRequest("s", "hi")).temperature == 0.8
    r = rt.chat(ChatRequest("s", "hi", max_new_tokens=3))
    assert r.generated_tokens == len(r.token_ids) <= 3
    if not r.stopped_by_eos:
        assert r.generated_tokens == 3
    assert r.ttft_ms <= r.total_ms


def test_images_change_the_prompt_and_the_reply():
    plain = vlm().chat(greedy("s", "describe"))
    with_img = vlm().chat(greedy("s", "describe", images=[image(3)]))
    assert with_img.prompt_tokens == plain.prompt_tokens + 16 + 2  # 16 vision tokens + start/end markers
    assert with_img.token_ids != plain.token_ids
    other_img = vlm().chat(greedy("s", "describe", images=[image(4)]))
    assert other_img.token_ids != with_img.token_ids


def test_steady_state_chat_allocates_nothing():
    rt = vlm()
    n, nbytes = rt.executor.pool.num_allocations, rt.executor.device_bytes
    for i in range(3):
        rt.chat(greedy(f"s{i}", "hello " * 30, images=[image(i)]))
        rt.chat(greedy(f"s{i}", "more"))
    assert rt.executor.pool.num_allocations == n
    assert rt.executor.device_bytes == nbytes


def test_qwen3_real_size_single_session():
    cfg = cfg_of("vlm_qwen3", session={"max_sessions": 1})
    rt = VLMRuntime(cfg)
    try:
        r = rt.chat(ChatRequest("s", "hi", max_new_tokens=2))
        assert r.generated_tokens == len(r.token_ids) <= 2
        assert all(0 <= t < cfg.llm.vocab_size for t in r.token_ids)
        llm, vis = cfg.llm, cfg.vision
        L, KV, Dh, H, V = llm.num_layers, llm.num_kv_heads, llm.head_dim, llm.hidden_dim, llm.vocab_size
        f16 = 2
        slot = int(np.prod(llm.kv_shape)) * f16
        assert slot == 36 * 2 * 8 * 4096 * 128 * 2
        P = max(llm.prefill_buckets)
        th, tw = vis.tile_size
        K = len(vis.deepstack_layers)
        need = (slot
                + L * 2 * KV * P * Dh * f16 + P * H * 4 + V * 4 + 16   # prefill staging (largest bucket)
                + 3 * P * 8 + K * P * H * 4                            # its M-RoPE positions, DeepStack maps
                + P * 8 + P * H * 4                                   # embed staging
                + L * 2 * KV * 1 * Dh * f16 + V * 4 + 16 + 3 * 8       # decode staging
                + vis.num_tiles * 3 * th * tw * 4 + (1 + K) * vis.num_tokens * H * 4)  # vision encoder
        assert slot + L * 2 * KV * P * Dh * f16 <= rt.executor.device_bytes <= 1.1 * need
        assert rt.kv_pool.num_slots == 1
    finally:
        rt.close()


# ---------------------------------------------------------------- whole conversations (OpenAI-style requests)

def with_history(sid, turns, replies, last, **extra):
    """The request a stateless client sends for turn ``len(replies)``: every earlier turn and its reply."""
    from synflux_ros.runtimes.sessions import PastMessage
    past = []
    for turn, reply in zip(turns, replies):
        past += [PastMessage("user", turn["prompt"], tuple(turn.get("images", ()))), PastMessage("assistant", reply)]
    return ChatRequest(sid, **last, history=tuple(past), **extra)


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_a_conversation_sent_whole_continues_the_session_or_rebuilds_it(sampling):
    """Each turn carrying the whole conversation: the session that holds it reuses its cache, exactly as
    turn-by-turn requests do; a runtime that never saw the session (a replica that died) rebuilds it and
    answers the same."""
    extra = dict(temperature=1.0, top_p=0.95) if sampling else {}
    stateful, stateless, fresh = vlm(), vlm(), vlm()
    replies = []
    for i, turn in enumerate(CONVERSATION):
        a = stateful.chat(ChatRequest("s1", **turn, **extra))
        b = stateless.chat(with_history("s1", CONVERSATION, replies, turn, **extra))
        c = fresh.chat(with_history("s1", CONVERSATION, replies, turn, **extra))
        assert a.token_ids == b.token_ids == c.token_ids, f"turn {i}"
        assert (a.cached_tokens, a.prompt_tokens) == (b.cached_tokens, b.prompt_tokens)
        assert c.cached_tokens == 0 and c.prompt_tokens == a.prompt_tokens + a.cached_tokens
        assert i == 0 or b.cached_tokens > 0
        replies.append(a.reply)
        fresh = vlm()  # every turn on a runtime that has not seen the session


def test_an_edited_history_rebuilds_the_session():
    rt = vlm()
    first = rt.chat(ChatRequest("e", "hello there"))
    same = rt.chat(with_history("e", [dict(prompt="hello there")], [first.reply], dict(prompt="go on")))
    assert same.cached_tokens > 0
    edited = rt.chat(with_history("e", [dict(prompt="hello there")], [first.reply + " (edited)"],
                                  dict(prompt="go on")))
    assert edited.cached_tokens == 0
    assert [m.text for m in rt.sessions.peek("e").messages] == ["hello there", first.reply + " (edited)", "go on",
                                                                edited.reply]
    # another image under the same turn is another conversation too
    img_turn = dict(prompt="what is this?", images=[image(1, 90, 150)])
    r = rt.chat(with_history("i", [img_turn], ["a thing"], dict(prompt="sure?")))
    again = rt.chat(with_history("i", [img_turn], ["a thing"], dict(prompt="sure?")))
    assert r.cached_tokens == 0 and again.cached_tokens == 0  # the session now holds the turn after "sure?"
    other = dict(prompt="what is this?", images=[image(2, 90, 150)])
    assert not VLMRuntime._holds(rt.sessions.peek("i"), "", [])
    swapped = rt.chat(with_history("i", [other], ["a thing"], dict(prompt="sure?")))
    assert swapped.cached_tokens == 0


def test_a_bad_history_is_refused_saying_why():
    from synflux_ros.runtimes.sessions import PastMessage
    rt = vlm()
    for history, needle in [
        ((PastMessage("assistant", "hi"),), "history[0]: expected a user message"),
        ((PastMessage("user", "a"), PastMessage("user", "b")), "history[1]: expected a assistant message"),
        ((PastMessage("user", "a"),), "it must end with the assistant's message"),
        ((PastMessage("user", ""), PastMessage("assistant", "b")), "prompt is empty"),
        ((PastMessage("user", "a"), PastMessage("assistant", "b", (image(),))), "carries no images"),
        ((PastMessage("user", "a", (np.zeros((4, 4), np.uint8),)), PastMessage("assistant", "b")),
         "expected an HxWx3 uint8 RGB array"),
        (("user: a",), "history[0]: expected a user message"),
    ]:
        with pytest.raises(RequestError, match=needle.replace("[", r"\[")):
            rt.chat(ChatRequest("x", "next", history=history))
    assert rt.chat(ChatRequest("x", "next", history=())).reply is not None
