"""synflux-bench on a tiny checkpoint: the one-batch rows of a graph set, and the comparison with
transformers and onnxruntime-genai on the same checkpoint (their figures are not checked for speed,
only for being measured and reported)."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

from synflux_ros.bench import llm as bench  # noqa: E402

ROW_KEYS = {"engine", "input_len", "output_len", "prefill_ms", "decode_ms_per_token", "tokens_per_s", "bucket",
            "threads"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    import torch
    from checkpoints import write_tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("bench_ckpt")
    Qwen3ForCausalLM(Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, intermediate_size=128, vocab_size=512, max_position_embeddings=256,
                                 tie_word_embeddings=True)).save_pretrained(out)
    write_tokenizer(str(out))
    return str(out)


def test_graph_set_rows_follow_the_one_batch_semantics(ckpt, tmp_path, capsys):
    from synflux_ros.buildtool.export import build
    gdir = str(tmp_path / "graphs")
    build(bench.bench_graph_config(20, 6), gdir, hf_dir=ckpt, threads=1)  # prefill 20, decode span 32
    jsonl = tmp_path / "rows.jsonl"
    assert bench.main(["--graphs", gdir, "--input-len", "5", "--input-len", "20", "--output-len", "6",
                       "--threads", "1", "--jsonl", str(jsonl)]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert printed == rows and [r["input_len"] for r in rows] == [5, 20]
    for r in rows:
        assert set(r) == ROW_KEYS and r["engine"] == "synflux" and r["output_len"] == 6 and r["threads"] == 1
        assert r["prefill_ms"] > 0 and r["decode_ms_per_token"] > 0
        # 5 decode steps in the measured decode time
        assert r["tokens_per_s"] == pytest.approx(1e3 / r["decode_ms_per_token"], rel=0.01)
    # prompt 5 fits the smallest prefill bucket, prompt 20 the next; 26 tokens fit the 32-position span
    assert rows[0]["bucket"] == "prefill_20/decode_32..32" and rows[1]["bucket"] == "prefill_20/decode_32..32"
    with pytest.raises(ValueError, match=r"input 30 \+ output 6 exceed the graph set's context 32"):
        bench.bench_synflux(gdir, [30], 6, 1, repeats=0)


def test_compare_times_every_engine_on_one_checkpoint(ckpt, tmp_path, capsys):
    jsonl = tmp_path / "cmp.jsonl"
    assert bench.main(["--compare", "--hf", ckpt, "--work", str(tmp_path / "work"), "--input-len", "12",
                       "--output-len", "4", "--threads", "1", "--repeats", "2", "--jsonl", str(jsonl)]) == 0
    out = capsys.readouterr().out
    assert "best of 2" in out
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["engine"] for r in rows] == ["synflux", "synflux-prepacked", "transformers", "onnxruntime-genai"]
    for r in rows:
        assert set(r) - {"model"} == ROW_KEYS and r["input_len"] == 12 and r["decode_ms_per_token"] > 0
    assert "decode ratio at input 12: synflux/genai" in out and "synflux-prepacked/transformers" in out
    # both models were built from the same checkpoint, offline
    name = os.path.basename(ckpt)
    assert (tmp_path / "work" / f"{name}.genai" / "genai_config.json").is_file()
    assert (tmp_path / "work" / f"{name}.synflux" / "manifest.json").is_file()
    # the prepacked variant ran from the optimised copy of the graph set
    assert any((tmp_path / "work" / f"{name}.ort").rglob("manifest.json"))


def test_bandwidth_probe_samples_between_engine_runs(ckpt, tmp_path):
    from synflux_ros.buildtool.export import build
    gdir = str(tmp_path / "graphs")
    build(bench.bench_graph_config(8, 4), gdir, hf_dir=ckpt, threads=1)
    calls = []

    class Counting(bench.BandwidthProbe):
        def sample(self):
            calls.append(len(calls))
            super().sample()

    probe = Counting(1, mib=8, repeats=1)
    engine = bench.SynfluxEngine(gdir, 1)
    try:
        rows = bench.measure([engine], [8], 4, 1, repeats=2, probes=[probe])
    finally:
        engine.close()
    assert len(rows) == 1 and len(calls) == 3  # one sample per turn: warm-up + 2 repeats
    assert set(probe.best) == {"dot", "gemv", "bound"} and min(probe.best.values()) > 0
    assert probe.best["bound"] == max(probe.best["dot"], probe.best["gemv"])


def test_ttft_turns_reuse_the_cache_and_recompute_the_history(ckpt, tmp_path):
    from synflux_ros.buildtool.export import build
    gdir = str(tmp_path / "graphs")
    build(bench.bench_graph_config(64, 8, 256), gdir, hf_dir=ckpt, threads=1)
    tt = bench.ttft_turns(gdir, 1, turns=3, max_new=2, repeats=2)
    reuse, rec = tt["reuse"], tt["recompute"]
    assert len(reuse["ttft_ms"]) == len(rec["ttft_ms"]) == 3
    assert all(0 < t < float("inf") for t in reuse["ttft_ms"] + rec["ttft_ms"])
    # the same conversations; with reuse the history comes from the cache, without it is recomputed
    assert [p + c for p, c in zip(reuse["prompt_tokens"], reuse["cached_tokens"])] == rec["prompt_tokens"]
    assert min(reuse["prompt_tokens"]) > 0
    assert reuse["cached_tokens"][0] == 0 < reuse["cached_tokens"][1] < reuse["cached_tokens"][2]
    assert rec["cached_tokens"] == [0, 0, 0]


def test_graph_set_memory_loads_and_runs_every_graph_in_a_fresh_process(demo_graphs):
    gdir = str(demo_graphs["vlm_demo"])
    mem = bench.graph_set_memory(gdir, 1)
    assert set(mem) == {"rss_peak_growth", "rss_growth", "pss_growth", "pss_growth_loaded", "graphs", "weights_file"}
    with open(os.path.join(gdir, "manifest.json"), encoding="utf-8") as fh:
        assert mem["graphs"] == len(json.load(fh)["graphs"]) > 1
    assert mem["weights_file"] == os.path.getsize(os.path.join(gdir, "weights.bin"))
    assert mem["rss_peak_growth"] >= mem["rss_growth"] > 0 and mem["pss_growth"] > 0
