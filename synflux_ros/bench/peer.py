"""Peer engines (llama.cpp, onnxruntime-genai, transformers, LeRobot) run in processes of their own, so that
one that crashes loses its own rows and not the benchmark's table. The wire is JSON lines on the child's
stdout (and, for an engine, on its stdin); a failure (a signal, an exit status, a timeout, output that is not
JSON) becomes a :class:`PeerFailure` that names the cause and the child's last lines of stderr.

    python -m synflux_ros.bench.peer call MODULE:FUNCTION [KWARGS_JSON]   # prints the result as JSON
    python -m synflux_ros.bench.peer serve MODULE:CLASS [KWARGS_JSON]     # an engine over JSON lines
"""
from __future__ import annotations

import collections
import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading

STDERR_LINES = 8
"""How many of a failed child's last stderr lines its failure keeps."""
START_TIMEOUT_S = 900.0
RUN_TIMEOUT_S = 600.0


class PeerFailure(RuntimeError):
    """A child process that did not answer: ``cause`` (e.g. "killed by SIGSEGV (signal 11)", "exit 1",
    "timed out after 600 s") and ``stderr`` (its last lines)."""

    def __init__(self, what: str, cause: str, stderr: list[str] = ()):
        self.what, self.cause, self.stderr = what, cause, list(stderr)
        tail = "; stderr: " + " | ".join(self.stderr[-3:]) if self.stderr else ""
        super().__init__(f"{what} failed: {cause}{tail}")


def exit_cause(returncode: int | None) -> str:
    """A child's exit status in words: the signal that killed it, or its exit code."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return f"killed by {name} (signal {-returncode})"
    return f"exit {returncode}"


def failed_row(engine: str, failure: PeerFailure, **fields) -> dict:
    """The row standing for an engine that failed: its name, why, and the child's last stderr lines."""
    return {"engine": engine, **fields, "failed": failure.cause, "stderr_tail": failure.stderr}


def _last_json(what: str, stdout: str, stderr: list[str]):
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise PeerFailure(what, "no JSON on stdout" + (f" (last line: {lines[-1][:200]!r})" if lines else ""),
                          stderr) from None


def run_json(argv: list[str], what: str, timeout: float | None = START_TIMEOUT_S, env: dict | None = None):
    """Runs ``argv`` to its end and returns the JSON value of its last stdout line; :class:`PeerFailure`
    when it is killed, exits non-zero, runs past ``timeout`` seconds or prints no JSON."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise PeerFailure(what, f"timed out after {timeout:g} s", err.splitlines()[-STDERR_LINES:]) from None
    stderr = done.stderr.splitlines()[-STDERR_LINES:]
    if done.returncode:
        raise PeerFailure(what, exit_cause(done.returncode), stderr)
    return _last_json(what, done.stdout, stderr)


def _entry(kind: str, target: str, kwargs: dict | None) -> list[str]:
    return [sys.executable, "-m", "synflux_ros.bench.peer", kind, target, json.dumps(kwargs or {})]


def call(target: str, kwargs: dict | None = None, what: str | None = None, timeout: float | None = START_TIMEOUT_S,
         env: dict | None = None):
    """``MODULE:FUNCTION(**kwargs)`` in a fresh Python process; its JSON-able result (see :func:`run_json`)."""
    return run_json(_entry("call", target, kwargs), what or target, timeout, env)


class PeerEngine:
    """A benchmark engine (``once(ids, output_len) -> (prefill_s, decode_s)``, ``vocab``, ``close()``) made by
    ``MODULE:CLASS(**kwargs)`` in a child process. It never raises at construction: a child that fails to
    start leaves ``failure`` set, and ``once`` raises :class:`PeerFailure` when the child dies or stops
    answering."""

    def __init__(self, target: str, kwargs: dict | None = None, name: str | None = None,
                 start_timeout: float = START_TIMEOUT_S, run_timeout: float = RUN_TIMEOUT_S, env: dict | None = None):
        self.name = name or target.rpartition(":")[2]
        self.run_timeout = run_timeout
        self.failure: PeerFailure | None = None
        self.vocab = 0
        self._stderr: collections.deque = collections.deque(maxlen=STDERR_LINES)
        self._lines: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen(_entry("serve", target, kwargs), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1,
                                     env=None if env is None else {**os.environ, **env})
        self._pumps = [threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines.put, True), daemon=True),
                       threading.Thread(target=self._pump, args=(self.proc.stderr, self._stderr.append, False),
                                        daemon=True)]
        for t in self._pumps:
            t.start()
        try:
            self.vocab = int(self._answer(start_timeout)["vocab"])
        except PeerFailure as exc:
            self.failure = exc

    @staticmethod
    def _pump(stream, put, mark_end: bool) -> None:
        for line in stream:
            put(line.rstrip("\n"))
        if mark_end:
            put(None)

    def _fail(self, cause: str) -> PeerFailure:
        """Ends the child (``cause`` given: a timeout or bad output) or waits for it to end (its stdout
        closed: the cause is its exit status) and records the failure."""
        try:
            self.proc.wait(timeout=0 if cause else 10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        code = self.proc.wait()
        self._pumps[1].join(timeout=5)  # the child's last stderr lines
        self.failure = PeerFailure(self.name, cause or exit_cause(code), list(self._stderr))
        return self.failure

    def _answer(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise self._fail(f"timed out after {timeout:g} s") from None
        if line is None:
            raise self._fail("")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise self._fail(f"answered {line[:200]!r}, not JSON") from None

    def once(self, ids, output_len: int):
        if self.failure:
            raise self.failure
        try:
            self.proc.stdin.write(json.dumps({"ids": [int(i) for i in ids], "output_len": int(output_len)}) + "\n")
            self.proc.stdin.flush()
        except OSError:
            raise self._fail("") from None
        ans = self._answer(self.run_timeout)
        return float(ans["prefill_s"]), float(ans["decode_s"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


class FailedPeer:
    """Stands in the turns for a peer that could not be made (e.g. its model did not build): ``measure``
    gives it a row saying why."""
    vocab = 0

    def __init__(self, name: str, failure: PeerFailure):
        self.name, self.failure = name, failure

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------- the child
def _resolve(target: str):
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise SystemExit(f"{target!r}: expected MODULE:NAME")
    return getattr(importlib.import_module(module), attr)


def _serve(make, kwargs: dict, out) -> None:
    import numpy as np

    engine = make(**kwargs)
    try:
        out.write(json.dumps({"vocab": int(engine.vocab)}) + "\n")
        out.flush()
        for line in sys.stdin:
            req = json.loads(line)
            prefill, decode = engine.once(np.asarray(req["ids"], np.int64), int(req["output_len"]))
            out.write(json.dumps({"prefill_s": prefill, "decode_s": decode}) + "\n")
            out.flush()
    finally:
        engine.close()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3) or argv[0] not in ("call", "serve"):
        print("usage: python -m synflux_ros.bench.peer call|serve MODULE:NAME [KWARGS_JSON]", file=sys.stderr)
        return 2
    kwargs = json.loads(argv[2]) if len(argv) == 3 else {}
    # stdout carries only the answers: whatever the engine's libraries print goes to stderr
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    fn = _resolve(argv[1])
    if argv[0] == "serve":
        _serve(fn, kwargs, out)
    else:
        out.write(json.dumps(fn(**kwargs)) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
