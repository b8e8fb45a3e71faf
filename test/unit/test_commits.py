"""Commit messages read as a log (CONTRIBUTING.md): a subject of at most 72 characters and, for every commit
but a merge, a body that says why. Checked from the commit that set the rule on; skipped outside a git checkout
of this repository (an installed copy, a shallow clone without that commit)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SINCE = "7083d29"  # the rule holds for the commits after this one
FIELD, RECORD = "\x1f", "\x1e"


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=60)


def test_commit_subjects_fit_72_characters_and_say_why_in_the_body():
    if shutil.which("git") is None or git("cat-file", "-e", f"{SINCE}^{{commit}}").returncode != 0:
        pytest.skip(f"not a git checkout holding {SINCE}")
    log = git("log", f"--format=%h %p{FIELD}%s{FIELD}%b{RECORD}", f"{SINCE}..HEAD").stdout
    problems = []
    for entry in filter(str.strip, log.split(RECORD)):
        head, subject, body = entry.strip("\n").split(FIELD)
        sha, *parents = head.split()
        if len(subject) > 72:
            problems.append(f"{sha}: subject of {len(subject)} characters: {subject!r}")
        if len(parents) < 2 and not body.strip():
            problems.append(f"{sha}: no body saying why: {subject!r}")
    assert not problems, "\n".join(problems)
