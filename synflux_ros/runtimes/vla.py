"""VLA runtime: camera frame + instruction -> action chunk, as three pipeline stages.

Stages (each may run on its own device and in its own pipeline thread):

1. ``stage_vision``   resize/letterbox, normalise, tile, vision encoder graph
2. ``stage_backbone`` LLM prefill of [vision tokens | instruction tokens] into a KV-cache slot
3. ``stage_head``     flow matching (Euler steps of the action expert) or autoregressive action tokens,
                      then un-normalisation; the slot is released

:meth:`VLARuntime.infer` runs the three in sequence; :class:`VLAPipeline` runs them in threads.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..core.executor import Executor
from ..core.kv_cache import KVCachePool
from ..core.pipeline import Pipeline
from ..pieces.heads.action_tokens import ActionTokenizer, unnormalize
from ..core.config import ConfigError, ModelConfig
from ..pieces.heads.flow_matching import FlowMatchingHead
from ..pieces.backbone import LLMBackbone
from ..pieces.tokenizer import Tokenizer, load_tokenizer
from ..pieces.vision import VisionEncoder
from .stack import create_executor, resolve_graph_dir

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
    timings: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _Instruction:
    text: str
    ids: tuple[int, ...]
    embeds: np.ndarray


class VLARuntime:
    def __init__(self, cfg: ModelConfig, executor: Executor | None = None, tokenizer: Tokenizer | None = None):
        if cfg.mode != "vla":
            raise ConfigError(f"mode: VLARuntime needs a 'vla' config, {cfg.name!r} is {cfg.mode!r}")
        self.cfg = cfg
        self.executor = executor if executor is not None else create_executor(cfg)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg, resolve_graph_dir(cfg))
        self.vision = VisionEncoder(cfg, self.executor)
        self.backbone = LLMBackbone(cfg, self.executor)
        act = cfg.action
        self.horizon, self.action_dim = act.action_horizon, act.action_dim
        if act.head_type == "flow_matching":
            self.flow = FlowMatchingHead(cfg, self.executor)
            self.action_tokens = 0
        else:
            self.tokens = ActionTokenizer(act.token_vocab_size or cfg.llm.vocab_size, act.num_bins)
            self.action_tokens = self.horizon * self.action_dim
        # One slot per frame that can be between the backbone and the end of the head at once.
        self.kv = KVCachePool(self.executor, cfg.pipeline.queue_depth + 2, cfg.llm.kv_shape, cfg.llm.kv_dtype,
                              "vla_kv")
        self.executor.freeze()
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
        need = self.vision.num_tokens + len(ids) + self.action_tokens
        if need > self.cfg.llm.max_seq_len:
            raise ValueError(f"instruction needs {len(ids)} tokens; with {self.vision.num_tokens} vision tokens"
                             f"{' and ' + str(self.action_tokens) + ' action tokens' if self.action_tokens else ''}"
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
        frame.timings["preprocess_ms"] = (time.perf_counter() - t0) * 1e3
        return frame

    def stage_backbone(self, frame: Frame) -> Frame:
        t0 = time.perf_counter()
        instr = self._instruction
        slot = self.kv.acquire()
        try:
            prefix = np.concatenate([frame.vision_embeds, instr.embeds], axis=0)
            frame.logits = self.backbone.prefill(self.kv.tensor(slot), 0, prefix)
        except BaseException:
            self.kv.release(slot)
            raise
        frame.slot, frame.prefix_len, frame.instruction = slot, prefix.shape[0], instr.text
        frame.vision_embeds = None
        frame.timings["backbone_ms"] = (time.perf_counter() - t0) * 1e3
        return frame

    def stage_head(self, frame: Frame) -> Frame:
        t0 = time.perf_counter()
        try:
            slot = self.kv.tensor(frame.slot)
            if self.action_tokens:
                actions = self._autoregressive(slot, frame)
            else:
                noise = self.flow.initial_noise(self.cfg.action.seed + frame.seq)
                actions = self.flow(slot, frame.prefix_len, noise)
        finally:
            self.release(frame)
        frame.actions = unnormalize(actions, self.cfg.action)
        frame.logits = None
        frame.timings["head_ms"] = (time.perf_counter() - t0) * 1e3
        return frame

    def _autoregressive(self, slot, frame: Frame) -> np.ndarray:
        ids = []
        logits, pos = frame.logits, frame.prefix_len
        for i in range(self.action_tokens):
            tok = self.tokens.best_action_token(logits)
            ids.append(tok)
            if i + 1 < self.action_tokens:
                logits = self.backbone.decode(slot, pos, tok)
                pos += 1
        return self.tokens.decode(ids).reshape(self.horizon, self.action_dim)

    def release(self, frame: Frame) -> None:
        """Give back the KV slot a frame holds (used when a frame fails or is discarded)."""
        if frame.slot is not None:
            self.kv.release(frame.slot)
            frame.slot = None

    @property
    def stages(self) -> list[tuple[str, Callable]]:
        return [("preprocess", self.stage_vision), ("backbone", self.stage_backbone), ("head", self.stage_head)]

    def infer(self, image: np.ndarray, seq: int = 0) -> Frame:
        """Run one frame through all stages in the calling thread."""
        frame = Frame(seq, image)
        for _, fn in self.stages:
            fn(frame)
        return frame

    def close(self) -> None:
        self.executor.close()


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

    def stop(self):
        self.pipeline.stop()

    def submit(self, frame: Frame) -> bool:
        return self.pipeline.submit(frame)
