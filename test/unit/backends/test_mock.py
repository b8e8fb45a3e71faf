"""Mock backend: causal KV semantics, bucket checks and simulated latency."""
import contextlib
import time
from pathlib import Path

import numpy as np
import pytest

from synflux_ros.backends.mock.executor import MockExecutor
from synflux_ros.core.contract import GraphMeta, TensorSpec
from synflux_ros.core.kv_cache import KVCachePool
from synflux_ros.core.config import load_config
from synflux_ros.core.contract import graph_set, time_embedding_dim
from synflux_ros.model.time_embedding import time_embedding
from synflux_ros.model.backbone import ContextOverflowError, LLMBackbone
from synflux_ros.runtimes.base import create_executor

CONFIG_DIR = Path(__file__).resolve().parents[3] / "config"
IDS = (np.arange(300) * 37 + 11) % 500


class Model:
    def __init__(self, kv_dtype="float32", slots=4, latency=None):
        cfg = load_config(str(CONFIG_DIR / "vlm_demo.yaml"))
        over = {"llm": {"kv_dtype": kv_dtype}}
        if latency:
            over["executor"] = {"latency_ms": latency}
        self.cfg = cfg.with_overrides(**over)
        self.ex = create_executor(self.cfg)
        self.pool = KVCachePool(self.ex, slots, self.cfg.llm.kv_shape, self.cfg.llm.kv_dtype)
        self.ex.freeze()
        self.bb = LLMBackbone(self.cfg, self.ex)

    def slot(self):
        return self.pool.tensor(self.pool.acquire())

    @contextlib.contextmanager
    def borrowed(self, n=1):
        idx = [self.pool.acquire() for _ in range(n)]
        try:
            yield [self.pool.tensor(i) for i in idx]
        finally:
            for i in idx:
                self.pool.release(i)

    def prefill(self, slot, start, ids):
        return self.bb.prefill(slot, start, self.bb.embed(ids))


@pytest.fixture(scope="module")
def model():
    return Model()


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_one_call_vs_chunks_vs_decode_are_bit_identical(kv_dtype):
    m = Model(kv_dtype)
    ids = IDS[:100]
    a = m.slot()
    logits_a = m.prefill(a, 0, ids)

    b = m.slot()
    pos = 0
    for n in (30, 50, 20):
        logits_b = m.prefill(b, pos, ids[pos:pos + n])
        pos += n

    c = m.slot()
    logits_c = m.prefill(c, 0, ids[:60])
    for p in range(60, 100):
        logits_c = m.bb.decode(c, p, int(ids[p]))

    assert logits_a.shape == (m.cfg.llm.vocab_size,)
    assert np.array_equal(logits_a, logits_b)
    assert np.array_equal(logits_a, logits_c)
    ka, kb, kc = m.ex.read(a), m.ex.read(b), m.ex.read(c)
    assert ka.dtype == np.dtype(kv_dtype)
    assert np.array_equal(ka[:, :, :, :100], kb[:, :, :, :100])
    assert np.array_equal(ka[:, :, :, :100], kc[:, :, :, :100])
    assert np.any(ka[:, :, :, :100] != 0)


def test_multi_bucket_prefill_equals_manual_chunks(model):
    ids = IDS[:300]  # larger than the largest prefill bucket (128)
    with model.borrowed(2) as (a, b):
        logits_a = model.prefill(a, 0, ids)
        logits_b = model.prefill(b, 0, ids[:7])
        logits_b = model.prefill(b, 7, ids[7:200])
        logits_b = model.prefill(b, 200, ids[200:])
        assert np.array_equal(logits_a, logits_b)
        assert np.array_equal(model.ex.read(a)[:, :, :, :300], model.ex.read(b)[:, :, :, :300])


def test_every_decode_step_matches_a_fresh_prefill():
    m = Model(slots=2)
    ids = IDS[:20]
    dec = m.slot()
    logits = m.prefill(dec, 0, ids[:1])
    ref_slot = m.pool.tensor(m.pool.acquire())
    for i in range(1, 20):
        logits = m.bb.decode(dec, i, int(ids[i]))
        ref = m.prefill(ref_slot, 0, ids[:i + 1])
        assert np.array_equal(logits, ref), i


def test_logits_depend_on_tokens_and_history(model):
    with model.borrowed() as (s,):
        base = model.prefill(s, 0, IDS[:40])
        other_last = model.prefill(s, 0, np.r_[IDS[:39], (IDS[39] + 1) % 500])
        other_first = model.prefill(s, 0, np.r_[(IDS[0] + 1) % 500, IDS[1:40]])
        shorter = model.prefill(s, 0, IDS[1:40])
        assert not np.array_equal(base, other_last)
        assert not np.array_equal(base, other_first)
        assert not np.array_equal(base, shorter)


def _manual_prefill(m, slot, pos, ids, write_at):
    b = 128
    x = np.zeros((1, b, m.cfg.llm.hidden_dim), np.float32)
    x[0, :len(ids)] = m.bb.embed(ids)
    out = m.ex.run(f"prefill_{b}", {"inputs_embeds": x, "num_tokens": np.array([len(ids)], np.int64),
                                    "cache_position": np.array([pos], np.int64), "past_kv": slot})
    if write_at is not None:
        m.ex.write(slot, np.s_[:, :, :, write_at:write_at + len(ids)], out["new_kv"][:, :, :, :len(ids)])
    return out["logits"][0]


@pytest.mark.parametrize("write_at", [0, 1, None], ids=["correct", "off_by_one", "not_written"])
def test_kv_must_be_written_at_the_right_position(write_at):
    m = Model(slots=2)
    ref = m.prefill(m.slot(), 0, IDS[:90])
    s = m.slot()
    _manual_prefill(m, s, 0, IDS[:50], write_at)
    logits = _manual_prefill(m, s, 50, IDS[50:90], 50)
    if write_at == 0:
        assert np.array_equal(logits, ref)
    else:
        assert not np.array_equal(logits, ref)


def test_decode_at_a_wrong_position_changes_logits():
    m = Model(slots=2)
    a, b = m.slot(), m.slot()
    m.prefill(a, 0, IDS[:30])
    m.prefill(b, 0, IDS[:30])
    right = m.bb.decode(a, 30, 7)
    wrong = m.bb.decode(b, 31, 7)  # leaves a hole at position 30
    assert not np.array_equal(right, wrong)


def test_decode_bucket_smaller_than_position_raises(model):
    with model.borrowed() as (s,):
        feeds = {"input_ids": np.array([[5]], np.int64), "cache_position": np.array([255], np.int64),
                 "past_kv": s}
        model.ex.run("decode_256", feeds)  # position 255 fits a span of 256
        feeds["cache_position"] = np.array([256], np.int64)
        with pytest.raises(ValueError, match="decode_256.*257.*256"):
            model.ex.run("decode_256", feeds)
        model.ex.run("decode_512", feeds)


def test_prefill_argument_checks(model):
    with model.borrowed() as (s,):
        x = np.zeros((1, 32, 64), np.float32)

        def run(n, cp):
            return model.ex.run("prefill_32", {"inputs_embeds": x, "num_tokens": np.array([n], np.int64),
                                               "cache_position": np.array([cp], np.int64), "past_kv": s})
        run(32, 0)
        with pytest.raises(ValueError, match="num_tokens 0"):
            run(0, 0)
        with pytest.raises(ValueError, match="num_tokens 33"):
            run(33, 0)
        with pytest.raises(ValueError, match="exceeds the cache"):
            run(10, 1020)
        with pytest.raises(ContextOverflowError):
            model.prefill(s, 1000, IDS[:30])
        with pytest.raises(ContextOverflowError):
            model.bb.decode(s, 1024, 1)
        with pytest.raises(ValueError, match="at least one token"):
            model.bb.prefill(s, 0, np.zeros((0, 64), np.float32))


def test_vision_encoder_is_deterministic_and_input_dependent(model):
    px = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    a = model.ex.run("vision_encoder", {"pixel_values": px})["vision_embeds"]
    b = model.ex.run("vision_encoder", {"pixel_values": px.copy()})["vision_embeds"]
    c = model.ex.run("vision_encoder", {"pixel_values": -px})["vision_embeds"]
    assert a.shape == (16, 64)
    assert np.array_equal(a, b)
    assert not np.allclose(a, c)
    assert np.all(np.isfinite(a))


def test_embed_is_per_token():
    m = Model(slots=1)
    e1 = m.bb.embed(IDS[:10])
    e2 = m.bb.embed(IDS[:200])
    assert e1.shape == (10, 64)
    assert np.array_equal(e1, e2[:10])
    assert not np.array_equal(e1[0], e1[1])


def test_latency_is_simulated():
    m = Model(slots=1, latency={"vision_encoder": 40.0})
    px = np.zeros((1, 3, 224, 224), np.float32)
    t0 = time.perf_counter()
    m.ex.run("vision_encoder", {"pixel_values": px})
    elapsed = time.perf_counter() - t0
    assert elapsed >= 0.040
    assert m.ex.stats["vision_encoder"].last_ms >= 40.0


def test_latency_by_kind_and_group():
    cfg = load_config(str(CONFIG_DIR / "vlm_demo.yaml"))
    graphs = graph_set(cfg)
    ex = MockExecutor(graphs, options={"latency_ms": {"prefill": 30, "embed": 20}}).load()
    assert ex._latency_for(ex.graphs["prefill_32"]) == 30.0   # by kind
    assert ex._latency_for(ex.graphs["embed_128"]) == 20.0    # by group / kind
    assert ex._latency_for(ex.graphs["decode_256"]) == 0.0
    t0 = time.perf_counter()
    ex.run("embed_32", {"input_ids": np.zeros((1, 32), np.int64)})
    assert time.perf_counter() - t0 >= 0.020
    ex2 = MockExecutor(graphs, options={"latency_ms": {"decode_512": 15}}).load()
    assert ex2._latency_for(ex2.graphs["decode_512"]) == 15.0
    assert ex2._latency_for(ex2.graphs["decode_256"]) == 0.0


def test_bad_mock_options_and_kinds():
    with pytest.raises(ValueError, match="latency_ms.prefill"):
        MockExecutor([], options={"latency_ms": {"prefill": -1}})
    weird = GraphMeta("w", "softmax", (TensorSpec("x", (1,), "float32"),), (TensorSpec("y", (1,), "float32"),))
    with pytest.raises(ValueError, match="unsupported kind 'softmax'"):
        MockExecutor([weird]).load()
    dec = GraphMeta("decode_8", "decode",
                    (TensorSpec("input_ids", (1, 1), "int64"), TensorSpec("cache_position", (1,), "int64"),
                     TensorSpec("past_kv", (1, 2, 1, 8, 4), "float32", resident=True)),
                    (TensorSpec("logits", (1, 10), "float32"), TensorSpec("new_kv", (1, 2, 1, 1, 4), "float32")),
                    attrs={"bucket": 8})
    ex = MockExecutor([dec]).load()
    kv = ex.alloc_tensor("kv", (1, 2, 1, 8, 4), "float32")
    with pytest.raises(ValueError, match="hidden_dim"):
        ex.run("decode_8", {"input_ids": np.zeros((1, 1), np.int64),
                            "cache_position": np.zeros(1, np.int64), "past_kv": kv})


def test_action_expert_checks_prefix_len():
    cfg = load_config(str(CONFIG_DIR / "vla_demo_orin.yaml"))
    ex = create_executor(cfg)
    kv = ex.alloc_tensor("kv", cfg.llm.kv_shape, cfg.llm.kv_dtype)
    feeds = {"noisy_actions": np.zeros((1, 16, 7), np.float32), "time_embedding": time_embedding(1.0, time_embedding_dim(cfg)),
             "prefix_len": np.array([0], np.int64), "past_kv": kv}
    with pytest.raises(ValueError, match="prefix_len must be >= 1"):
        ex.run("action_expert_160", feeds)
    feeds["prefix_len"] = np.array([161], np.int64)
    with pytest.raises(ValueError, match="span is 160"):
        ex.run("action_expert_160", feeds)
    feeds["prefix_len"] = np.array([160], np.int64)
    out = ex.run("action_expert_160", feeds)["velocity"]
    assert out.shape == (1, 16, 7) and np.all(np.isfinite(out))
