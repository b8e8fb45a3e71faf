"""The action-head interface: one call from the backbone's prefix to a normalised action chunk."""
from __future__ import annotations

import abc

import numpy as np

from ...core.executor import DeviceTensor


class ActionHead(abc.ABC):
    """Turns a prefilled KV slot into a normalised action chunk [horizon, action_dim]."""

    context_tokens: int = 0
    """Positions the head appends to the context after the prefix (action tokens); they must fit in it."""

    @abc.abstractmethod
    def __call__(self, kv: DeviceTensor, prefix_len: int, logits: np.ndarray | None, seq: int,
                 state: np.ndarray | None = None) -> np.ndarray:
        """``kv`` holds the prefix of ``prefix_len`` positions whose last logits are ``logits`` (None for a
        flow-matching head, whose prefill computes none: ``core.contract.reads_logits``); ``seq``
        is the frame's sequence number (seeds the flow-matching noise); ``state`` is the robot-state vector
        [action.state_dim] of the frame (heads with a state input only)."""
