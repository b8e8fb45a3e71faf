"""Threaded pipeline: accounting, newest-frame-wins admission, ordering, failures and overlap."""
import queue
import threading
import time

import numpy as np
import pytest

from synflux_ros.core.pipeline import EMPTY, Mailbox, Pipeline, PipelineCounters


class Recorder:
    def __init__(self):
        self.results = []
        self.discarded = []
        self.errors = []
        self.lock = threading.Lock()

    def on_result(self, item):
        with self.lock:
            self.results.append(item)

    def on_discard(self, item):
        with self.lock:
            self.discarded.append(item)

    def on_error(self, item, stage, exc):
        with self.lock:
            self.errors.append((item, stage, exc))


def make(stages, rec, queue_depth=1):
    p = Pipeline(stages, rec.on_result, on_error=rec.on_error, on_discard=rec.on_discard,
                 queue_depth=queue_depth)
    p.start()
    return p


def gated_first_stage():
    """Stage fn that blocks on ``gate`` while processing and signals ``started`` for each item."""
    gate = threading.Event()
    started = threading.Semaphore(0)

    def fn(x):
        started.release()
        gate.wait(10)
        return x
    return fn, gate, started


def accepting_stage(sleep_s=0.0):
    """Stage fn that signals when it takes an item, so a submitter can wait for acceptance."""
    accepted = threading.Semaphore(0)

    def fn(x):
        accepted.release()
        if sleep_s:
            time.sleep(sleep_s)
        return x
    return fn, accepted


def submit_accepted(p, accepted, items):
    for i in items:
        assert p.submit(i) is True
        assert accepted.acquire(timeout=5)


# ------------------------------------------------------------------ mailbox

def test_mailbox_replaces_waiting_item():
    mb = Mailbox()
    assert mb.put(1) is EMPTY
    assert mb.put(2) == 1
    assert mb.get(timeout=0) == 2
    with pytest.raises(queue.Empty):
        mb.get(timeout=0.01)
    assert mb.put(3) is EMPTY


def test_counters_in_flight():
    assert PipelineCounters(10, 5, 3, 1).in_flight == 1


def test_construction_and_lifecycle_errors():
    with pytest.raises(ValueError, match="at least one stage"):
        Pipeline([], lambda x: None)
    p = Pipeline([("a", lambda x: x)], lambda x: None)
    with pytest.raises(RuntimeError, match="not running"):
        p.submit(1)
    p.start()
    assert p.running
    p.start()  # idempotent
    p.stop()
    assert not p.running
    p.stop()  # idempotent
    with pytest.raises(RuntimeError, match="not running"):
        p.submit(1)


# ------------------------------------------------------------------ admission and accounting

def test_newest_frame_wins():
    rec = Recorder()
    fn, gate, started = gated_first_stage()
    p = make([("a", fn), ("b", lambda x: x), ("c", lambda x: x)], rec)
    try:
        assert p.submit(0) is True
        assert started.acquire(timeout=5)  # stage a holds item 0
        assert p.submit(1) is True  # waits in the mailbox
        for i in range(2, 10):
            assert p.submit(i) is False  # replaces the waiting one
        gate.set()
        assert p.wait_idle(5)
        assert rec.results == [0, 9]
        assert rec.discarded == list(range(1, 9))
        c = p.counters()
        assert (c.submitted, c.processed, c.dropped, c.failed) == (10, 2, 8, 0)
    finally:
        gate.set()
        p.stop()


def test_every_item_accounted_with_a_slow_stage():
    rec = Recorder()
    fn, gate, started = gated_first_stage()

    def slow(x):
        time.sleep(0.01)
        return x
    p = make([("a", fn), ("b", slow), ("c", lambda x: x)], rec)
    try:
        p.submit(0)
        assert started.acquire(timeout=5)
        for i in range(1, 40):
            p.submit(i)
        gate.set()
        for i in range(40, 100):  # a second burst while stage b is the bottleneck
            p.submit(i)
            if i % 10 == 0:
                time.sleep(0.005)
        assert p.wait_idle(10)
        c = p.counters()
        assert c.submitted == 100
        assert c.submitted == c.processed + c.dropped + c.failed
        assert c.in_flight == 0
        assert c.failed == 0
        assert c.dropped >= 38  # at least the first burst minus the last one
        assert c.processed == len(rec.results) and c.dropped == len(rec.discarded)
        assert set(rec.results).isdisjoint(rec.discarded)
        assert sorted(rec.results + rec.discarded) == list(range(100))
        assert rec.results == sorted(rec.results)  # order preserved among processed
        assert rec.results[0] == 0 and rec.results[-1] == 99  # the newest frame is never lost
        assert p.stats[1].count == c.processed
    finally:
        gate.set()
        p.stop()


def test_no_drops_when_submitting_after_acceptance():
    rec = Recorder()
    fn, accepted = accepting_stage(0.002)
    p = make([("a", fn), ("b", lambda x: x * 10)], rec)
    try:
        submit_accepted(p, accepted, range(20))
        assert p.wait_idle(5)
        assert rec.results == [i * 10 for i in range(20)]
        assert p.counters() == PipelineCounters(20, 20, 0, 0)
        assert rec.discarded == []
    finally:
        p.stop()


# ------------------------------------------------------------------ failures

def test_failing_stage_counts_as_failed_and_pipeline_keeps_serving():
    rec = Recorder()
    fn, accepted = accepting_stage()

    def picky(x):
        if x % 3 == 1:
            raise ValueError(f"bad item {x}")
        return x
    p = make([("a", fn), ("b", picky), ("c", lambda x: x)], rec)
    try:
        submit_accepted(p, accepted, range(9))
        assert p.wait_idle(5)
        c = p.counters()
        assert (c.submitted, c.processed, c.dropped, c.failed) == (9, 6, 0, 3)
        assert rec.results == [0, 2, 3, 5, 6, 8]
        assert [(item, stage) for item, stage, _ in rec.errors] == [(1, "b"), (4, "b"), (7, "b")]
        assert all(isinstance(e, ValueError) and "bad item" in str(e) for _, _, e in rec.errors)
        submit_accepted(p, accepted, [9])
        assert p.wait_idle(5)
        assert rec.results[-1] == 9
        assert p.counters().processed == 7
    finally:
        p.stop()


def test_failure_in_first_stage_and_in_on_result():
    rec = Recorder()
    results = []

    def on_result(x):
        if x == 2:
            raise RuntimeError("consumer failed")
        results.append(x)

    def first(x):
        if x == 0:
            raise KeyError("first")
        return x
    p = Pipeline([("a", first), ("b", lambda x: x)], on_result, on_error=rec.on_error)
    p.start()
    try:
        for i in range(4):
            p.submit(i)
            assert p.wait_idle(5)
        c = p.counters()
        assert (c.submitted, c.processed, c.dropped, c.failed) == (4, 2, 0, 2)
        assert results == [1, 3]
        assert [(i, s) for i, s, _ in rec.errors] == [(0, "a"), (2, "b")]
    finally:
        p.stop()


# ------------------------------------------------------------------ overlap

def test_stages_overlap():
    rec = Recorder()
    fn, accepted = accepting_stage(0.05)

    def sleep50(x):
        time.sleep(0.05)
        return x
    p = make([("a", fn), ("b", sleep50), ("c", sleep50)], rec)
    try:
        t0 = time.perf_counter()
        submit_accepted(p, accepted, range(10))
        assert p.wait_idle(10)
        elapsed = time.perf_counter() - t0
        assert rec.results == list(range(10))
        assert p.counters().dropped == 0
        # Serial execution would take 10 * 150 ms; a pipeline needs about (10 + 2) * 50 ms.
        assert elapsed < 0.75 * 1.5
        assert [s.count for s in p.stats] == [10, 10, 10]
        assert all(s.mean_ms >= 50.0 for s in p.stats[1:])
    finally:
        p.stop()


# ------------------------------------------------------------------ stop

def test_stop_discards_items_left_between_stages():
    rec = Recorder()
    gate = threading.Event()
    a_started = threading.Semaphore(0)
    b_started = threading.Semaphore(0)

    def a(x):
        a_started.release()
        return x

    def b(x):
        b_started.release()
        gate.wait(10)
        return x
    p = make([("a", a), ("b", b), ("c", lambda x: x)], rec)
    try:
        p.submit(0)
        assert b_started.acquire(timeout=5)  # stage b is stuck on item 0
        p.submit(1)
        assert a_started.acquire(timeout=5)
        p.submit(2)
        assert a_started.acquire(timeout=5)  # stage a took item 2, so item 1 sits in the queue to b
        p.stop(timeout=0.2)
        assert 1 in rec.discarded
        assert p.counters().dropped == len(rec.discarded)
        assert 0 not in rec.discarded
    finally:
        gate.set()


def test_stop_discards_the_item_waiting_in_the_mailbox():
    rec = Recorder()
    fn, gate, started = gated_first_stage()
    p = make([("a", fn), ("b", lambda x: x)], rec)
    p.submit("A")
    assert started.acquire(timeout=5)
    p.submit("B")  # waits in the mailbox while stage a is busy
    threading.Timer(0.05, gate.set).start()
    p.stop()
    assert rec.results == ["A"]
    assert rec.discarded == ["B"]
    assert p.counters().in_flight == 0


def test_a_call_that_outlives_stop_is_reported():
    rec = Recorder()
    gate = threading.Event()
    started = threading.Semaphore(0)

    def stuck(x):
        started.release()
        gate.wait(10)
        return x
    p = make([("a", stuck)], rec)
    p.submit(0)
    assert started.acquire(timeout=5)
    assert p.stop(timeout=0.1) is False  # the stage is still in its call: its executor must not be freed
    assert p.busy
    gate.set()
    deadline = time.monotonic() + 5
    while p.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not p.busy


def test_none_items_are_accounted():
    rec = Recorder()
    fn, gate, started = gated_first_stage()
    p = make([("a", fn)], rec)
    try:
        p.submit("first")
        assert started.acquire(timeout=5)
        p.submit(None)
        p.submit("last")  # replaces the waiting None
        gate.set()
        assert p.wait_idle(1.0)
    finally:
        gate.set()
        p.stop()


def test_source_rate_from_the_stamps_of_what_arrived():
    from synflux_ros.core.pipeline import source_rate
    rng = np.random.default_rng(0)
    t = np.arange(300) / 30.0
    rate, ratio = source_rate(t)
    assert rate == pytest.approx(30.0) and ratio == pytest.approx(1.0)
    # every third frame lost on the way
    rate, ratio = source_rate([x for i, x in enumerate(t) if i % 3 != 2])
    assert rate == pytest.approx(30.0) and ratio == pytest.approx(2 / 3, abs=0.01)
    # stamps jittered by up to 30 % of a period, nothing lost: no loss reported
    rate, ratio = source_rate(t + rng.uniform(-0.3, 0.3, t.size) / 30.0)
    assert rate == pytest.approx(30.0, rel=0.03) and ratio > 0.97
    # random loss of 30 % with jitter
    keep = rng.random(t.size) > 0.3
    rate, ratio = source_rate((t + rng.uniform(-0.2, 0.2, t.size) / 30.0)[keep])
    assert rate == pytest.approx(30.0, rel=0.03) and ratio == pytest.approx(keep.mean(), abs=0.05)
    assert source_rate([1.0, 1.0]) == (0.0, 1.0)  # too few, or unstamped frames
