"""π0-FAST's action head: greedy FAST action tokens through the decode graphs, decoded as LeRobot 0.4.4 does.

The backbone (PaliGemma) generates after the prefix, greedily over the whole vocabulary, until the token ``|``
(LeRobot generates ``max_decoding_steps`` tokens and reads those before the first ``|``: the same actions).
The tokens must start with ``Action:``; every occurrence of the ids of ``"Action: "`` is removed, each id becomes
a FAST token ``vocab_size - 1 - fast_skip_tokens - id``, the FAST BPE tokenizer decodes them to a string whose
characters are DCT coefficients (``ord(c) + min_token``), which are cut or zero-padded to ``horizon * dim``
("relaxed" decoding), laid out [horizon, dim] and turned back into normalised actions by the orthonormal inverse
DCT along time of ``coefficients / scale``. A sequence that cannot be decoded fails the frame with the reason
(LeRobot would publish zeros: the normalised mean action).
"""
from __future__ import annotations

import json
import os

import numpy as np

from ...core.config import ConfigError, ModelConfig
from ...core.executor import DeviceTensor
from .base import ActionHead

ACTION_PREFIX = "Action: "
"""What π0-FAST writes before its action tokens (the prompt stops at ``;\\n``, the model goes on)."""
END_TOKEN = "|"


def idct_matrix(n: int) -> np.ndarray:
    """[n, n] float64: ``M @ c`` is the orthonormal DCT-III (inverse of the orthonormal DCT-II) of ``c`` along its
    first axis, as ``scipy.fftpack.idct(c, axis=0, norm="ortho")``."""
    k = np.arange(n)[None, :]
    t = np.arange(n)[:, None]
    m = np.cos(np.pi * k * (2 * t + 1) / (2 * n)) * np.sqrt(2.0 / n)
    m[:, 0] = np.sqrt(1.0 / n)
    return m


def _clean_up_spaces(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (a tokenizer with ``clean_up_tokenization_spaces``)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class FastCodec:
    """FAST token ids of the backbone's vocabulary <-> normalised action chunks [horizon, dim]."""

    def __init__(self, tokenizer, fast_tokenizer: str, horizon: int, dim: int, scale: float, min_token: int,
                 skip_tokens: int, clean_up_spaces: bool = False):
        from tokenizers import Tokenizer as _Tok
        if not os.path.isfile(fast_tokenizer):
            raise ConfigError(f"action.fast_tokenizer: {fast_tokenizer!r} is not a file (the FAST tokenizer.json)")
        self.bpe = _Tok.from_file(fast_tokenizer)
        self.fast_vocab = self.bpe.get_vocab_size(with_added_tokens=True)
        self.tokenizer = tokenizer
        self.horizon, self.dim = horizon, dim
        self.scale, self.min_token, self.skip = float(scale), int(min_token), int(skip_tokens)
        self.clean_up = clean_up_spaces
        self.vocab_size = tokenizer.base_vocab_size
        try:
            self.end_id = tokenizer.token_id(END_TOKEN)
        except KeyError:
            raise ConfigError(f"action.token_codec fast: the tokenizer has no token {END_TOKEN!r}, which ends the "
                              f"action tokens") from None
        self.prefix_ids = tuple(tokenizer.encode(ACTION_PREFIX))
        self.idct = idct_matrix(horizon)

    def fast_ids(self, ids) -> list[int]:
        """Generated ids (up to the end token) -> FAST token ids; ValueError naming what is wrong."""
        ids = [int(i) for i in ids]
        if END_TOKEN in (pieces := [self.tokenizer.token_text(i) for i in ids]):
            ids = ids[:pieces.index(END_TOKEN)]
            pieces = pieces[:len(ids)]
        if pieces[:2] != ["Action", ":"]:
            raise ValueError(f"the action tokens do not start with 'Action:' (they start with {pieces[:2]})")
        n, p, out, i = len(ids), len(self.prefix_ids), [], 0
        while i < n:  # every occurrence of "Action: " goes
            if p and tuple(ids[i:i + p]) == self.prefix_ids:
                i += p
                continue
            out.append(ids[i])
            i += 1
        fast = [self.vocab_size - 1 - self.skip - t for t in out]
        bad = [f for f in fast if not 0 <= f < self.fast_vocab]
        if bad:
            raise ValueError(f"{len(bad)} generated ids map outside the FAST vocabulary (e.g. FAST id {bad[0]})")
        return fast

    def decode(self, ids) -> np.ndarray:
        """Generated ids -> normalised actions [horizon, dim] (float32)."""
        text = self.bpe.decode(self.fast_ids(ids), skip_special_tokens=False)
        if self.clean_up:
            text = _clean_up_spaces(text)
        coeffs = np.array([ord(c) for c in text], np.int64) + self.min_token
        flat = np.zeros(self.horizon * self.dim, np.float64)
        flat[:min(coeffs.size, flat.size)] = coeffs[:flat.size]  # relaxed: cut or zero-padded
        return (self.idct @ (flat.reshape(self.horizon, self.dim) / self.scale)).astype(np.float32)


def fast_settings(path: str) -> dict:
    """``scale`` and ``min_token`` of a FAST processor_config.json."""
    with open(path, encoding="utf-8") as fh:
        raw = json.load(fh)
    missing = [k for k in ("scale", "min_token") if k not in raw]
    if missing:
        raise ConfigError(f"{path}: {missing} missing (a FAST processor_config.json has scale and min_token)")
    return {"scale": float(raw["scale"]), "min_token": int(raw["min_token"])}


class FastActionHead(ActionHead):
    """Greedy FAST tokens after the prefix (the first from the prefill's logits) until ``|``, at most
    ``action.max_decoding_steps``, through the backbone's decode graphs -> :class:`FastCodec`."""

    def __init__(self, cfg: ModelConfig, backbone, tokenizer):
        act = cfg.action
        self.backbone = backbone
        self.codec = FastCodec(tokenizer, cfg.relative_to_source(act.fast_tokenizer), act.action_horizon,
                               act.action_dim, act.fast_scale, act.fast_min_token, act.fast_skip_tokens,
                               act.fast_clean_up_spaces)
        self.context_tokens = act.max_decoding_steps

    def generate(self, kv: DeviceTensor, prefix_len: int, logits: np.ndarray) -> list[int]:
        ids, pos = [], prefix_len
        for i in range(self.context_tokens):
            tok = int(np.argmax(logits))
            ids.append(tok)
            if tok == self.codec.end_id or i + 1 == self.context_tokens:
                break
            logits = self.backbone.decode(kv, pos, tok)
            pos += 1
        return ids

    def __call__(self, kv: DeviceTensor, prefix_len: int, logits: np.ndarray, seq: int,
                 state: np.ndarray | None = None) -> np.ndarray:
        return self.codec.decode(self.generate(kv, prefix_len, logits))
