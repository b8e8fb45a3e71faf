"""Real-Time Chunking guidance for flow-matching heads (Black et al. 2025), numpy only.

A new chunk is denoised while the robot still executes the previous one. The guidance pulls each Euler step's
velocity so that the chunk's first steps (those the robot executes before the new chunk arrives, and a decaying
stretch after them) continue the previous chunk's leftover. The math of each flavour is in
docs/real-time-chunking.md.

Time runs from 1 (noise) to 0 (actions) and the denoised estimate is ``x1 = x - t * v(x)``; with ``y`` the
leftover padded to the chunk, ``W`` the prefix weights and ``w(t)`` the guidance weight clamped to
``max_guidance_weight``, the error is ``e = (y - x1) * W`` and the guided velocity ``v - w(t) * c``:

* ``lerobot``: ``c = e``, exactly what LeRobot 0.4.4's ``RTCProcessor.denoise_step`` computes inside π0's
  ``sample_actions``;
* ``vjp``: ``c = J^T e`` with J the Jacobian of x1 in x (the paper's Algorithm 1), computed by the
  ``action_expert_vjp_<d>`` graph.
"""
from __future__ import annotations

import difflib
import math
import numbers
from dataclasses import dataclass

import numpy as np

SCHEDULES = ("zeros", "ones", "linear", "exp")
FLAVOURS = ("lerobot", "vjp")


def _choice(what: str, value, choices: tuple[str, ...]) -> None:
    if value in choices:
        return
    near = difflib.get_close_matches(str(value).lower(), choices, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    raise ValueError(f"rtc {what}: {value!r} is not one of {', '.join(choices)}{hint}")


def _integer(what: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"rtc {what}: expected an integer number of steps, got {value!r}")
    if value < minimum:
        raise ValueError(f"rtc {what}: must be at least {minimum}, got {value}")
    return int(value)


def _linear_ramp(start: int, end: int, total: int) -> np.ndarray:
    """The weights strictly between 1 and 0 over steps [start, min(end, total))."""
    steps = total - max(total - end, 0) - start
    if end <= start or steps <= 0:
        return np.zeros(0, np.float32)
    return np.linspace(1.0, 0.0, steps + 2, dtype=np.float32)[1:-1]


def prefix_weights(inference_delay: int, execution_horizon: int, total: int, schedule: str) -> np.ndarray:
    """Per-step guidance weights [total] (float32), LeRobot's ``get_prefix_weights``: 1 over the first
    ``min(inference_delay, execution_horizon)`` steps (executed before the chunk arrives), then per schedule
    until ``execution_horizon`` (zeros: 0; ones: 1; linear: a ramp from 1 to 0, both ends excluded; exp: the
    ramp r times ``expm1(r) / (e - 1)``), 0 after it."""
    _choice("schedule", schedule, SCHEDULES)
    start, end = min(inference_delay, execution_horizon), execution_horizon
    if schedule == "zeros":
        weights = np.zeros(total, np.float32)
        weights[:start] = 1.0
        return weights
    if schedule == "ones":
        weights = np.ones(total, np.float32)
        weights[end:] = 0.0
        return weights
    ramp = _linear_ramp(start, end, total)
    if schedule == "exp":
        ramp = ramp * (np.expm1(ramp) / np.float32(math.e - 1))
    return np.concatenate([np.ones(min(start, total), np.float32), ramp,
                           np.zeros(max(total - end, 0), np.float32)]).astype(np.float32)


def guidance_weight(time: float, max_guidance_weight: float) -> float:
    """``min(c * inv_r2, max)`` with tau = 1 - t, c = (1 - tau) / tau, inv_r2 = ((1 - tau)^2 + tau^2) /
    (1 - tau)^2, in float64; infinities become the maximum and 0 * inf (t = 0) becomes 0, as LeRobot's
    ``nan_to_num`` does."""
    tau = 1.0 - float(time)
    one_minus_sq = (1.0 - tau) ** 2
    with np.errstate(divide="ignore", invalid="ignore"):
        inv_r2 = np.float64(one_minus_sq + tau ** 2) / np.float64(one_minus_sq)
        c = np.float64(1.0 - tau) / np.float64(tau)
        c = np.nan_to_num(c, posinf=max_guidance_weight)
        weight = np.nan_to_num(c * inv_r2, posinf=max_guidance_weight)
    return float(min(weight, max_guidance_weight))


def lerobot_velocity(x: np.ndarray, v: np.ndarray, time: float, target: np.ndarray, weights: np.ndarray,
                     max_guidance_weight: float) -> np.ndarray:
    """The ``lerobot`` flavour's guided velocity for one Euler step at flow time ``time`` (1 = noise).

    ``x`` and ``v`` are the step's input and the expert's velocity [1, horizon, action_dim]; ``target`` the
    padded leftover of the same shape and ``weights`` the prefix weights [1, horizon, 1] (see
    :meth:`RTCGuidance.arrays`). LeRobot evaluates the velocity before it marks ``x`` as requiring gradients, so
    the gradient of ``x1`` with respect to ``x`` it takes is the identity: the correction is the weighted error.
    """
    x1 = x - np.float32(time) * v
    error = (target - x1) * weights
    return (v - np.float32(guidance_weight(time, max_guidance_weight)) * error).astype(np.float32, copy=False)


def vjp_velocity(v: np.ndarray, correction: np.ndarray, time: float, max_guidance_weight: float) -> np.ndarray:
    """The ``vjp`` flavour's guided velocity from the ``action_expert_vjp_<d>`` graph's velocity and correction
    ``J^T e`` at flow time ``time``."""
    return (v - np.float32(guidance_weight(time, max_guidance_weight)) * correction).astype(np.float32, copy=False)


def require_vjp_graph(executor, graph: str) -> None:
    """Raise ValueError naming the build settings when ``executor``'s graph set lacks the vjp guidance's
    ``graph`` (an executor that lists no graphs is taken at its word)."""
    graphs = getattr(executor, "graphs", None)
    if graphs is not None and graph not in graphs:
        raise ValueError(f"rtc flavour vjp runs the graph {graph}, which this graph set does not have: build it "
                         f"with execution.mode: rtc and execution.rtc.guidance: vjp")


@dataclass(frozen=True)
class RTCGuidance:
    """What steers one chunk towards the previous one.

    ``prev_chunk`` [T_prev, action_dim] holds the previous chunk's actions not yet executed when this chunk's
    frame was taken, in the model's normalised action space (the head's output before un-normalisation); fewer
    steps than the horizon or fewer dimensions than the model's ``action_dim`` are padded with zeros, as LeRobot
    pads them (padded dimensions are pulled towards 0). ``inference_delay`` is the number of steps executed
    while the chunk is computed, ``execution_horizon`` how far the guidance reaches (at most T_prev).
    ``flavour`` is one of :data:`FLAVOURS` (``vjp`` needs a graph set built with it).
    """

    prev_chunk: np.ndarray
    inference_delay: int
    execution_horizon: int
    schedule: str = "linear"
    max_guidance_weight: float = 10.0
    flavour: str = "lerobot"

    def __post_init__(self):
        try:
            prev = np.array(self.prev_chunk, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"rtc prev_chunk: not an array of numbers ({exc})") from None
        if prev.ndim != 2 or prev.shape[0] < 1 or prev.shape[1] < 1:
            raise ValueError(f"rtc prev_chunk: expected [steps, action_dim] with at least one of each, got shape "
                             f"{list(prev.shape)}")
        if not np.isfinite(prev).all():
            bad = np.argwhere(~np.isfinite(prev))[0]
            raise ValueError(f"rtc prev_chunk: non-finite value at step {bad[0]}, dimension {bad[1]}")
        prev.setflags(write=False)
        object.__setattr__(self, "prev_chunk", prev)
        object.__setattr__(self, "inference_delay", _integer("inference_delay", self.inference_delay, 0))
        object.__setattr__(self, "execution_horizon", _integer("execution_horizon", self.execution_horizon, 1))
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("flavour", self.flavour, FLAVOURS)
        w = self.max_guidance_weight
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"rtc max_guidance_weight: expected a finite number > 0, got {w!r}")
        object.__setattr__(self, "max_guidance_weight", float(w))

    def arrays(self, horizon: int, action_dim: int) -> tuple[np.ndarray, np.ndarray]:
        """The leftover zero-padded to [1, horizon, action_dim] and the prefix weights [1, horizon, 1] for a chunk
        of that shape; the execution horizon is cut to the leftover's length."""
        steps, dims = self.prev_chunk.shape
        if steps > horizon or dims > action_dim:
            raise ValueError(f"rtc prev_chunk: shape {[steps, dims]} does not fit the model's chunk "
                             f"[{horizon}, {action_dim}] (action_horizon, action_dim)")
        target = np.zeros((1, horizon, action_dim), np.float32)
        target[0, :steps, :dims] = self.prev_chunk
        weights = prefix_weights(self.inference_delay, min(self.execution_horizon, steps), horizon, self.schedule)
        return target, weights.reshape(1, horizon, 1)


__all__ = ["FLAVOURS", "SCHEDULES", "RTCGuidance", "guidance_weight", "lerobot_velocity", "prefix_weights",
           "require_vjp_graph", "vjp_velocity"]
