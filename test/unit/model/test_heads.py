"""Action heads (OpenVLA action tokens, flow matching) and the text sampling head."""
from pathlib import Path

import numpy as np
import pytest

from synflux_ros.core.kv_cache import KVCachePool
from synflux_ros.model.heads.action_tokens import ActionTokenizer, unnormalize
from synflux_ros.core.config import ActionConfig, load_config
from synflux_ros.model.time_embedding import time_embedding
from synflux_ros.backends.mock.executor import time_from_embedding
from synflux_ros.model.heads.flow_matching import FlowMatchingHead
from synflux_ros.model.backbone import LLMBackbone
from synflux_ros.model.heads.text_sampling import Generation, SamplingParams, generate, sample_token
from synflux_ros.runtimes.base import create_executor

CONFIG_DIR = Path(__file__).resolve().parents[3] / "config"


# ------------------------------------------------------------------ OpenVLA action tokens

def openvla_encode(action, vocab_size, n_bins=256):
    """Reference: openvla/prismatic/vla/action_tokenizer.py."""
    bins = np.linspace(-1, 1, n_bins)
    discretized = np.digitize(np.clip(action, -1.0, 1.0), bins)
    return vocab_size - discretized


def openvla_decode(ids, vocab_size, n_bins=256):
    bins = np.linspace(-1, 1, n_bins)
    centers = (bins[:-1] + bins[1:]) / 2.0
    discretized = vocab_size - np.asarray(ids)
    discretized = np.clip(discretized - 1, a_min=0, a_max=centers.shape[0] - 1)
    return centers[discretized]


ACTIONS = np.r_[np.random.default_rng(0).uniform(-1.2, 1.2, 2000), -1.0, 1.0, 0.0, -1.5, 1.5,
                np.linspace(-1, 1, 256)]


def test_action_tokenizer_matches_openvla():
    tok = ActionTokenizer(32000, 256)
    np.testing.assert_array_equal(tok.bins, np.linspace(-1, 1, 256))
    ids = tok.encode(ACTIONS)
    assert ids.dtype == np.int64
    np.testing.assert_array_equal(ids, openvla_encode(ACTIONS, 32000))
    np.testing.assert_allclose(tok.decode(ids), openvla_decode(ids, 32000), rtol=0, atol=1e-7)
    assert tok.decode(ids).dtype == np.float32


def test_action_tokens_are_the_last_ids_of_the_vocabulary():
    tok = ActionTokenizer(32000, 256)
    ids = tok.encode(ACTIONS)
    assert ids.min() >= 32000 - 256 and ids.max() <= 31999
    assert tok.first_id == 31744
    assert tok.encode(np.array([1.0]))[0] == 31744
    assert tok.encode(np.array([-1.0]))[0] == 31999
    assert len(set(tok.encode(np.linspace(-1, 1, 5000)).tolist())) == 256


def test_action_round_trip_error_is_at_most_half_a_bin():
    tok = ActionTokenizer(1000, 256)
    a = np.clip(ACTIONS, -1, 1)
    err = np.abs(tok.decode(tok.encode(a)) - a)
    half_bin = (2.0 / 255) / 2
    assert err.max() <= half_bin + 1e-6
    centers = tok.centers
    assert centers.size == 255
    np.testing.assert_allclose(tok.decode(tok.encode(centers.astype(np.float32))), centers, atol=1e-6)


def test_decode_clips_out_of_range_tokens():
    tok = ActionTokenizer(1000, 256)
    assert tok.decode([1000])[0] == pytest.approx(tok.centers[0])   # k = 0 -> first bin
    assert tok.decode([0])[0] == pytest.approx(tok.centers[-1])     # far below the range -> last bin


def test_best_action_token_ignores_text_tokens():
    tok = ActionTokenizer(1000, 256)
    logits = np.zeros(1000, np.float32)
    logits[5] = 100.0  # a text token with the highest score
    logits[800] = 1.0
    assert tok.best_action_token(logits) == 800


def test_best_action_token_ignores_padding_ids():
    tok = ActionTokenizer(1000, 256)
    logits = np.zeros(1064, np.float32)
    logits[1010] = 5.0  # a padding id above the action tokens
    logits[900] = 1.0
    assert tok.best_action_token(logits) == 900


def test_unnormalize_with_mask():
    cfg = ActionConfig(head_type="autoregressive", action_dim=3, action_horizon=1,
                       norm_q01=(-2.0, 0.0, 10.0), norm_q99=(2.0, 1.0, 20.0), norm_mask=(True, False, True))
    a = np.array([[-1.0, 0.3, 1.0], [0.0, -0.7, 0.5]], np.float32)
    out = unnormalize(a, cfg)
    q01, q99 = np.array([-2.0, 0.0, 10.0]), np.array([2.0, 1.0, 20.0])
    expected = 0.5 * (a + 1.0) * (q99 - q01) + q01
    expected[:, 1] = a[:, 1]
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out[0], [-2.0, 0.3, 20.0])


def test_unnormalize_without_statistics_or_mask():
    plain = ActionConfig(head_type="flow_matching", action_dim=2, action_horizon=1)
    a = np.array([[0.25, -0.5]], np.float64)
    out = unnormalize(a, plain)
    np.testing.assert_array_equal(out, a.astype(np.float32))
    assert out.dtype == np.float32
    nomask = ActionConfig(head_type="flow_matching", action_dim=2, action_horizon=1,
                          norm_q01=(0.0, 0.0), norm_q99=(4.0, 2.0))
    np.testing.assert_allclose(unnormalize(a, nomask), [[2.5, 0.5]])


# ------------------------------------------------------------------ flow matching

class FlowSetup:
    def __init__(self, **action):
        cfg = load_config(str(CONFIG_DIR / "vla_demo_orin.yaml"))
        if action:
            cfg = cfg.with_overrides(action=action)
        self.cfg = cfg
        self.ex = create_executor(cfg)
        self.pool = KVCachePool(self.ex, 2, cfg.llm.kv_shape, cfg.llm.kv_dtype)
        self.ex.freeze()
        self.bb = LLMBackbone(cfg, self.ex)
        self.head = FlowMatchingHead(cfg, self.ex)

    def prefix(self, slot_index, seed, n):
        slot = self.pool.tensor(slot_index)
        x = np.random.default_rng(seed).standard_normal((n, self.cfg.llm.hidden_dim)).astype(np.float32)
        self.bb.prefill(slot, 0, x)
        return slot


@pytest.fixture(scope="module")
def flow():
    return FlowSetup()


def test_flow_matching_reaches_the_target_for_any_noise(flow):
    slot = flow.prefix(0, seed=1, n=100)
    noises = [flow.head.initial_noise(s) for s in (0, 1, 2)]
    assert noises[0].shape == (1, 16, 7)
    assert not np.allclose(noises[0], noises[1])
    outs = [flow.head.denoise(slot, 100, n) for n in noises]
    assert outs[0].shape == (16, 7)
    # The mock's velocity at t = 1 for x = 0 is -target.
    v = flow.ex.run("action_expert_160", {
        "noisy_actions": np.zeros((1, 16, 7), np.float32), "time_embedding": time_embedding(1.0, flow.head.time_embeddings[0].shape[1]),
        "prefix_len": np.array([100], np.int64), "past_kv": slot})["velocity"][0]
    target = -v
    assert np.all(np.abs(target) < 1.0)
    for out, noise in zip(outs, noises):
        np.testing.assert_allclose(out, target, atol=1e-4)
        assert not np.allclose(out, noise[0], atol=0.1)


def test_flow_matching_is_deterministic_per_seed(flow):
    slot = flow.prefix(0, seed=1, n=100)
    noise = flow.head.initial_noise(7)
    np.testing.assert_array_equal(noise, flow.head.initial_noise(7))
    a = flow.head.denoise(slot, 100, noise)
    b = flow.head.denoise(slot, 100, noise.copy())
    assert np.array_equal(a, b)
    # one call for any head: the frame's sequence number seeds the noise
    c = flow.head(slot, 100, np.zeros(0, np.float32), seq=7 - flow.head.seed)
    assert np.array_equal(a, c)
    np.testing.assert_array_equal(noise, flow.head.initial_noise(7))  # the input is not modified


def test_flow_matching_depends_on_the_prefix(flow):
    a = flow.head.denoise(flow.prefix(0, seed=1, n=100), 100, flow.head.initial_noise(0))
    b = flow.head.denoise(flow.prefix(1, seed=2, n=100), 100, flow.head.initial_noise(0))
    assert not np.allclose(a, b, atol=1e-3)


def test_flow_matching_runs_num_denoise_steps_in_the_right_bucket():
    fs = FlowSetup(num_denoise_steps=4)
    slot = fs.prefix(0, seed=3, n=200)
    out = fs.head.denoise(slot, 200, fs.head.initial_noise(0))
    assert fs.ex.stats["action_expert_256"].calls == 4
    assert fs.ex.stats["action_expert_160"].calls == 0
    ten = FlowSetup()
    out10 = ten.head.denoise(ten.prefix(0, seed=3, n=200), 200, ten.head.initial_noise(5))
    assert ten.ex.stats["action_expert_256"].calls == 10
    np.testing.assert_allclose(out, out10, atol=1e-4)  # the straight path is exact for any step count


def test_time_embedding_is_pi0s_sinusoid_in_float64():
    """sin | cos of t at frequencies 2*pi / (4e-3 * 1000 ** f), f = linspace(0, 1, E/2), computed in float64
    (pi0's create_sinusoidal_pos_embedding) and handed over as float32; t comes back from it."""
    for t, dim in ((1.0, 8), (0.7, 64), (0.1, 1024), (np.float32(0.3), 32)):
        emb = time_embedding(t, dim)
        f = np.linspace(0.0, 1.0, dim // 2)
        arg = 2 * np.pi / (4e-3 * (4.0 / 4e-3) ** f) * float(t)
        assert emb.shape == (1, dim) and emb.dtype == np.float32
        np.testing.assert_array_equal(emb[0], np.r_[np.sin(arg), np.cos(arg)].astype(np.float32))
        assert abs(time_from_embedding(emb) - float(t)) < 1e-6
    # the highest frequency turns ~1571 rad per unit of t: t rounded to fp16 (as a device would) moves it by
    # about a radian, which is why the host computes the embedding
    t16 = float(np.float16(0.7))
    assert abs(2 * np.pi / 4e-3 * (t16 - 0.7)) > 0.1


def test_flow_time_steps_as_lerobot_samples():
    """Step k at t = 1 + k * dt in float64, then float32 (LeRobot 0.4.3+ sample_actions); one embedding per
    step. Accumulating t in float32 instead (openpi) gives other float32 values for some steps."""
    fs = FlowSetup(num_denoise_steps=10)
    want = [np.float32(1.0 + k * (-1.0 / 10)) for k in range(10)]
    acc, accumulated = np.float32(1.0), []
    for _ in range(10):
        accumulated.append(acc)
        acc = np.float32(acc + np.float32(-0.1))
    assert want != accumulated  # the two rules differ, so this test tells them apart
    assert fs.head.dt == np.float32(-0.1) and len(fs.head.time_embeddings) == 10
    dim = fs.head.time_embeddings[0].shape[1]
    for emb, t in zip(fs.head.time_embeddings, want):
        np.testing.assert_array_equal(emb, time_embedding(t, dim))


# ------------------------------------------------------------------ text sampling

LOGITS = np.array([1.0, 3.0, 2.5, -1.0, 0.0, 2.9], np.float32)


def test_greedy_is_argmax():
    rng = np.random.default_rng(0)
    assert sample_token(LOGITS, 0.0, 1.0, rng) == 1
    assert sample_token(LOGITS, -1.0, 0.5, rng) == 1
    ties = np.array([0.0, 5.0, 5.0])
    assert sample_token(ties, 0.0, 1.0, rng) == 1


def test_tiny_top_p_is_argmax():
    rng = np.random.default_rng(0)
    assert {sample_token(LOGITS, 1.0, 1e-6, rng) for _ in range(200)} == {1}
    assert {sample_token(LOGITS, 50.0, 1e-6, rng) for _ in range(200)} == {1}


def softmax(z):
    z = z.astype(np.float64)
    p = np.exp(z - z.max())
    return p / p.sum()


def test_temperature_sampling_matches_softmax():
    rng = np.random.default_rng(123)
    n = 20000
    for temperature in (0.7, 2.0):
        draws = np.array([sample_token(LOGITS, temperature, 1.0, rng) for _ in range(n)])
        freq = np.bincount(draws, minlength=LOGITS.size) / n
        np.testing.assert_allclose(freq, softmax(LOGITS / temperature), atol=0.015)


def test_top_p_excludes_the_tail():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(p).astype(np.float32)
    rng = np.random.default_rng(5)
    draws = np.array([sample_token(logits, 1.0, 0.75, rng) for _ in range(4000)])
    assert set(draws.tolist()) == {0, 1}
    assert np.mean(draws == 0) == pytest.approx(0.5 / 0.8, abs=0.03)
    draws = np.array([sample_token(logits, 1.0, 0.9, rng) for _ in range(4000)])
    assert set(draws.tolist()) == {0, 1, 2}
    draws = np.array([sample_token(logits, 1.0, 1.0, rng) for _ in range(4000)])
    assert 3 in set(draws.tolist())


def test_sampling_is_reproducible_with_a_seeded_rng():
    a = [sample_token(LOGITS, 1.0, 0.9, np.random.default_rng(9)) for _ in range(5)]
    r1, r2 = np.random.default_rng(11), np.random.default_rng(11)
    s1 = [sample_token(LOGITS, 1.0, 0.9, r1) for _ in range(50)]
    s2 = [sample_token(LOGITS, 1.0, 0.9, r2) for _ in range(50)]
    assert len(set(a)) == 1
    assert s1 == s2


def scripted_step(sequence, V=10):
    """step(pos, tok) that returns logits peaked at the next scripted token and records calls."""
    calls = []

    def step(pos, tok):
        calls.append((pos, tok))
        z = np.zeros(V, np.float32)
        z[sequence[len(calls)]] = 1.0
        return z
    return step, calls


def test_generate_stops_at_eos():
    seq = [3, 4, 5, 9, 1, 1]
    step, calls = scripted_step(seq)
    first = np.zeros(10, np.float32)
    first[seq[0]] = 1.0
    gen = generate(first, step, 50, SamplingParams(100, eos_ids=(9,)), np.random.default_rng(0))
    assert isinstance(gen, Generation)
    assert gen.tokens == [3, 4, 5, 9] and gen.stopped_by_eos
    assert calls == [(50, 3), (51, 4), (52, 5)]  # the last sampled token is not fed
    assert gen.ttft_s >= 0


def test_generate_stops_at_the_token_budget():
    seq = [2] * 10
    step, calls = scripted_step(seq)
    first = np.zeros(10, np.float32)
    first[2] = 1.0
    gen = generate(first, step, 0, SamplingParams(3, eos_ids=(9,)), np.random.default_rng(0))
    assert gen.tokens == [2, 2, 2] and not gen.stopped_by_eos
    assert len(calls) == 2
    gen = generate(first, step, 0, SamplingParams(1), np.random.default_rng(0))
    assert gen.tokens == [2]
