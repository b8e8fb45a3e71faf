"""State normalisation and action un-normalisation of flow-matching VLAs (``action.state_norm``,
``action.action_norm``, ``action.output_dim``), with LeRobot's normalizer semantics (see
:class:`~synflux_ros.core.config.NormalizationConfig`).

The order is the reference's: the robot's joint values are normalised first and then zero-padded to the
model's ``state_dim``; the model's ``action_dim`` outputs are cut to ``output_dim`` first and then
un-normalised. The arithmetic runs in float32, the dtype LeRobot casts its statistics to.
"""
from __future__ import annotations

import numpy as np

from ..core.config import ActionConfig, NormalizationConfig


class Normalizer:
    """One :class:`NormalizationConfig` as float32 arrays: :meth:`forward` (robot units -> model) and
    :meth:`inverse` (model -> robot units)."""

    def __init__(self, cfg: NormalizationConfig):
        f32 = np.float32
        self.mode = cfg.mode
        self.eps = f32(cfg.eps)
        self.clip = cfg.clip
        if cfg.mode == "mean_std":
            self.mean = np.asarray(cfg.mean, f32)
            self.std = np.asarray(cfg.std, f32)
        else:
            self.low = np.asarray(cfg.low, f32)
            span = np.asarray(cfg.high, f32) - self.low
            self.flat = span == 0
            self.span = np.where(self.flat, f32(1.0) if self.clip else self.eps, span).astype(f32)

    def forward(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float32)
        if self.mode == "mean_std":
            return (x - self.mean) / (self.std + self.eps)
        y = np.float32(2.0) * (x - self.low) / self.span - np.float32(1.0)
        if self.clip:  # GR00T: equal bounds map to 0, the rest is clipped to [-1, 1]
            y = np.clip(np.where(self.flat, np.float32(0.0), y), -1.0, 1.0).astype(np.float32)
        return y

    def inverse(self, y: np.ndarray) -> np.ndarray:
        y = np.asarray(y, np.float32)
        if self.mode == "mean_std":
            return y * self.std + self.mean
        if self.clip:
            y = np.clip(y, -1.0, 1.0).astype(np.float32)
            return (y + np.float32(1.0)) / np.float32(2.0) * (self.span * ~self.flat) + self.low
        return (y + np.float32(1.0)) * self.span / np.float32(2.0) + self.low


def state_vector(state, dim: int) -> np.ndarray:
    """``state`` as a float32 vector of ``dim`` finite values; ValueError naming what is wrong otherwise."""
    state = np.asarray(state, np.float32).reshape(-1)
    if state.shape != (dim,) or not np.isfinite(state).all():
        raise ValueError(f"robot state: expected {dim} finite values, got "
                         f"{state.shape[0]}{'' if np.isfinite(state).all() else ' with non-finite ones'}")
    return state


STATE_BINS = 256
"""pi0.5 writes the normalised state into its prompt as bin indices of this many bins over [-1, 1]."""
PI05_PROMPT = "Task: {instruction}, State: {state};\nAction: "
"""pi0.5's prompt (``tokenizer.prompt_template``; LeRobot's ``Pi05PrepareStateTokenizerProcessorStep``)."""
PI0_FAST_PROMPT = "Task: {instruction}, State: {state};\n"
"""pi0-FAST's prompt: pi0.5's without "Action: ", which the model generates before its action tokens."""


def state_prompt_text(state: np.ndarray) -> str:
    """A normalised state vector as pi0.5's prompt spells it (openpi's ``PaligemmaTokenizer``, LeRobot's
    ``Pi05PrepareStateTokenizerProcessorStep``): each value's bin among :data:`STATE_BINS` equal bins over
    [-1, 1], space-separated. A value below -1 reads -1, one of 1 or more 255, as there."""
    edges = np.linspace(-1.0, 1.0, STATE_BINS + 1)[:-1]
    bins = np.digitize(np.asarray(state, np.float32).reshape(-1), bins=edges) - 1
    return " ".join(str(int(b)) for b in bins)


class StateActionMaps:
    """What a flow-matching runtime applies around the model: :meth:`state_in` on the robot state (the
    ``state_joints`` values, zero-padded to ``state_dim``) and :meth:`actions_out` on the denoised chunk."""

    def __init__(self, act: ActionConfig):
        self.joints = len(act.state_joints)
        self.state = Normalizer(act.state_norm) if act.state_norm is not None else None
        self.actions = Normalizer(act.action_norm) if act.action_norm is not None else None
        self.out_dim = act.published_dim
        self.relative = np.asarray(act.relative_mask, np.float32) if any(act.relative_mask) else None

    def state_in(self, state: np.ndarray) -> np.ndarray:
        """Robot-unit state [state_dim] (joints first, zeros after) -> the model's state vector."""
        state = np.asarray(state, np.float32)
        if self.state is None:
            return state
        out = np.zeros_like(state)
        out[:self.joints] = self.state.forward(state[:self.joints])
        return out

    def actions_out(self, actions: np.ndarray, state: np.ndarray | None = None) -> np.ndarray:
        """Model actions [horizon, action_dim] -> published actions [horizon, output_dim] in robot units; with
        ``action.relative_mask``, plus the frame's robot-unit ``state`` where the mask says (LeRobot's
        absolute-actions step)."""
        actions = np.asarray(actions, np.float32)[:, :self.out_dim]
        actions = actions if self.actions is None else self.actions.inverse(actions)
        if self.relative is None:
            return actions
        if state is None:
            raise ValueError("relative actions (action.relative_mask) add the frame's robot state; none was given")
        return actions + np.asarray(state, np.float32).reshape(-1)[:self.out_dim] * self.relative
