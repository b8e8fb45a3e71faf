"""Engines and functions the peer tests run in child processes (imported there by name from this folder)."""
from __future__ import annotations

import os
import signal
import sys
import time


class Steady:
    """An engine whose runs take a fixed time."""

    def __init__(self, vocab: int = 100, seconds: float = 0.001):
        self.vocab, self.seconds = vocab, seconds

    def once(self, ids, output_len: int):
        time.sleep(self.seconds)
        return self.seconds, self.seconds * (output_len - 1)

    def close(self) -> None:
        pass


class CrashesOnRun(Steady):
    """An engine that dies by SIGSEGV on its ``crash_at``-th run, after a line on stderr."""

    def __init__(self, crash_at: int = 1, vocab: int = 100):
        super().__init__(vocab)
        self.crash_at, self.runs = crash_at, 0

    def once(self, ids, output_len: int):
        self.runs += 1
        if self.runs >= self.crash_at:
            print(f"about to crash at run {self.runs}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGSEGV)
        return super().once(ids, output_len)


class FailsToLoad:
    def __init__(self, code: int = 3):
        print("cannot load the model", file=sys.stderr, flush=True)
        raise SystemExit(code)


class Hangs(Steady):
    def once(self, ids, output_len: int):
        time.sleep(60)


def answer(x: int) -> dict:
    print("noise on stdout goes to stderr")
    return {"twice": 2 * x}


def crash() -> None:
    print("crashing", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGSEGV)
