"""Flow-matching action head (pi0 style).

Start from Gaussian noise at t = 1 and integrate the action expert's velocity field to t = 0 with
``num_denoise_steps`` Euler steps, ``x <- x + dt * v(x, t)`` with ``dt = -1 / N`` and step k at
``t = 1 + k * dt`` (computed in float64, then float32), as LeRobot 0.4.3+'s ``PI0Pytorch.sample_actions``
does (openpi and LeRobot releases older than 0.4.3 accumulate t in float32, which differs by ~1e-7 in t).
The expert attends to the prefix (vision + instruction) through the KV cache; the noise is seeded per
frame. The expert takes the sinusoidal embedding of t, which is computed here in float64 for all steps
once (``synflux_ros.model.time_embedding``). With a Real-Time Chunking guidance (:mod:`.rtc`) each step uses
the guided velocity instead; its ``vjp`` flavour runs ``action_expert_vjp_<d>`` in place of the expert.
"""
from __future__ import annotations

import numpy as np

from ...core.config import ModelConfig
from ...core.executor import DeviceTensor, Executor
from ...core.contract import select_bucket, time_embedding_dim
from ..normalization import state_vector
from ..time_embedding import time_embedding
from .base import ActionHead
from .rtc import RTCGuidance, lerobot_velocity, require_vjp_graph, vjp_velocity


class FlowMatchingHead(ActionHead):
    """Denoises seeded Gaussian noise into an action chunk with the ``action_expert_<bucket>`` graphs."""

    def __init__(self, cfg: ModelConfig, executor: Executor):
        self.ex = executor
        self.seed = cfg.action.seed
        self.act = cfg.action
        self.buckets = cfg.llm.decode_buckets
        self.shape = (1, self.act.action_horizon, self.act.action_dim)
        n = self.act.num_denoise_steps
        self.dt = np.float32(-1.0 / n)
        self.times = [1.0 + k * (-1.0 / n) for k in range(n)]  # float64, as LeRobot hands t to its RTC step
        times = [np.float32(t) for t in self.times]
        dim = time_embedding_dim(cfg)
        self.time_embeddings = [time_embedding(t, dim) for t in times]

    def initial_noise(self, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).standard_normal(self.shape).astype(np.float32)

    def __call__(self, kv: DeviceTensor, prefix_len: int, logits: np.ndarray | None, seq: int,
                 state: np.ndarray | None = None, rtc: RTCGuidance | None = None) -> np.ndarray:
        return self.denoise(kv, prefix_len, self.initial_noise(self.seed + seq), state, rtc)

    def denoise(self, kv: DeviceTensor, prefix_len: int, noise: np.ndarray,
                state: np.ndarray | None = None, rtc: RTCGuidance | None = None) -> np.ndarray:
        """Denoise ``noise`` [1, horizon, action_dim] conditioned on the prefix (and, with a state token,
        ``action.state_token_dim``, the robot state [state_dim]) -> [horizon, action_dim]; ``rtc`` steers it
        towards the previous chunk."""
        bucket = select_bucket(self.buckets, prefix_len)
        graph = f"action_expert_{bucket}"
        guide = vjp = None
        if rtc is not None:
            if not isinstance(rtc, RTCGuidance):
                raise TypeError(f"rtc: expected an RTCGuidance, got {type(rtc).__name__}")
            guide = rtc.arrays(self.act.action_horizon, self.act.action_dim)
            if rtc.flavour == "vjp":
                graph = f"action_expert_vjp_{bucket}"
                require_vjp_graph(self.ex, graph)
                vjp = {"target": guide[0], "weights": guide[1]}
        x = noise.astype(np.float32, copy=True)
        feeds = {"noisy_actions": x, "prefix_len": np.array([prefix_len], np.int64), "past_kv": kv}
        if self.act.state_token_dim:
            if state is None:
                raise ValueError("the action expert takes the robot state (action.state_dim), none was given")
            feeds["state"] = state_vector(state, self.act.state_dim)[None, :]
        if vjp is not None:
            feeds.update(vjp)
        for t, emb in zip(self.times, self.time_embeddings):
            feeds["time_embedding"] = emb
            if vjp is not None:
                feeds["flow_time"] = np.array([t], np.float32)
                out = self.ex.run(graph, feeds)
                v = vjp_velocity(out["velocity"], out["correction"], t, rtc.max_guidance_weight)
            else:
                v = self.ex.run(graph, feeds)["velocity"]
                if guide is not None:
                    v = lerobot_velocity(x, v, t, *guide, rtc.max_guidance_weight)
            x += self.dt * v
        return x[0]
