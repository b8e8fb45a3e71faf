"""Autoregressive action head as OpenVLA does it.

Continuous actions normalised to [-1, 1] are discretised into ``num_bins`` uniform bins whose tokens are
the last ``num_bins`` ids of the vocabulary (bin ``k`` of ``np.digitize`` -> token ``vocab_size - k``).
Decoding maps a token back to the centre of its bin and un-normalises each dimension with its 1st/99th
percentiles, ``0.5 * (a + 1) * (q99 - q01) + q01``, except dimensions whose mask is False (e.g. the
gripper), which are kept as predicted.
"""
from __future__ import annotations

import numpy as np

from ...core.config import ActionConfig, ModelConfig
from ...core.executor import DeviceTensor
from .base import ActionHead


class ActionTokenizer:
    """Maps normalised actions to the last ``num_bins`` token ids of the vocabulary and back."""

    def __init__(self, vocab_size: int, num_bins: int = 256):
        self.vocab_size = vocab_size
        self.num_bins = num_bins
        self.bins = np.linspace(-1.0, 1.0, num_bins)
        self.centers = (self.bins[:-1] + self.bins[1:]) / 2.0
        self.first_id = vocab_size - num_bins

    def encode(self, actions: np.ndarray) -> np.ndarray:
        """Normalised actions -> token ids."""
        k = np.digitize(np.clip(actions, -1.0, 1.0), self.bins)
        return (self.vocab_size - k).astype(np.int64)

    def decode(self, token_ids) -> np.ndarray:
        """Token ids -> normalised actions at bin centres."""
        k = self.vocab_size - np.asarray(token_ids, np.int64)
        k = np.clip(k - 1, 0, self.centers.size - 1)
        return self.centers[k].astype(np.float32)

    def best_action_token(self, logits: np.ndarray) -> int:
        """Greedy choice restricted to the action-token range: the last ``num_bins`` ids of the token
        vocabulary (ids of a padded embedding beyond it are never chosen)."""
        return self.first_id + int(np.argmax(logits[self.first_id:self.vocab_size]))


class ActionTokenHead(ActionHead):
    """Greedy autoregressive decoding of ``horizon * action_dim`` action tokens after the prefix, through
    the backbone's decode graphs, mapped back to bin centres."""

    def __init__(self, cfg: ModelConfig, backbone):
        act = cfg.action
        self.backbone = backbone
        self.action_tokenizer = ActionTokenizer(act.token_vocab_size or cfg.llm.vocab_size, act.num_bins)
        self.shape = (act.action_horizon, act.action_dim)
        self.context_tokens = act.action_horizon * act.action_dim

    def __call__(self, kv: DeviceTensor, prefix_len: int, logits: np.ndarray, seq: int,
                 state: np.ndarray | None = None) -> np.ndarray:
        ids, pos = [], prefix_len
        for i in range(self.context_tokens):
            tok = self.action_tokenizer.best_action_token(logits)
            ids.append(tok)
            if i + 1 < self.context_tokens:
                logits = self.backbone.decode(kv, pos, tok)
                pos += 1
        return self.action_tokenizer.decode(ids).reshape(self.shape)


def unnormalize(actions: np.ndarray, cfg: ActionConfig) -> np.ndarray:
    """Map [-1, 1] actions to robot units with the config's per-dimension q01/q99 and mask."""
    if not cfg.norm_q01:
        return actions.astype(np.float32)
    q01 = np.asarray(cfg.norm_q01, np.float32)
    q99 = np.asarray(cfg.norm_q99, np.float32)
    mask = np.asarray(cfg.norm_mask, bool) if cfg.norm_mask else np.ones(cfg.action_dim, bool)
    return np.where(mask, 0.5 * (actions + 1.0) * (q99 - q01) + q01, actions).astype(np.float32)
