"""Chat sessions: each owns a KV-cache slot holding everything said so far.

Sessions are bounded by the slot pool. When all slots are taken, a new session either evicts the least
recently used one (``eviction: lru``) or is refused (``eviction: refuse``).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ..core.kv_cache import KVCachePool


class RequestError(ValueError):
    """A request that cannot be served; the message says why. The node keeps serving."""


@dataclass
class Message:
    """One message of a conversation as the chat template sees it, with the keys of its images."""
    role: str
    text: str
    images: list = field(default_factory=list)  # keys into Session.images, in order

    def for_template(self) -> dict:
        """A string content, or (with images) a list of image items then the text, as transformers'
        processors pass it."""
        if not self.images:
            return {"role": self.role, "content": self.text}
        return {"role": self.role, "content": [{"type": "image"} for _ in self.images]
                + [{"type": "text", "text": self.text}]}


@dataclass(frozen=True)
class PastMessage:
    """A message of the conversation before a turn as a client holds it (OpenAI-style requests carry the
    whole conversation): ``role`` user or assistant, its text, and a user message's images (HxWx3 uint8)."""
    role: str
    text: str
    images: tuple = ()


@dataclass
class Session:
    """One conversation: its KV slot, what the slot holds, and the conversation to render."""
    id: str
    slot: int
    cached: int = 0  # valid positions in the slot
    tokens: list = field(default_factory=list)
    """What the slot holds, position by position: a token id, or (image key, row) for an image's rows."""
    messages: list[Message] = field(default_factory=list)
    system: str = ""  # the system prompt the session started with; "" = the template's default
    images: dict = field(default_factory=dict)  # image key -> its ImageFeatures (embeddings [tokens, H], ...)
    digests: dict = field(default_factory=dict)  # image key -> digest of the pixels it was encoded from
    turns: int = 0
    last_used: float = field(default_factory=time.monotonic)


class SessionManager:
    """Sessions by id, bounded by the KV pool; evicts the least recently used or refuses, as configured."""

    def __init__(self, pool: KVCachePool, eviction: str = "lru"):
        self.pool = pool
        self.eviction = eviction
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # LRU order: oldest first
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, sid: str) -> bool:
        return sid in self._sessions

    def peek(self, sid: str) -> Session | None:
        """The session, without touching its LRU position."""
        return self._sessions.get(sid)

    def ids(self) -> list[str]:
        return list(self._sessions)

    def get_or_create(self, sid: str) -> tuple[Session, str | None]:
        """Return (session, id of a session evicted to make room or None)."""
        s = self._sessions.get(sid)
        if s is not None:
            self._sessions.move_to_end(sid)
            s.last_used = time.monotonic()
            return s, None
        evicted = None
        slot = self.pool.try_acquire()
        if slot is None:
            if self.eviction == "refuse" or not self._sessions:
                raise RequestError(f"all {self.pool.num_slots} session slots are in use; end a session "
                                   f"(end_session) or wait")
            evicted, old = self._sessions.popitem(last=False)
            self.pool.release(old.slot)
            self.evicted += 1
            slot = self.pool.try_acquire()
        s = Session(sid, slot)
        self._sessions[sid] = s
        return s, evicted

    def end(self, sid: str) -> None:
        s = self._sessions.pop(sid, None)
        if s is None:
            raise RequestError(f"unknown session {sid!r}")
        self.pool.release(s.slot)

    def reset(self, s: Session) -> None:
        s.cached = 0
        s.tokens.clear()
        s.messages.clear()
        s.images.clear()
        s.digests.clear()
        s.system = ""
        s.turns = 0
