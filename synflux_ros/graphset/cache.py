"""Caches made from a graph set (the onnxruntime executor's optimised and fused copies, QNN context binaries,
OpenVINO compiled blobs, RKNN and TensorRT compile keys): one way to key an entry, name its directory, check a
cached copy and prune the copies no process will load again. Standard library only.

A cache entry's *fingerprint* is a JSON-able dict of everything the entry depends on: the package versions and
settings of the backend that made it, and, for a copy of a graph set, its source (:func:`source_fingerprint`:
the absolute path, the config hash, and the size and modification time of every graph file and the weights
file). Its *key* is :func:`key` of the fingerprint; a copy's directory is :func:`entry_dir`, and its
manifest keeps the fingerprint under a name of the backend's (``ort_optimized``, ``ort_fused``,
``qnn_context``), which :func:`cached_copy_valid` compares and :func:`prune_cache` reads.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

from .reader import MANIFEST_FILE

KEY_LENGTH = 16
"""Hex digits of a cache key."""


def key(fields, default=None) -> str:
    """The key of a cache entry: the first :data:`KEY_LENGTH` hex digits of SHA-256 over ``fields`` as JSON with
    sorted keys (``default``: as for :func:`json.dumps`, for values JSON lacks)."""
    blob = json.dumps(fields, sort_keys=True, default=default)
    return hashlib.sha256(blob.encode()).hexdigest()[:KEY_LENGTH]


def digest(paths=(), *, head=(), named: bool = False, length: int | None = None) -> str:
    """SHA-256 hex digest of ``head`` (str or bytes items, in order) and then of the content of each file of
    ``paths``: a path, or ``(path, offset, length)`` for a byte range (length < 0: to the end). ``named``
    prefixes each file's content with its base name (a renamed file changes the digest); ``length`` cuts the
    digest to that many hex digits. The one way the package fingerprints its own source files (what an
    exported or compiled graph depends on) and digests the files a build reads."""
    h = hashlib.sha256()
    for part in head:
        h.update(part.encode() if isinstance(part, str) else part)
    for item in paths:
        path, offset, size = (item, 0, -1) if isinstance(item, (str, os.PathLike)) else item
        if named:
            h.update(os.path.basename(path).encode())
        with open(path, "rb") as fh:
            fh.seek(offset)
            left = size
            while left:
                chunk = fh.read(1 << 20 if left < 0 else min(left, 1 << 20))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk) if left > 0 else 0
    return h.hexdigest()[:length] if length else h.hexdigest()


def file_stamps(paths: dict[str, str], missing_ok: bool = False) -> dict[str, list[int]]:
    """``name -> [size, mtime_ns]`` of each file of ``paths`` (name -> path): what a cache entry records of a
    file it was made from, cheaper than its content and changed by any rewrite. ``missing_ok``: a missing file
    is left out instead of raising."""
    stamps = {}
    for name, path in paths.items():
        try:
            st = os.stat(path)
        except FileNotFoundError:
            if missing_ok:
                continue
            raise
        stamps[name] = [st.st_size, st.st_mtime_ns]
    return stamps


def source_fingerprint(graph_dir: str, manifest: dict, paths: dict[str, str], missing_ok: bool = False) -> dict:
    """What a copy of the graph set in ``graph_dir`` (its ``manifest``) is made from: ``source`` (absolute),
    ``config_hash`` and ``files``, the stamps of the graph files ``paths`` (key -> path) and of the weights file
    (by its file name). :func:`prune_cache` reads these fields to tell a rebuilt or deleted source."""
    files = dict(paths)
    wfile = (manifest.get("weights") or {}).get("file", "")
    if wfile:
        files[wfile] = os.path.join(graph_dir, wfile)
    return {"source": os.path.abspath(graph_dir), "config_hash": manifest.get("config_hash", ""),
            "files": file_stamps(files, missing_ok)}


def label(manifest: dict) -> str:
    """The model name of a manifest as a file-name part (other characters become ``_``)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(manifest.get("model") or "graphs"))


def entry_dir(root: str, manifest: dict, fingerprint: dict, kind: str = "") -> str:
    """``<root>/<model>[-<kind>]-<key>``: the directory of the cache entry keyed ``fingerprint``."""
    return os.path.join(root, f"{label(manifest)}{'-' + kind if kind else ''}-{key(fingerprint)}")


def cached_manifest(directory: str) -> dict | None:
    """``directory/manifest.json`` of a cached copy of a graph set, or None when it is missing or unreadable
    (such a copy is made again, not refused)."""
    try:
        with open(os.path.join(directory, MANIFEST_FILE), encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def cached_copy_valid(directory: str, key_name: str, fingerprint: dict, names) -> bool:
    """Whether ``directory`` holds a cached copy keyed ``fingerprint`` (under ``key_name`` in its manifest)
    with the file ``<name>.onnx`` of every graph in ``names``."""
    data = cached_manifest(directory)
    return data is not None and data.get(key_name) == fingerprint and all(
        os.path.isfile(os.path.join(directory, f"{name}.onnx")) for name in names)


def publish_directory(work: str, target: str, valid) -> None:
    """Move ``work`` (written next to ``target``) into place. If another process published ``target``
    first, a valid one (``valid(target)``) is kept; a stale or incomplete one is replaced."""
    try:
        os.rename(work, target)
    except OSError:
        if not valid(target):
            shutil.rmtree(target, ignore_errors=True)
            os.rename(work, target)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _source_changed(fingerprint: dict) -> bool:
    """Whether the graph set a cached copy was made from (``fingerprint['source']``, its files' size and mtime
    in ``fingerprint['files']``, by graph name or file name) is gone or has been written again since. A
    fingerprint that names no absolute source cannot tell: False."""
    source = str(fingerprint.get("source") or "")
    if not os.path.isabs(source):
        return False
    manifest = cached_manifest(source)
    if manifest is None:
        return True
    graphs = manifest.get("graphs") or []
    files = {str(g.get("name")): str(g.get("file") or f"{g.get('name')}.onnx") for g in graphs if isinstance(g, dict)}
    for name, recorded in (fingerprint.get("files") or {}).items():
        try:
            st = os.stat(os.path.join(source, files.get(name, name)))
        except OSError:
            return True
        if [st.st_size, st.st_mtime_ns] != list(recorded):
            return True
    return False


def prune_cache(cache_dir: str, key_name: str, current: dict, keep: str, versions=()) -> list[str]:
    """Remove the cached copies of graph sets in ``cache_dir`` that no process will load again, after ``keep``
    (keyed ``current`` under ``key_name`` in its manifest) was written there: those whose source graph set is
    gone or was written again (a rebuild), those of the same source and settings as ``current`` that differ
    only in ``versions`` (the fingerprint fields naming package versions: an upgrade), and the half-written
    ``*.partial-<pid>`` directories of processes that no longer run. Copies made with other settings (another
    node's options) and directories without a ``key_name`` fingerprint are left alone. Returns what was
    removed. A process already running on a removed copy keeps its mapped files until it exits."""
    slot = {k: v for k, v in current.items() if k not in versions and k != "files"}
    removed = []
    try:
        entries = sorted(os.listdir(cache_dir))
    except OSError:
        return removed
    for entry in entries:
        path = os.path.join(cache_dir, entry)
        if path == keep or not os.path.isdir(path):
            continue
        stem, sep, pid = entry.rpartition(".partial-")
        if sep and stem and pid.isdigit():
            stale = not _pid_alive(int(pid))
        else:
            fingerprint = (cached_manifest(path) or {}).get(key_name)
            if not isinstance(fingerprint, dict):
                continue
            stale = _source_changed(fingerprint) or slot == {
                k: v for k, v in fingerprint.items() if k not in versions and k != "files"}
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
