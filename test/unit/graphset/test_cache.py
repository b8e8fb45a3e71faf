"""graphset.cache: the keys, directories, validity check and pruning every cache made from a graph set uses."""
import hashlib
import json
import os
import subprocess
import sys

from synflux_ros.graphset import cache
from synflux_ros.graphset.writer import write_manifest


def graph_set(root, name="m", weights=b"w" * 64, graphs=("a", "b")):
    """A graph set's files as a cache sees them: a manifest, a weights file and one file per graph."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "weights.bin").write_bytes(weights)
    for g in graphs:
        (root / f"{g}.onnx").write_bytes(g.encode() * 10)
    manifest = {"model": name, "config_hash": "c0ffee", "weights": {"file": "weights.bin", "bytes": len(weights)},
                "graphs": [{"name": g, "kind": "decode", "inputs": [], "outputs": [], "file": f"{g}.onnx"}
                           for g in graphs]}
    write_manifest(str(root), manifest)
    return manifest, {g: str(root / f"{g}.onnx") for g in graphs}


def copy_of(cache_dir, source, manifest, paths, key_name, settings, names=("a", "b")):
    """A cached copy of ``source`` as a backend writes one: its graphs and the fingerprint in its manifest."""
    fingerprint = {**settings, **cache.source_fingerprint(str(source), manifest, paths)}
    target = cache.entry_dir(str(cache_dir), manifest, fingerprint)
    os.makedirs(target)
    for n in names:
        open(os.path.join(target, f"{n}.onnx"), "wb").close()
    write_manifest(target, {"graphs": [], key_name: fingerprint})
    return target, fingerprint


def test_a_key_depends_on_the_fields_not_their_order():
    a = cache.key({"x": 1, "y": [1, 2]})
    assert a == cache.key({"y": [1, 2], "x": 1}) and len(a) == cache.KEY_LENGTH
    assert a != cache.key({"x": 2, "y": [1, 2]})
    assert cache.key({"t": (1, 2)}) == cache.key({"t": [1, 2]})
    assert cache.key({"s": {3}}, default=sorted) == cache.key({"s": [3]})


def test_keys_stay_what_the_caches_on_disk_were_named_with():
    """The caches written before keep loading: a key is still SHA-256 of the sorted JSON, 16 hex digits."""
    fp = {"onnxruntime": "1.23.0", "files": {"a": [10, 5]}, "source": "/g"}
    assert cache.key(fp) == hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def test_a_digest_is_sha256_of_the_head_then_the_files(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.bin"
    a.write_bytes(b"print(1)\n")
    b.write_bytes(bytes(range(256)) * 9000)  # more than one read chunk
    whole = hashlib.sha256(b"k=1;" + a.read_bytes() + b.read_bytes()).hexdigest()
    assert cache.digest([str(a), str(b)], head=["k=1;"]) == whole
    assert cache.digest([str(a), str(b)], head=[b"k=1;"], length=12) == whole[:12]
    named = hashlib.sha256(b"a.py" + a.read_bytes() + b"b.bin" + b.read_bytes()).hexdigest()
    assert cache.digest([a, b], named=True) == named
    data = b.read_bytes()
    ranged = hashlib.sha256(data[10:10 + 1_500_000] + data[7:]).hexdigest()
    assert cache.digest([(str(b), 10, 1_500_000), (str(b), 7, -1)]) == ranged


def test_entry_dirs_name_the_model_and_kind(tmp_path):
    fp = {"x": 1}
    assert cache.entry_dir("/c", {"model": "Qwen3 0.6B/it"}, fp) == f"/c/Qwen3_0.6B_it-{cache.key(fp)}"
    assert cache.entry_dir("/c", {}, fp, "fused") == f"/c/graphs-fused-{cache.key(fp)}"


def test_a_source_fingerprint_stamps_graphs_and_weights(tmp_path):
    manifest, paths = graph_set(tmp_path / "g")
    fp = cache.source_fingerprint(str(tmp_path / "g"), manifest, paths)
    assert fp["source"] == str(tmp_path / "g") and fp["config_hash"] == "c0ffee"
    assert sorted(fp["files"]) == ["a", "b", "weights.bin"] and fp["files"]["weights.bin"][0] == 64
    os.remove(paths["b"])
    assert sorted(cache.source_fingerprint(str(tmp_path / "g"), manifest, paths, missing_ok=True)["files"]) == \
        ["a", "weights.bin"]


def test_a_cached_copy_is_valid_with_its_fingerprint_and_every_graph(tmp_path):
    manifest, paths = graph_set(tmp_path / "g")
    target, fp = copy_of(tmp_path / "c", tmp_path / "g", manifest, paths, "k", {"v": 1})
    assert cache.cached_copy_valid(target, "k", fp, ["a", "b"])
    assert not cache.cached_copy_valid(target, "other", fp, ["a", "b"])
    assert not cache.cached_copy_valid(target, "k", {**fp, "v": 2}, ["a", "b"])
    assert not cache.cached_copy_valid(target, "k", fp, ["a", "b", "c"])
    (tmp_path / "c" / "broken").mkdir()
    (tmp_path / "c" / "broken" / "manifest.json").write_text("{not json")
    assert cache.cached_manifest(str(tmp_path / "c" / "broken")) is None


def test_pruning_removes_what_no_process_loads_again(tmp_path):
    manifest, paths = graph_set(tmp_path / "g")
    other_manifest, other_paths = graph_set(tmp_path / "h", name="h")
    cdir = tmp_path / "c"
    old, _ = copy_of(cdir, tmp_path / "g", manifest, paths, "k", {"v": "1.0", "level": "all"})
    other_settings, _ = copy_of(cdir, tmp_path / "g", manifest, paths, "k", {"v": "1.0", "level": "basic"})
    rebuilt, _ = copy_of(cdir, tmp_path / "h", other_manifest, other_paths, "k", {"v": "1.1", "level": "basic"})
    gone, _ = copy_of(cdir, tmp_path / "g", manifest, paths, "k", {"v": "1.1", "level": "x"})
    (tmp_path / "h" / "a.onnx").write_bytes(b"rewritten, longer than before")  # h was rebuilt
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (cdir / f"m-1234.partial-{int(dead.stdout)}").mkdir()
    live = cdir / f"m-5678.partial-{os.getpid()}"
    live.mkdir()
    unkeyed = cdir / "unrelated"
    unkeyed.mkdir()
    os.remove(os.path.join(gone, "manifest.json"))  # no fingerprint: left alone
    current, fp = copy_of(cdir, tmp_path / "g", manifest, paths, "k", {"v": "1.1", "level": "all"})
    removed = cache.prune_cache(str(cdir), "k", fp, current, versions=("v",))
    assert sorted(removed) == sorted([old, rebuilt, str(cdir / f"m-1234.partial-{int(dead.stdout)}")])
    assert all(os.path.isdir(p) for p in (current, other_settings, gone, str(live), str(unkeyed)))


def test_publishing_keeps_a_valid_copy_another_process_wrote_first(tmp_path):
    target = tmp_path / "t"
    for i, valid in enumerate((True, False)):
        target.mkdir(exist_ok=True)
        (target / "mark").write_text("first")
        work = tmp_path / f"w{i}"
        work.mkdir()
        (work / "mark").write_text("second")
        cache.publish_directory(str(work), str(target), lambda d, v=valid: v)
        assert (target / "mark").read_text() == ("first" if valid else "second")
