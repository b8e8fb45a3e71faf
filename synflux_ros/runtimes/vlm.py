"""VLM runtime: multi-turn chat with a per-session KV cache.

Each turn renders the whole conversation (system prompt, earlier turns with the replies as text, the new
message) with the checkpoint's chat template (:mod:`synflux_ros.model.chat_template`) and tokenizes it;
each image marker (``tokenizer.image_token``, one per image) becomes the image's vision tokens. The
longest common prefix of that token sequence and what the session's KV slot holds is reused; only the
rest is prefilled (``cached_tokens`` reports the reuse). This works with any template, including those
that rewrite earlier turns (their unchanged prefix is still reused). With ``session.reuse_kv_cache:
false`` the whole conversation is prefilled each turn instead, which must give the same reply: it is the
reference the cache path is tested against.
"""
from __future__ import annotations

import hashlib
import math
import numbers
import threading
import time
import zlib
from dataclasses import dataclass, field

import numpy as np

from ..core.config import ConfigError, ModelConfig
from ..core.executor import Executor
from ..model.positions import mrope_positions
from ..model.image import ImageError, check_image_size
from ..model.chat_template import ChatTemplateError, load_chat_template
from ..model.heads.text_sampling import SamplingParams, generate
from ..model.tokenizer import Tokenizer
from .sessions import Message, PastMessage, RequestError, Session, SessionManager
from .base import ModelRuntime

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
    system: str | None = None  # the system prompt of a new or reset session; None / "" = the template's default
    reuse_kv_cache: bool | None = None  # None = the config's session.reuse_kv_cache; False: prefill the history
    # The conversation before this turn as the client holds it (PastMessage per message, user first, user and
    # assistant alternating), for clients that send it whole (OpenAI's API). A session holding exactly it goes
    # on; else the session is rebuilt from it (a replica that never saw the session, an edited history).
    history: tuple | None = None


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
    network_ms: float | None = None  # a remote turn: its time less the server's (executor.backend remote)


@dataclass
class _Turn:
    """A checked request: the rendered conversation and how much of it the session's cache holds."""

    req: ChatRequest
    params: SamplingParams
    message: Message
    images: dict  # this turn's image key -> embeddings
    system: str
    tokens: list  # the whole conversation: token ids, (image key, row) for image rows
    reused: int  # leading positions of ``tokens`` the session's cache already holds
    t0: float
    digests: dict  # this turn's image key -> pixel digest
    rebuilt: "_Past | None" = None  # the conversation the session restarts from (a request's history)


@dataclass
class _Past:
    """A conversation rebuilt from a request's history, as a session holds one."""
    system: str
    messages: list
    images: dict
    digests: dict
    turns: int


def pixel_digest(img: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(img).data).hexdigest() + "x".join(map(str, img.shape))


def _utf8(name: str, text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{name} is not valid Unicode text ({exc.reason} at character {exc.start})") from None


def chat_template_of(cfg: ModelConfig, tokenizer: Tokenizer):
    """The chat template the runtime renders with: ``tokenizer.chat_template`` (relative to the config file), else
    the one beside the tokenizer, else plain completion (text-only) or ChatML (with vision), see
    :func:`~synflux_ros.model.chat_template.load_chat_template`."""
    return load_chat_template(tokenizer.directory, cfg.relative_to_source(cfg.tokenizer.chat_template),
                              text_only=cfg.vision is None)


def check_chat_setup(cfg: ModelConfig, tokenizer: Tokenizer, template) -> None:
    """Raise ConfigError for what the runtime cannot chat with: a vision config whose tokenizer lacks the image
    token or whose template places no images, no end-of-sequence id. ``synflux-build`` runs the same check, so
    it refuses a graph set that ``vlm_node`` would refuse at start."""
    if cfg.vision is not None:
        marker = cfg.tokenizer.image_token
        try:
            tokenizer.special(marker)
        except KeyError:
            raise ConfigError(f"tokenizer.image_token: {marker!r} is not a token of the tokenizer; a model with "
                              f"a vision section needs the token its chat template marks images with") from None
        if marker not in template.source and "image" not in template.source:
            raise ConfigError(f"the chat template ({template.origin}) does not place images; set "
                              f"tokenizer.chat_template to one that does, or use a text-only config")
    if not tuple(tokenizer.eos_ids):
        raise ConfigError("text.eos_token_ids: no end-of-sequence id (set it or use a tokenizer that has one)")


def check_turn(cfg: ModelConfig, special_strings, session_id: str, prompt: str, num_images: int,
               system: str | None = None) -> None:
    """The checks of a chat turn that cost nothing: session id, prompt (and system prompt) size in bytes, the
    tokenizer's ``special_strings`` in them, and the number of images."""
    if not isinstance(session_id, str) or not session_id.strip():
        raise RequestError("session_id is empty")
    if len(session_id) > MAX_SESSION_ID_CHARS:
        raise RequestError(f"session_id has {len(session_id)} characters (limit {MAX_SESSION_ID_CHARS})")
    _utf8("session_id", session_id)
    if num_images and cfg.vision is None:
        raise RequestError(f"{num_images} images attached, but {cfg.name!r} is a text-only model (its "
                           f"config has no vision section): send the prompt without images")
    if num_images > cfg.session.max_images_per_turn:  # before the prompt: the first fault is the one said
        raise RequestError(f"{num_images} images attached, at most {cfg.session.max_images_per_turn} per turn "
                           f"(session.max_images_per_turn)")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("prompt is empty")
    limit = cfg.session.max_prompt_bytes
    # Each character is at least one byte: a prompt this long is refused without encoding it.
    if len(prompt) > limit:
        raise RequestError(f"prompt has {len(prompt)} characters, over the limit of {limit} bytes "
                           f"(session.max_prompt_bytes)")
    size = len(_utf8("prompt", prompt))
    if size > limit:
        raise RequestError(f"prompt has {size} bytes, over the limit of {limit} bytes (session.max_prompt_bytes)")
    if system is not None and not isinstance(system, str):
        raise RequestError(f"system prompt must be text, got {type(system).__name__}")
    if system:
        size = len(_utf8("system prompt", system))
        if size > limit:
            raise RequestError(f"system prompt has {size} bytes, over the limit of {limit} bytes "
                               f"(session.max_prompt_bytes)")
    for name, text in (("prompt", prompt), ("system prompt", system or "")):
        found = sorted(t for t in special_strings if t and t in text)
        if found:
            raise RequestError(f"{name} contains the special token {found[0]!r}, which the chat template would "
                               f"turn into a control token; remove it")


def checked_images(cfg: ModelConfig, req: ChatRequest, special_strings=()) -> list:
    """``req``'s images after :func:`check_turn` and a check of each (HxWx3 uint8, within the pixel limit)."""
    images = req.images
    if not isinstance(images, (list, tuple)):
        raise RequestError(f"images must be a list of arrays, got {type(images).__name__}")
    check_turn(cfg, special_strings, req.session_id, req.prompt, len(images), req.system)
    max_pixels = cfg.vision.max_input_pixels if cfg.vision is not None else 0
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
    return list(images)


class VLMRuntime(ModelRuntime):
    """Multi-turn chat: one KV-cache slot per session, each turn prefilling only its new tokens (or, with
    ``session.reuse_kv_cache: false``, the whole history). One turn runs at a time."""

    mode = "vlm"

    def __init__(self, cfg: ModelConfig, executor: Executor | None = None, tokenizer: Tokenizer | None = None):
        super().__init__(cfg, cfg.session.max_sessions, "session_kv", executor, tokenizer)

    def _setup(self) -> None:
        self.sessions = SessionManager(self.kv_pool, self.cfg.session.eviction)
        tok = self.tokenizer
        self.template = chat_template_of(self.cfg, tok)
        check_chat_setup(self.cfg, tok, self.template)
        self._image_id = tok.special(self.cfg.tokenizer.image_token) if self.cfg.vision is not None else None
        self._eos = tuple(tok.eos_ids)
        vis = self.cfg.vision
        self._grid = vis.merged_grid if self.backbone.mrope and vis is not None else None
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

    def check_limits(self, session_id: str, prompt: str, num_images: int, system: str | None = None) -> None:
        """The checks that cost nothing (:func:`check_turn`). A caller that still has to decode the images runs
        these first; :meth:`chat` runs them too."""
        check_turn(self.cfg, self.tokenizer.special_strings, session_id, prompt, num_images, system)

    def _validate(self, req: ChatRequest) -> None:
        checked_images(self.cfg, req, self.tokenizer.special_strings)

    @property
    def max_sessions(self) -> int:
        return self.kv_pool.num_slots

    @property
    def devices(self) -> dict[str, str]:
        """Where the vision encoder and the language model run ("" without a vision encoder)."""
        return {"vision": self.executor.device_of("vision_encoder") if self.cfg.vision is not None else "",
                "llm": self.executor.device_of(f"decode_{self.cfg.llm.decode_buckets[0]}")}

    # ---------------------------------------------------------------- chat
    def _render(self, system: str, messages: list[Message], images: dict) -> list:
        """The conversation as the model reads it: token ids, each image marker replaced by that image's
        rows as ``(image key, row)``."""
        convo = ([{"role": "system", "content": system}] if system else []) + [m.for_template() for m in messages]
        try:
            text = self.template.render(convo)
            ids = self.tokenizer.encode_prompt(text) if self.template.plain else self.tokenizer.encode_chat(text)
        except ChatTemplateError as exc:
            raise RequestError(str(exc)) from None
        keys = [k for m in messages for k in m.images]
        markers = sum(1 for i in ids if i == self._image_id) if self._image_id is not None else 0
        if markers != len(keys):
            raise RequestError(f"the chat template ({self.template.origin}) placed {markers} image markers for "
                               f"{len(keys)} images")
        out, n = [], 0
        for i in ids:
            if i == self._image_id and self._image_id is not None:
                key = keys[n]
                n += 1
                out += [(key, row) for row in range(images[key].rows)]
            else:
                out.append(i)
        return out

    def _embed(self, tokens: list, images: dict) -> np.ndarray:
        ids = [t if isinstance(t, int) else self._image_id for t in tokens]
        x = self.backbone.embed(ids)
        for pos, t in enumerate(tokens):
            if not isinstance(t, int):
                x[pos] = images[t[0]].embeds[t[1]]
        return x

    def _deepstack(self, tokens: list, images: dict) -> np.ndarray | None:
        """[K, n, H]: each image row's DeepStack features at its position, zeros at text positions."""
        if not self.backbone.num_deepstack:
            return None
        out = np.zeros((self.backbone.num_deepstack, len(tokens), self.backbone.hidden), np.float32)
        for pos, t in enumerate(tokens):
            if not isinstance(t, int):
                out[:, pos] = images[t[0]].deepstack[:, t[1]]
        return out

    def chat(self, req: ChatRequest, on_token=None) -> ChatResult:
        """Serve one turn; a request that cannot be served raises :class:`RequestError` saying why.
        ``on_token`` gets each generated token id as it is sampled (streaming)."""
        try:
            with self._lock:
                turn = self._check(req)
                session, evicted = self.sessions.get_or_create(req.session_id)
                if req.reset or turn.rebuilt is not None:
                    self.sessions.reset(session)
                if turn.rebuilt is not None:
                    past = turn.rebuilt
                    session.system, session.messages, session.turns = past.system, past.messages, past.turns
                    session.images.update(past.images)
                    session.digests.update(past.digests)
                return self._run_turn(turn, session, evicted, on_token)
        except RequestError:
            self.requests_refused += 1
            raise

    def _check(self, req: ChatRequest) -> _Turn:
        """Validate a request, encode its images, render the conversation, and check that it fits."""
        t0 = time.perf_counter()
        self._validate(req)
        params = self.sampling_params(req)
        existing = None if req.reset else self.sessions.peek(req.session_id)
        system = req.system or ""
        rebuilt = None
        if req.history is not None:
            past = self._check_history(req)
            if existing is None or not self._holds(existing, system, past):
                rebuilt, existing = self._rebuild(system, past), None
        if req.history is None and existing is not None and existing.turns and system and \
                system != existing.system:
            raise RequestError("system prompt: it applies when a session starts or resets; this session already "
                               "has one (send reset to start it again with another)")
        if existing is not None and existing.turns:
            system = existing.system
        images, digests = {}, {}
        start = rebuilt.turns if rebuilt else existing.turns if existing else 0
        for i, img in enumerate(req.images):
            try:
                images[(start, i)] = self.vision.features(img)
            except ImageError as exc:
                raise RequestError(f"images[{i}]: {exc}") from None
            digests[(start, i)] = pixel_digest(img)
        message = Message("user", req.prompt, list(images))
        held = rebuilt or existing
        earlier = held.messages if held else []
        all_images = {**(held.images if held else {}), **images}
        tokens = self._render(system, earlier + [message], all_images)
        reused = 0
        reuse = self.cfg.session.reuse_kv_cache if req.reuse_kv_cache is None else req.reuse_kv_cache
        if existing is not None and reuse:
            held = existing.tokens[:existing.cached]
            limit = min(len(held), len(tokens) - 1)  # at least one token is prefilled: its logits start the reply
            while reused < limit and held[reused] == tokens[reused]:
                reused += 1
        ctx = self.cfg.llm.max_seq_len
        if len(tokens) > ctx:
            raise RequestError(f"the conversation needs {len(tokens)} tokens but the context is {ctx} tokens; "
                               f"shorten the prompt{' or reset the session' if earlier else ''}")
        if len(tokens) + params.max_new_tokens - 1 > ctx:
            room = ctx - len(tokens) + 1
            raise RequestError(f"max_new_tokens {params.max_new_tokens} does not fit: after this prompt "
                               f"({len(tokens)} tokens with the conversation) only {room} tokens can be generated in "
                               f"the context of {ctx}; lower max_new_tokens or reset the session")
        return _Turn(req, params, message, images, system, tokens, reused, t0, digests, rebuilt)

    def _check_history(self, req: ChatRequest) -> list[PastMessage]:
        """A request's history, checked as its turns were when they were sent."""
        past = list(req.history)
        for i, m in enumerate(past):
            want = "user" if i % 2 == 0 else "assistant"
            if not isinstance(m, PastMessage) or m.role != want:
                got = m.role if isinstance(m, PastMessage) else type(m).__name__
                raise RequestError(f"history[{i}]: expected a {want} message (the conversation alternates user and "
                                   f"assistant from a user message, and the new message is a user's), got {got}")
            if m.role == "user":
                self._validate(ChatRequest(req.session_id, m.text, list(m.images)))
            else:
                if m.images:
                    raise RequestError(f"history[{i}]: an assistant message carries no images")
                if not isinstance(m.text, str) or len(_utf8("reply", m.text)) > self.cfg.session.max_prompt_bytes:
                    raise RequestError(f"history[{i}]: an assistant message must be text of at most "
                                       f"{self.cfg.session.max_prompt_bytes} bytes (session.max_prompt_bytes)")
        if past and past[-1].role != "assistant":
            raise RequestError("history: it must end with the assistant's message (the new message is a user's)")
        return past

    @staticmethod
    def _holds(session: Session, system: str, past: list[PastMessage]) -> bool:
        """Whether ``session`` holds exactly this conversation (texts, roles, image pixels, system prompt)."""
        if session.system != system or len(session.messages) != len(past):
            return False
        return all(m.role == p.role and m.text == p.text and
                   [session.digests.get(k) for k in m.images] == [pixel_digest(img) for img in p.images]
                   for m, p in zip(session.messages, past))

    def _rebuild(self, system: str, past: list[PastMessage]) -> _Past:
        """The conversation of a history as a session would hold it, its images encoded."""
        rebuilt = _Past(system, [], {}, {}, 0)
        for m in past:
            keys = []
            for i, img in enumerate(m.images):
                key = (rebuilt.turns, i)
                try:
                    rebuilt.images[key] = self.vision.features(img)
                except ImageError as exc:
                    raise RequestError(f"history image {i} of turn {rebuilt.turns}: {exc}") from None
                rebuilt.digests[key] = pixel_digest(img)
                keys.append(key)
            rebuilt.messages.append(Message(m.role, m.text, keys))
            if m.role == "assistant":
                rebuilt.turns += 1
        return rebuilt

    def _run_turn(self, turn: _Turn, session: Session, evicted: str | None, on_token=None) -> ChatResult:
        """Prefill what the cache does not hold (all of it without reuse), generate, record the turn."""
        slot = self.kv_pool.tensor(session.slot)
        # From here on the slot is written from ``reused``: if the turn fails, the session keeps only
        # what stays valid (the next turn prefills the rest of its conversation again).
        session.cached = min(session.cached, turn.reused)
        del session.tokens[session.cached:]
        images = {**session.images, **turn.images}
        new = turn.tokens[turn.reused:]
        positions, shift = None, None
        if self.backbone.mrope:
            # Rotary positions of the whole conversation (those of the reused part are what the cache holds);
            # generated tokens continue after the last one: cache position + shift.
            every, nxt = mrope_positions(turn.tokens, self._grid)
            positions, shift = every[:, turn.reused:], nxt - len(turn.tokens)
        logits = self.backbone.prefill(slot, turn.reused, self._embed(new, images), positions,
                                       self._deepstack(new, images))
        pos = len(turn.tokens)
        rng = np.random.default_rng([self.cfg.text.seed, zlib.crc32(turn.req.session_id.encode()), session.turns])
        gen = generate(logits, lambda p, tok: self.backbone.decode(slot, p, tok, None if shift is None else p + shift),
                       pos, turn.params, rng, turn.t0, on_token)
        text_ids = [t for t in gen.tokens if t not in self._eos]
        reply = self.tokenizer.decode(text_ids)
        self._record_turn(session, turn, gen.tokens, reply)
        total = (time.perf_counter() - turn.t0) * 1e3
        return ChatResult(reply, len(turn.tokens) - turn.reused, turn.reused, len(gen.tokens),
                          gen.ttft_s * 1e3, total, gen.stopped_by_eos, evicted, list(gen.tokens))

    def _record_turn(self, session: Session, turn: _Turn, tokens: list[int], reply: str) -> None:
        """The slot now holds the conversation and every sampled token but the last; the next turn renders
        the reply as text and reuses whatever of it tokenizes the same."""
        session.system = turn.system
        session.images.update(turn.images)
        session.digests.update(turn.digests)
        session.messages += [turn.message, Message("assistant", reply)]
        session.tokens = list(turn.tokens) + [int(t) for t in tokens[:-1]]
        session.cached = len(session.tokens)
        session.turns += 1
        self.turns_served += 1

    def end_session(self, session_id: str) -> None:
        with self._lock:
            self.sessions.end(session_id)

