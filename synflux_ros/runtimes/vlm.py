"""VLM runtime: multi-turn chat with a per-session KV cache.

A turn is rendered with a Qwen-style template::

    <|im_start|>user\\n[<|vision_start|><|image_pad|>*N<|vision_end|>]...{prompt}<|im_end|>\\n<|im_start|>assistant\\n

Only the turn's new tokens are prefilled on top of the session's cache (``cached_tokens`` reports how
many positions were reused). With ``session.reuse_kv_cache: false`` the whole history is recomputed each
turn instead, which must give the same reply: it is the reference the cache path is tested against.
"""
from __future__ import annotations

import math
import threading
import time
import zlib
from dataclasses import dataclass, field

import numpy as np

from ..core.executor import Executor
from ..core.kv_cache import KVCachePool
from ..core.config import ConfigError, ModelConfig
from ..pieces.backbone import LLMBackbone
from ..pieces.heads.text_sampling import SamplingParams, generate
from ..pieces.tokenizer import Tokenizer, load_tokenizer
from ..pieces.vision import VisionEncoder
from .stack import create_executor, resolve_graph_dir
from ..core.image import ImageError
from .sessions import RequestError, Segment, Session, SessionManager

MAX_SESSION_ID_CHARS = 128


@dataclass(frozen=True)
class ChatRequest:
    session_id: str
    prompt: str
    images: list = field(default_factory=list)  # HxWx3 uint8 RGB arrays
    reset: bool = False
    max_new_tokens: int = 0  # 0 = config default
    temperature: float = -1.0  # < 0 = config default; 0 = greedy
    top_p: float = 0.0  # <= 0 = config default


@dataclass
class ChatResult:
    reply: str
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft_ms: float
    total_ms: float
    stopped_by_eos: bool
    evicted_session: str | None = None
    token_ids: list[int] = field(default_factory=list)


class VLMRuntime:
    def __init__(self, cfg: ModelConfig, executor: Executor | None = None, tokenizer: Tokenizer | None = None):
        if cfg.mode != "vlm":
            raise ConfigError(f"mode: VLMRuntime needs a 'vlm' config, {cfg.name!r} is {cfg.mode!r}")
        self.cfg = cfg
        self.executor = executor if executor is not None else create_executor(cfg)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg, resolve_graph_dir(cfg))
        self.vision = VisionEncoder(cfg, self.executor)
        self.backbone = LLMBackbone(cfg, self.executor)
        self.pool = KVCachePool(self.executor, cfg.session.max_sessions, cfg.llm.kv_shape, cfg.llm.kv_dtype,
                                "session_kv")
        self.executor.freeze()
        self.sessions = SessionManager(self.pool, cfg.session.eviction)
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
        t = self.cfg.text
        if req.max_new_tokens < 0 or req.max_new_tokens > self.cfg.llm.max_seq_len:
            raise RequestError(f"max_new_tokens {req.max_new_tokens} is out of range (0 = default "
                               f"{t.max_new_tokens}, at most the context {self.cfg.llm.max_seq_len})")
        if not math.isfinite(req.temperature) or req.temperature > 100.0:
            raise RequestError(f"temperature {req.temperature} is out of range (<0 = default, 0 = greedy, "
                               f"at most 100)")
        if not math.isfinite(req.top_p) or req.top_p > 1.0:
            raise RequestError(f"top_p {req.top_p} is out of range (<=0 = default, at most 1)")
        max_new = req.max_new_tokens or t.max_new_tokens
        if req.temperature >= 0:
            temperature = req.temperature
        else:
            temperature = t.temperature if t.do_sample else 0.0
        top_p = req.top_p if req.top_p > 0 else t.top_p
        return SamplingParams(max_new, temperature, top_p, self._eos)

    def _validate(self, req: ChatRequest) -> None:
        sid = req.session_id
        if not sid or not sid.strip():
            raise RequestError("session_id is empty")
        if len(sid) > MAX_SESSION_ID_CHARS:
            raise RequestError(f"session_id has {len(sid)} characters (limit {MAX_SESSION_ID_CHARS})")
        if not req.prompt or not req.prompt.strip():
            raise RequestError("prompt is empty")
        limit = self.cfg.session.max_images_per_turn
        if len(req.images) > limit:
            raise RequestError(f"{len(req.images)} images attached, at most {limit} per turn")

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
        try:
            with self._lock:
                return self._chat(req)
        except RequestError:
            self.requests_refused += 1
            raise

    def _chat(self, req: ChatRequest) -> ChatResult:
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
        pending = existing.pending if existing else []
        segs = self._turn_segments(pending, req.prompt, images)
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

        session, evicted = self.sessions.get_or_create(req.session_id)
        if req.reset:
            self.sessions.reset(session)
        slot = self.pool.tensor(session.slot)
        if self.cfg.session.reuse_kv_cache:
            cached = session.cached
            logits = self.backbone.prefill(slot, cached, self._embed_segments(segs))
        else:
            cached = 0
            logits = self.backbone.prefill(slot, 0, self._embed_segments(session.history + segs))
        pos = history + n_new
        rng = np.random.default_rng([self.cfg.text.seed, zlib.crc32(req.session_id.encode()), session.turns])
        gen = generate(logits, lambda p, tok: self.backbone.decode(slot, p, tok), pos, params, rng, t0)
        # Everything but the last sampled token is now in the cache.
        session.history.extend(segs)
        session.history.append(Segment(gen.tokens[:-1]))
        session.cached = pos + len(gen.tokens) - 1
        session.pending = [gen.tokens[-1]] + (self._nl if gen.stopped_by_eos else self._close_reply)
        session.turns += 1
        self.turns_served += 1
        text_ids = [t for t in gen.tokens if t not in self._eos]
        total = (time.perf_counter() - t0) * 1e3
        return ChatResult(self.tokenizer.decode(text_ids), n_new, cached, len(gen.tokens), gen.ttft_s * 1e3, total,
                          gen.stopped_by_eos, evicted, list(gen.tokens))

    def end_session(self, session_id: str) -> None:
        with self._lock:
            self.sessions.end(session_id)

    def close(self) -> None:
        self.executor.close()
