"""Static memory pool: every device buffer is allocated once at load time.

After :meth:`StaticMemoryPool.freeze` the pool refuses new allocations, so a steady-state allocation
(which on an accelerator means a latency spike or an out-of-memory error mid-mission) fails loudly in
tests instead of happening silently on the robot.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable


class PoolFrozenError(RuntimeError):
    """A device allocation was requested after the pool was frozen."""


@dataclass(frozen=True)
class Allocation:
    """One named buffer of the static pool."""
    name: str
    handle: object
    nbytes: int


class StaticMemoryPool:
    """Tracks every device allocation of one executor.

    ``alloc_fn(nbytes) -> handle`` is the backend's ``_alloc_device`` hook.
    """

    def __init__(self, alloc_fn: Callable[[int], object], free_fn: Callable[[object], None] | None = None):
        self._alloc_fn = alloc_fn
        self._free_fn = free_fn
        self._allocs: dict[str, Allocation] = {}
        self._frozen = False
        self._lock = threading.Lock()

    def allocate(self, name: str, nbytes: int) -> object:
        with self._lock:
            if self._frozen:
                raise PoolFrozenError(
                    f"device allocation of {nbytes} bytes for {name!r} after load: the steady state must not "
                    f"allocate (allocate it at load time)")
            if name in self._allocs:
                raise ValueError(f"device buffer {name!r} is already allocated")
            handle = self._alloc_fn(max(int(nbytes), 1))
            self._allocs[name] = Allocation(name, handle, int(nbytes))
            return handle

    def freeze(self) -> None:
        self._frozen = True

    @property
    def frozen(self) -> bool:
        return self._frozen

    @property
    def allocated_bytes(self) -> int:
        return sum(a.nbytes for a in self._allocs.values())

    @property
    def num_allocations(self) -> int:
        return len(self._allocs)

    def breakdown(self) -> dict[str, int]:
        return {a.name: a.nbytes for a in self._allocs.values()}

    def release_all(self) -> None:
        with self._lock:
            if self._free_fn is not None:
                for a in self._allocs.values():
                    self._free_fn(a.handle)
            self._allocs.clear()
            self._frozen = False
