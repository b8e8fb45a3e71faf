"""The onnxruntime executor's ``fusions`` option (synflux_ros/backends/ort_fusions.py): decoder graphs built by
synflux-build, rewritten at load into ORT's fused kernels, compute what the portable graphs compute."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import onnx  # noqa: E402

from synflux_ros.backends import build_executor
from synflux_ros.backends.onnxruntime import fusions as ort_fusions  # noqa: E402
from synflux_ros.buildtool import export as build_tool  # noqa: E402
from synflux_ros.graphset import reader as graphset  # noqa: E402
from synflux_ros.core.config import from_dict, load_config  # noqa: E402
from synflux_ros.core.contract import graph_set  # noqa: E402
from synflux_ros.core.kv_cache import KVCachePool  # noqa: E402
from synflux_ros.model.backbone import LLMBackbone  # noqa: E402
from synflux_ros.runtimes.base import create_executor  # noqa: E402
from synflux_ros.runtimes.vla import VLARuntime  # noqa: E402

HAVE_ONNXSCRIPT = True
try:
    import onnxscript  # noqa: F401
except ImportError:
    HAVE_ONNXSCRIPT = False
needs_onnxscript = pytest.mark.skipif(not HAVE_ONNXSCRIPT, reason="needs onnxscript (pip install onnxscript)")

LAYERS = 2
DECODER = ("prefill_8", "prefill_32", "decode_64", "decode_128")


def config(architecture="qwen3", kv_dtype="float32", vocab=512):
    return from_dict({
        "name": f"fusions-{architecture}", "mode": "vlm",
        "vision": {"resolution": [64, 64], "tile_size": [64, 64], "tokens_per_tile": 4},
        "llm": {"num_layers": LAYERS, "hidden_dim": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                "intermediate_size": 128, "vocab_size": vocab, "architecture": architecture, "kv_dtype": kv_dtype,
                # decode_64 reads the first 64 of 128 cache positions (a Slice of each view), decode_128 all
                "prefill_buckets": [8, 32], "decode_buckets": [64, 128], "max_seq_len": 128},
        "text": {"max_new_tokens": 8},
        "executor": {"backend": "onnxruntime"},
    })


def build_set(out, **kw) -> str:
    build_tool.build(config(**kw), str(out), seed=3)
    return str(out)


@pytest.fixture(scope="module", params=[("qwen3", "float32"), ("llama", "float32"), ("qwen3", "float16")],
                ids=lambda p: "-".join(p))
def gset(request, tmp_path_factory):
    arch, kv_dtype = request.param
    return build_set(tmp_path_factory.mktemp(f"g_{arch}_{kv_dtype}"), architecture=arch, kv_dtype=kv_dtype)


def executor(graph_dir, **options):
    cfg = load_config(os.path.join(graph_dir, "config.yaml"))
    ex = build_executor("onnxruntime", graph_set(cfg), graph_dir, {"intra_op_num_threads": 1, **options})
    return cfg, ex.load()


def kv_slot(ex, cfg, values):
    """The executor's KV slot (allocated on first use) holding ``values``."""
    slot = getattr(ex, "_test_slot", None)
    if slot is None:
        slot = ex._test_slot = ex.alloc_tensor("kv", cfg.llm.kv_shape, cfg.llm.kv_dtype)
    ex.write(slot, (Ellipsis,), values)
    return slot


def fused_dir(ex) -> Path:
    assert ex._from_cache
    return Path(ex._load_dir)


def ops(path) -> dict:
    return ort_fusions.count_ops(onnx.load(str(path), load_external_data=False))


# ------------------------------------------------------------------------------------------ what is fused
def _in_place_expected(cfg, name) -> dict:
    """The decode graphs' attention appends to float32 KV views in place; a llama layer's Q/K/V (no per-head
    norms between the product and the rotary) go into it packed, rotated inside it."""
    if not name.startswith("decode") or cfg.llm.kv_dtype != "float32":
        return {}
    return {"kv_in_place": LAYERS, "packed_qkv": LAYERS if cfg.llm.architecture == "llama" else 0}


@needs_onnxscript
def test_decoder_graphs_get_the_fused_kernels(gset):
    cfg, ex = executor(gset, fusions=True)
    sub = fused_dir(ex)
    assert sub.parent == Path(gset) / "ort_fused"
    counts = graphset.read_manifest(str(sub))["fusion_counts"]
    norms = LAYERS * (4 if cfg.llm.architecture == "qwen3" else 2) + 1  # + q/k norms; + the final norm
    for name in DECODER:
        in_place = _in_place_expected(cfg, name)
        assert counts[name] == {"rms_norm": norms, "rotary": 2 * LAYERS, "attention": LAYERS, **in_place}, name
        found = ops(sub / f"{name}.onnx")
        assert found.get("SimplifiedLayerNormalization") == norms
        rotary_nodes = 0 if in_place.get("packed_qkv") else 2 * LAYERS
        assert found.get("com.microsoft.RotaryEmbedding", 0) == rotary_nodes
        assert found.get("com.microsoft.GroupQueryAttention") == LAYERS
        for gone in ("Softmax", "Neg", "Pow", "Sqrt", "Where"):
            assert gone not in found, (name, gone, found)
        # the graph set's own files stay standard ONNX at opset 17
        source = onnx.load(os.path.join(gset, f"{name}.onnx"), load_external_data=False)
        assert {n.domain for n in source.graph.node} == {""}
        assert [(o.domain, o.version) for o in source.opset_import] == [("", 17)]
    # the vision encoder and the embedding graphs have nothing to fuse
    assert not any(counts["vision_encoder"].values()) and not any(counts["embed_8"].values())
    ex.close()


@needs_onnxscript
def test_a_list_selects_the_fusions(gset, tmp_path):
    cfg, ex = executor(gset, fusions=["rotary", "skip_rms_norm"], optimized_model_dir=str(tmp_path / "c"))
    (fused,) = [d for d in (tmp_path / "c").iterdir() if "-fused-" in d.name]
    found = ops(fused / "decode_128.onnx")
    assert found.get("com.microsoft.RotaryEmbedding") == 2 * LAYERS
    # residual adds fused into the norm after them: per layer after attention and after the MLP but the last
    assert found.get("com.microsoft.SkipSimplifiedLayerNormalization") == 2 * LAYERS
    assert "com.microsoft.GroupQueryAttention" not in found and "Softmax" in found
    ex.close()


@needs_onnxscript
@pytest.mark.parametrize("optimized", [False, True], ids=["fused", "fused+ort-optimized-prepacked"])
def test_decode_attention_appends_to_the_kv_views_in_place(gset, optimized, tmp_path):
    """In a decode graph GQA takes each KV view whole ([1, KV, S, Dh], a decode span shorter than the slot
    included) and returns it as ``<view>.in_place``, which the executor binds to the view's own memory: GQA
    then writes the new row where the slot holds it and copies nothing else. The graph leaves out new_kv,
    which the executor reads from the row written, and says that the slot holds it (the runtime does not
    write it again). The same holds for the ORT-optimised set made from the fused one."""
    options = {"optimized_model_dir": str(tmp_path / "opt"), "prepack": True} if optimized else {}
    cfg, ex = executor(gset, fusions=True, **options)
    llm = cfg.llm
    kv, s, dh = llm.num_kv_heads, llm.max_seq_len, llm.head_dim
    fused = fused_dir(ex) if not optimized else next(p for p in (tmp_path / "opt").iterdir() if "-fused-" in p.name)
    for name in ("decode_64", "decode_128"):
        model = onnx.load(str(fused / f"{name}.onnx"), load_external_data=False)
        inputs = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
        outputs = [o.name for o in model.graph.output]
        if not _in_place_expected(cfg, name):
            assert outputs == ["logits", "new_kv"] and inputs["past_kv.0.0"] == [kv, s, dh]
            assert not ex.updates_in_place(name, "past_kv")
            continue
        views = [graphset.view_name("past_kv", (layer, j)) for layer in range(LAYERS) for j in range(2)]
        assert outputs == ["logits"] + [v + graphset.IN_PLACE_SUFFIX for v in views]
        assert all(inputs[v] == [1, kv, s, dh] for v in views)
        for node in model.graph.node:
            if node.op_type == "GroupQueryAttention":
                assert node.input[3] in views and node.output[1] == node.input[3] + graphset.IN_PLACE_SUFFIX
        assert "Concat" not in ops(fused / f"{name}.onnx")  # nothing stacks the new rows any more
        assert ex.updates_in_place(name, "past_kv") and not ex.updates_in_place(name, "input_ids")
    if not _in_place_expected(cfg, "decode_64"):
        return ex.close()

    rng = np.random.default_rng(7)
    for name, cache_position in (("decode_64", 0), ("decode_64", 41), ("decode_128", 127)):
        f = _feeds(cfg, name, cache_position, 1, rng)
        slot = kv_slot(ex, cfg, f["past_kv"])
        out = ex.run(name, {**f, "past_kv": slot})
        after = ex.read(slot)
        others = np.ones(s, bool)
        others[cache_position] = False
        np.testing.assert_array_equal(after[:, :, :, others], f["past_kv"][:, :, :, others])
        np.testing.assert_array_equal(after[:, :, :, cache_position:cache_position + 1], out["new_kv"])
        assert not np.array_equal(out["new_kv"], f["past_kv"][:, :, :, cache_position:cache_position + 1])
    # another slot rebinds the in-place outputs with the inputs: the first slot is left as it was
    first = ex.read(slot)
    other = ex.alloc_tensor("kv2", llm.kv_shape, llm.kv_dtype)
    f = _feeds(cfg, "decode_128", 90, 1, rng)
    ex.write(other, (Ellipsis,), f["past_kv"])
    out = ex.run("decode_128", {**f, "past_kv": other})
    np.testing.assert_array_equal(ex.read(slot), first)
    np.testing.assert_array_equal(ex.read(other)[:, :, :, 90:91], out["new_kv"])

    # the graph bound to the first slot (as the backbone decodes), taking turns with runs on the other:
    # each call appends to its own slot, and the bound one returns what a run on a copy of its slot returns
    bound = ex.bind("decode_128", {"past_kv": slot}, outputs=["logits"])
    copy = ex.alloc_tensor("kv3", llm.kv_shape, llm.kv_dtype)
    for position in (60, 61):
        f = _feeds(cfg, "decode_128", position, 1, rng)
        ex.write(copy, (Ellipsis,), ex.read(slot))
        want = ex.run("decode_128", {**f, "past_kv": copy})
        before = ex.read(other)
        got = bound.run({k: v for k, v in f.items() if k != "past_kv"})
        assert list(got) == ["logits"]
        np.testing.assert_array_equal(got["logits"], want["logits"])
        np.testing.assert_array_equal(ex.read(slot), ex.read(copy))
        np.testing.assert_array_equal(ex.read(other), before)
        ex.run("decode_128", {**_feeds(cfg, "decode_128", 30, 1, rng), "past_kv": other})
    ex.close()


def test_in_place_outputs_must_match_their_input_and_are_refused_elsewhere():
    from synflux_ros.backends.binding import Port, binding_plan
    from synflux_ros.core.executor import ShapeError

    meta = next(m for m in graph_set(config()) if m.name == "decode_128")
    kv_shape = dict((t.name, t.shape) for t in meta.inputs)["past_kv"]
    view = [1, *kv_shape[2:]]
    inputs = [Port("input_ids", "int64", [1, 1]), Port("cache_position", "int64", [1])] + [
        Port(graphset.view_name("past_kv", (layer, j)), "float32", view) for layer in range(LAYERS) for j in range(2)]
    contract = [Port(t.name, t.dtype, list(t.shape)) for t in meta.outputs]
    extra = [Port("past_kv.1.0" + graphset.IN_PLACE_SUFFIX, "float32", view)]
    in_place: dict = {}
    plan = binding_plan(meta, inputs, contract + extra, "g.onnx", "rebuild", in_place=in_place)
    size = int(np.prod(kv_shape[2:])) * 4
    assert ("past_kv.1.0", 2 * size, tuple(view)) in plan["past_kv"]
    assert in_place == {"past_kv": [("past_kv.1.0.in_place", 2 * size, tuple(view))]}
    with pytest.raises(ShapeError, match=r"unexpected \['past_kv.1.0.in_place'\]"):
        binding_plan(meta, inputs, contract + extra, "g.onnx", "rebuild")  # a backend that cannot bind them
    wrong = [Port("past_kv.1.0" + graphset.IN_PLACE_SUFFIX, "float32", [1, *kv_shape[2:-1], 8])]
    with pytest.raises(ShapeError, match=r"output 'past_kv.1.0.in_place' updates input 'past_kv.1.0' in place"):
        binding_plan(meta, inputs, contract + wrong, "g.onnx", "rebuild", in_place={})
    stray = [Port("past_kv.9.0" + graphset.IN_PLACE_SUFFIX, "float32", view)]  # no such input
    with pytest.raises(ShapeError, match=r"unexpected \['past_kv.9.0.in_place'\]"):
        binding_plan(meta, inputs, contract + stray, "g.onnx", "rebuild", in_place={})

    # new_kv may be left out only where every view of past_kv is updated in place, and only for a caller
    # that reads it from there
    logits = [p for p in contract if p.name == "logits"]
    every = [Port(graphset.view_name("past_kv", (layer, j)) + graphset.IN_PLACE_SUFFIX, "float32", view)
             for layer in range(LAYERS) for j in range(2)]
    derived: set = set()
    binding_plan(meta, inputs, logits + every, "g.onnx", "rebuild", in_place={}, derived=derived)
    assert derived == {"new_kv"}
    for outputs, options in ((logits + every[1:], {"in_place": {}, "derived": set()}),
                             (logits + every, {"in_place": {}}), (logits, {"in_place": {}, "derived": set()})):
        with pytest.raises(ShapeError, match=r"missing \['new_kv'\]"):
            binding_plan(meta, inputs, outputs, "g.onnx", "rebuild", **options)


# ------------------------------------------------------------------------------------------ numerics
def _feeds(cfg, name, cache_position, num_tokens, rng):
    llm = cfg.llm
    kv = rng.standard_normal(llm.kv_shape).astype(llm.kv_dtype)
    if name.startswith("prefill"):
        p = int(name.split("_")[1])
        return {"inputs_embeds": rng.standard_normal((1, p, llm.hidden_dim)).astype(np.float32),
                "num_tokens": np.array([num_tokens], np.int64),
                "cache_position": np.array([cache_position], np.int64), "past_kv": kv}
    return {"input_ids": np.array([[int(rng.integers(llm.vocab_size))]], np.int64),
            "cache_position": np.array([cache_position], np.int64), "past_kv": kv}


CASES = [("prefill_8", 0, 8), ("prefill_8", 5, 3), ("prefill_8", 117, 8), ("prefill_32", 0, 32),
         ("prefill_32", 40, 17), ("prefill_32", 100, 28),  # the 4 padded rows pass the cache's end
         ("decode_64", 0, 1), ("decode_64", 1, 1), ("decode_64", 37, 1), ("decode_64", 63, 1),
         ("decode_128", 64, 1), ("decode_128", 127, 1)]


@needs_onnxscript
def test_logits_and_new_kv_equal_the_portable_graphs(gset):
    cfg, plain = executor(gset)
    _, fused = executor(gset, fusions=True)
    rng = np.random.default_rng(0)
    for name, cache_position, n in CASES:
        f = _feeds(cfg, name, cache_position, n, rng)
        want = plain.run(name, {**f, "past_kv": kv_slot(plain, cfg, f["past_kv"])})
        got = fused.run(name, {**f, "past_kv": kv_slot(fused, cfg, f["past_kv"])})
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-4, err_msg=f"{name}@{cache_position} {key}")
        assert np.abs(want["logits"]).max() > 1e-3  # not trivially equal
    plain.close()
    fused.close()


# A flow-matching VLA's prefill and action-expert graphs, fused as bench.pi0 runs them
VLA_FUSIONS = ["rms_norm", "skip_rms_norm", "rotary", "padded_keys"]


@needs_onnxscript
@pytest.mark.parametrize("name", ["vla_pi0.yaml", "vla_pi05.yaml", "vla_smolvla.yaml"])
def test_flow_matching_chunks_equal_the_portable_graphs(name, tmp_path, shipped_graphs):
    """Every rotary embedding of the prefill and the action expert becomes RotaryEmbedding (SmolVLA's
    cross-attention queries too: their cos/sin rows are constants of positions 0 .. T-1), and the chunk is the
    portable graphs' (demo widths, two cameras for SmolVLA, the state in the prompt for pi0.5). Every attention
    reads the keys up to the prefix's length (the instruction is short: most of the bucket is padding), but
    SmolVLA's block-causal prefix."""
    shutil.copytree(shipped_graphs(name), tmp_path / "graphs")  # the fused set is written beside it
    cfg = load_config(str(tmp_path / "graphs" / "config.yaml"))
    rng = np.random.default_rng(1)
    side = cfg.vision.resolution
    images = [rng.integers(0, 256, (side[1], side[0], 3), np.uint8) for _ in cfg.vision.cameras or [None]]
    state = np.zeros(cfg.action.state_dim, np.float32)
    state[:len(cfg.action.state_joints)] = rng.uniform(-1, 1, len(cfg.action.state_joints))
    chunks, runtimes = {}, {}
    for label, options in (("portable", {}), ("fused", {"fusions": VLA_FUSIONS})):
        rt = runtimes[label] = VLARuntime(cfg.with_overrides(executor={
            "backend": "onnxruntime", "graph_dir": str(tmp_path / "graphs"),
            "options": {"intra_op_num_threads": 1, **options}}))
        rt.set_instruction("pick up the red block")
        chunks[label] = rt.infer(images if len(images) > 1 else images[0], seq=3, state=state).actions
    fused = fused_dir(runtimes["fused"].executor)
    for rt in runtimes.values():
        rt.close()
    np.testing.assert_allclose(chunks["fused"], chunks["portable"], rtol=0, atol=1e-4)
    assert np.abs(chunks["portable"]).max() > 1e-3  # not trivially equal
    for graph in (f"prefill_{cfg.llm.prefill_buckets[-1]}", f"action_expert_{cfg.llm.decode_buckets[-1]}"):
        counts = ops(fused / f"{graph}.onnx")
        # the rotate-half's Neg is the only one in these graphs: none left means every rotary was fused
        assert counts.get("com.microsoft.RotaryEmbedding", 0) > 0 and counts.get("Neg", 0) == 0, f"{graph}: {counts}"
        if graph.startswith("prefill") and name == "vla_smolvla.yaml":
            continue  # SmolVLA's prefix attends block-causally (the state row last): no key-length mask
        # every attention reads the keys up to the prefix length: the mask's Where is gone, except where the
        # new keys keep a mask of their own (pi0's state token, SmolVLA's causal actions)
        own_mask = graph.startswith("action_expert") and name != "vla_pi05.yaml"
        assert counts.get("Clip", 0) > 0 and (counts.get("Where", 0) == 0 or own_mask), f"{graph}: {counts}"


def _greedy(graph_dir, prompt, steps, **options):
    cfg = load_config(os.path.join(graph_dir, "config.yaml"))
    cfg = cfg.with_overrides(executor={"backend": "onnxruntime", "graph_dir": graph_dir,
                                       "options": {"intra_op_num_threads": 1, **options}})
    ex = create_executor(cfg)
    pool = KVCachePool(ex, 1, cfg.llm.kv_shape, cfg.llm.kv_dtype, "kv")
    ex.freeze()
    llm, slot = LLMBackbone(cfg, ex), pool.tensor(0)
    logits = llm.prefill(slot, 0, llm.embed(prompt))
    tokens, pos = [], len(prompt)
    for _ in range(steps):
        tokens.append(int(np.argmax(logits)))
        logits = llm.decode(slot, pos, tokens[-1])
        pos += 1
    follow = np.array(tokens[:5], np.int64)  # a second turn prefilled on top of the cache
    last = llm.prefill(slot, pos, llm.embed(follow))
    ex.close()
    return tokens, last


@needs_onnxscript
def test_greedy_tokens_are_identical(gset):
    prompt = np.random.default_rng(1).integers(0, 512, 21).astype(np.int64)
    want, want_last = _greedy(gset, prompt, 50)
    got, got_last = _greedy(gset, prompt, 50, fusions=True)
    assert got == want
    np.testing.assert_allclose(got_last, want_last, rtol=0, atol=1e-4)


# ------------------------------------------------------------------------------------------ cache
@needs_onnxscript
def test_the_fused_set_is_written_once_and_reused(tmp_path, monkeypatch):
    gdir = build_set(tmp_path / "g")
    _, ex = executor(gdir, fusions=True)
    sub = fused_dir(ex)
    manifest = graphset.read_manifest(str(sub))
    assert manifest[ort_fusions.CACHE_KEY]["onnxscript"] == onnxscript.__version__
    assert manifest[ort_fusions.CACHE_KEY]["fusions"] == list(ort_fusions.DEFAULT_FUSIONS)
    stamps = {p.name: p.stat().st_mtime_ns for p in sub.iterdir()}
    ex.close()

    def no_rewrite(*args, **kwargs):
        raise AssertionError("the fused set was rewritten although nothing changed")
    monkeypatch.setattr(ort_fusions, "fuse_model", no_rewrite)
    _, ex2 = executor(gdir, fusions=True)
    assert fused_dir(ex2) == sub
    assert {p.name: p.stat().st_mtime_ns for p in sub.iterdir()} == stamps
    ex2.close()
    monkeypatch.undo()

    # a changed source file (or another fusion list) gives a new fused set
    os.utime(os.path.join(gdir, "decode_64.onnx"))
    _, ex3 = executor(gdir, fusions=True)
    assert fused_dir(ex3) != sub and fused_dir(ex3).parent == sub.parent
    ex3.close()


@needs_onnxscript
def test_fusions_with_optimized_model_dir_chain_both_caches(tmp_path):
    gdir = build_set(tmp_path / "g")
    cache = tmp_path / "cache"
    cfg, ex = executor(gdir, fusions=True, optimized_model_dir=str(cache))
    fused = [d for d in cache.iterdir() if d.is_dir() and "-fused-" in d.name]
    optimized = [d for d in cache.iterdir() if d.is_dir() and "-fused-" not in d.name]
    assert len(fused) == 1 and len(optimized) == 1 and Path(ex._load_dir) == optimized[0]
    key = graphset.read_manifest(str(optimized[0]))["ort_optimized"]
    assert key["source"] == str(fused[0])
    _, plain = executor(gdir)
    f = _feeds(cfg, "decode_128", 90, 1, np.random.default_rng(5))
    want = plain.run("decode_128", {**f, "past_kv": kv_slot(plain, cfg, f["past_kv"])})
    got = ex.run("decode_128", {**f, "past_kv": kv_slot(ex, cfg, f["past_kv"])})
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=0, atol=1e-4)
    ex.close()
    plain.close()


def _fake_cache(directory: Path, manifest: dict, key: str, **changed) -> Path:
    """A cached set's manifest alone (all the pruning reads), its fingerprint ``key`` with ``changed`` fields."""
    directory.mkdir()
    data = {**manifest, key: {**manifest[key], **changed}}
    (directory / graphset.MANIFEST_FILE).write_text(json.dumps(data))
    return directory


@needs_onnxscript
def test_superseded_cached_sets_are_removed_and_the_others_kept(tmp_path):
    gdir = build_set(tmp_path / "g")
    cache = tmp_path / "cache"

    def load(prepack):
        _, ex = executor(gdir, fusions=True, optimized_model_dir=str(cache), prepack=prepack)
        loaded = Path(ex._load_dir)
        ex.close()
        return loaded

    def fused_sets():
        return {d for d in cache.iterdir() if "-fused-" in d.name}

    packed = load(True)
    (fused,) = fused_sets()
    # what an older onnxscript and an older onnxruntime left with the same settings, a half-written set of a
    # process that was killed, one being written now, and a directory that is not a cached set
    old_fused = _fake_cache(cache / "old-fused", graphset.read_manifest(str(fused)), ort_fusions.CACHE_KEY,
                            onnxscript="0.0.1")
    old_packed = _fake_cache(cache / "old-packed", graphset.read_manifest(str(packed)), "ort_optimized",
                             onnxruntime="0.0.1")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    (cache / f"{packed.name}.partial-{int(dead.stdout)}").mkdir()
    live = cache / f"{packed.name}.partial-{os.getppid()}"  # a process that runs
    live.mkdir()
    notes = cache / "notes"
    notes.mkdir()
    (notes / "README").write_text("kept")

    shutil.rmtree(packed)
    assert load(True) == packed  # written again: the older onnxruntime's copy and the dead partial go
    assert {d.name for d in cache.iterdir()} == {fused.name, old_fused.name, packed.name, live.name, "notes"}
    assert old_packed not in set(cache.iterdir())

    unpacked = load(False)  # other settings: both optimised sets stay
    assert unpacked != packed and {packed, unpacked} <= set(cache.iterdir())

    # the graph set is built again: every set made from the old files goes, those of other settings included
    os.utime(os.path.join(gdir, "decode_64.onnx"))
    current = load(False)
    (fused_now,) = fused_sets()
    assert fused_now != fused and current not in (packed, unpacked)
    assert set(cache.iterdir()) == {fused_now, current, live, notes}
    assert graphset.read_manifest(str(current))["ort_optimized"]["source"] == str(fused_now)


# ------------------------------------------------------------------------------------------ weights once
@needs_onnxscript
def test_the_fused_set_holds_the_weights_once_and_shares_them(gset):
    cfg, ex = executor(gset, fusions=True)
    sub = fused_dir(ex)
    source = os.path.getsize(os.path.join(gset, "weights.bin"))
    half_tables = 2 * cfg.llm.max_seq_len * cfg.llm.head_dim // 2 * 4
    assert os.path.getsize(sub / "weights.bin") <= source + half_tables + 4 * 64
    for name in DECODER:
        ext = graphset.external_initializers(str(sub / f"{name}.onnx"))
        assert {t.location for t in ext} == {"weights.bin"}
        assert ex.shared_initializers(name) == len(ext)  # every one a view of the one weights buffer
    ex.close()


_MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys
    from synflux_ros.backends import build_executor
    from synflux_ros.core.config import load_config
    from synflux_ros.core.contract import graph_set

    def status(key, path="/proc/self/status"):
        for line in open(path):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    graph_dir, options = sys.argv[1], json.loads(sys.argv[2])
    cfg = load_config(graph_dir + "/config.yaml")
    ex = build_executor("onnxruntime", graph_set(cfg), graph_dir, {"intra_op_num_threads": 1, **options})
    import onnx, onnxscript  # imported by either load (writing or checking a cache); not what is measured
    base = status("VmRSS")
    ex.load()
    print(json.dumps({"growth": status("VmHWM") - base, "staging": ex.device_bytes,
                      "graphs": len(ex.graphs)}))
""")


def _load_growth(graph_dir, options, tmp_path):
    script = tmp_path / "measure.py"
    script.write_text(_MEMORY_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), graph_dir, json.dumps(options)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return r["growth"] - r["staging"]


@needs_onnxscript
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (Linux) to read RSS")
def test_bucket_graphs_of_the_fused_set_hold_one_copy_of_the_weights(tmp_path):
    """Loading every graph of the fused set grows peak RSS by about one copy of the weights, as for the
    portable set (a 131072-token vocabulary: the embedding and head tables are most of the 66 MiB)."""
    gdir = build_set(tmp_path / "big", vocab=131072)
    weights = os.path.getsize(os.path.join(gdir, "weights.bin"))
    _load_growth(gdir, {"fusions": True}, tmp_path)  # writes the fused set
    fused = _load_growth(gdir, {"fusions": True}, tmp_path)
    plain = _load_growth(gdir, {}, tmp_path)
    print(f"peak RSS growth: fused {fused / 2**20:.0f} MiB, portable {plain / 2**20:.0f} MiB, "
          f"weights {weights / 2**20:.0f} MiB")
    assert fused < 1.5 * weights, f"peak RSS growth {fused / 2**20:.0f} MiB for {weights / 2**20:.0f} MiB of weights"
    assert fused < plain + 0.25 * weights, (fused, plain)


# ------------------------------------------------------------------------------------------ errors
def test_the_rules_and_onnxscript_are_imported_only_to_fuse():
    """Parsing the option and keying a fused set (what loading an up-to-date one does) import neither the rules
    nor onnxscript; fusing imports the rules module."""
    code = ("import sys\n"
            "from synflux_ros.backends.onnxruntime import fusions\n"
            "fusions.parse(True); fusions.versions()\n"
            "print(sorted(m for m in sys.modules if m.startswith('onnxscript') or m.endswith('fusion_rules')))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_missing_onnxscript_is_named_with_the_install_command(tmp_path, monkeypatch):
    gdir = build_set(tmp_path / "g")
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # as if it were not installed
    with pytest.raises(RuntimeError, match=r"fusions option needs the 'onnxscript' package \(pip install onnxscript\)"):
        executor(gdir, fusions=True)
    assert not (Path(gdir) / "ort_fused").exists() or not any((Path(gdir) / "ort_fused").iterdir())
    executor(gdir, fusions=False)[1].close()  # without the option nothing needs it


@pytest.mark.parametrize("value, error", [
    (["rotary", "flash"], r"fusions: unknown fusion 'flash' \(choices: rms_norm, skip_rms_norm, rotary, attention, padded_keys\)"),
    ("yes", r"executor.options.fusions: expected true, false or a list"),
])
def test_bad_fusions_values_are_named(value, error):
    metas = graph_set(config())
    with pytest.raises(ValueError, match=error):
        build_executor("onnxruntime", metas, "", {"fusions": value})
