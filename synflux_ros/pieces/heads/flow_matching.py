"""Flow-matching action head (pi0 style).

Start from Gaussian noise at t = 1 and integrate the action expert's velocity field to t = 0 with
``num_denoise_steps`` Euler steps, ``x <- x + dt * v(x, t)`` with ``dt = -1 / N``. The expert attends to
the prefix (vision + instruction) through the KV cache; the noise is seeded per frame.
"""
from __future__ import annotations

import numpy as np

from ...core.config import ModelConfig
from ...core.executor import DeviceTensor, Executor
from ...core.graphs import select_bucket
from .base import ActionHead


class FlowMatchingHead(ActionHead):
    """Denoises seeded Gaussian noise into an action chunk with the ``action_expert_<bucket>`` graphs."""

    def __init__(self, cfg: ModelConfig, executor: Executor):
        self.ex = executor
        self.seed = cfg.action.seed
        self.act = cfg.action
        self.buckets = cfg.llm.decode_buckets
        self.shape = (1, self.act.action_horizon, self.act.action_dim)

    def initial_noise(self, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).standard_normal(self.shape).astype(np.float32)

    def __call__(self, kv: DeviceTensor, prefix_len: int, logits: np.ndarray, seq: int) -> np.ndarray:
        return self.denoise(kv, prefix_len, self.initial_noise(self.seed + seq))

    def denoise(self, kv: DeviceTensor, prefix_len: int, noise: np.ndarray) -> np.ndarray:
        """Denoise ``noise`` [1, horizon, action_dim] conditioned on the prefix -> [horizon, action_dim]."""
        graph = f"action_expert_{select_bucket(self.buckets, prefix_len)}"
        n = self.act.num_denoise_steps
        dt = -1.0 / n
        x = noise.astype(np.float32, copy=True)
        plen = np.array([prefix_len], np.int64)
        for i in range(n):
            t = np.array([1.0 + i * dt], np.float32)
            v = self.ex.run(graph, {"noisy_actions": x, "timestep": t, "prefix_len": plen, "past_kv": kv})
            x += np.float32(dt) * v["velocity"]
        return x[0]
