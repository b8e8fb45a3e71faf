"""The sinusoidal embedding of the flow time t that a flow-matching head feeds its action expert (pi0's),
computed on the host in float64, (the mock executor reads t back)."""
from __future__ import annotations

import numpy as np

from ..core.contract import TIME_MAX_PERIOD, TIME_MIN_PERIOD


def _time_frequencies(dim: int) -> np.ndarray:
    fraction = np.linspace(0.0, 1.0, dim // 2, dtype=np.float64)
    period = TIME_MIN_PERIOD * (TIME_MAX_PERIOD / TIME_MIN_PERIOD) ** fraction
    return 2.0 * np.pi / period


def time_embedding(t: float, dim: int) -> np.ndarray:
    """[1, dim] float32: sin | cos of t times frequencies from 2*pi/4e-3 down to 2*pi/4, computed in float64
    from t as given (pi0's ``create_sinusoidal_pos_embedding``)."""
    arg = _time_frequencies(dim) * float(t)
    return np.concatenate((np.sin(arg), np.cos(arg)))[None, :].astype(np.float32)
