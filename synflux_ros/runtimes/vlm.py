"""VLM runtime: multi-turn chat with a per-session KV cache.

A turn is rendered with a Qwen-style template::

    <|im_start|>user\\n[<|vision_start|><|image_pad|>*N<|vision_end|>]...{prompt}<|im_end|>\\n<|im_start|>assistant\\n

Only the turn's new tokens are prefilled on top of the session's cache (``cached_tokens`` reports how
many positions were reused). With ``session.reuse_kv_cache: false`` the whole history is recomputed each
turn instead, which must give the same reply: it is the reference the cache path is tested against.
"""
from __future__ import annotations

import math
import numbers
import threading
import time
import zlib
from dataclasses import dataclass, field

import numpy as np

from ..core.config import ConfigError, ModelConfig
from ..core.executor import Executor
from ..core.image import ImageError, check_image_size
from ..pieces.heads.text_sampling import SamplingParams, generate
from ..pieces.tokenizer import Tokenizer
from .sessions import RequestError, Segment, Session, SessionManager
from .stack import ModelRuntime

MAX_SESSION_ID_CHARS = 128
MIN_TEMPERATURE = 1e-6  # smallest sampling temperature; below it logits / temperature can overflow


@dataclass(frozen=True)
class ChatRequest:
    """One chat turn as the runtime takes it; None means the config's value."""
    session_id: str
    prompt: str
    images: list = field(default_factory=list)  # HxWx3 uint8 RGB arrays
    reset: bool = False
    max_new_tokens: int | None = None  # None = the config's text.max_new_tokens
    temperature: float | None = None  # None = the config's sampling; 0 = greedy
    top_p: float | None = None  # None = the config's text.top_p


@dataclass
class ChatResult:
    """The reply of one turn with its token counts and timings."""
    reply: str
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft_ms: float
    total_ms: float
    stopped_by_eos: bool
    evicted_session: str | None = None
    token_ids: list[int] = field(default_factory=list)


@dataclass
class _Turn:
    """A checked request: what the turn adds to the session and where it starts."""

    req: ChatRequest
    params: SamplingParams
    segments: list[Segment]
    new_tokens: int
    history: int  # positions the session held before this turn
    t0: float


def _utf8(name: str, text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{name} is not valid Unicode text ({exc.reason} at character {exc.start})") from None


class VLMRuntime(ModelRuntime):
    """Multi-turn chat: one KV-cache slot per session, each turn prefilling only its new tokens (or, with
    ``session.reuse_kv_cache: false``, the whole history). One turn runs at a time."""

    mode = "vlm"

    def __init__(self, cfg: ModelConfig, executor: Executor | None = None, tokenizer: Tokenizer | None = None):
        super().__init__(cfg, cfg.session.max_sessions, "session_kv", executor, tokenizer)

    def _setup(self) -> None:
        self.sessions = SessionManager(self.kv_pool, self.cfg.session.eviction)
        tok = self.tokenizer
        try:
            sp = {name: tok.special(f"<|{name}|>") for name in ("im_start", "im_end", "vision_start", "vision_end",
                                                                "image_pad")}
        except KeyError as exc:
            raise ConfigError(f"tokenizer: the chat template needs the special token {exc.args[0]!r}") from None
        self._sp = sp
        nl = tok.encode("\n")
        self._user_prefix = [sp["im_start"]] + tok.encode("user\n")
        self._turn_suffix = [sp["im_end"]] + nl + [sp["im_start"]] + tok.encode("assistant\n")
        self._close_reply = [sp["im_end"]] + nl
        self._nl = nl
        eos = tuple(tok.eos_ids)
        if not eos:
            raise ConfigError("text.eos_token_ids: no end-of-sequence id (set it or use a tokenizer that has one)")
        self._eos = eos
        self._lock = threading.Lock()
        self.turns_served = 0
        self.requests_refused = 0

    # ---------------------------------------------------------------- validation
    def sampling_params(self, req: ChatRequest) -> SamplingParams:
        """The request's limits, each None replaced by the config's value."""
        t = self.cfg.text
        ctx = self.cfg.llm.max_seq_len
        for name in ("max_new_tokens", "temperature", "top_p"):
            value = getattr(req, name)
            kind = numbers.Integral if name == "max_new_tokens" else numbers.Real
            if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
                raise RequestError(f"{name} must be {'an integer' if kind is numbers.Integral else 'a number'}, "
                                   f"got {value!r}")
        if req.max_new_tokens is not None and not 1 <= req.max_new_tokens <= ctx:
            raise RequestError(f"max_new_tokens {req.max_new_tokens} is out of range (1 to the context {ctx}; "
                               f"leave it unset for the default {t.max_new_tokens})")
        if req.temperature is not None and not (math.isfinite(req.temperature) and (
                req.temperature == 0.0 or MIN_TEMPERATURE <= req.temperature <= 100.0)):
            raise RequestError(f"temperature {req.temperature} is out of range (0 = greedy, else {MIN_TEMPERATURE:g} "
                               f"to 100; leave it unset for the config's sampling)")
        if req.top_p is not None and not (math.isfinite(req.top_p) and 0.0 < req.top_p <= 1.0):
            raise RequestError(f"top_p {req.top_p} is out of range (above 0, at most 1; leave it unset for the "
                               f"default {t.top_p})")
        max_new = t.max_new_tokens if req.max_new_tokens is None else req.max_new_tokens
        if req.temperature is not None:
            temperature = req.temperature
        else:
            temperature = t.temperature if t.do_sample else 0.0
        top_p = t.top_p if req.top_p is None else req.top_p
        return SamplingParams(max_new, temperature, top_p, self._eos)

    def check_limits(self, session_id: str, prompt: str, num_images: int) -> None:
        """The checks that cost nothing: session id, prompt size in bytes and the number of images. A
        caller that still has to decode the images runs these first; :meth:`chat` runs them too."""
        if not isinstance(session_id, str) or not session_id.strip():
            raise RequestError("session_id is empty")
        if len(session_id) > MAX_SESSION_ID_CHARS:
            raise RequestError(f"session_id has {len(session_id)} characters (limit {MAX_SESSION_ID_CHARS})")
        _utf8("session_id", session_id)
        if not isinstance(prompt, str) or not prompt.strip():
            raise RequestError("prompt is empty")
        limit = self.cfg.session.max_prompt_bytes
        # Each character is at least one byte: a prompt this long is refused without encoding it.
        if len(prompt) > limit:
            raise RequestError(f"prompt has {len(prompt)} characters, over the limit of {limit} bytes "
                               f"(session.max_prompt_bytes)")
        size = len(_utf8("prompt", prompt))
        if size > limit:
            raise RequestError(f"prompt has {size} bytes, over the limit of {limit} bytes (session.max_prompt_bytes)")
        limit = self.cfg.session.max_images_per_turn
        if num_images > limit:
            raise RequestError(f"{num_images} images attached, at most {limit} per turn "
                               f"(session.max_images_per_turn)")

    def _validate(self, req: ChatRequest) -> None:
        images = req.images
        if not isinstance(images, (list, tuple)):
            raise RequestError(f"images must be a list of arrays, got {type(images).__name__}")
        self.check_limits(req.session_id, req.prompt, len(images))
        max_pixels = self.cfg.vision.max_input_pixels
        for i, img in enumerate(images):
            if not isinstance(img, np.ndarray) or img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
                what = f"shape {img.shape}, dtype {img.dtype}" if isinstance(img, np.ndarray) else \
                    type(img).__name__
                raise RequestError(f"images[{i}]: expected an HxWx3 uint8 RGB array, got {what}")
            height, width = img.shape[:2]
            if height == 0 or width == 0:
                raise RequestError(f"images[{i}]: zero-size image (width {width}, height {height})")
            try:
                check_image_size(width, height, max_pixels)
            except ImageError as exc:
                raise RequestError(f"images[{i}]: {exc}") from None

    # ---------------------------------------------------------------- chat
    def _turn_segments(self, pending: list[int], prompt: str, image_embeds: list[np.ndarray]) -> list[Segment]:
        segs = [Segment(list(pending) + self._user_prefix)]
        for emb in image_embeds:
            segs.append(Segment([self._sp["vision_start"]]))
            segs.append(Segment([self._sp["image_pad"]] * emb.shape[0], emb))
            segs.append(Segment([self._sp["vision_end"]]))
        segs.append(Segment(self.tokenizer.encode(prompt) + self._turn_suffix))
        return segs

    def _embed_segments(self, segs: list[Segment]) -> np.ndarray:
        ids = [i for s in segs for i in s.ids]
        x = self.backbone.embed(ids)
        off = 0
        for s in segs:
            if s.image_embeds is not None:
                x[off:off + len(s.ids)] = s.image_embeds
            off += len(s.ids)
        return x

    def chat(self, req: ChatRequest) -> ChatResult:
        """Serve one turn; a request that cannot be served raises :class:`RequestError` saying why."""
        try:
            with self._lock:
                turn = self._check(req)
                session, evicted = self.sessions.get_or_create(req.session_id)
                if req.reset:
                    self.sessions.reset(session)
                return self._run_turn(turn, session, evicted)
        except RequestError:
            self.requests_refused += 1
            raise

    def _check(self, req: ChatRequest) -> _Turn:
        """Validate a request, encode its images and template, and check that it fits the context."""
        t0 = time.perf_counter()
        self._validate(req)
        params = self.sampling_params(req)
        images = []
        for i, img in enumerate(req.images):
            try:
                images.append(self.vision(img))
            except ImageError as exc:
                raise RequestError(f"images[{i}]: {exc}") from None
        existing = None if req.reset else self.sessions.peek(req.session_id)
        history = existing.history_tokens if existing else 0
        segs = self._turn_segments(existing.pending if existing else [], req.prompt, images)
        n_new = sum(len(s.ids) for s in segs)
        ctx = self.cfg.llm.max_seq_len
        if history + n_new > ctx:
            where = f"the session has {ctx - history} of {ctx} context positions left" if history else \
                f"the context is {ctx} tokens"
            raise RequestError(f"prompt needs {n_new} tokens but {where}; shorten the prompt"
                               f"{' or reset the session' if history else ''}")
        if history + n_new + params.max_new_tokens - 1 > ctx:
            room = ctx - history - n_new + 1
            raise RequestError(f"max_new_tokens {params.max_new_tokens} does not fit: after this prompt "
                               f"({n_new} tokens) only {room} tokens can be generated in the context of {ctx}; "
                               f"lower max_new_tokens or reset the session")
        return _Turn(req, params, segs, n_new, history, t0)

    def _run_turn(self, turn: _Turn, session: Session, evicted: str | None) -> ChatResult:
        """Prefill the turn (only its new tokens when the cache is reused), generate, record the turn."""
        slot = self.kv_pool.tensor(session.slot)
        if self.cfg.session.reuse_kv_cache:
            cached = session.cached
            logits = self.backbone.prefill(slot, cached, self._embed_segments(turn.segments))
        else:
            cached = 0
            logits = self.backbone.prefill(slot, 0, self._embed_segments(session.history + turn.segments))
        pos = turn.history + turn.new_tokens
        rng = np.random.default_rng([self.cfg.text.seed, zlib.crc32(turn.req.session_id.encode()), session.turns])
        gen = generate(logits, lambda p, tok: self.backbone.decode(slot, p, tok), pos, turn.params, rng, turn.t0)
        self._record_turn(session, turn, gen.tokens, gen.stopped_by_eos)
        text_ids = [t for t in gen.tokens if t not in self._eos]
        total = (time.perf_counter() - turn.t0) * 1e3
        return ChatResult(self.tokenizer.decode(text_ids), turn.new_tokens, cached, len(gen.tokens),
                          gen.ttft_s * 1e3, total, gen.stopped_by_eos, evicted, list(gen.tokens))

    def _record_turn(self, session: Session, turn: _Turn, tokens: list[int], stopped_by_eos: bool) -> None:
        """Everything but the last sampled token is now in the cache; that token and the reply's closing
        template are prefilled at the start of the next turn."""
        session.history.extend(turn.segments)
        session.history.append(Segment(tokens[:-1]))
        session.cached = turn.history + turn.new_tokens + len(tokens) - 1
        session.pending = [tokens[-1]] + (self._nl if stopped_by_eos else self._close_reply)
        session.turns += 1
        self.turns_served += 1

    def end_session(self, session_id: str) -> None:
        with self._lock:
            self.sessions.end(session_id)

