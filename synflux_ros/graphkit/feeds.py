"""Seeded inputs a graph accepts by construction, from its contract alone: what ``synflux-validate`` feeds
both backends and what a backend's build step calibrates with when no calibration set is given."""
from __future__ import annotations

import numpy as np

from ..core.config import ModelConfig
from ..core.contract import MASKED_SCORE, GraphMeta
from ..model.time_embedding import time_embedding


def seeded_feeds(meta: GraphMeta, cfg: ModelConfig, rng: np.random.Generator, kv) -> dict:
    """Inputs a graph accepts by construction: ids inside the vocabulary, positions inside the bucket;
    ``kv`` (a device tensor) is fed as ``past_kv``. Used to validate backends and to calibrate."""
    bucket = int(meta.attrs.get("bucket", 0))
    S = cfg.llm.max_seq_len
    feeds = {}
    for spec in meta.inputs:
        name = spec.name
        if name == "past_kv":
            feeds[name] = kv
        elif name == "input_ids":
            feeds[name] = rng.integers(0, cfg.llm.vocab_size, spec.shape).astype(spec.dtype)
        elif name == "num_tokens":  # a partly filled prefill bucket
            feeds[name] = np.array([max(1, bucket - bucket // 4)], spec.dtype)
        elif name == "cache_position":  # decode: the last position of its span; prefill: after a history
            pos = bucket - 1 if meta.kind == "decode" else min(S - bucket, S // 4)
            if meta.kind == "prefill" and cfg.llm.prefill_attention == "bidirectional":
                pos = 0  # a bidirectional prefix starts the cache
            feeds[name] = np.array([pos], spec.dtype)
        elif name == "position_ids":  # text positions after a history (an image's rows differ per axis)
            n = spec.shape[1]
            first = bucket - 1 if meta.kind == "decode" else min(S - bucket, S // 4)
            grid = rng.integers(0, 3, (3, n)) * (meta.kind != "decode")
            feeds[name] = (first + np.arange(n)[None, :] + grid).astype(spec.dtype)
        elif name == "prefix_len":
            feeds[name] = np.array([max(1, bucket // 2)], spec.dtype)
        elif name == "time_embedding":
            feeds[name] = time_embedding(rng.uniform(0.0, 1.0), spec.shape[-1])
        elif name == "image_rows":  # GR00T: every third row an image token
            feeds[name] = (np.arange(spec.shape[1]) % 3 == 0).astype(spec.dtype)[None]
        elif name == "timestep":  # GR00T's time bucket
            feeds[name] = np.array([rng.integers(0, cfg.action.time_buckets)], spec.dtype)
        elif name == "cross_bias":  # GR00T's masks: text rows, image rows; the last quarter padding
            rows = np.arange(spec.shape[1])
            valid = rows < max(1, bucket - bucket // 4)
            image = rows % 3 == 0
            feeds[name] = np.where(np.stack([valid & ~image, valid & image]), 0.0, MASKED_SCORE).astype(spec.dtype)
        elif name in ("weights", "flow_time"):  # RTC guidance: prefix weights and flow time lie in [0, 1]
            feeds[name] = rng.uniform(0.0, 1.0, spec.shape).astype(spec.dtype)
        else:  # pixel values, embeddings, noisy actions, RTC targets: Gaussian at the scale the graph sees
            scale = 0.05 if name in ("inputs_embeds", "deepstack_embeds") else 1.0
            feeds[name] = (rng.standard_normal(spec.shape) * scale).astype(spec.dtype)
    return feeds
