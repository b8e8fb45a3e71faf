"""The scoring behind `make check-quality` (synflux_ros/bench/quality.py), checked on a tiny GGUF model
against transformers reading the same file: teacher-forced perplexity through the decode graphs, the
windows, and the first-difference count of greedy replies. (The check itself runs on SmolLM2 and llama.cpp,
outside `make test`.)"""
from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

from synflux_ros.bench import quality  # noqa: E402
from synflux_ros.buildtool import export as build_tool  # noqa: E402

from gguf_files import base_yaml, hf_reference, write_gguf  # noqa: E402


def test_windows_cover_the_text_in_order():
    ids = list(range(600))
    w = quality.windows(ids, 256)
    assert [len(c) for c in w] == [256, 256, 88] and sum(w, []) == ids
    assert quality.windows(list(range(257)), 256) == [list(range(256))]  # a 1-token tail scores nothing


def test_first_difference():
    assert quality._first_difference([1, 2, 3], [1, 2, 3]) is None
    assert quality._first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert quality._first_difference([1, 2], [1, 2, 3]) == 2  # one stopped earlier


def test_teacher_forced_perplexity_equals_transformers(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", "llama", seed=4)
    out = str(tmp_path / "set")
    assert build_tool.main(["--config", base_yaml(tmp_path, (16,), (64,), 64), "--out", out,
                            "--from-gguf", path]) == 0
    rng = np.random.default_rng(0)
    chunks = [rng.integers(3, 300, 64).tolist(), rng.integers(3, 300, 20).tolist()]
    got = quality.perplexity_synflux(out, chunks)
    model, _ = hf_reference(path)
    nll, n = 0.0, 0
    with torch.no_grad():
        for c in chunks:
            logits = model(torch.tensor([c])).logits[0].double()
            logp = torch.log_softmax(logits, -1)
            nll -= float(sum(logp[i - 1, c[i]] for i in range(1, len(c))))
            n += len(c) - 1
    want = math.exp(nll / n)
    assert want > 1.0 and abs(got / want - 1) < 1e-4, (got, want)
