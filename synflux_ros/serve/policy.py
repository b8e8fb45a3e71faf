"""A VLA as openpi's policy interface: an observation dict in, ``{"actions": [horizon, dim], "policy_timing"}``
out, computed by the same :class:`~synflux_ros.runtimes.vla.VLARuntime` that ``vla_node`` runs.

Observation keys map onto the config's cameras, state and prompt through its ``serve`` section
(:class:`~synflux_ros.core.config.ServeConfig`). Images are uint8, HxWx3 or 3xHxW (openpi's ALOHA layout);
the state is the concatenation of the state keys, in ``action.state_joints`` order, zero-padded to
``action.state_dim``. A request may carry ``rtc``: the previous chunk's actions not yet executed (robot units,
as the server sent them) and the delay in steps, so Real-Time Chunking steers the new chunk across the wire.
Requests are computed one at a time per policy (one runtime, one instruction in force).
"""
from __future__ import annotations

import threading
import time

import numpy as np

from ..core.config import ModelConfig
from ..core.executor import Executor
from ..model.heads.rtc import RTCGuidance
from ..model.image import ImageError, check_image_size, decode_compressed
from ..model.normalization import Normalizer
from ..runtimes.vla import VLARuntime

RTC_KEY = "rtc"
SEQ_KEY = "seq"


class RequestError(ValueError):
    """An observation the policy cannot take; the text names the key and what was wrong."""


def _lookup(obs: dict, path: tuple[str, ...]):
    node = obs
    for i, key in enumerate(path):
        if not isinstance(node, dict) or key not in node:
            where = "/".join(path[:i]) or "the observation"
            raise KeyError(f"{'/'.join(path)!r} (no {key!r} in {where})")
        node = node[key]
    return node


def _name(path: tuple[str, ...]) -> str:
    return path[0] if len(path) == 1 else "[" + ", ".join(path) + "]"


class VLAPolicy:
    """openpi's ``infer(obs) -> dict`` over a VLA config; :attr:`metadata` is the frame sent on connect."""

    def __init__(self, cfg: ModelConfig, executor: Executor | None = None):
        self.runtime = VLARuntime(cfg, executor)
        self.cfg = cfg
        self.camera_keys = cfg.serve.image_keys(cfg.vision.cameras)
        self.state_keys = cfg.serve.state_keys
        self.prompt_key = cfg.serve.prompt_key
        act = cfg.action
        self.flow = act.head_type == "flow_matching"
        self.action_norm = Normalizer(act.action_norm) if self.flow and act.action_norm is not None else None
        self._lock = threading.Lock()

    @property
    def metadata(self) -> dict:
        cfg, act = self.cfg, self.cfg.action
        return {"model": cfg.name, "backend": cfg.executor.backend, "action_horizon": act.published_horizon,
                "action_dim": act.published_dim, "step_period": act.step_period, "head": act.head_type,
                "cameras": {c: _name(p) for c, p in self.camera_keys},
                "state": [_name(p) for p in self.state_keys] if act.state_dim else [],
                "state_dim": len(act.state_joints) or act.state_dim, "prompt": _name(self.prompt_key),
                "rtc": self.flow}

    def close(self) -> None:
        self.runtime.close()

    # ---------------------------------------------------------------- request parsing
    def images(self, obs: dict) -> list[np.ndarray]:
        out = []
        limit = self.cfg.vision.max_input_pixels
        for cam, path in self.camera_keys:
            try:
                img = _lookup(obs, path)
            except KeyError as exc:
                raise RequestError(f"camera {cam!r}: the observation has no image at {exc.args[0]}") from None
            if isinstance(img, bytes):  # JPEG or PNG (what executor.backend remote sends)
                try:
                    img = decode_compressed("image", img, max_pixels=limit)
                except ImageError as exc:
                    raise RequestError(f"camera {cam!r} ({_name(path)}): {exc}") from None
            if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3:
                what = f"{img.dtype} array of shape {list(img.shape)}" if isinstance(img, np.ndarray) else \
                    type(img).__name__
                raise RequestError(f"camera {cam!r} ({_name(path)}): expected a uint8 image HxWx3 or 3xHxW (or "
                                   f"JPEG/PNG bytes), got a {what}")
            if img.shape[-1] != 3 and img.shape[0] == 3:
                img = img.transpose(1, 2, 0)
            if img.shape[-1] != 3:
                raise RequestError(f"camera {cam!r} ({_name(path)}): expected 3 colour channels, got shape "
                                   f"{list(img.shape)}")
            if img.shape[0] == 0 or img.shape[1] == 0:
                raise RequestError(f"camera {cam!r} ({_name(path)}): a zero-size image ({img.shape[1]}x"
                                   f"{img.shape[0]}); expected at least 1x1")
            try:
                check_image_size(img.shape[1], img.shape[0], limit)
            except ValueError as exc:
                raise RequestError(f"camera {cam!r} ({_name(path)}): {exc}") from None
            out.append(np.ascontiguousarray(img))
        return out

    def state(self, obs: dict) -> np.ndarray | None:
        act = self.cfg.action
        if not act.state_dim:
            return None
        parts = []
        for path in self.state_keys:
            try:
                value = _lookup(obs, path)
            except KeyError as exc:
                raise RequestError(f"state: the observation has no value at {exc.args[0]}") from None
            arr = np.asarray(value) if isinstance(value, (np.ndarray, list, tuple, int, float, np.generic)) \
                else None
            if arr is None or arr.dtype.kind not in "biuf" or arr.ndim > 1:
                raise RequestError(f"state ({_name(path)}): expected a number or a 1-D array of numbers")
            parts.append(arr.astype(np.float32).reshape(-1))
        vec = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        want = len(act.state_joints) or act.state_dim
        if vec.shape[0] != want:
            raise RequestError(f"state: {' + '.join(_name(p) for p in self.state_keys)} hold {vec.shape[0]} values, "
                               f"the model takes {want}"
                               + (f" ({', '.join(act.state_joints)})" if act.state_joints else ""))
        if not np.all(np.isfinite(vec)):
            raise RequestError("state: holds NaN or Inf")
        out = np.zeros(act.state_dim, np.float32)
        out[:want] = vec
        return out

    def prompt(self, obs: dict) -> str | None:
        try:
            text = _lookup(obs, self.prompt_key)
        except KeyError:
            return None
        if not isinstance(text, str):
            raise RequestError(f"prompt ({_name(self.prompt_key)}): expected a string, got {type(text).__name__}")
        return text

    def guidance(self, obs: dict) -> RTCGuidance | None:
        if RTC_KEY not in obs:
            return None
        req = obs[RTC_KEY]
        if not self.flow:
            raise RequestError(f"rtc: Real-Time Chunking guides a flow-matching head; this model's head is "
                               f"{self.cfg.action.head_type}")
        model_space = isinstance(req, dict) and "prev_chunk_model" in req
        key = "prev_chunk_model" if model_space else "prev_chunk"
        if not isinstance(req, dict) or key not in req or "inference_delay" not in req:
            raise RequestError("rtc: expected a map with prev_chunk ([steps, action_dim], the previous chunk's "
                               "actions not yet executed, as sent; or prev_chunk_model, as model_actions gave "
                               "them) and inference_delay (steps)")
        prev = np.asarray(req[key]) if isinstance(req[key], (np.ndarray, list)) else None
        dim = self.cfg.action.action_dim if model_space else self.cfg.action.published_dim
        if prev is None or prev.dtype.kind not in "iuf" or prev.ndim != 2 or prev.shape[1] != dim \
                or prev.shape[0] < 1:
            raise RequestError(f"rtc {key}: expected a [steps, {dim}] array of numbers")
        prev = prev.astype(np.float32)
        if not np.all(np.isfinite(prev)):
            raise RequestError(f"rtc {key}: holds NaN or Inf")
        delay = req["inference_delay"]
        horizon = req.get("execution_horizon", self.cfg.execution.rtc.execution_horizon)
        steps = self.cfg.action.action_horizon
        for name, v in (("inference_delay", delay), ("execution_horizon", horizon)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise RequestError(f"rtc {name}: expected a non-negative integer, got {v!r}")
            if v > steps:  # steps of a chunk: more can neither be executed nor guided
                raise RequestError(f"rtc {name}: {v} is out of range (0 to the model's horizon, {steps} steps)")
        if self.action_norm is not None and not model_space:
            prev = self.action_norm.forward(prev)
        rtc = self.cfg.execution.rtc
        try:
            return RTCGuidance(prev_chunk=prev, inference_delay=int(delay), execution_horizon=int(horizon),
                               schedule=rtc.schedule, max_guidance_weight=rtc.max_guidance_weight,
                               flavour=rtc.guidance)
        except ValueError as exc:
            raise RequestError(str(exc)) from None

    # ---------------------------------------------------------------- inference
    def infer(self, obs, seq: int) -> dict:
        """One chunk for ``obs``; the initial noise is the one ``vla_node`` uses for frame ``seq`` (the request's
        own ``seq`` when it carries one)."""
        if not isinstance(obs, dict):
            raise RequestError(f"expected an observation map, got {type(obs).__name__}")
        if SEQ_KEY in obs:
            seq = obs[SEQ_KEY]
            if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) or not 0 <= seq < 2**63:
                raise RequestError(f"seq: expected a non-negative integer, got {seq!r}")
            seq = int(seq)
        images, state, prompt, rtc = self.images(obs), self.state(obs), self.prompt(obs), self.guidance(obs)
        with self._lock:
            t0 = time.perf_counter()
            if prompt is not None and prompt.strip() != self.runtime.instruction:
                try:
                    self.runtime.set_instruction(prompt)
                except ValueError as exc:
                    raise RequestError(f"prompt: {exc}") from None
            image = images if self.cfg.vision.cameras else images[0]
            frame = self.runtime.infer(image, seq=seq, state=state, rtc=rtc)
            infer_ms = (time.perf_counter() - t0) * 1e3
        timing = {"infer_ms": infer_ms, **{k: float(v) for k, v in frame.timings.items()}}
        out = {"actions": np.asarray(frame.actions, np.float32), "policy_timing": timing}
        if frame.raw_actions is not None:  # the chunk in the model's space: what an RTC leftover is made of
            out["model_actions"] = np.asarray(frame.raw_actions, np.float32)
        return out
