"""Merge modes (``execution.mode``): how a new chunk's rows combine with the plan in force at the same times.

One function per mode in :data:`MERGES`. Adding a mode is a function here, its name in
``core.config.EXECUTION_MODES`` and a row in docs/execution.md (a unit test holds the three together);
whether the plan's leftover also steers the next inference (Real-Time Chunking) is
``ExecutionConfig.guides_inference``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..core.config import ExecutionConfig


@dataclass(frozen=True)
class Overlap:
    """A new chunk against the plan: ``new`` [n, dim] (a copy the merge may write), ``old`` the plan's rows at
    the same times, finite where ``mask`` says they overlap, and ``counts`` the predictions already averaged
    into each old row."""
    new: np.ndarray
    old: np.ndarray
    mask: np.ndarray
    counts: np.ndarray
    cfg: ExecutionConfig
    horizon: int


Merge = Callable[[Overlap], "tuple[np.ndarray, np.ndarray]"]
"""(rows to execute, predictions averaged into each) from an :class:`Overlap`."""


def replace(o: Overlap) -> tuple[np.ndarray, np.ndarray]:
    """The new chunk takes over from its first executed step."""
    return o.new, np.ones(len(o.new), np.int64)


def blend(w_old: float, w_new: float) -> Merge:
    """LeRobot's asynchronous-inference aggregate: ``w_old * old + w_new * new`` where they overlap."""
    def merge(o: Overlap) -> tuple[np.ndarray, np.ndarray]:
        out = o.new
        out[o.mask] = w_old * o.old[o.mask] + w_new * out[o.mask]
        return out, np.ones(len(out), np.int64)
    merge.__doc__ = f"{w_old} old + {w_new} new where the chunks overlap."
    return merge


def temporal_ensemble(o: Overlap) -> tuple[np.ndarray, np.ndarray]:
    """ACT's temporal ensemble: every prediction for a step averaged with weights ``exp(-m * i)``, i = 0 the
    oldest (``temporal_ensemble_coeff`` m); a row holds at most ``horizon`` predictions."""
    w = np.exp(-o.cfg.temporal_ensemble_coeff * np.arange(o.horizon + 1))
    cum = np.cumsum(w)
    out, counts = o.new, np.ones(len(o.new), np.int64)
    c = np.minimum(o.counts[o.mask], o.horizon)
    out[o.mask] = (o.old[o.mask] * cum[c - 1][:, None] + out[o.mask] * w[c][:, None]) / cum[c][:, None]
    counts[o.mask] = c + 1
    return out, counts


MERGES: dict[str, Merge] = {
    "replace": replace,
    "latest_only": replace,  # LeRobot's name for it
    "rtc": replace,  # the guidance happened in the model: its chunk replaces the plan
    "weighted_average": blend(0.3, 0.7),
    "average": blend(0.5, 0.5),
    "conservative": blend(0.7, 0.3),
    "temporal_ensemble": temporal_ensemble,
}


def merge_for(mode: str) -> Merge:
    """The function of a mode; ``auto`` (resolved by the model config) acts as ``replace``."""
    return replace if mode == "auto" else MERGES[mode]
