"""Three-stage (or N-stage) threaded pipeline with bounded queues and newest-frame-wins admission.

::

    submit() -> [mailbox: 1 frame] -> stage 1 -> [queue] -> stage 2 -> [queue] -> stage 3 -> on_result

* Each stage runs in its own thread, so frame t+2 is in stage 1 while t+1 is in stage 2 and t in stage 3.
* The mailbox holds at most one waiting frame: a frame that arrives while stage 1 is busy replaces the
  waiting one, which is counted as dropped (control wants the newest image).
* Queues between stages are bounded: a slow stage back-pressures the ones before it.
* Every submitted item ends up counted exactly once as processed, dropped or failed
  (``submitted == processed + dropped + failed + in_flight``).
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

_STOP = object()
EMPTY = object()  # Mailbox.put's answer when nothing was waiting


class Mailbox:
    """A one-item slot where a new item replaces the waiting one."""

    def __init__(self):
        self._item = None
        self._has = False
        self._cond = threading.Condition()

    def put(self, item) -> Any:
        """Store ``item``; return the item it replaced, or ``EMPTY`` when nothing was waiting."""
        with self._cond:
            old = self._item if self._has else EMPTY
            self._item, self._has = item, True
            self._cond.notify()
            return old

    def get(self, timeout: float | None = None):
        with self._cond:
            if not self._cond.wait_for(lambda: self._has, timeout=timeout):
                raise queue.Empty
            item, self._item, self._has = self._item, None, False
            return item


@dataclass
class StageStats:
    """Timing of one pipeline stage (all calls, and the recent ones for medians)."""
    name: str
    count: int = 0
    total_ms: float = 0.0
    last_ms: float = 0.0
    busy_since: float = 0.0
    recent_ms: list[float] = field(default_factory=list)

    def record(self, ms: float, keep: int = 200):
        self.count += 1
        self.total_ms += ms
        self.last_ms = ms
        self.recent_ms.append(ms)
        if len(self.recent_ms) > keep:
            del self.recent_ms[: len(self.recent_ms) - keep]

    @property
    def mean_ms(self) -> float:
        return self.total_ms / self.count if self.count else 0.0


@dataclass(frozen=True)
class PipelineCounters:
    """Items submitted and how each ended; the rest are in flight."""
    submitted: int
    processed: int
    dropped: int
    failed: int

    @property
    def in_flight(self) -> int:
        return self.submitted - self.processed - self.dropped - self.failed


class Pipeline:
    """Run ``stages`` (name, fn(item) -> item) in threads; ``on_result(item)`` gets finished items.

    ``on_error(item, stage_name, exc)`` is called when a stage raises (the item is then counted as
    failed and the pipeline keeps running); ``on_discard(item)`` is called for dropped items and for
    items abandoned at stop, so owners can release resources held by them.
    """

    def __init__(self, stages: list[tuple[str, Callable]], on_result: Callable,
                 on_error: Callable | None = None, on_discard: Callable | None = None, queue_depth: int = 1):
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        self._stages = list(stages)
        self._on_result = on_result
        self._on_error = on_error
        self._on_discard = on_discard
        self._inbox = Mailbox()
        self._queues = [queue.Queue(maxsize=queue_depth) for _ in stages[1:]]
        self.stats = [StageStats(name) for name, _ in stages]
        self._lock = threading.Lock()
        self._submitted = self._processed = self._dropped = self._failed = 0
        self._threads: list[threading.Thread] = []
        self._stragglers: list[threading.Thread] = []
        self._running = False

    # ---------------------------------------------------------------- control
    def start(self) -> None:
        if self._running:
            return
        self._running = True
        self._threads = [threading.Thread(target=self._worker, args=(i,), name=f"stage-{name}", daemon=True)
                         for i, (name, _) in enumerate(self._stages)]
        for t in self._threads:
            t.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the stage threads. A frame waiting in the mailbox is dropped; frames already between
        stages are finished (the stop marker queues behind them) unless a thread misses ``timeout``, in
        which case what is left in the queues is dropped too. Returns False when a thread is still in a
        call after ``timeout``: its stage then still uses what it runs on (the executor), which the
        caller must not free (a device call cannot be cut short)."""
        if not self._running:
            return not self._stragglers
        self._running = False
        old = self._inbox.put(_STOP)
        if old is not EMPTY and old is not _STOP:
            self._discard(old)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for q in self._queues:
            while True:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP:
                    self._discard(item)
        self._stragglers = [t for t in self._threads if t.is_alive()]
        self._threads = []
        return not self._stragglers

    @property
    def busy(self) -> bool:
        """A stage thread outlived :meth:`stop` and is still in its call."""
        self._stragglers = [t for t in self._stragglers if t.is_alive()]
        return bool(self._stragglers)

    @property
    def running(self) -> bool:
        return self._running

    def submit(self, item) -> bool:
        """Offer a new item; returns False if it replaced a waiting one (which is counted as dropped)."""
        if not self._running:
            raise RuntimeError("pipeline is not running")
        with self._lock:
            self._submitted += 1
        old = self._inbox.put(item)
        if old is not EMPTY and old is not _STOP:
            self._discard(old)
            return False
        return True

    def counters(self) -> PipelineCounters:
        with self._lock:
            return PipelineCounters(self._submitted, self._processed, self._dropped, self._failed)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every submitted item is accounted for."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.counters().in_flight == 0:
                return True
            time.sleep(0.002)
        return self.counters().in_flight == 0

    # ---------------------------------------------------------------- internals
    def _discard(self, item) -> None:
        with self._lock:
            self._dropped += 1
        if self._on_discard is not None:
            self._on_discard(item)

    def _get(self, i: int):
        return self._inbox.get() if i == 0 else self._queues[i - 1].get()

    def _worker(self, i: int) -> None:
        name, fn = self._stages[i]
        stats = self.stats[i]
        last = i == len(self._stages) - 1
        while True:
            item = self._get(i)
            if item is _STOP:
                if not last:
                    self._queues[i].put(_STOP)
                return
            t0 = time.perf_counter()
            stats.busy_since = t0
            try:
                item = fn(item)
                stats.busy_since = 0.0
                stats.record((time.perf_counter() - t0) * 1e3)
                if last:
                    self._on_result(item)
            except Exception as exc:  # a bad frame must not kill the pipeline
                stats.busy_since = 0.0
                with self._lock:
                    self._failed += 1
                if self._on_error is not None:
                    self._on_error(item, name, exc)
                continue
            if last:
                with self._lock:
                    self._processed += 1
            else:
                self._queues[i].put(item)


def source_rate(stamps) -> tuple[float, float]:
    """The rate of a periodic source and the share of its items that arrived, from the source's own
    time stamps (seconds) of the items that did arrive: ``(rate_hz, delivery_ratio)``, ``(0.0, 1.0)``
    when there are too few.

    The period is the mean of the gaps near a typical one: start from the (lower) median gap (a lost item
    widens a gap and never narrows one, so while fewer than half of the gaps span a loss the median is a
    single period, and a burst of late-then-early stamps does not pull it down) and average the gaps
    within [0.5, 1.5] of it, a few times, so that jitter in the stamps averages out. The items expected
    over the stamps' span at that period give the delivery ratio; heavier loss is under-reported, never
    hidden (the ratio stays well below 1).
    """
    ts = sorted(float(t) for t in stamps)
    gaps = [b - a for a, b in zip(ts, ts[1:]) if b > a]
    if len(gaps) < 2:
        return 0.0, 1.0
    period = sorted(gaps)[(len(gaps) - 1) // 2]
    for _ in range(4):
        near = [g for g in gaps if 0.5 * period <= g <= 1.5 * period]
        if not near:
            break
        period = sum(near) / len(near)
    expected = (ts[-1] - ts[0]) / period + 1.0
    return 1.0 / period, min(1.0, len(ts) / expected)
