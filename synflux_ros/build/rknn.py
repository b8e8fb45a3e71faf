"""``synflux-build --backend rknn``: compile a graph set's ONNX files to ``.rknn`` files for a Rockchip NPU.

::

    synflux-build --config config/vlm_demo.yaml --out engines/vlm_demo --backend rknn --target rk3588

The portable ONNX graph set is built (or brought up to date) first; then every graph is compiled with
rknn-toolkit2 (fp16) into ``DIR/rknn/<target>/<graph>.rknn``, described by ``DIR/rknn/<target>/rknn.json``::

    {"format": "synflux-rknn/1", "target": "rk3588", "toolkit": "2.5.0", "dtype": "fp16",
     "graphs": {"decode_256": {"file": "decode_256.rknn", "source": "decode_256.rknn.onnx",
                               "key": "...", "onnx_key": "...", "inputs": [[name, shape], ...],
                               "outputs": [name, ...], "seconds": 1.9}, ...}}

``file`` is relative to that directory, ``source`` (the ONNX file the toolkit compiled, which the x86
simulator builds again) to DIR. ``onnx_key`` is the graph's skip-unchanged key in the graph set's
manifest; ``key`` adds backend, target, toolkit version, dtype and this compiler's source, so a graph
whose ONNX, target and toolkit are unchanged is not compiled again. Several targets can live side by side.

The toolkit pins numpy <= 1.26.4 and onnx <= 1.18, so it runs in its own venv (``make rknn-venv`` ->
``.venv-rknn``) as a subprocess: ``rknn_compile.py`` beside this file, one process for all stale graphs.
A graph that fails is named with the toolkit's error lines (they name the node or operator when the
toolkit does); the toolkit's whole log is kept in ``DIR/rknn/<target>/compile.log``.

Source rewrite: a ``past_kv.<l>.<k|v>`` input that a graph reads without slicing it (the decode graph
whose span is the whole cache) is passed through an ``Identity`` node first. Without it rknn-toolkit2
2.5.0 computes that graph wrongly (measured in the simulator: cosine 0.66 against onnxruntime on the
logits of decode at full span; with the Identity 0.99999). Such graphs are compiled from a rewritten
copy, ``<graph>.rknn.onnx`` beside the original (same weights file); the others from ``<graph>.onnx``.

Not done: int8 quantization (``--quantize int8``) is refused with an error; the graphs compile as fp16.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

from ..backends.rknn import toolkit_env
from ..core import graphset
from ..core.executor import GraphMeta

TARGETS = ("rk3562", "rk3566", "rk3568", "rk3576", "rk3588")
"""Platforms of rknn-toolkit2 whose NPU takes these graphs; rk3588 is the one exercised here."""
DTYPES = ("fp16",)
SIDECAR = "rknn.json"
FORMAT = "synflux-rknn/1"
COMPILER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rknn_compile.py")
VENV_HINT = "run `make rknn-venv` in the synflux_ros checkout (or pass --rknn-python PATH)"


class RKNNBuildError(RuntimeError):
    """Compiling to .rknn failed or cannot start (no toolkit venv, bad target)."""


def rknn_dir(out: str, target: str) -> str:
    return os.path.join(out, "rknn", target)


def rebuild_command(out: str, target: str) -> str:
    return f"synflux-build --config <model.yaml> --out {out or '<graph_dir>'} --backend rknn --target {target}"


def default_toolkit_pythons() -> list[str]:
    """Where ``make rknn-venv`` puts the toolkit's Python: beside the venv this package runs from
    (``<prefix>/../.venv-rknn``), then beside the source tree this file is in."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.path.join(os.path.dirname(os.path.abspath(sys.prefix)), ".venv-rknn", "bin", "python"),
                  os.path.join(os.path.dirname(os.path.dirname(here)), ".venv-rknn", "bin", "python")]
    return list(dict.fromkeys(candidates))


def find_toolkit_python(explicit: str | None = None) -> str:
    if explicit:
        if not os.path.isfile(explicit):
            raise RKNNBuildError(f"--rknn-python {explicit}: no such file; {VENV_HINT}")
        return explicit
    for path in default_toolkit_pythons():
        if os.path.isfile(path):
            return path
    raise RKNNBuildError(f"--backend rknn needs rknn-toolkit2, which lives in a venv of its own; none found at "
                         f"{', '.join(default_toolkit_pythons())}: {VENV_HINT}")


def toolkit_version(python: str) -> str:
    try:
        res = subprocess.run([python, COMPILER, "--version"], capture_output=True, text=True, timeout=120,
                             env=toolkit_env())
    except OSError as exc:
        raise RKNNBuildError(f"cannot run {python}: {exc}; {VENV_HINT}") from exc
    if res.returncode != 0:
        raise RKNNBuildError(f"{python} has no working rknn-toolkit2 ({res.stderr.strip().splitlines()[-1:]}); "
                             f"{VENV_HINT}")
    return json.loads(res.stdout.strip().splitlines()[-1])["toolkit"]


def model_inputs(meta: GraphMeta) -> list[tuple[str, tuple[int, ...]]]:
    """The ONNX inputs of a graph in the order the runtime feeds them: the contract's, each of
    ``graphset.VIEW_INPUTS`` as its views (``past_kv.<l>.<k|v>``)."""
    out = []
    for spec in meta.inputs:
        lead = graphset.VIEW_INPUTS.get(spec.name, 0)
        if lead:
            out += [(graphset.view_name(spec.name, idx), tuple(spec.shape[lead:]))
                    for idx in graphset.view_indices(spec.shape, lead)]
        else:
            out.append((spec.name, tuple(spec.shape)))
    return out


def _fingerprint() -> str:
    h = hashlib.sha256()
    for path in (os.path.abspath(__file__), COMPILER):
        with open(path, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:12]


def rknn_key(onnx_key: str, target: str, toolkit: str, dtype: str) -> str:
    blob = json.dumps({"onnx": onnx_key, "backend": "rknn", "target": target, "toolkit": toolkit, "dtype": dtype,
                       "compiler": _fingerprint()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def read_sidecar(out: str, target: str) -> dict:
    path = os.path.join(rknn_dir(out, target), SIDECAR)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("format") == FORMAT else {}


def prepare_source(out: str, name: str, onnx_file: str) -> str:
    """The ONNX file (relative to ``out``) to compile ``name`` from: ``onnx_file`` itself, or a copy whose
    unsliced ``past_kv`` views go through an Identity node (see the module docstring)."""
    import onnx
    from onnx import helper

    path = os.path.join(out, onnx_file)
    model = onnx.load(path, load_external_data=False)
    graph = model.graph
    consumers: dict[str, set] = {}
    for node in graph.node:
        for x in node.input:
            consumers.setdefault(x, set()).add(node.op_type)
    views = [i.name for i in graph.input
             if any(i.name.startswith(v + ".") for v in graphset.VIEW_INPUTS) and consumers.get(i.name, set()) - {"Slice"}]
    rewritten = f"{name}.rknn.onnx"
    if not views:
        if os.path.isfile(os.path.join(out, rewritten)):
            os.remove(os.path.join(out, rewritten))
        return onnx_file
    taken = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    first = []
    for view in views:
        alias = f"{view}/rknn_identity"
        while alias in taken:
            alias += "_"
        for node in graph.node:
            for k, x in enumerate(node.input):
                if x == view:
                    node.input[k] = alias
        first.append(helper.make_node("Identity", [view], [alias], name=f"{view}/rknn_identity"))
    nodes = first + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save(model, os.path.join(out, rewritten + ".partial"))
    os.replace(os.path.join(out, rewritten + ".partial"), os.path.join(out, rewritten))
    return rewritten


def compile_graph_set(out: str, manifest: dict, target: str, dtype: str = "fp16", force: bool = False,
                      toolkit_python: str | None = None, progress=print) -> dict:
    """Compile every graph of the graph set in ``out`` (its ``manifest``) for ``target``; graphs whose
    key is unchanged are kept. Returns the sidecar written to ``rknn/<target>/rknn.json``."""
    if target not in TARGETS:
        raise RKNNBuildError(f"--target {target!r} is not an RKNN platform (choices: {', '.join(TARGETS)})")
    if dtype not in DTYPES:
        raise RKNNBuildError(f"--quantize {dtype!r}: only fp16 is supported by --backend rknn (int8 quantization "
                             f"with a calibration set is not implemented)")
    python = find_toolkit_python(toolkit_python)
    toolkit = toolkit_version(python)
    tdir = rknn_dir(out, target)
    os.makedirs(tdir, exist_ok=True)
    old = {} if force else read_sidecar(out, target)
    old_graphs = old.get("graphs", {}) if old.get("target") == target else {}
    metas = {m.name: m for m in graphset.graph_metas(out, manifest)}
    entries, stale = {}, []
    for g in manifest["graphs"]:
        name = g["name"]
        key = rknn_key(g.get("key", ""), target, toolkit, dtype)
        prev = old_graphs.get(name, {})
        if prev.get("key") == key and os.path.isfile(os.path.join(tdir, prev.get("file", ""))) and \
                os.path.isfile(os.path.join(out, prev.get("source", ""))):
            entries[name] = prev
            continue
        stale.append((name, key, g))
    progress(f"synflux-build: rknn {target} (rknn-toolkit2 {toolkit}, {dtype}): {len(stale)} of "
             f"{len(manifest['graphs'])} graphs to compile -> {tdir}")
    failures = []
    if stale:
        jobs, info = [], {}
        for name, key, g in stale:
            source = prepare_source(out, name, g.get("file") or f"{name}.onnx")
            ins = model_inputs(metas[name])
            outs = [t.name for t in metas[name].outputs]
            jobs.append({"name": name, "onnx": os.path.abspath(os.path.join(out, source)),
                         "out": os.path.abspath(os.path.join(tdir, f"{name}.rknn")),
                         "inputs": [[n, list(s)] for n, s in ins], "outputs": outs})
            info[name] = {"file": f"{name}.rknn", "source": source, "key": key, "onnx_key": g.get("key", ""),
                          "inputs": [[n, list(s)] for n, s in ins], "outputs": outs}
        log_path = os.path.join(tdir, "compile.log")
        with tempfile.TemporaryDirectory(prefix="synflux_rknn_") as tmp:
            job_path = os.path.join(tmp, "job.json")
            with open(job_path, "w", encoding="utf-8") as fh:
                json.dump({"target": target, "dtype": dtype, "graphs": jobs}, fh)
            rfd, wfd = os.pipe()
            with open(log_path, "wb") as log:
                proc = subprocess.Popen([python, COMPILER, "--job", job_path, "--results-fd", str(wfd),
                                         "--log", log_path], stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, pass_fds=(wfd,), cwd=tmp, env=toolkit_env())
            os.close(wfd)
            done = set()
            with os.fdopen(rfd, encoding="utf-8") as results:
                for line in results:
                    row = json.loads(line)
                    name = row["graph"]
                    done.add(name)
                    if row["ok"]:
                        entries[name] = {**info[name], "seconds": row.get("seconds", 0.0)}
                        progress(f"  {name}: compiled in {row.get('seconds', 0.0):.1f} s")
                    else:
                        said = "; ".join(row.get("messages") or []) or "no error lines in its log"
                        failures.append(f"graph {name!r} ({jobs[[j['name'] for j in jobs].index(name)]['onnx']}) "
                                        f"failed at {row.get('stage')}: {row.get('error')}; the toolkit says: {said}")
                        progress(f"  {name}: FAILED at {row.get('stage')}")
            rc = proc.wait()
        missing = [name for name, _, _ in stale if name not in done]
        if missing:
            tail = _log_tail(log_path)
            failures.append(f"the compiler stopped (exit code {rc}) before graphs {missing}; last lines of "
                            f"{log_path}:\n{tail}")
    sidecar = {"format": FORMAT, "target": target, "toolkit": toolkit, "dtype": dtype,
               "config_hash": manifest.get("config_hash", ""), "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "graphs": {g["name"]: entries[g["name"]] for g in manifest["graphs"] if g["name"] in entries}}
    path = os.path.join(tdir, SIDECAR)
    with open(path + ".partial", "w", encoding="utf-8") as fh:
        json.dump(sidecar, fh, indent=1)
    os.replace(path + ".partial", path)
    if failures:
        raise RKNNBuildError(f"rknn-toolkit2 {toolkit} could not compile {len(failures)} graph(s) for {target}:\n  "
                             + "\n  ".join(failures) + f"\n(full log: {os.path.join(tdir, 'compile.log')})")
    progress(f"  rknn graphs up to date in {tdir}" if not stale else f"  wrote {len(stale)} .rknn files to {tdir}")
    return sidecar


def _log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError:
        return ""
