"""How a model process shares the robot computer with the others on it (docs/colocation.md).

* :func:`parse_cpus` / :func:`parse_scheduling`: the ``cpus`` and ``*_scheduling`` node parameters, checked.
* :func:`apply_to_threads`: a core set and a Linux scheduling policy on every thread of the process (threads
  made later inherit them from their creator) or on one thread (the control loop's).
* :class:`ThreadTimes`: what the threads spent running and waiting for a core (``/proc/self/task/*/schedstat``),
  the contention an integrator reads in ``/diagnostics``.
* :class:`Arbiter`: an accelerator arbiter between processes (two ``flock`` files): the control model (the VLA)
  holds it while a frame is in flight; a background model (the chat) waits at its graph boundaries while it is
  held, so a frame waits for at most the one background graph call that was running when it came.

Linux only (``os.sched_*`` and ``/proc``); elsewhere :func:`apply_to_threads` says so and changes nothing.
"""
from __future__ import annotations

import fcntl
import os
import threading
import time
from dataclasses import dataclass

POLICIES = ("normal", "batch", "idle", "fifo", "rr")
"""``normal``: the default time sharing (with an optional nice value); ``batch``: time sharing that wakes no
other thread early; ``idle``: runs only on cores nothing else wants (needs no privilege); ``fifo``/``rr``:
real-time priority 1-99 (needs CAP_SYS_NICE or an RLIMIT_RTPRIO of at least the priority)."""


@dataclass(frozen=True)
class Scheduling:
    """A Linux scheduling policy and its number: the nice value (-20..19) for normal/batch, the real-time
    priority (1..99) for fifo/rr, 0 for idle."""
    policy: str = "normal"
    priority: int = 0

    @property
    def default(self) -> bool:
        return self.policy == "normal" and self.priority == 0

    def __str__(self) -> str:
        return self.policy if self.priority == 0 else f"{self.policy}:{self.priority}"


def parse_scheduling(text: str) -> Scheduling:
    """``"normal"``, ``"normal:5"`` (nice 5), ``"batch"``, ``"idle"``, ``"fifo:80"``, ``"rr:50"``; ValueError
    naming what is wrong."""
    policy, _, number = str(text).strip().lower().partition(":")
    policy = policy or "normal"
    if policy not in POLICIES:
        raise ValueError(f"{text!r}: the policy must be one of {', '.join(POLICIES)} (e.g. 'fifo:80', 'normal:5')")
    try:
        priority = int(number) if number else 0
    except ValueError:
        raise ValueError(f"{text!r}: {number!r} after the ':' is not an integer") from None
    if policy in ("fifo", "rr") and not 1 <= priority <= 99:
        raise ValueError(f"{text!r}: a real-time policy needs a priority 1..99 (e.g. '{policy}:80')")
    if policy in ("normal", "batch") and not -20 <= priority <= 19:
        raise ValueError(f"{text!r}: a nice value is -20..19")
    if policy == "idle" and priority:
        raise ValueError(f"{text!r}: the idle policy takes no number")
    return Scheduling(policy, priority)


def parse_cpus(text) -> frozenset[int]:
    """``"2-5"``, ``"0,2,4-7"`` (also a core number or a list of them, as a YAML file may give); ``""`` is the
    empty set (every core the process may use). ValueError naming a bad item or a core this machine lacks."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a core set")
    if isinstance(text, int):
        text = str(text)
    elif isinstance(text, (list, tuple)):
        text = ",".join(map(str, text))
    cpus: set[int] = set()
    for item in str(text).replace(" ", "").split(","):
        if not item:
            continue
        lo, dash, hi = item.partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"{text!r}: {item!r} is not a core number or a range like '2-5'") from None
        if first < 0 or last < first:
            raise ValueError(f"{text!r}: {item!r} is not a range of core numbers")
        cpus.update(range(first, last + 1))
    online = os.cpu_count() or 1
    missing = sorted(c for c in cpus if c >= online)
    if missing:
        raise ValueError(f"{text!r}: no core {', '.join(map(str, missing))} on this machine (cores 0-{online - 1})")
    return frozenset(cpus)


def thread_ids() -> list[int]:
    """The kernel thread ids of this process's threads."""
    try:
        return sorted(int(t) for t in os.listdir("/proc/self/task"))
    except OSError:
        return [threading.get_native_id()]


_POLICY_IDS = {"normal": "SCHED_OTHER", "batch": "SCHED_BATCH", "idle": "SCHED_IDLE", "fifo": "SCHED_FIFO",
               "rr": "SCHED_RR"}


def _set(tid: int, sched: Scheduling | None, cpus: frozenset[int]) -> None:
    if cpus:
        os.sched_setaffinity(tid, cpus)
    if sched is not None:
        policy = getattr(os, _POLICY_IDS[sched.policy])
        rt = sched.policy in ("fifo", "rr")
        os.sched_setscheduler(tid, policy, os.sched_param(sched.priority if rt else 0))
        if not rt:
            os.setpriority(os.PRIO_PROCESS, tid, sched.priority)  # per thread on Linux


def apply_to_threads(sched: Scheduling | None, cpus: frozenset[int] = frozenset(),
                     tids: list[int] | None = None) -> str | None:
    """Give ``tids`` (default: every thread of the process) the core set ``cpus`` (empty: leave) and the policy
    ``sched`` (None: leave). None when it was applied; else the reason it was not, naming what the process
    lacks, for the caller to warn with (the threads keep what they had)."""
    if not hasattr(os, "sched_setscheduler"):
        return "thread scheduling and core sets need Linux"
    failed = []
    for tid in thread_ids() if tids is None else tids:
        try:
            _set(tid, sched, cpus)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except PermissionError:
            need = ("CAP_SYS_NICE, or an RLIMIT_RTPRIO of at least "
                    f"{sched.priority} (e.g. 'rtprio {sched.priority}' in /etc/security/limits.conf, or the "
                    "container's --cap-add=SYS_NICE / --ulimit rtprio)") if sched and sched.policy in ("fifo", "rr") \
                else "CAP_SYS_NICE (a nice value below the current one needs it too)"
            return f"not permitted: {sched} needs {need}"
        except OSError as exc:
            failed.append(f"thread {tid}: {exc}")
    return "; ".join(failed) or None


class ThreadTimes:
    """Seconds a set of threads ran and waited runnable for a core, from ``/proc/self/task/<tid>/schedstat``
    (kernels with CONFIG_SCHED_INFO); threads that ended keep what they had counted."""

    def __init__(self):
        self._done = [0, 0]  # nanoseconds, as the kernel counts: sums of integers never go back
        self._last: dict[int, tuple[int, int]] = {}
        self.available = os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat")

    def sample(self, tids: list[int] | None = None) -> tuple[float, float]:
        """(seconds running, seconds waiting for a core) of ``tids`` (default: every thread) so far."""
        seen = {}
        for tid in thread_ids() if tids is None else tids:
            try:
                with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as fh:
                    run_ns, wait_ns, _ = fh.read().split()
            except (OSError, ValueError):
                continue
            seen[tid] = (int(run_ns), int(wait_ns))
        for tid, (run, wait) in self._last.items():
            if tid not in seen:
                self._done[0] += run
                self._done[1] += wait
        self._last = seen
        return ((self._done[0] + sum(r for r, _ in seen.values())) * 1e-9,
                (self._done[1] + sum(w for _, w in seen.values())) * 1e-9)


ROLES = ("control", "background")


class Arbiter:
    """The accelerator arbiter between the processes that name the same ``path`` (three files, ``path`` +
    ``.turn``, ``.run`` and ``.calls``, made when missing).

    A ``control`` process (the VLA) calls :meth:`enter` when a frame starts and :meth:`leave` when it is done;
    frames may overlap (pipelined), the arbiter is held from the first enter to the last leave. While held,
    a ``background`` process (the chat) waits in :meth:`gate` (around each graph call) before its next call;
    with ``exclusive`` the control side also waits, at its first enter, for the background calls running
    then (on a GPU, where a call cannot be preempted; on a CPU the kernel preempts an ``idle`` chat anyway).

    The order holds through the kernel's ``flock``: a background call takes ``.turn`` shared only for the
    moment it takes ``.run`` shared, so a waiting control side is never passed by more than the calls that
    were already running. Locks die with their process: a crashed holder frees the other side.

    ``.calls`` holds the count of background calls started; the control side reads it before and after its
    wait, so :attr:`max_passed` is the most calls that started while one frame waited (at most one per
    background process: the one taking its locks at that instant)."""

    def __init__(self, path: str, role: str, exclusive: bool = True):
        if role not in ROLES:
            raise ValueError(f"arbiter role {role!r}: one of {', '.join(ROLES)}")
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise ValueError(f"accelerator arbiter {path!r}: no directory {directory!r}")
        self.path, self.role, self.exclusive = path, role, exclusive
        self._turn = os.open(path + ".turn", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        self._run = os.open(path + ".run", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        self._count = os.open(path + ".calls", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        self._cond = threading.Condition()  # the depth of frames in flight and who is taking the locks
        self._depth = 0
        self._acquiring = False
        self._calls = threading.Lock()
        self.waits = 0  # calls or frames that found the other side in the way
        self.wait_s = 0.0  # the time they waited
        self.max_wait_s = 0.0
        self.max_passed = 0  # control: the most background calls that started while one frame waited
        self.held_s = 0.0  # control: the time the arbiter was held
        self._held_since = 0.0

    def _waited(self, t0: float) -> None:
        dt = time.perf_counter() - t0
        if dt > 50e-6:
            self.waits += 1
            self.wait_s += dt
            self.max_wait_s = max(self.max_wait_s, dt)

    # ------------------------------------------------------------------ control side
    def enter(self) -> None:
        """A frame starts (control side); blocks only for the first frame in flight."""
        with self._cond:
            while self._acquiring:
                self._cond.wait()
            self._depth += 1
            if self._depth > 1:
                return
            self._acquiring = True
        t0 = time.perf_counter()
        try:
            calls = self._calls_started()
            fcntl.flock(self._turn, fcntl.LOCK_EX)
            if self.exclusive:
                fcntl.flock(self._run, fcntl.LOCK_EX)
            self.max_passed = max(self.max_passed, self._calls_started() - calls)
        finally:
            with self._cond:
                self._acquiring = False
                self._held_since = time.perf_counter()
                self._cond.notify_all()
        self._waited(t0)

    def leave(self) -> None:
        """A frame is done (published, failed or dropped)."""
        with self._cond:
            if self._depth == 0:
                raise RuntimeError("arbiter: leave() without enter()")
            self._depth -= 1
            if self._depth:
                return
            if self.exclusive:
                fcntl.flock(self._run, fcntl.LOCK_UN)
            fcntl.flock(self._turn, fcntl.LOCK_UN)
            self.held_s += time.perf_counter() - self._held_since

    # ------------------------------------------------------------------ background side
    def gate(self) -> "_Gate":
        """``with arbiter.gate(): run_graph()`` (background side)."""
        return _Gate(self)

    def _begin_call(self) -> None:
        self._calls.acquire()  # a flock is the open file's, not the thread's: one call of the process at a time
        t0 = time.perf_counter()
        fcntl.flock(self._turn, fcntl.LOCK_SH)
        try:
            fcntl.flock(self._run, fcntl.LOCK_SH)
            self._count_call()
        finally:
            fcntl.flock(self._turn, fcntl.LOCK_UN)
        self._waited(t0)

    def _read_count(self) -> int:
        return int.from_bytes(os.pread(self._count, 8, 0).ljust(8, b"\0"), "little")

    def _calls_started(self) -> int:
        fcntl.flock(self._count, fcntl.LOCK_SH)
        try:
            return self._read_count()
        finally:
            fcntl.flock(self._count, fcntl.LOCK_UN)

    def _count_call(self) -> None:
        fcntl.flock(self._count, fcntl.LOCK_EX)  # background processes count one after the other
        try:
            os.pwrite(self._count, ((self._read_count() + 1) % (1 << 63)).to_bytes(8, "little"), 0)
        finally:
            fcntl.flock(self._count, fcntl.LOCK_UN)

    def _end_call(self) -> None:
        fcntl.flock(self._run, fcntl.LOCK_UN)
        self._calls.release()

    def close(self) -> None:
        for fd in (self._turn, self._run, self._count):
            try:
                os.close(fd)
            except OSError:
                pass

    def stats(self) -> dict:
        return {"arbiter_waits": self.waits, "arbiter_wait_ms": self.wait_s * 1e3,
                "arbiter_max_wait_ms": self.max_wait_s * 1e3}


class _Gate:
    __slots__ = ("_arbiter",)

    def __init__(self, arbiter: Arbiter):
        self._arbiter = arbiter

    def __enter__(self):
        self._arbiter._begin_call()

    def __exit__(self, *exc):
        self._arbiter._end_call()
