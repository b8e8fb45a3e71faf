"""Chat sessions: each owns a KV-cache slot holding everything said so far.

Sessions are bounded by the slot pool. When all slots are taken, a new session either evicts the least
recently used one (``eviction: lru``) or is refused (``eviction: refuse``).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..core.kv_cache import KVCachePool


class RequestError(ValueError):
    """A request that cannot be served; the message says why. The node keeps serving."""


@dataclass
class Segment:
    """Part of a conversation: text token ids, or an image's vision embeddings (for recompute)."""

    ids: list[int]
    image_embeds: np.ndarray | None = None


@dataclass
class Session:
    """One conversation: its KV slot, what the slot holds and what is still to prefill."""
    id: str
    slot: int
    cached: int = 0  # valid positions in the slot
    history: list[Segment] = field(default_factory=list)  # everything fed to the model so far
    pending: list[int] = field(default_factory=list)  # tokens to feed before the next user turn
    turns: int = 0
    last_used: float = field(default_factory=time.monotonic)

    @property
    def history_tokens(self) -> int:
        return sum(len(s.ids) for s in self.history)


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
        s.history.clear()
        s.pending.clear()
        s.turns = 0
