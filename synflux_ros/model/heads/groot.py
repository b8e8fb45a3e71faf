"""GR00T N1.7's flow-matching head (``action.expert_type: dit``).

Once per frame ``vl_context_<p>`` turns the backbone's features into what every DiT block reads (the keys and
values of its cross-attention, the masks of the text and image rows) and encodes the normalised robot state;
then ``num_denoise_steps`` Euler steps of ``dit_<p>`` integrate seeded Gaussian noise from t = 0 to 1:
step k runs at the time bucket ``int(k / N * time_buckets)`` and adds ``(1 / N) * velocity``. GR00T's
direction is the opposite of pi0's (noise at 0, actions at 1).

Real-Time Chunking has two flavours. ``lerobot`` is GR00T's own (LeRobot 0.6.1's ``GrootPolicy`` with
``prev_chunk_left_over``), not a guided velocity: the leftover of the previous chunk (its trailing all-zero rows dropped, at most a horizon) is
written over the first ``overlap = min(its length, execution_horizon)`` rows of the initial noise (its last
``overlap`` rows), and each step's velocity is scaled per row: 0 for the ``min(inference_delay, overlap)`` rows
executed before the chunk arrives (they stay the leftover), then a ramp ``1 - exp(-rtc_ramp_rate * u)``
normalised to end at 1, over u evenly spaced in (0, 1) for the rows up to ``overlap``, 1 after them.
``vjp`` is the paper's guidance, as for the π0 family: plain noise, and each step runs ``dit_vjp_<p>``, whose
correction ``J^T e`` (of x1 = x + (1 - τ) v) is added to the velocity with the guidance weight of
:func:`.rtc.guidance_weight` (π0's time is 1 - τ).
"""
from __future__ import annotations

import numpy as np

from ...core.config import ModelConfig
from ...core.executor import Executor
from .rtc import RTCGuidance, guidance_weight, require_vjp_graph


class GrootDiTHead:
    """Denoises seeded Gaussian noise into a normalised action chunk [horizon, action_dim]."""

    def __init__(self, cfg: ModelConfig, executor: Executor):
        self.ex = executor
        act = cfg.action
        self.seed = act.seed
        self.shape = (1, act.action_horizon, act.action_dim)
        self.state_dim = act.state_dim
        n = act.num_denoise_steps
        self.dt = 1.0 / n
        self.buckets = [np.array([int(k / float(n) * act.time_buckets)], np.float32) for k in range(n)]
        self.ramp_rate = np.float32(act.rtc_ramp_rate)

    def initial_noise(self, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).standard_normal(self.shape).astype(np.float32)

    def context(self, bucket: int, features: np.ndarray, num_tokens: int, image_rows: np.ndarray,
                state: np.ndarray) -> dict:
        """``vl_context_<bucket>`` of a prompt's ``features`` [1, bucket, H] (``num_tokens`` valid rows,
        ``image_rows`` [bucket] 1 at an image token) and the normalised, zero-padded ``state`` [state_dim]."""
        state = np.asarray(state, np.float32).reshape(1, -1)
        if state.shape[1] != self.state_dim:
            raise ValueError(f"the DiT head takes a state of {self.state_dim} values (action.state_dim), got "
                             f"{state.shape[1]}")
        out = self.ex.run(f"vl_context_{bucket}", {
            "features": features, "num_tokens": np.array([num_tokens], np.int64),
            "image_rows": np.asarray(image_rows, np.float32).reshape(1, -1), "state": state})
        return {"bucket": bucket, "cross_kv": out["cross_kv"], "cross_bias": out["cross_bias"],
                "state_features": out["state_features"]}

    def rtc_start(self, noise: np.ndarray, rtc: RTCGuidance) -> tuple[np.ndarray, np.ndarray | None]:
        """The initial actions and the per-row velocity scale [1, horizon, 1] of GR00T's Real-Time Chunking (None:
        the leftover holds no row, plain denoising)."""
        if not isinstance(rtc, RTCGuidance):
            raise TypeError(f"rtc: expected an RTCGuidance, got {type(rtc).__name__}")
        _, horizon, dims = self.shape
        prev = rtc.prev_chunk
        if prev.shape[1] > dims:
            raise ValueError(f"rtc prev_chunk: {prev.shape[1]} dimensions, the model's chunk has {dims} "
                             f"(action_dim)")
        rows = np.flatnonzero(np.abs(prev).sum(axis=1) > 0)
        x = np.array(noise, np.float32, copy=True).reshape(self.shape)
        if rows.size == 0:  # trailing all-zero rows are padding, as GR00T reads a leftover
            return x, None
        prev = prev[:rows[-1] + 1][-horizon:]
        steps = prev.shape[0]
        overlap = min(steps, rtc.execution_horizon)
        frozen = min(rtc.inference_delay, overlap)
        x[0, :overlap] = 0.0
        x[0, :overlap, :prev.shape[1]] = prev[steps - overlap:]
        scale = np.ones((1, horizon, 1), np.float32)
        scale[0, :frozen] = 0.0
        u = np.linspace(0.0, 1.0, overlap - frozen + 2, dtype=np.float32)
        ramp = np.float32(1.0) - np.exp(-self.ramp_rate * u)
        ramp = ramp / max(ramp[-1], np.float32(1e-8))
        scale[0, frozen:overlap, 0] = ramp[1:-1]
        return x, scale

    def denoise(self, context: dict, noise: np.ndarray, rtc: RTCGuidance | None = None) -> np.ndarray:
        """``noise`` [1, horizon, action_dim] -> the normalised chunk [horizon, action_dim]; ``rtc`` continues the
        previous chunk (see the module docstring)."""
        if rtc is not None and not isinstance(rtc, RTCGuidance):
            raise TypeError(f"rtc: expected an RTCGuidance, got {type(rtc).__name__}")
        if rtc is not None and rtc.flavour == "vjp":
            return self._denoise_vjp(context, noise, rtc)
        if rtc is not None:
            x, scale = self.rtc_start(noise, rtc)
        else:
            x, scale = np.array(noise, np.float32, copy=True).reshape(self.shape), None
        feeds = {"noisy_actions": x, "state_features": context["state_features"],
                 "cross_kv": context["cross_kv"], "cross_bias": context["cross_bias"]}
        graph = f"dit_{context['bucket']}"
        dt = np.float32(self.dt)
        for t in self.buckets:
            feeds["timestep"] = t
            step = dt * self.ex.run(graph, feeds)["velocity"]
            x += step if scale is None else step * scale
        return x[0]

    def _denoise_vjp(self, context: dict, noise: np.ndarray, rtc: RTCGuidance) -> np.ndarray:
        graph = f"dit_vjp_{context['bucket']}"
        require_vjp_graph(self.ex, graph)
        _, horizon, dims = self.shape
        target, weights = rtc.arrays(horizon, dims)
        x = np.array(noise, np.float32, copy=True).reshape(self.shape)
        feeds = {"noisy_actions": x, "state_features": context["state_features"], "cross_kv": context["cross_kv"],
                 "cross_bias": context["cross_bias"], "target": target, "weights": weights}
        dt, n = np.float32(self.dt), len(self.buckets)
        for k, bucket in enumerate(self.buckets):
            tau = k / float(n)
            feeds["timestep"], feeds["flow_time"] = bucket, np.array([tau], np.float32)
            out = self.ex.run(graph, feeds)
            w = np.float32(guidance_weight(1.0 - tau, rtc.max_guidance_weight))
            x += dt * (out["velocity"] + w * out["correction"])
        return x[0]

    def __call__(self, context: dict, seq: int, rtc: RTCGuidance | None = None) -> np.ndarray:
        return self.denoise(context, self.initial_noise(self.seed + seq), rtc)
