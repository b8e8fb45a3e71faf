"""The VLA runtime of GR00T N1.7 (``action.expert_type: dit``), the same three stages as
:class:`~synflux_ros.runtimes.vla.VLARuntime`:

1. ``vision``    preprocess each camera, then the Qwen3-VL vision encoder on all of them in one call (or one
                 call each without ``vision.batch_cameras``): their tokens and DeepStack maps
2. ``backbone``  the prompt GR00T's processor builds, one user message of every camera's image and then the
                 instruction rendered with the checkpoint's chat template, image markers expanded to the
                 cameras' tokens at their multimodal rotary positions; ``features_<p>`` gives the cut language
                 model's last hidden states
3. ``head``      ``vl_context_<p>`` and the DiT's Euler steps (:class:`~synflux_ros.model.heads.groot.GrootDiTHead`)
                 on the normalised robot state, then the clipped min-max un-normalisation

The prompt's token ids (and so its bucket and positions) change only with the instruction; each frame fills
in its image rows.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from ..core.config import ConfigError, ModelConfig
from ..core.contract import select_bucket
from ..core.executor import Executor
from ..model.chat_template import ChatTemplateError
from ..model.heads.action_tokens import unnormalize
from ..model.heads.groot import GrootDiTHead
from ..model.normalization import StateActionMaps, state_vector
from ..model.positions import mrope_positions
from ..model.tokenizer import Tokenizer
from .base import ModelRuntime
from .vla import Frame, VLARuntime, instruction_text
from .vlm import chat_template_of


def formalized(text: str) -> str:
    """GR00T's ``formalize_language``: lower case, only letters, digits, whitespace and underscores."""
    return "".join(ch for ch in text.lower() if ch.isalnum() or ch.isspace() or ch == "_")


@dataclass(frozen=True)
class _Prompt:
    text: str
    tokens: tuple  # a token id, or (camera index, row) at an image row
    bucket: int
    embeds: np.ndarray  # [n, H], image rows zero
    positions: np.ndarray  # [3, bucket]
    image_rows: np.ndarray  # [bucket] float32, 1 at an image row
    camera_starts: tuple  # the first row of each camera's tokens (they are consecutive)


class GrootVLARuntime(VLARuntime):
    """GR00T N1.7: camera frames + instruction + robot state -> action chunk. No KV cache: the backbone's features
    of one frame go to the head whole."""

    def __init__(self, cfg: ModelConfig, executor: Executor | None = None, tokenizer: Tokenizer | None = None):
        ModelRuntime.__init__(self, cfg, 0, "vla_kv", executor, tokenizer)

    def _setup(self) -> None:
        cfg = self.cfg
        self.head = GrootDiTHead(cfg, self.executor)
        self.horizon, self.action_dim = cfg.action.published_horizon, cfg.action.published_dim
        self.maps = StateActionMaps(cfg.action)
        self.template = chat_template_of(cfg, self.tokenizer)
        try:
            self._image_id = self.tokenizer.special(cfg.tokenizer.image_token)
        except KeyError:
            raise ConfigError(f"tokenizer.image_token: {cfg.tokenizer.image_token!r} is not a token of the "
                              f"tokenizer") from None
        self._grid = cfg.vision.merged_grid
        self._instruction: _Prompt | None = None
        self._instr_lock = threading.Lock()
        self.set_instruction(cfg.default_instruction)

    # ---------------------------------------------------------------- instruction
    def prompt_tokens(self, text: str) -> list:
        """The prompt of an instruction: token ids, each camera's image marker expanded to ``(camera, row)``."""
        if self.cfg.action.formalize_language:
            text = formalized(text)
        cams = self.cfg.vision.num_cameras
        convo = [{"role": "user", "content": [*({"type": "image"} for _ in range(cams)),
                                              {"type": "text", "text": text}]}]
        try:
            rendered = self.template.render(convo, add_generation_prompt=False)
        except ChatTemplateError as exc:
            raise ValueError(f"the chat template cannot render the prompt: {exc}") from None
        ids = self.tokenizer.encode_chat(rendered)
        markers = [i for i, t in enumerate(ids) if t == self._image_id]
        if len(markers) != cams:
            raise ConfigError(f"the chat template ({self.template.origin}) placed {len(markers)} image markers "
                              f"for {cams} cameras")
        rows = self._grid[0] * self._grid[1]
        out, cam = [], 0
        for t in ids:
            if t == self._image_id:
                out += [(cam, r) for r in range(rows)]
                cam += 1
            else:
                out.append(t)
        return out

    def set_instruction(self, text: str) -> None:
        """Render, tokenise and embed a new instruction once; frames after this call use it."""
        text = instruction_text(text)
        tokens = self.prompt_tokens(text)
        n, largest = len(tokens), self.cfg.llm.prefill_buckets[-1]
        if n > largest:
            raise ValueError(f"instruction: the prompt needs {n} tokens with the cameras' "
                             f"{self.cfg.prefix_vision_tokens} image tokens, over the largest prefill bucket "
                             f"({largest}; the prompt is one call)")
        bucket = select_bucket(self.cfg.llm.prefill_buckets, n)
        ids = [t if isinstance(t, int) else self._image_id for t in tokens]
        embeds = self.backbone.embed(ids)
        image = np.array([not isinstance(t, int) for t in tokens])
        embeds[image] = 0.0
        pos, _ = mrope_positions([t if isinstance(t, int) else (f"cam{t[0]}", t[1]) for t in tokens], self._grid)
        positions = np.empty((3, bucket), np.int64)
        positions[:, :n] = pos
        positions[:, n:] = pos[:, n - 1:n] + np.arange(1, bucket - n + 1)  # padded rows continue after the last
        rows = np.zeros(bucket, np.float32)
        rows[:n] = image
        starts = tuple(i for i, t in enumerate(tokens) if not isinstance(t, int) and t[1] == 0)
        with self._instr_lock:
            self._instruction = _Prompt(text, tuple(tokens), bucket, embeds, positions, rows, starts)

    # ---------------------------------------------------------------- stages
    def stage_vision(self, frame: Frame) -> Frame:
        t0 = time.perf_counter()
        images = self.camera_images(frame.image)
        frame.image = None
        frame.vision_embeds = self.vision.features_of(images)  # every camera in one call (vision.batch_cameras)
        frame.timings["vision_ms"] = (time.perf_counter() - t0) * 1e3
        return frame

    def stage_backbone(self, frame: Frame) -> Frame:
        t0 = time.perf_counter()
        prompt = self._instruction
        p, n, hidden = prompt.bucket, len(prompt.tokens), self.cfg.llm.hidden_dim
        x = np.zeros((1, p, hidden), np.float32)
        x[0, :n] = prompt.embeds
        k = self.backbone.num_deepstack
        deepstack = np.zeros((k, p, hidden), np.float32) if k else None
        for start, feats in zip(prompt.camera_starts, frame.vision_embeds):  # each camera's rows, in one copy
            x[0, start:start + feats.rows] = feats.embeds
            if k:
                deepstack[:, start:start + feats.rows] = feats.deepstack
        feeds = {"inputs_embeds": x, "num_tokens": np.array([n], np.int64), "position_ids": prompt.positions}
        if k:
            feeds["deepstack_embeds"] = deepstack
        frame.logits = self.executor.run(f"features_{p}", feeds)["features"]
        frame.prefix_len, frame.instruction = n, prompt.text
        frame.slot = None
        frame.prompt = prompt
        frame.vision_embeds = None
        frame.timings["backbone_ms"] = (time.perf_counter() - t0) * 1e3
        return frame

    def stage_head(self, frame: Frame) -> Frame:
        t0 = time.perf_counter()
        prompt = frame.prompt
        if frame.state is None:
            raise ValueError("GR00T encodes the robot state (action.state_dim), none was given")
        state = self.maps.state_in(state_vector(frame.state, self.cfg.action.state_dim))
        context = self.head.context(prompt.bucket, frame.logits, frame.prefix_len, prompt.image_rows, state)
        frame.logits = None
        if callable(frame.rtc):
            frame.rtc = frame.rtc()
        actions = self.head(context, frame.seq, frame.rtc)[:self.horizon]  # action.output_horizon
        frame.raw_actions = actions
        actions = self.maps.actions_out(actions, frame.state)
        frame.actions = unnormalize(actions, self.cfg.action)
        frame.timings["head_ms"] = (time.perf_counter() - t0) * 1e3
        return frame

    def action_tokens(self, image, seq: int = 0, state=None):
        raise TypeError("action_tokens: GR00T's head generates no tokens")

    @property
    def stage_devices(self) -> dict[str, str]:
        p = self.cfg.llm.prefill_buckets[0]
        return {"vision": self.executor.device_of("vision_encoder"),
                "backbone": self.executor.device_of(f"features_{p}"),
                "head": self.executor.device_of(f"dit_{p}")}
