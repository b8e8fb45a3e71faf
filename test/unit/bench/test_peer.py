"""Peers in child processes (synflux_ros/bench/peer.py): a peer that crashes, exits, hangs or never starts
loses its own row, named with the cause and its last stderr lines, and the table keeps the others."""
from __future__ import annotations

import os

import pytest

from synflux_ros.bench import gguf, llm
from synflux_ros.bench.peer import FailedPeer, PeerEngine, PeerFailure, call

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, (HERE, os.environ.get("PYTHONPATH"))))}
SEGV = "killed by SIGSEGV (signal 11)"


def peer(cls: str, name: str, **kwargs) -> PeerEngine:
    return PeerEngine(f"peers:{cls}", kwargs, name, start_timeout=60, run_timeout=60, env=ENV)


def test_call_returns_the_json_of_a_function_in_a_child_and_its_prints_go_to_stderr():
    assert call("peers:answer", {"x": 21}, env=ENV) == {"twice": 42}


def test_call_names_the_signal_and_the_last_stderr_lines():
    with pytest.raises(PeerFailure) as err:
        call("peers:crash", what="the crashing peer", env=ENV)
    assert err.value.cause == SEGV and err.value.stderr[-1] == "crashing"
    assert str(err.value).startswith(f"the crashing peer failed: {SEGV}; stderr: crashing")


def test_a_peer_that_cannot_start_is_a_failure_not_an_exception():
    e = peer("FailsToLoad", "llama.cpp", code=3)
    assert e.failure.cause == "exit 3" and "cannot load the model" in e.failure.stderr
    with pytest.raises(PeerFailure):
        e.once([1, 2], 4)
    e.close()


def test_a_peer_that_stops_answering_is_killed_after_the_timeout():
    e = PeerEngine("peers:Hangs", {}, "slow", start_timeout=60, run_timeout=1, env=ENV)
    with pytest.raises(PeerFailure, match="timed out after 1 s"):
        e.once([1, 2], 4)
    assert e.proc.poll() is not None
    e.close()


def test_a_crashing_peer_loses_its_own_rows_and_the_table_prints_the_others(capsys):
    engines = [peer("Steady", "synflux-int4", seconds=0.002), peer("Steady", "onnxruntime-genai-fp32"),
               peer("CrashesOnRun", "llama.cpp", crash_at=2),  # the warm-up runs, the first timed run crashes
               FailedPeer("onnxruntime-genai-int4", PeerFailure("onnxruntime-genai model builder", "exit 1"))]
    try:
        rows = llm.measure(engines, [8], 4, 1, repeats=2)
    finally:
        for e in engines:
            e.close()
    assert [r["engine"] for r in rows] == ["synflux-int4", "onnxruntime-genai-fp32", "llama.cpp",
                                           "onnxruntime-genai-int4"]
    good, crashed, unbuilt = rows[:2], rows[2], rows[3]
    for r in good:
        assert "failed" not in r and r["decode_ms_per_token"] > 0 and r["input_len"] == 8
    assert good[0]["prefill_ms"] >= 2.0  # the child's own timing came back
    assert crashed["failed"] == SEGV and crashed["stderr_tail"][-1] == "about to crash at run 2"
    assert "decode_ms_per_token" not in crashed and crashed["input_len"] == 8
    assert unbuilt["failed"] == "exit 1"
    assert llm.decode_ms(rows).keys() == {"synflux-int4", "onnxruntime-genai-fp32"}

    gguf.table("the table:", rows)
    tables = (("session pools", rows),)
    met = [gguf.speed_target(tables, "synflux-int4", "llama.cpp", "int4 decode vs llama.cpp"),
           gguf.speed_target(tables, "synflux-int4", "onnxruntime-genai-fp32", "int4 vs genai")]
    print(llm.count_targets(met))
    out = capsys.readouterr().out
    assert met[0] is None and met[1] is not None
    lines = out.splitlines()
    assert any(line.split()[0] == "synflux-int4" and "FAILED" not in line for line in lines[2:4])
    assert f"llama.cpp                    FAILED: {SEGV}" in out and "| about to crash at run 2" in out
    assert "onnxruntime-genai-int4       FAILED: exit 1" in out
    assert (f"int4 decode vs llama.cpp: - (target <= 1.0x, the best) could not be judged (llama.cpp failed in the "
            f"session pools table: {SEGV})") in out
    assert "1 could not be judged (a peer failed)" in out and f"{int(met[1])} of 2 targets met" in out
