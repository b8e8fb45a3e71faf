"""``synflux-build --backend rknn``: compile a graph set's ONNX files to ``.rknn`` files for a Rockchip NPU.

::

    synflux-build --config config/vlm_demo.yaml --out engines/vlm_demo --backend rknn --target rk3588
    synflux-build ... --backend rknn --target rk3588 --quantize int8 --calib /data/calib   # vision encoder int8

The portable ONNX graph set is built first; then each graph is compiled with rknn-toolkit2 into
``DIR/rknn/<target>/<graph>.rknn``, described by ``rknn.json`` there, and compiled again only when its key
(ONNX, target, toolkit, dtype, quantization and calibration data, this compiler) changes. The toolkit pins
old numpy and onnx, so it runs in its own venv (``.venv-rknn``) as a subprocess: ``compile.py`` beside this
file. The sidecar format, ``--quantize``, calibration data and the ONNX rewrites made before compiling are
described in docs/internals/build.md.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import dataclasses
import tempfile
from dataclasses import dataclass

import numpy as np

from . import sidecar
from .executor import toolkit_env
from ...graphset import cache, reader as graphset
from ...core.contract import GraphMeta
from ...graphkit.builder import BuildError, Builder

TARGETS = ("rk3562", "rk3566", "rk3568", "rk3576", "rk3588")
"""Platforms of rknn-toolkit2 whose NPU takes these graphs; rk3588 is the one exercised here."""
KINDS = ("vision_encoder", "embed", "prefill", "decode", "action_expert")
"""Graph kinds ``--quantize int8:KIND,...`` can name."""
DEFAULT_INT8_KINDS = ("vision_encoder",)
"""What ``--quantize int8`` quantizes (docs/internals/build.md says why the vision encoder alone)."""
INT8 = {"dtype": "w8a8", "algorithm": "normal", "method": "channel"}
"""rknn.config(quantized_dtype=, quantized_algorithm=, quantized_method=) of an int8 graph."""
CALIB_SAMPLES = 4
"""Generated calibration samples per graph when no --calib is given."""
CALIB_DIR = "calib"
COMPILER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile.py")
VENV_HINT = "run `make rknn-venv` in the synflux_ros checkout (or pass --rknn-python PATH)"
QUANTIZE_HINT = (f"--quantize fp16, int8 (= int8:{','.join(DEFAULT_INT8_KINDS)}) or int8:KIND[,KIND...] with "
                 f"KIND among {', '.join(KINDS)}, all")


class RKNNBuildError(BuildError):
    """Compiling to .rknn failed or cannot start (no toolkit venv, bad target, bad --quantize or --calib)."""


def rknn_dir(out: str, target: str) -> str:
    return sidecar.target_dir(out, target)


def rebuild_command(out: str, target: str, quantize: str = "fp16") -> str:
    return (f"synflux-build --config <model.yaml> --out {out or '<graph_dir>'} --backend rknn --target {target}"
            + ("" if quantize in ("", "fp16") else f" --quantize {quantize}"))


def parse_quantize(value: str) -> tuple[str, ...]:
    """The graph kinds a ``--quantize`` value compiles in int8: ``fp16`` -> (), ``int8`` ->
    :data:`DEFAULT_INT8_KINDS`, ``int8:KIND[,KIND...]`` -> those (``all``: every kind), in :data:`KINDS` order."""
    value = str(value or "fp16").strip()
    if value == "fp16":
        return ()
    if value == "int8":
        return DEFAULT_INT8_KINDS
    head, sep, rest = value.partition(":")
    if head != "int8" or not sep:
        raise RKNNBuildError(f"--quantize {value!r} is not allowed ({QUANTIZE_HINT})")
    names = [k.strip() for k in rest.split(",")]
    if not rest.strip() or not all(names):
        raise RKNNBuildError(f"--quantize {value!r}: name at least one graph kind after 'int8:' ({QUANTIZE_HINT})")
    if "all" in names:
        return KINDS
    unknown = [k for k in names if k not in KINDS]
    if unknown:
        raise RKNNBuildError(f"--quantize {value!r}: unknown graph kind {unknown[0]!r} ({QUANTIZE_HINT})")
    return tuple(k for k in KINDS if k in names)


def check_quantize(quantize: str, calib: str | None = None) -> tuple[str, ...]:
    """``parse_quantize(quantize)``, and ``calib`` must be a directory and go with int8."""
    kinds = parse_quantize(quantize)
    if calib is not None and not kinds:
        raise RKNNBuildError(f"--calib is for --quantize int8 (the graphs compile as fp16 with --quantize {quantize})")
    if calib is not None and not os.path.isdir(calib):
        raise RKNNBuildError(f"--calib {calib}: no such directory")
    return kinds


def quantize_spec(int8_kinds) -> str:
    """The canonical ``--quantize`` value of a set of int8 kinds (recorded as ``quantize`` in the sidecar)."""
    kinds = tuple(k for k in KINDS if k in set(int8_kinds))
    return "fp16" if not kinds else "int8:" + ",".join(kinds)


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
    """This module's and the compiler script's source: editing either recompiles."""
    return cache.digest([os.path.abspath(__file__), COMPILER], length=12)


def rknn_key(onnx_key: str, target: str, toolkit: str, dtype: str, quantization: dict | None = None) -> str:
    """A graph's compile key; ``quantization`` (int8 graphs): the toolkit's quantization choices and the
    SHA-256 of the calibration data."""
    fields = {"onnx": onnx_key, "backend": "rknn", "target": target, "toolkit": toolkit, "dtype": dtype,
              "compiler": _fingerprint()}
    if quantization:
        fields["quantization"] = quantization
    return cache.key(fields)


# ---------------------------------------------------------------------------------------------- calibration
class Calibration:
    """The calibration samples of one int8 graph: per sample, one array per model input (model order)."""

    def __init__(self, graph: str, inputs: list[tuple[str, tuple[int, ...]]], samples: list[list[np.ndarray]],
                 source: str):
        self.graph = graph
        self.inputs = inputs
        self.samples = samples
        self.source = source  # "generated" or the --calib directory
        h = hashlib.sha256()
        for sample in samples:
            for (name, _), arr in zip(inputs, sample):
                h.update(f"{name}|{arr.dtype.str}|{list(arr.shape)}|".encode())
                h.update(np.ascontiguousarray(arr).tobytes())
        self.sha256 = h.hexdigest()

    def without(self, names) -> "Calibration":
        """The same samples without the inputs ``names`` (those a compiled graph leaves out, see
        :func:`prepare_source`)."""
        names = set(names)
        keep = [i for i, (name, _) in enumerate(self.inputs) if name not in names]
        return Calibration(self.graph, [self.inputs[i] for i in keep], [[s[i] for i in keep] for s in self.samples],
                           self.source)

    def choices(self) -> dict:
        """What goes into the graph's key besides its ONNX: the toolkit's choices and the data's hash."""
        return {**INT8, "calib_sha256": self.sha256}


def input_dtypes(meta: GraphMeta) -> dict[str, str]:
    """The dtype of each model input (a view has the dtype of its contract input)."""
    out = {}
    for spec in meta.inputs:
        lead = graphset.VIEW_INPUTS.get(spec.name, 0)
        if lead:
            for idx in graphset.view_indices(spec.shape, lead):
                out[graphset.view_name(spec.name, idx)] = spec.dtype
        else:
            out[spec.name] = spec.dtype
    return out


def _view_of(name: str):
    """``("past_kv", (l, k))`` for a view input name, else None."""
    for contract in graphset.VIEW_INPUTS:
        if name.startswith(contract + "."):
            parts = name[len(contract) + 1:].split(".")
            if parts and all(p.isdigit() for p in parts):
                return contract, tuple(int(p) for p in parts)
    return None


def _sample_arrays(meta: GraphMeta, arrays, where: str, calib: str) -> list[np.ndarray]:
    """One sample's arrays in model-input order from ``arrays`` (name -> array: the model inputs, or a
    view input's whole contract tensor), checked against the graph: presence, shape, dtype kind, finite."""
    dtypes = input_dtypes(meta)
    contract_shapes = {spec.name: tuple(spec.shape) for spec in meta.inputs}
    have = list(arrays.keys())
    out = []
    for name, shape in model_inputs(meta):
        view = _view_of(name)
        if name in have:
            arr = np.asarray(arrays[name])
        elif view and view[0] in have:
            whole = np.asarray(arrays[view[0]])
            if whole.shape != contract_shapes[view[0]]:
                raise RKNNBuildError(f"--calib {calib}: graph {meta.name!r} input {view[0]!r}: {where} holds shape "
                                     f"{list(whole.shape)}, the graph takes {list(contract_shapes[view[0]])}")
            arr = whole[view[1]]
        else:
            want = [n for n, _ in model_inputs(meta)]
            raise RKNNBuildError(f"--calib {calib}: graph {meta.name!r}: {where} has no input {name!r} (it has: "
                                 f"{', '.join(have) or 'nothing'}; the graph takes: {', '.join(want)})")
        if arr.shape != tuple(shape):
            raise RKNNBuildError(f"--calib {calib}: graph {meta.name!r} input {name!r}: {where} holds shape "
                                 f"{list(arr.shape)}, the graph takes {list(shape)}")
        want_dt = np.dtype(dtypes[name])
        if want_dt.kind in "iu":
            if arr.dtype.kind not in "iu":
                raise RKNNBuildError(f"--calib {calib}: graph {meta.name!r} input {name!r}: {where} holds "
                                     f"{arr.dtype} values; the graph takes integers ({want_dt}: token ids and "
                                     f"positions stay integers, they are not quantized)")
        else:
            if arr.dtype.kind not in "fiu":
                raise RKNNBuildError(f"--calib {calib}: graph {meta.name!r} input {name!r}: {where} holds "
                                     f"{arr.dtype} values; the graph takes {want_dt}")
            if not np.all(np.isfinite(arr)):
                raise RKNNBuildError(f"--calib {calib}: graph {meta.name!r} input {name!r}: {where} holds "
                                     f"non-finite values (NaN or inf)")
        out.append(np.ascontiguousarray(arr, dtype=want_dt))
    return out


def load_calibration(calib: str, meta: GraphMeta) -> Calibration:
    """The samples of ``meta``'s graph in ``calib``: ``calib/<graph>/*.npz``, or for the vision encoder
    ``calib/*.npz`` (the --backend tensorrt layout) when ``calib/<graph>/`` does not exist."""
    sub = os.path.join(calib, meta.name)
    files = sorted(glob.glob(os.path.join(sub, "*.npz")))
    if not files and not os.path.isdir(sub) and meta.kind == "vision_encoder":
        files = sorted(glob.glob(os.path.join(calib, "*.npz")))
    if not files:
        flat = " (or *.npz holding pixel_values directly in it)" if meta.kind == "vision_encoder" else ""
        raise RKNNBuildError(f"--calib {calib}: no samples for graph {meta.name!r} (int8): expected "
                             f"{os.path.join(sub, '*.npz')}{flat}, one sample per file with an array per input "
                             f"({', '.join(n for n, _ in model_inputs(meta))})")
    samples = []
    for path in files:
        try:
            with np.load(path, allow_pickle=False) as z:
                samples.append(_sample_arrays(meta, z, path, calib))
        except RKNNBuildError:
            raise
        except (OSError, ValueError) as exc:
            raise RKNNBuildError(f"--calib {calib}: graph {meta.name!r}: {path} is not a readable .npz "
                                 f"({exc})") from exc
    return Calibration(meta.name, model_inputs(meta), samples, os.path.abspath(calib))


def generated_calibration(cfg, meta: GraphMeta, n: int = CALIB_SAMPLES) -> Calibration:
    """``n`` seeded samples for bring-up: ``synflux-validate``'s representative inputs (Gaussian pixel
    values and embeddings, ids in the vocabulary, positions in the bucket, a random KV cache), drawn
    from seeds of their own (validation runs on other draws)."""
    from ...graphkit.feeds import seeded_feeds

    samples = []
    for s in range(n):
        rng = np.random.default_rng([0x5CA1, s, sum(map(ord, meta.name))])
        kv = (rng.standard_normal(cfg.llm.kv_shape) * 0.5).astype(cfg.llm.kv_dtype)
        feeds = seeded_feeds(meta, cfg, rng, kv)
        samples.append(_sample_arrays(meta, feeds, f"generated sample {s}", "(generated)"))
    return Calibration(meta.name, model_inputs(meta), samples, "generated")


def plan_quantization(out: str, metas: list[GraphMeta], int8_kinds, calib: str | None = None) -> dict:
    """The :class:`Calibration` of every graph compiled in int8 (graph name -> it): from ``calib`` when
    given, else generated from the graph set's ``config.yaml``."""
    chosen = [m for m in metas if m.kind in set(int8_kinds)]
    if calib is not None and not os.path.isdir(calib):
        raise RKNNBuildError(f"--calib {calib}: no such directory")
    if not chosen:
        return {}
    cfg = None
    if calib is None:
        from ...core.config import load_config
        path = os.path.join(out, "config.yaml")
        if not os.path.isfile(path):
            raise RKNNBuildError(f"cannot generate a calibration set: {path} not found; pass --calib DIR")
        cfg = load_config(path)
    return {m.name: (load_calibration(calib, m) if calib is not None else generated_calibration(cfg, m))
            for m in chosen}


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def write_calibration(tdir: str, cal: Calibration) -> str:
    """The samples as .npy files plus the toolkit's dataset.txt in ``tdir/calib/<graph>/`` (relative names,
    which the toolkit resolves against dataset.txt's directory); returns dataset.txt relative to ``tdir``."""
    gdir = os.path.join(tdir, CALIB_DIR, cal.graph)
    if os.path.isdir(gdir):
        shutil.rmtree(gdir)
    os.makedirs(gdir)
    lines = []
    for s, sample in enumerate(cal.samples):
        files = []
        for i, ((name, _), arr) in enumerate(zip(cal.inputs, sample)):
            fname = f"s{s:03d}_{i}_{_UNSAFE.sub('_', name)}.npy"
            np.save(os.path.join(gdir, fname), arr)
            files.append(fname)
        lines.append(" ".join(files))
    with open(os.path.join(gdir, "dataset.txt"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    return os.path.join(CALIB_DIR, cal.graph, "dataset.txt")


def read_sidecar(out: str, target: str) -> sidecar.Sidecar | None:
    """The sidecar of an earlier compile for ``target`` (None when there is none or it cannot be used)."""
    try:
        return sidecar.read(out, target)
    except (OSError, sidecar.SidecarError):
        return None


def prepare_source(out: str, name: str, onnx_file: str) -> tuple[str, list[str]]:
    """The ONNX file (relative to ``out``) to compile ``name`` from, and the inputs it leaves out:
    ``onnx_file`` itself, or a copy whose unsliced ``past_kv`` views go through an Identity node and which
    takes no view that nothing reads (docs/internals/build.md says why)."""
    import onnx
    from onnx import helper

    path = os.path.join(out, onnx_file)
    model = onnx.load(path, load_external_data=False)
    graph = model.graph
    consumers: dict[str, set] = {}
    for node in graph.node:
        for x in node.input:
            consumers.setdefault(x, set()).add(node.op_type)
    is_view = [i for i in graph.input if any(i.name.startswith(v + ".") for v in graphset.VIEW_INPUTS)]
    views = [i.name for i in is_view if consumers.get(i.name, set()) - {"Slice"}]
    unread = [i.name for i in is_view if i.name not in consumers]
    rewritten = f"{name}.rknn.onnx"
    if not views and not unread:
        if os.path.isfile(os.path.join(out, rewritten)):
            os.remove(os.path.join(out, rewritten))
        return onnx_file, []
    kept = [i for i in graph.input if i.name not in unread]
    del graph.input[:]
    graph.input.extend(kept)
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
    return rewritten, unread


def compile_graph_set(out: str, manifest: dict, target: str, quantize: str = "fp16", force: bool = False,
                      toolkit_python: str | None = None, calib: str | None = None, progress=print) -> dict:
    """Compile every graph of the graph set in ``out`` (its ``manifest``) for ``target``, the graph kinds
    ``quantize`` names in int8 (calibrated on ``calib``, else on generated samples), the others in fp16;
    graphs whose key is unchanged are kept. Returns the sidecar written to ``rknn/<target>/rknn.json``."""
    if target not in TARGETS:
        raise RKNNBuildError(f"--target {target!r} is not an RKNN platform (choices: {', '.join(TARGETS)})")
    int8_kinds = check_quantize(quantize, calib)
    spec = quantize_spec(int8_kinds)
    metas = {m.name: m for m in graphset.graph_metas(out, manifest)} if manifest["graphs"] else {}
    plans = plan_quantization(out, list(metas.values()), int8_kinds, calib)  # before the toolkit: bad data fails fast
    python = find_toolkit_python(toolkit_python)
    toolkit = toolkit_version(python)
    tdir = rknn_dir(out, target)
    os.makedirs(tdir, exist_ok=True)
    old = None if force else read_sidecar(out, target)
    old_graphs = old.graphs if old is not None else {}
    entries, stale = {}, []
    for g in manifest["graphs"]:
        name = g["name"]
        cal = plans.get(name)
        dtype = "int8" if cal else "fp16"
        key = rknn_key(g.get("key", ""), target, toolkit, dtype, cal.choices() if cal else None)
        prev = old_graphs.get(name)
        dataset = prev.quantization.dataset if prev is not None and prev.quantization else ""
        if prev is not None and prev.key == key and os.path.isfile(os.path.join(tdir, prev.file)) and \
                os.path.isfile(os.path.join(out, prev.source)) and \
                (not cal or os.path.isfile(os.path.join(tdir, dataset))):
            entries[name] = prev
            continue
        stale.append((name, key, g))
    progress(f"synflux-build: rknn {target} (rknn-toolkit2 {toolkit}, {spec}): {len(stale)} of "
             f"{len(manifest['graphs'])} graphs to compile -> {tdir}")
    if int8_kinds and not plans:
        progress(f"  --quantize {quantize}: no graph of kind {', '.join(int8_kinds)} in this set; all fp16")
    for name, cal in plans.items():
        if any(name == st[0] for st in stale):
            where = (f"{len(cal.samples)} generated samples (bring-up only: calibrate on recorded inputs with "
                     f"--calib DIR)" if cal.source == "generated" else f"{len(cal.samples)} samples from {cal.source}")
            progress(f"  {name}: int8 ({INT8['dtype']}, {INT8['algorithm']}), calibrated on {where}")
    failures = []
    if stale:
        jobs, info = [], {}
        for name, key, g in stale:
            source, unread = prepare_source(out, name, g.get("file") or f"{name}.onnx")
            ins = [x for x in model_inputs(metas[name]) if x[0] not in unread]
            outs = [t.name for t in metas[name].outputs]
            job = {"name": name, "onnx": os.path.abspath(os.path.join(out, source)),
                   "out": os.path.abspath(os.path.join(tdir, f"{name}.rknn")),
                   "inputs": [[n, list(s)] for n, s in ins], "outputs": outs, "quantize": None}
            info[name] = sidecar.GraphEntry(file=f"{name}.rknn", source=source, key=key,
                                            onnx_key=str(g.get("key", "")), inputs=tuple(ins), outputs=tuple(outs))
            cal = plans.get(name)
            if cal:
                cal = cal.without(unread)  # one .npy per input the compiled graph takes
                dataset = write_calibration(tdir, cal)
                job["quantize"] = {**INT8, "dataset": os.path.abspath(os.path.join(tdir, dataset))}
                info[name] = dataclasses.replace(info[name], dtype="int8", quantization=sidecar.Quantization(
                    **INT8, dataset=dataset, samples=len(cal.samples), calib_sha256=cal.sha256,
                    calib_source=cal.source))
            jobs.append(job)
        log_path = os.path.join(tdir, "compile.log")
        with tempfile.TemporaryDirectory(prefix="synflux_rknn_") as tmp:
            job_path = os.path.join(tmp, "job.json")
            with open(job_path, "w", encoding="utf-8") as fh:
                json.dump({"target": target, "graphs": jobs}, fh)
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
                        entries[name] = dataclasses.replace(info[name], seconds=row.get("seconds", 0.0))
                        progress(f"  {name}: compiled ({info[name].dtype}) in {row.get('seconds', 0.0):.1f} s")
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
    graphs = {g["name"]: entries[g["name"]] for g in manifest["graphs"] if g["name"] in entries}
    _prune_calibration(tdir, {n for n, e in graphs.items() if e.dtype == "int8"})
    written = sidecar.write(out, sidecar.Sidecar(target=target, toolkit=toolkit, graphs=graphs, quantize=spec,
                                                 config_hash=manifest.get("config_hash", "")))
    if failures:
        raise RKNNBuildError(f"rknn-toolkit2 {toolkit} could not compile {len(failures)} graph(s) for {target}:\n  "
                             + "\n  ".join(failures) + f"\n(full log: {os.path.join(tdir, 'compile.log')})")
    progress(f"  rknn graphs up to date in {tdir}" if not stale else f"  wrote {len(stale)} .rknn files to {tdir}")
    return written


def _prune_calibration(tdir: str, keep: set) -> None:
    """Remove the calibration samples of graphs that are no longer compiled in int8."""
    root = os.path.join(tdir, CALIB_DIR)
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if name not in keep:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    if not os.listdir(root):
        os.rmdir(root)


def _log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError:
        return ""


@dataclass(frozen=True)
class RKNNOptions:
    """``synflux-build --backend rknn`` options: the platform, which graph kinds run in int8 and on what
    calibration data, and the Python of the venv holding rknn-toolkit2."""
    target: str | None = None
    quantize: str = "fp16"
    calib: str | None = None
    toolkit_python: str | None = None

    def __post_init__(self):
        if self.target is not None and self.target not in TARGETS:
            raise RKNNBuildError(f"--target {self.target!r} is not an RKNN platform (choices: {', '.join(TARGETS)})")
        check_quantize(self.quantize, self.calib)


class RKNNBuilder(Builder):
    """``synflux-build --backend rknn``: one .rknn per graph for a Rockchip NPU, compiled by rknn-toolkit2 in
    its own venv."""

    name = "rknn"
    options_type = RKNNOptions
    description = ("portable ONNX, then one .rknn per graph for a Rockchip NPU (--target; rknn-toolkit2 in "
                   ".venv-rknn)")

    def add_arguments(self, group) -> None:
        group.add_argument("--target", default=None, help=f"the Rockchip platform to compile for ({', '.join(TARGETS)})")
        group.add_argument("--quantize", default="fp16",
                           help="fp16 (default); int8 = the vision encoder in int8 (w8a8), the rest fp16; "
                                "int8:KIND[,KIND] = these graph kinds (vision_encoder, embed, prefill, decode, "
                                "action_expert, all) in int8; calibrated on --calib DIR (DIR/<graph>/*.npz), else on "
                                "generated samples (bring-up only)")
        group.add_argument("--rknn-python", dest="toolkit_python", default=None,
                           help="Python of the venv holding rknn-toolkit2 (default: .venv-rknn beside this package's "
                                "venv, made by `make rknn-venv`)")

    def options_from_args(self, args) -> RKNNOptions:
        return RKNNOptions(target=args.target, quantize=args.quantize, calib=args.calib,
                           toolkit_python=args.toolkit_python)

    def prepare(self, options, weights: str) -> RKNNOptions:
        if options is None or not options.target:
            raise RKNNBuildError(f"--backend rknn needs --target (choices: {', '.join(TARGETS)})")
        return options

    def check_config(self, cfg) -> None:
        if cfg.vision_images_per_call > 1:
            raise RKNNBuildError(f"--backend rknn: the vision encoder takes {cfg.vision_images_per_call} cameras in "
                                 f"one call, a graph rknn-toolkit2 2.5.0 did not finish compiling in 15 minutes "
                                 f"(the one-image graph compiles in seconds): set vision.batch_cameras: false")

    def compile(self, cfg, out, manifest, options, *, hf_dir, seed, force, progress) -> None:
        compile_graph_set(out, manifest, options.target, options.quantize, force=force,
                          toolkit_python=options.toolkit_python, calib=options.calib, progress=progress)
