"""VLA runtime: camera frame + instruction -> action chunk, as three pipeline stages.

Stages (each may run on its own device and in its own pipeline thread):

1. ``vision``    per camera (``vision.cameras``, in config order): resize/letterbox, normalise, tile, vision
                 encoder graph
2. ``backbone``  LLM prefill of [camera 1 tokens | camera 2 tokens | ... | instruction tokens (| state row)]
                 into a KV-cache slot (in one prefill call with ``llm.prefill_attention: bidirectional``, pi0's
                 prefix; SmolVLA's ends with the robot state, ``action.state_input: prefix``)
3. ``head``      the action head (flow matching: Euler steps of the action expert on the normalised robot
                 state, see :mod:`synflux_ros.model.normalization`; or autoregressive action tokens), then
                 un-normalisation; the slot is released

:meth:`VLARuntime.infer` runs the three in sequence; :class:`VLAPipeline` runs them in threads.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..core.config import ConfigError, ModelConfig
from ..core.executor import Executor
from ..core.pipeline import Pipeline
from ..model.heads import action_head
from ..model.heads.action_tokens import unnormalize
from ..model.normalization import StateActionMaps, state_prompt_text, state_vector
from ..model.tokenizer import Tokenizer
from .base import ModelRuntime

MAX_INSTRUCTION_CHARS = 2000


def bounded_text(text, what: str, limit: int) -> str:
    """``text`` stripped; ValueError naming ``what`` when it is not text, is empty or is longer than ``limit``."""
    if not isinstance(text, str):
        raise ValueError(f"{what} must be text, got {type(text).__name__}")
    text = text.strip()
    if not text:
        raise ValueError(f"{what} is empty")
    if len(text) > limit:
        raise ValueError(f"{what} has {len(text)} characters (limit {limit})")
    return text


def instruction_text(text: str) -> str:
    """An instruction stripped; ValueError when it is empty or longer than MAX_INSTRUCTION_CHARS."""
    return bounded_text(text, "instruction", MAX_INSTRUCTION_CHARS)


@dataclass
class Frame:
    """One camera frame travelling through the pipeline."""

    seq: int
    image: np.ndarray | list | None  # HxWx3 uint8 RGB; with vision.cameras a list, one per camera in order
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
    rtc: Any = None  # flow matching: a RTCGuidance (model.heads.rtc), or a callable giving one, for the head
    raw_actions: np.ndarray | None = None  # the head's output before un-normalisation [horizon, action_dim]
    prompt: Any = None  # GR00T: the prompt the backbone ran (runtimes.groot)
    holds_arbiter: bool = False  # entered the accelerator arbiter (VLAPipeline), left once it is done
    timings: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _Instruction:
    text: str
    ids: tuple[int, ...]
    embeds: np.ndarray


class StagedVLA:
    """What a VLA runtime shares whether the model runs here or on a server: its ``cfg`` and ``stages``
    give :meth:`camera_images` and :meth:`infer`."""

    cfg: ModelConfig
    stages: list

    def camera_images(self, image) -> list[np.ndarray]:
        """A frame's images, one per camera in config order; ValueError when the count is wrong."""
        images = list(image) if isinstance(image, (list, tuple)) else [image]
        vis = self.cfg.vision
        if len(images) != vis.num_cameras:
            names = f" ({', '.join(vis.cameras)})" if vis.cameras else ""
            raise ValueError(f"the model takes {vis.num_cameras} camera image(s) per frame{names}, "
                             f"got {len(images)}")
        return images

    def infer(self, image, seq: int = 0, state: np.ndarray | None = None, rtc=None) -> Frame:
        """Run one frame (an image, or a list of one per camera with ``vision.cameras``; its robot state in
        robot units, for configs with one; a Real-Time Chunking guidance for flow heads) through all stages in
        the calling thread."""
        frame = Frame(seq, image, state=state, rtc=rtc)
        for _, fn in self.stages:
            fn(frame)
        return frame


class VLARuntime(StagedVLA, ModelRuntime):
    """Camera frame + instruction -> action chunk, as three stages (:attr:`stages`) that
    :class:`VLAPipeline` runs in threads. The instruction is tokenised and embedded once per change."""

    mode = "vla"

    def __new__(cls, cfg: ModelConfig, *args, **kwargs):
        if cls is VLARuntime and getattr(cfg, "groot_dit", False):  # GR00T N1.7: its own stages
            from .groot import GrootVLARuntime
            cls = GrootVLARuntime
        return super().__new__(cls)

    def __init__(self, cfg: ModelConfig, executor: Executor | None = None, tokenizer: Tokenizer | None = None):
        # One KV slot per frame that can be between the backbone and the end of the head at once.
        super().__init__(cfg, cfg.pipeline.queue_depth + 2, "vla_kv", executor, tokenizer)

    def _setup(self) -> None:
        cfg = self.cfg
        self.head = action_head(cfg, self.executor, self.backbone, self.tokenizer)
        self.horizon, self.action_dim = cfg.action.published_horizon, cfg.action.published_dim
        fast = cfg.action.token_codec == "fast"  # (an autoregressive head's codec)
        self.maps = StateActionMaps(cfg.action) if cfg.action.head_type == "flow_matching" or fast else None
        self.vision_tokens = cfg.prefix_vision_tokens
        self.max_instruction_tokens = cfg.tokenizer.max_instruction_tokens
        self.state_in_prompt = cfg.action.state_input == "prompt"  # pi0.5, pi0-FAST
        self.state_in_prefix = bool(cfg.prefix_state_dim)  # SmolVLA: the prefix's last row
        self.bos = [self._special("instruction_bos")] if cfg.tokenizer.instruction_bos else []
        self.end = [self._special("prompt_end_token")] if cfg.tokenizer.prompt_end_token else []
        self._instruction: _Instruction | None = None
        self._instr_lock = threading.Lock()
        self.set_instruction(cfg.default_instruction)

    # ---------------------------------------------------------------- instruction
    @property
    def instruction(self) -> str:
        return self._instruction.text

    def prompt_ids(self, text: str, state: np.ndarray | None = None) -> list[int]:
        """The prompt's token ids for an instruction (and, with ``action.state_input: prompt``, the frame's
        normalised state, written in as pi0.5's bins, and the instruction's underscores and newlines made spaces
        as pi0.5's processor cleans a task), cut to ``tokenizer.max_instruction_tokens``."""
        fields = {"instruction": text}
        if self.state_in_prompt:
            fields["instruction"] = text.replace("_", " ").replace("\n", " ")
            state = state_vector(state, self.cfg.action.state_dim)
            if self.cfg.action.prompt_state == "joints":  # LeRobot 0.5+: the true state, not the padded one
                state = state[:len(self.cfg.action.state_joints)]
            fields["state"] = state_prompt_text(state)
        encode = self.tokenizer.encode_prompt if self.cfg.tokenizer.prompt_special_tokens else self.tokenizer.encode
        ids = self.bos + encode(self.cfg.tokenizer.prompt_template.format(**fields))
        if self.max_instruction_tokens:  # cut as LeRobot's tokenizer step does (truncation to its max length)
            ids = ids[:self.max_instruction_tokens]
        return ids + self.end  # pi0-FAST: one more <bos> after the (padded) prompt

    def _special(self, field: str) -> int:
        token = getattr(self.cfg.tokenizer, field)
        try:
            return self.tokenizer.special(token)
        except KeyError:
            raise ConfigError(f"tokenizer.{field}: the tokenizer has no special token {token!r}") from None

    def set_instruction(self, text: str) -> None:
        """Tokenise and embed a new instruction once; frames after this call use it. With the state in the
        prompt, the prompt is tokenised and embedded per frame; here its length is checked with a state of zeros
        (a frame whose state makes it longer fails with the reason)."""
        text = instruction_text(text)
        ids = self.prompt_ids(text, np.zeros(self.cfg.action.state_dim, np.float32))
        self._check_prompt_length(ids, "instruction")
        with self._instr_lock:
            if ids and not self.state_in_prompt:
                embeds = self.backbone.embed(ids)
            else:
                embeds = np.zeros((0, self.cfg.llm.hidden_dim), np.float32)
            self._instruction = _Instruction(text, tuple(ids), embeds)

    def _check_prompt_length(self, ids: list[int], what: str) -> None:
        """ValueError when the prompt's tokens do not fit beside the vision tokens (in the largest prefill bucket,
        for a bidirectional prefix, which is prefilled in one call) and the action tokens after them (in the
        context)."""
        extra = self.head.context_tokens
        prefix = self.vision_tokens + (1 if self.state_in_prefix else 0) + len(ids)  # the state row after the prompt
        bucket = self.cfg.llm.prefill_buckets[-1] if self.cfg.llm.prefill_attention == "bidirectional" else None
        for limit, used, room in ((bucket, prefix, "the largest prefill bucket, {} (a bidirectional prefix is "
                                                   "prefilled in one call)"),
                                  (self.cfg.llm.max_seq_len, prefix + extra, "the context of {}")):
            if limit is not None and used > limit:
                raise ValueError(f"{what} needs {len(ids)} tokens; with {self.vision_tokens} vision tokens"
                                 f"{' and the state row' if self.state_in_prefix else ''}"
                                 f"{f' and {extra} action tokens' if extra and room.startswith('the context') else ''}"
                                 f" that exceeds {room.format(limit)}")

    # ---------------------------------------------------------------- stages
    def stage_vision(self, frame: Frame) -> Frame:
        t0 = time.perf_counter()
        images = self.camera_images(frame.image)
        frame.image = None
        embeds = [self.vision.encode(self.vision.preprocess(img)) for img in images]
        frame.vision_embeds = embeds[0] if len(embeds) == 1 else np.concatenate(embeds, axis=0)
        frame.timings["vision_ms"] = (time.perf_counter() - t0) * 1e3
        return frame

    def stage_backbone(self, frame: Frame) -> Frame:
        t0 = time.perf_counter()
        instr = self._instruction
        embeds = instr.embeds
        if self.state_in_prompt:  # pi0.5: the prompt holds this frame's state
            if frame.state is None:
                raise ValueError("the prompt takes the robot state (action.state_input: prompt), none was given")
            ids = self.prompt_ids(instr.text, self.maps.state_in(frame.state))
            self._check_prompt_length(ids, "the prompt with this frame's state")
            embeds = self.backbone.embed(ids)
        parts, state = [frame.vision_embeds, embeds], None
        if self.state_in_prefix:  # SmolVLA: the prefill graph projects the state into this placeholder row
            if frame.state is None:
                raise ValueError("the prefix ends with the robot state (action.state_input: prefix), none was given")
            dim = self.cfg.action.state_dim
            state = state_vector(self.maps.state_in(state_vector(frame.state, dim)), dim)
            parts.append(np.zeros((1, self.cfg.llm.hidden_dim), np.float32))
        slot = self.kv_pool.acquire()
        try:
            prefix = np.concatenate(parts, axis=0)
            frame.logits = self.backbone.prefill(self.kv_pool.tensor(slot), 0, prefix, state=state)
        except BaseException:
            self.kv_pool.release(slot)
            raise
        frame.slot, frame.prefix_len, frame.instruction = slot, prefix.shape[0], instr.text
        frame.vision_embeds = None
        frame.timings["backbone_ms"] = (time.perf_counter() - t0) * 1e3
        return frame

    def stage_head(self, frame: Frame) -> Frame:
        t0 = time.perf_counter()
        # pi0.5's state is in the prompt, SmolVLA's in the prefix
        state = frame.state if not (self.state_in_prompt or self.state_in_prefix) else None
        try:
            if state is not None and self.maps is not None:
                state = self.maps.state_in(state)
            if callable(frame.rtc):  # a provider: the guidance is taken from the plan in force now
                frame.rtc = frame.rtc()
            if frame.rtc is not None:
                actions = self.head(self.kv_pool.tensor(frame.slot), frame.prefix_len, frame.logits, frame.seq,
                                    state, rtc=frame.rtc)
            else:
                actions = self.head(self.kv_pool.tensor(frame.slot), frame.prefix_len, frame.logits, frame.seq,
                                    state)
        finally:
            self.release(frame)
        frame.raw_actions = actions = actions[:self.horizon]  # action.output_horizon: the steps published
        if self.maps is not None:
            actions = self.maps.actions_out(actions, frame.state)
        frame.actions = unnormalize(actions, self.cfg.action)  # norm_q01/q99 (OpenVLA style), when given
        frame.logits = None
        frame.timings["head_ms"] = (time.perf_counter() - t0) * 1e3
        return frame

    def action_tokens(self, image, seq: int = 0, state: np.ndarray | None = None) -> list[int]:
        """pi0-FAST (``action.token_codec: fast``): the tokens the head generates for a frame, not decoded (a
        random model's do not decode; validation and tests compare them)."""
        generate = getattr(self.head, "generate", None)
        if generate is None:
            raise TypeError("action_tokens: the model's action head generates no tokens (action.token_codec fast)")
        frame = self.stage_backbone(self.stage_vision(Frame(seq, image, state=state)))
        try:
            return generate(self.kv_pool.tensor(frame.slot), frame.prefix_len, frame.logits)
        finally:
            self.release(frame)

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


class VLAPipeline:
    """The VLA runtime's stages in a threaded :class:`Pipeline`."""

    def __init__(self, runtime: VLARuntime, on_result: Callable[[Frame], None],
                 on_error: Callable[[Frame, str, Exception], None] | None = None, arbiter=None):
        """``arbiter``: a control-side :class:`~synflux_ros.core.sharing.Arbiter`, held from the moment a frame
        enters its first stage until it is published, failed or dropped (the chat's calls wait meanwhile)."""
        self.runtime = runtime
        stages = list(runtime.stages)

        def leave(frame):  # only a frame that entered holds it (so never without an arbiter)
            if frame.holds_arbiter:
                frame.holds_arbiter = False
                arbiter.leave()

        def _error(frame, stage, exc):
            runtime.release(frame)
            leave(frame)
            if on_error is not None:
                on_error(frame, stage, exc)

        def _discard(frame):
            runtime.release(frame)
            leave(frame)

        if arbiter is not None:
            name, first = stages[0]

            def entered(frame):
                arbiter.enter()  # the arbiter counts its own waits (diagnostics)
                frame.holds_arbiter = True
                return first(frame)

            def published(frame):
                try:
                    on_result(frame)
                finally:
                    leave(frame)

            stages[0] = (name, entered)
            result = published
        else:
            result = on_result
        self.pipeline = Pipeline(stages, result, on_error=_error, on_discard=_discard,
                                 queue_depth=runtime.cfg.pipeline.queue_depth)

    def start(self):
        self.pipeline.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the stage threads; False if one is still in a device call after ``timeout``."""
        return self.pipeline.stop(timeout)

    def submit(self, frame: Frame) -> bool:
        return self.pipeline.submit(frame)
