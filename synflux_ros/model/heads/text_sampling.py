"""Text decoding head: greedy, temperature and nucleus (top-p) sampling with eos ids and a token budget."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """Limits and sampling of one reply."""
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    eos_ids: tuple[int, ...] = ()


def sample_token(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """Pick the next token id from logits [V]."""
    if temperature <= 0.0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, top_p) + 1)]
        q = p[keep] / p[keep].sum()
        return int(keep[rng.choice(keep.size, p=q)])
    return int(rng.choice(p.size, p=p))


@dataclass
class Generation:
    """The tokens of one reply, why it stopped and its time to first token."""
    tokens: list[int]
    stopped_by_eos: bool
    ttft_s: float


def generate(first_logits: np.ndarray, step: Callable[[int, int], np.ndarray], start_pos: int,
             params: SamplingParams, rng: np.random.Generator, t0: float | None = None,
             on_token: Callable[[int], None] | None = None) -> Generation:
    """Sample up to ``max_new_tokens``; ``step(pos, token)`` feeds a token and returns the next logits;
    ``on_token`` (for streaming) gets each token as it is sampled.

    The last sampled token is not fed (nothing reads its logits); the caller keeps it for the next turn.
    """
    t0 = time.perf_counter() if t0 is None else t0
    tokens: list[int] = []
    logits = first_logits
    pos = start_pos
    ttft = 0.0
    eos = set(params.eos_ids)
    while True:
        tok = sample_token(logits, params.temperature, params.top_p, rng)
        if not tokens:
            ttft = time.perf_counter() - t0
        tokens.append(tok)
        if on_token is not None:
            on_token(tok)
        if tok in eos:
            return Generation(tokens, True, ttft)
        if len(tokens) >= params.max_new_tokens:
            return Generation(tokens, False, ttft)
        logits = step(pos, tok)
        pos += 1
