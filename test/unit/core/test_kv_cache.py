"""KV-cache slot pool: allocation, acquire/release, timeouts and thread safety; session manager."""
import threading
import time

import numpy as np
import pytest

from synflux_ros.backends.mock.executor import MockExecutor
from synflux_ros.core.executor import DeviceTensor
from synflux_ros.core.kv_cache import KVCachePool, NoFreeSlotError
from synflux_ros.core.memory import PoolFrozenError
from synflux_ros.runtimes.sessions import Message, RequestError, SessionManager

SHAPE = (2, 2, 1, 16, 4)


def make_pool(n=3, dtype="float32", freeze=True):
    ex = MockExecutor([]).load()
    pool = KVCachePool(ex, n, SHAPE, dtype, name="kv")
    if freeze:
        ex.freeze()
    return ex, pool


def test_slots_are_allocated_up_front_and_zeroed():
    ex, pool = make_pool(3, "float16")
    assert pool.num_slots == 3 and pool.num_free == 3
    assert pool.capacity == 16
    assert pool.slot_bytes == int(np.prod(SHAPE)) * 2
    assert ex.device_bytes == 3 * pool.slot_bytes
    assert sorted(ex.pool.breakdown()) == ["kv/slot0", "kv/slot1", "kv/slot2"]
    for i in range(3):
        t = pool.tensor(i)
        assert isinstance(t, DeviceTensor)
        assert t.shape == SHAPE and t.dtype == "float16"
        assert not ex.read(t).any()
    assert len({pool.tensor(i).handle for i in range(3)}) == 3


def test_slots_are_independent_buffers():
    ex, pool = make_pool(2)
    ex.write(pool.tensor(0), np.s_[:, :, :, 3:5], np.ones((2, 2, 1, 2, 4)))
    assert ex.read(pool.tensor(0))[:, :, :, 3:5].all()
    assert not ex.read(pool.tensor(0))[:, :, :, 5:].any()
    assert not ex.read(pool.tensor(1)).any()


def test_pool_needs_a_slot_and_respects_freeze():
    ex = MockExecutor([]).load()
    with pytest.raises(ValueError, match="at least one slot"):
        KVCachePool(ex, 0, SHAPE, "float32")
    ex.freeze()
    with pytest.raises(PoolFrozenError):
        KVCachePool(ex, 1, SHAPE, "float32")


def test_acquire_release_cycle():
    _, pool = make_pool(3)
    got = [pool.acquire(timeout=0) for _ in range(3)]
    assert sorted(got) == [0, 1, 2]
    assert pool.num_free == 0
    assert pool.try_acquire() is None
    pool.release(got[1])
    assert pool.num_free == 1
    assert pool.try_acquire() == got[1]
    for s in got:
        pool.release(s)
    assert pool.num_free == 3


def test_no_free_slot_on_timeout():
    _, pool = make_pool(1)
    pool.acquire()
    t0 = time.monotonic()
    with pytest.raises(NoFreeSlotError, match="1 slots"):
        pool.acquire(timeout=0.05)
    assert time.monotonic() - t0 >= 0.05
    with pytest.raises(NoFreeSlotError):
        pool.acquire(timeout=0)


def test_acquire_waits_for_a_release():
    _, pool = make_pool(1)
    s = pool.acquire()
    result = []
    t = threading.Thread(target=lambda: result.append(pool.acquire(timeout=10)))
    t.start()
    time.sleep(0.02)
    assert not result  # still waiting
    pool.release(s)
    t.join(10)
    assert result == [s]


def test_double_release_and_bad_slot():
    _, pool = make_pool(2)
    s = pool.acquire()
    pool.release(s)
    with pytest.raises(ValueError, match=f"slot {s} is not in use"):
        pool.release(s)
    with pytest.raises(ValueError, match="not in use"):
        pool.release(5)
    with pytest.raises(ValueError, match="not in use"):
        pool.release(-1)
    assert pool.num_free == 2


def test_acquire_release_is_thread_safe():
    _, pool = make_pool(3)
    held = set()
    held_lock = threading.Lock()
    errors = []
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        for _ in range(300):
            s = pool.acquire(timeout=10)
            with held_lock:
                if s in held:
                    errors.append(f"slot {s} handed out twice")
                held.add(s)
            with held_lock:
                held.discard(s)
            pool.release(s)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert pool.num_free == 3
    assert sorted(pool.try_acquire() for _ in range(3)) == [0, 1, 2]


def test_concurrent_holders_never_exceed_capacity():
    _, pool = make_pool(2)
    active = [0]
    peak = [0]
    lock = threading.Lock()

    def worker():
        for _ in range(50):
            s = pool.acquire(timeout=10)
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            with lock:
                active[0] -= 1
            pool.release(s)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert peak[0] <= 2
    assert pool.num_free == 2


# ------------------------------------------------------------------ session manager

def test_session_manager_lru_and_refuse():
    _, pool = make_pool(2)
    sm = SessionManager(pool, "lru")
    a, ev = sm.get_or_create("a")
    assert ev is None and len(sm) == 1 and "a" in sm
    b, _ = sm.get_or_create("b")
    assert {a.slot, b.slot} == {0, 1}
    sm.get_or_create("a")  # a becomes the most recent
    c, ev = sm.get_or_create("c")
    assert ev == "b" and sm.evicted == 1
    assert c.slot == b.slot
    assert sm.ids() == ["a", "c"]
    sm.end("a")
    assert pool.num_free == 1 and "a" not in sm
    with pytest.raises(RequestError, match="unknown session 'a'"):
        sm.end("a")

    _, pool2 = make_pool(1)
    sm2 = SessionManager(pool2, "refuse")
    sm2.get_or_create("x")
    with pytest.raises(RequestError, match="1 session slots are in use"):
        sm2.get_or_create("y")
    assert sm2.peek("x") is not None and sm2.peek("y") is None


def test_session_reset_clears_state():
    _, pool = make_pool(1)
    sm = SessionManager(pool)
    s, _ = sm.get_or_create("a")
    s.cached, s.turns, s.tokens, s.system = 3, 2, [1, 2, 3], "be brief"
    s.messages.append(Message("user", "hi", [(0, 0)]))
    s.images[(0, 0)] = "embeds"
    sm.reset(s)
    assert (s.cached, s.turns, s.tokens, s.messages, s.images, s.system) == (0, 0, [], [], {}, "")
    assert s.slot == 0


def test_fresh_slots_are_written_once_at_most():
    """A backend whose allocations come zero-filled is not asked to clear them again (a 7B model's KV slot
    is gigabytes); one whose allocations are not gets each slot cleared exactly once."""
    writes = []

    class Recording(MockExecutor):
        def _h2d(self, data, device_buffer):
            writes.append(data.nbytes)
            super()._h2d(data, device_buffer)

        def _zero_device(self, device_buffer, shape, dtype):
            writes.append(("zero", shape))
            super()._zero_device(device_buffer, shape, dtype)

    ex = Recording([]).load()
    KVCachePool(ex, 2, SHAPE, "float32")
    assert writes == []

    class Dirty(Recording):
        alloc_is_zeroed = False

        def _alloc_device(self, nbytes):
            handle = super()._alloc_device(nbytes)
            self._mem[handle][:] = 0xAB  # garbage, as device memory may hold
            return handle

    ex = Dirty([]).load()
    pool = KVCachePool(ex, 2, SHAPE, "float32")
    assert writes == [("zero", SHAPE), ("zero", SHAPE)]
    assert not ex.read(pool.tensor(0)).any() and not ex.read(pool.tensor(1)).any()
