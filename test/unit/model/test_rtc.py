"""Real-Time Chunking guidance (model.heads.rtc): prefix weights, guidance weight, validation, and the flow head
guided on the mock backend, whose expert is the exact velocity of a straight path to a target."""
import math
from pathlib import Path

import numpy as np
import pytest

from synflux_ros.core.config import load_config
from synflux_ros.core.kv_cache import KVCachePool
from synflux_ros.model.backbone import LLMBackbone
from synflux_ros.model.heads import RTCGuidance
from synflux_ros.model.heads.flow_matching import FlowMatchingHead
from synflux_ros.model.heads.rtc import (
    SCHEDULES, guidance_weight, lerobot_velocity, prefix_weights, vjp_velocity)
from synflux_ros.runtimes.base import create_executor

CONFIG_DIR = Path(__file__).resolve().parents[3] / "config"


def ramp(n):
    """n values strictly between 1 and 0, evenly spaced."""
    return [1 - (i + 1) / (n + 1) for i in range(n)]


def exp_of(r):
    return [v * math.expm1(v) / (math.e - 1) for v in r]


# (delay, horizon, total) -> schedule -> weights, written from the schedules' definitions
CASES = {
    (2, 6, 10): {"zeros": [1, 1] + [0] * 8, "ones": [1] * 6 + [0] * 4,
                 "linear": [1, 1, 0.8, 0.6, 0.4, 0.2, 0, 0, 0, 0],
                 "exp": [1, 1, *exp_of([0.8, 0.6, 0.4, 0.2]), 0, 0, 0, 0]},
    (0, 4, 6): {"zeros": [0] * 6, "ones": [1, 1, 1, 1, 0, 0],
                "linear": [*ramp(4), 0, 0], "exp": [*exp_of(ramp(4)), 0, 0]},
    (5, 3, 8): {"zeros": [1, 1, 1, 0, 0, 0, 0, 0], "ones": [1, 1, 1, 0, 0, 0, 0, 0],  # delay cut to the horizon
                "linear": [1, 1, 1, 0, 0, 0, 0, 0], "exp": [1, 1, 1, 0, 0, 0, 0, 0]},
    (1, 12, 5): {"zeros": [1, 0, 0, 0, 0], "ones": [1] * 5,  # horizon past the chunk's end
                 "linear": [1, *ramp(4)], "exp": [1, *exp_of(ramp(4))]},
    (3, 4, 10): {"zeros": [1, 1, 1] + [0] * 7, "ones": [1] * 4 + [0] * 6,
                 "linear": [1, 1, 1, 0.5] + [0] * 6, "exp": [1, 1, 1, *exp_of([0.5])] + [0] * 6},
}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", list(CASES), ids=lambda c: "d{}-h{}-n{}".format(*c))
def test_prefix_weights_follow_the_schedule(case, schedule):
    got = prefix_weights(*case, schedule)
    assert got.dtype == np.float32 and got.shape == (case[2],)
    np.testing.assert_allclose(got, CASES[case][schedule], rtol=0, atol=1e-6)


def test_guidance_weight():
    # tau = 1 - t; c = (1 - tau) / tau; inv_r2 = ((1 - tau)^2 + tau^2) / (1 - tau)^2; min(c * inv_r2, max)
    assert guidance_weight(1.0, 10.0) == 10.0  # tau = 0: c is infinite -> the maximum
    assert guidance_weight(0.5, 10.0) == pytest.approx(2.0)
    assert guidance_weight(0.9, 10.0) == pytest.approx(9 * (0.81 + 0.01) / 0.81)
    assert guidance_weight(0.9, 5.0) == 5.0
    assert guidance_weight(0.2, 10.0) == pytest.approx(0.25 * (0.04 + 0.64) / 0.04)
    assert guidance_weight(0.0, 10.0) == 0.0  # 0 * inf -> 0, as nan_to_num does


def test_lerobot_velocity_formula():
    rng = np.random.default_rng(0)
    x, v, y = (rng.standard_normal((1, 5, 3)).astype(np.float32) for _ in range(3))
    w = np.array([1, 1, 0.5, 0, 0], np.float32).reshape(1, 5, 1)
    got = lerobot_velocity(x, v, 0.7, y, w, 10.0)
    want = v - guidance_weight(0.7, 10.0) * (y - (x - 0.7 * v)) * w
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_array_equal(got[:, 3:], v[:, 3:])
    c = rng.standard_normal((1, 5, 3)).astype(np.float32)
    np.testing.assert_allclose(vjp_velocity(v, c, 0.7, 10.0), v - guidance_weight(0.7, 10.0) * c, atol=1e-5)


def test_arrays_pad_the_leftover_and_cut_the_horizon():
    prev = np.arange(12, dtype=np.float32).reshape(4, 3)
    g = RTCGuidance(prev, inference_delay=1, execution_horizon=8, schedule="ones")
    target, weights = g.arrays(6, 5)
    assert target.shape == (1, 6, 5) and weights.shape == (1, 6, 1)
    np.testing.assert_array_equal(target[0, :4, :3], prev)
    assert not target[0, 4:].any() and not target[0, :, 3:].any()
    np.testing.assert_array_equal(weights[0, :, 0], [1, 1, 1, 1, 0, 0])  # horizon cut to the 4 steps left
    with pytest.raises(ValueError, match="does not fit"):
        g.arrays(3, 5)
    with pytest.raises(ValueError, match="does not fit"):
        g.arrays(6, 2)


def test_guidance_is_validated():
    prev = np.zeros((3, 2), np.float32)
    RTCGuidance(prev, np.int64(2), 5, "exp", 1.5)
    bad = [
        (dict(prev_chunk=np.zeros(3)), "prev_chunk: expected \\[steps, action_dim\\]"),
        (dict(prev_chunk=np.zeros((0, 2))), "prev_chunk"),
        (dict(prev_chunk=np.array([[0.0, np.nan]])), "non-finite value at step 0, dimension 1"),
        (dict(prev_chunk=[["a"]]), "prev_chunk: not an array of numbers"),
        (dict(inference_delay=-1), "inference_delay: must be at least 0"),
        (dict(inference_delay=1.5), "inference_delay: expected an integer"),
        (dict(inference_delay=True), "inference_delay: expected an integer"),
        (dict(execution_horizon=0), "execution_horizon: must be at least 1"),
        (dict(schedule="linaer"), "schedule: 'linaer' is not one of zeros, ones, linear, exp; did you mean 'linear'"),
        (dict(schedule="LINEAR"), "did you mean 'linear'"),
        (dict(flavour="lerobto"), "flavour: 'lerobto'.*did you mean 'lerobot'"),
        (dict(max_guidance_weight=0.0), "max_guidance_weight: expected a finite number > 0"),
        (dict(max_guidance_weight=float("inf")), "max_guidance_weight"),
        (dict(max_guidance_weight="10"), "max_guidance_weight"),
    ]
    base = dict(prev_chunk=prev, inference_delay=1, execution_horizon=4)
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            RTCGuidance(**{**base, **change})
    with pytest.raises(ValueError, match="prefix|schedule"):
        prefix_weights(1, 2, 3, "cosine")


def test_guidance_keeps_its_own_copy():
    prev = np.ones((2, 2))
    g = RTCGuidance(prev, 1, 2)
    prev[:] = 5
    assert g.prev_chunk.dtype == np.float32 and (g.prev_chunk == 1).all()
    with pytest.raises(ValueError):
        g.prev_chunk[0, 0] = 3  # read-only


class Flow:
    def __init__(self, **overrides):
        cfg = load_config(str(CONFIG_DIR / "vla_demo_orin.yaml"))
        cfg = cfg.with_overrides(**overrides) if overrides else cfg
        self.cfg = cfg
        self.ex = create_executor(cfg)
        self.pool = KVCachePool(self.ex, 1, cfg.llm.kv_shape, cfg.llm.kv_dtype)
        self.ex.freeze()
        self.head = FlowMatchingHead(cfg, self.ex)
        self.slot = self.pool.tensor(0)
        x = np.random.default_rng(1).standard_normal((100, cfg.llm.hidden_dim)).astype(np.float32)
        LLMBackbone(cfg, self.ex).prefill(self.slot, 0, x)
        self.noise = self.head.initial_noise(3)
        self.plain = self.head.denoise(self.slot, 100, self.noise)


@pytest.fixture(scope="module")
def flow():
    return Flow()


def test_zero_weights_give_the_plain_chunk(flow):
    h, a = flow.plain.shape
    prev = np.random.default_rng(2).standard_normal((h, a)).astype(np.float32)
    for g in (RTCGuidance(prev, 0, 5, "zeros"), RTCGuidance(prev, 3, 3, "linear", max_guidance_weight=1e-30)):
        got = flow.head.denoise(flow.slot, 100, flow.noise, rtc=g)
        if g.schedule == "zeros":
            np.testing.assert_array_equal(got, flow.plain)
        else:
            np.testing.assert_allclose(got, flow.plain, atol=1e-6)


def test_guided_chunk_follows_the_euler_steps_of_the_formula(flow):
    """The mock's velocity (x - target) / t makes the denoised estimate x - t v the target at every step, so the
    guided Euler steps can be written out: x <- x + dt ((x - target) / t - w(t) W (prev - target))."""
    h, a = flow.plain.shape
    target = flow.plain.astype(np.float64)  # the plain chunk reaches the mock's target
    prev = np.random.default_rng(4).uniform(-1, 1, (7, a - 2)).astype(np.float32)  # fewer steps and dimensions
    g = RTCGuidance(prev, inference_delay=2, execution_horizon=5, schedule="exp", max_guidance_weight=4.0)
    got = flow.head(flow.slot, 100, None, seq=3 - flow.head.seed, rtc=g)
    padded = np.zeros((h, a))
    padded[:7, :a - 2] = prev
    weights = prefix_weights(2, 5, h, "exp")[:, None].astype(np.float64)
    n = flow.cfg.action.num_denoise_steps
    x = flow.noise[0].astype(np.float64)
    for k in range(n):
        t = 1.0 - k / n
        x = x - ((x - target) / t - guidance_weight(t, 4.0) * weights * (padded - target)) / n
    np.testing.assert_allclose(got, x, atol=1e-4)
    # the guidance moved the guided steps towards the leftover and left the others alone
    assert np.abs(got[:5] - flow.plain[:5]).max() > 0.1
    assert np.abs(got[:2] - padded[:2]).mean() < np.abs(flow.plain[:2] - padded[:2]).mean()
    np.testing.assert_array_equal(got[5:], flow.plain[5:])


def test_head_refuses_what_is_not_a_guidance(flow):
    with pytest.raises(TypeError, match="RTCGuidance"):
        flow.head.denoise(flow.slot, 100, flow.noise, rtc={"prev_chunk": np.zeros((2, 2))})
    too_long = RTCGuidance(np.zeros((flow.plain.shape[0] + 1, 2)), 1, 4)
    with pytest.raises(ValueError, match="does not fit"):
        flow.head.denoise(flow.slot, 100, flow.noise, rtc=too_long)


def test_vjp_guidance_needs_its_graphs(flow):
    g = RTCGuidance(np.zeros((3, 2)), 1, 4, flavour="vjp")
    with pytest.raises(ValueError, match="action_expert_vjp_160.*execution.rtc.guidance: vjp"):
        flow.head.denoise(flow.slot, 100, flow.noise, rtc=g)


def test_vjp_guidance_runs_its_graph():
    f = Flow(execution={"mode": "rtc", "rtc": {"guidance": "vjp"}})
    h, a = f.plain.shape
    prev = np.random.default_rng(4).uniform(-1, 1, (h - 2, a)).astype(np.float32)
    calls = f.ex.stats["action_expert_160"].calls
    got = f.head.denoise(f.slot, 100, f.noise, rtc=RTCGuidance(prev, 2, 5, flavour="vjp"))
    n = f.cfg.action.num_denoise_steps
    assert f.ex.stats["action_expert_vjp_160"].calls == n and f.ex.stats["action_expert_160"].calls == calls
    # the mock's denoised estimate is its target whatever x is, so the exact correction vanishes and the
    # chunk stays the plain one, where the lerobot flavour's weighted error pulls it towards the leftover
    np.testing.assert_allclose(got, f.plain, atol=1e-4)
    pulled = f.head.denoise(f.slot, 100, f.noise, rtc=RTCGuidance(prev, 2, 5, flavour="lerobot"))
    assert np.abs(pulled - f.plain).max() > 0.1
