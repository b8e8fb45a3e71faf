"""VLA runtime: camera frame + instruction -> action chunk, as three pipeline stages.

Stages (each may run on its own device and in its own pipeline thread):

1. ``vision``    resize/letterbox, normalise, tile, vision encoder graph
2. ``backbone``  LLM prefill of [vision tokens | instruction tokens] into a KV-cache slot
3. ``head``      the action head (flow matching: Euler steps of the action expert; or autoregressive
                 action tokens), then un-normalisation; the slot is released

:meth:`VLARuntime.infer` runs the three in sequence; :class:`VLAPipeline` runs them in threads.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..core.config import ModelConfig
from ..core.executor import Executor
from ..core.pipeline import Pipeline
from ..pieces.heads import action_head
from ..pieces.heads.action_tokens import unnormalize
from ..pieces.tokenizer import Tokenizer
from .stack import ModelRuntime

MAX_INSTRUCTION_CHARS = 2000


@dataclass
class Frame:
    """One camera frame travelling through the pipeline."""

    seq: int
    image: np.ndarray | None  # HxWx3 uint8 RGB
    t_receipt: float = field(default_factory=time.perf_counter)
    meta: Any = None  # passed through untouched (e.g. the ROS header)
    pixels: np.ndarray | None = None
    vision_embeds: np.ndarray | None = None
    slot: int | None = None
    prefix_len: int = 0
    logits: np.ndarray | None = None
    actions: np.ndarray | None = None
    instruction: str = ""
    state: np.ndarray | None = None  # robot state [action.state_dim] for the action expert (configs with one)
    timings: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _Instruction:
    text: str
    ids: tuple[int, ...]
    embeds: np.ndarray


class VLARuntime(ModelRuntime):
    """Camera frame + instruction -> action chunk, as three stages (:attr:`stages`) that
    :class:`VLAPipeline` runs in threads. The instruction is tokenised and embedded once per change."""

    mode = "vla"

    def __init__(self, cfg: ModelConfig, executor: Executor | None = None, tokenizer: Tokenizer | None = None):
        # One KV slot per frame that can be between the backbone and the end of the head at once.
        super().__init__(cfg, cfg.pipeline.queue_depth + 2, "vla_kv", executor, tokenizer)

    def _setup(self) -> None:
        cfg = self.cfg
        self.head = action_head(cfg, self.executor, self.backbone)
        self.horizon, self.action_dim = cfg.action.action_horizon, cfg.action.action_dim
        self._instruction: _Instruction | None = None
        self._instr_lock = threading.Lock()
        self.set_instruction(cfg.default_instruction)

    # ---------------------------------------------------------------- instruction
    @property
    def instruction(self) -> str:
        return self._instruction.text

    def set_instruction(self, text: str) -> None:
        """Tokenise and embed a new instruction once; frames after this call use it."""
        text = text.strip()
        if not text:
            raise ValueError("instruction is empty")
        if len(text) > MAX_INSTRUCTION_CHARS:
            raise ValueError(f"instruction has {len(text)} characters (limit {MAX_INSTRUCTION_CHARS})")
        ids = self.tokenizer.encode(self.cfg.tokenizer.prompt_template.format(instruction=text))
        extra = self.head.context_tokens
        if self.vision.num_tokens + len(ids) + extra > self.cfg.llm.max_seq_len:
            raise ValueError(f"instruction needs {len(ids)} tokens; with {self.vision.num_tokens} vision tokens"
                             f"{f' and {extra} action tokens' if extra else ''}"
                             f" that exceeds the context of {self.cfg.llm.max_seq_len}")
        with self._instr_lock:
            embeds = self.backbone.embed(ids) if ids else np.zeros((0, self.cfg.llm.hidden_dim), np.float32)
            self._instruction = _Instruction(text, tuple(ids), embeds)

    # ---------------------------------------------------------------- stages
    def stage_vision(self, frame: Frame) -> Frame:
        t0 = time.perf_counter()
        frame.pixels = self.vision.preprocess(frame.image)
        frame.image = None
        frame.vision_embeds = self.vision.encode(frame.pixels)
        frame.pixels = None
        frame.timings["vision_ms"] = (time.perf_counter() - t0) * 1e3
        return frame

    def stage_backbone(self, frame: Frame) -> Frame:
        t0 = time.perf_counter()
        instr = self._instruction
        slot = self.kv_pool.acquire()
        try:
            prefix = np.concatenate([frame.vision_embeds, instr.embeds], axis=0)
            frame.logits = self.backbone.prefill(self.kv_pool.tensor(slot), 0, prefix)
        except BaseException:
            self.kv_pool.release(slot)
            raise
        frame.slot, frame.prefix_len, frame.instruction = slot, prefix.shape[0], instr.text
        frame.vision_embeds = None
        frame.timings["backbone_ms"] = (time.perf_counter() - t0) * 1e3
        return frame

    def stage_head(self, frame: Frame) -> Frame:
        t0 = time.perf_counter()
        try:
            actions = self.head(self.kv_pool.tensor(frame.slot), frame.prefix_len, frame.logits, frame.seq,
                                frame.state)
        finally:
            self.release(frame)
        frame.actions = unnormalize(actions, self.cfg.action)
        frame.logits = None
        frame.timings["head_ms"] = (time.perf_counter() - t0) * 1e3
        return frame

    def release(self, frame: Frame) -> None:
        """Give back the KV slot a frame holds (used when a frame fails or is discarded)."""
        if frame.slot is not None:
            self.kv_pool.release(frame.slot)
            frame.slot = None

    @property
    def stage_devices(self) -> dict[str, str]:
        """Where each stage runs (``executor.placement`` may put them on different devices)."""
        llm = self.cfg.llm
        head_graph = (f"action_expert_{llm.decode_buckets[0]}" if self.cfg.action.head_type == "flow_matching"
                      else f"decode_{llm.decode_buckets[0]}")
        return {"vision": self.executor.device_of("vision_encoder"),
                "backbone": self.executor.device_of(f"prefill_{llm.prefill_buckets[0]}"),
                "head": self.executor.device_of(head_graph)}

    @property
    def stages(self) -> list[tuple[str, Callable]]:
        return [("vision", self.stage_vision), ("backbone", self.stage_backbone), ("head", self.stage_head)]

    def infer(self, image: np.ndarray, seq: int = 0, state: np.ndarray | None = None) -> Frame:
        """Run one frame (and its robot state, for configs with one) through all stages in the calling thread."""
        frame = Frame(seq, image, state=state)
        for _, fn in self.stages:
            fn(frame)
        return frame


class VLAPipeline:
    """The VLA runtime's stages in a threaded :class:`Pipeline`."""

    def __init__(self, runtime: VLARuntime, on_result: Callable[[Frame], None],
                 on_error: Callable[[Frame, str, Exception], None] | None = None):
        self.runtime = runtime

        def _error(frame, stage, exc):
            runtime.release(frame)
            if on_error is not None:
                on_error(frame, stage, exc)

        self.pipeline = Pipeline(runtime.stages, on_result, on_error=_error, on_discard=runtime.release,
                                 queue_depth=runtime.cfg.pipeline.queue_depth)

    def start(self):
        self.pipeline.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the stage threads; False if one is still in a device call after ``timeout``."""
        return self.pipeline.stop(timeout)

    def submit(self, frame: Frame) -> bool:
        return self.pipeline.submit(frame)
