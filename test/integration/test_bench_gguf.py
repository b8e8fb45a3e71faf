"""bench.gguf's llama.cpp peer on a tiny GGUF file: it runs in a child process, is timed there, and the build
that ran is named (skipped without llama-cpp-python: `make llamacpp`)."""
from __future__ import annotations

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
