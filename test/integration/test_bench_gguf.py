"""The llama.cpp peers on a tiny GGUF file: bench.gguf's engine runs in a child process, is timed there, and the
build that ran is named; bench.quality's perplexity comes back from its child (skipped without
llama-cpp-python: `make llamacpp`)."""
from __future__ import annotations

import math

import pytest

pytest.importorskip("gguf")
pytest.importorskip("llama_cpp", reason="llama-cpp-python is missing: make llamacpp")

from synflux_ros.bench import gguf, llm  # noqa: E402

from gguf_files import write_gguf  # noqa: E402


def test_llama_cpp_runs_as_a_peer_and_its_build_is_named(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", "llama", seed=4)
    engine = gguf.llama_cpp_peer(path, 64, 1)
    try:
        assert engine.failure is None, engine.failure
        assert engine.vocab > 256
        rows = llm.measure([engine], [12], 5, 1, repeats=1)
    finally:
        engine.close()
    assert engine.proc.returncode == 0  # the child ended when its stdin closed
    (row,) = rows
    assert "failed" not in row and row["engine"] == "llama.cpp" and row["input_len"] == 12
    assert row["prefill_ms"] > 0 and row["decode_ms_per_token"] > 0
    build = gguf.llama_cpp_build_line()
    assert build.startswith("llama-cpp-python 0.3.36, ") and "CPU : " in build and "AMX_INT8 = 1" not in build


def test_quality_scores_perplexity_with_llama_cpp_in_a_child(tmp_path):
    from synflux_ros.bench.peer import call
    path = write_gguf(tmp_path / "tiny.gguf", "llama", seed=4)
    chunks = [list(range(3, 40)), list(range(50, 70))]

    def ppl(windows):
        return call("synflux_ros.bench.quality:perplexity_llama_cpp", {"path": path, "chunks": windows, "threads": 1})

    both, first, second = ppl(chunks), ppl(chunks[:1]), ppl(chunks[1:])
    assert isinstance(both, float) and 1.0 < both < float("inf")
    # each window is scored on its own: the whole is the token-weighted geometric mean of the parts
    n1, n2 = len(chunks[0]) - 1, len(chunks[1]) - 1
    assert both == pytest.approx(math.exp((n1 * math.log(first) + n2 * math.log(second)) / (n1 + n2)), rel=1e-5)
