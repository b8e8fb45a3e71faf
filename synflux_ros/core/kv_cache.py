"""KV-cache slot pool: a fixed number of device tensors ``[layers, 2, kv_heads, max_seq, head_dim]``.

All slots are allocated when the pool is created (load time). A slot is owned by one user at a time:
a chat session, or one frame travelling from the backbone to the action head.
"""
from __future__ import annotations

import threading
from collections import deque

import numpy as np

from .executor import DeviceTensor, Executor


class NoFreeSlotError(RuntimeError):
    """Every KV-cache slot is in use."""


class KVCachePool:
    """A fixed set of KV-cache slots allocated at load; a slot belongs to one user (session or frame) at a time."""

    def __init__(self, executor: Executor, num_slots: int, kv_shape: tuple[int, ...], dtype: str, name: str = "kv"):
        if num_slots < 1:
            raise ValueError(f"KV-cache pool needs at least one slot, got {num_slots}")
        self.kv_shape = tuple(kv_shape)
        self.dtype = dtype
        self.capacity = self.kv_shape[3]
        self._slots = [executor.alloc_tensor(f"{name}/slot{i}", kv_shape, dtype) for i in range(num_slots)]
        self._free = deque(range(num_slots))
        self._cond = threading.Condition()

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def num_free(self) -> int:
        with self._cond:
            return len(self._free)

    @property
    def slot_bytes(self) -> int:
        return int(np.prod(self.kv_shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def tensor(self, slot: int) -> DeviceTensor:
        return self._slots[slot]

    def acquire(self, timeout: float | None = None) -> int:
        """Take a free slot, waiting up to ``timeout`` seconds (None = forever)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout=timeout):
                raise NoFreeSlotError(f"no free KV-cache slot within {timeout} s ({self.num_slots} slots)")
            return self._free.popleft()

    def try_acquire(self) -> int | None:
        with self._cond:
            return self._free.popleft() if self._free else None

    def release(self, slot: int) -> None:
        """Give a slot back. Its contents are not cleared: users track their own valid length."""
        with self._cond:
            if slot in self._free or not 0 <= slot < len(self._slots):
                raise ValueError(f"KV-cache slot {slot} is not in use")
            self._free.append(slot)
            self._cond.notify()
