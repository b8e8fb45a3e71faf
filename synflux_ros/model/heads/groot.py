"""GR00T N1.7's flow-matching head (``action.expert_type: dit``).

Once per frame ``vl_context_<p>`` turns the backbone's features into what every DiT block reads (the keys and
values of its cross-attention, the masks of the text and image rows) and encodes the normalised robot state;
then ``num_denoise_steps`` Euler steps of ``dit_<p>`` integrate seeded Gaussian noise from t = 0 to 1:
step k runs at the time bucket ``int(k / N * time_buckets)`` and adds ``(1 / N) * velocity``. GR00T's
direction is the opposite of pi0's (noise at 0, actions at 1).
"""
from __future__ import annotations

import numpy as np

from ...core.config import ModelConfig
from ...core.executor import Executor


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

    def denoise(self, context: dict, noise: np.ndarray) -> np.ndarray:
        """``noise`` [1, horizon, action_dim] -> the normalised chunk [horizon, action_dim]."""
        x = np.array(noise, np.float32, copy=True).reshape(self.shape)
        feeds = {"noisy_actions": x, "state_features": context["state_features"],
                 "cross_kv": context["cross_kv"], "cross_bias": context["cross_bias"]}
        graph = f"dit_{context['bucket']}"
        dt = np.float32(self.dt)
        for t in self.buckets:
            feeds["timestep"] = t
            x += dt * self.ex.run(graph, feeds)["velocity"]
        return x[0]

    def __call__(self, context: dict, seq: int) -> np.ndarray:
        return self.denoise(context, self.initial_noise(self.seed + seq))
