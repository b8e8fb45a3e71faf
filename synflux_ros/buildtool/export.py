"""synflux-build: export the static graph set of a model config to ONNX (random or Hugging Face weights).

    synflux-build --config config/vlm_demo.yaml --out engines/vlm_demo
    synflux-build --config config/vlm_qwen3.yaml --out engines/qwen3 --from-hf /models/Qwen3-VL-8B-Instruct
    synflux-build --config config/vlm_demo.yaml --out engines/smollm2 --from-gguf SmolLM2-135M-Instruct.Q4_1.gguf

Writes, for every graph of ``graph_set(config)`` (vision encoder, embed/prefill buckets, decode buckets,
action expert), ``<name>.onnx`` with its weights in one shared ``weights.bin``, plus ``manifest.json``
(graph metas, files, config hash, weight source, tool versions), ``config.yaml`` (the effective config to
start a node with) and, with ``--from-hf``, the checkpoint's ``tokenizer.json``.

A graph whose inputs did not change (same graph contract, same weights, same tools) is skipped; use
``--force`` to rebuild everything. The exported graphs use standard ONNX ops only; backend-specific
optimisation (fused operators, engines) happens in the backend (``--backend``), not in these files.

torch is needed here only; running the graphs needs onnxruntime and numpy.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time

import yaml

from ..backends import UnknownBackendError, buildable_backends, builder_table, resolve_builder
from ..core.config import ConfigError, ModelConfig, graph_values, load_config
from ..core.contract import GraphMeta, graph_set
from ..graphset import cache, reader as graphset, writer as graphset_writer
from ..graphkit.builder import PORTABLE_WEIGHT_DTYPES, BuildError, flags_given
from ..graphkit.onnx_export import (  # noqa: F401 (the export helpers stay importable from here)
    OPSET, check_model_io, example_inputs, example_tensors, export_graph, onnx_inputs, restore_unused_inputs)

TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")
"""Files of a checkpoint copied beside its tokenizer.json: the chat template and the special tokens."""


def _versions() -> dict:
    import onnx
    import torch

    from .. import __version__ as ours
    return {"synflux_ros": ours, "torch": torch.__version__, "onnx": onnx.__version__, "opset": OPSET,
            "exporter": _exporter_fingerprint()}


def _exporter_fingerprint() -> str:
    """Hash of the model definitions, the export code (this file and the ONNX export helpers) and the graph-set
    format: editing them invalidates the exported graphs (the other tools, e.g. the benchmark, do not)."""
    here = os.path.dirname(os.path.abspath(__file__))
    package = os.path.dirname(here)
    kit = os.path.join(package, "graphkit")
    models = os.path.join(kit, "torch_models")
    fmt = os.path.join(package, "graphset")
    paths = [os.path.abspath(__file__), os.path.join(kit, "onnx_export.py"), os.path.join(fmt, "reader.py"),
             os.path.join(fmt, "writer.py"), os.path.join(here, "quantize.py")]
    paths += [os.path.join(models, n) for n in sorted(os.listdir(models)) if n.endswith(".py")]
    return cache.digest(paths, named=True, length=12)


def weights_fingerprint(seed: int, hf_dir: str | None) -> str:
    """Identifies the weights: the seed for random weights, else the checkpoint's files (names, sizes,
    modification times) and its config.json."""
    if not hf_dir:
        return f"random:{seed}"
    h = hashlib.sha256()
    for name in sorted(os.listdir(hf_dir)):
        path = os.path.join(hf_dir, name)
        if not os.path.isfile(path):
            continue
        st = os.stat(path)
        h.update(f"{name}:{st.st_size}:{int(st.st_mtime)};".encode())
        if name == "config.json":
            with open(path, "rb") as fh:
                h.update(fh.read())
    return "hf:" + h.hexdigest()[:16]


def graph_key(cfg: ModelConfig, meta: GraphMeta, weights: str, versions: dict) -> str:
    """What one graph depends on: its own contract (shapes, bucket), the config sections that define its
    computation, the weights and the tools. Adding a bucket therefore exports only the new graphs."""
    d = cfg.to_dict()
    llm = {k: v for k, v in d["llm"].items() if k not in ("prefill_buckets", "decode_buckets")}
    if meta.kind == "vision_encoder":
        sections = {"vision": d["vision"], "hidden_dim": d["llm"]["hidden_dim"]}
    elif meta.kind in ("action_expert", "action_expert_vjp", "vl_context", "dit", "dit_vjp"):
        sections = {"llm": llm, "action": graph_values(cfg.action) if cfg.action is not None else {}}
    else:
        sections = {"llm": llm}
    return cache.key({"graph": meta.to_dict(), "sections": sections, "weights": weights, "tools": versions})


def _remove_graph_files(out: str, old: dict, gone: list[str]) -> None:
    """Delete the files of the last build's graphs ``gone`` from the set (e.g. decode graphs left in the
    directory by a build of a config that had them), once the new manifest does not name them."""
    for name in gone:
        try:
            path = graphset.member_path(out, str(old[name].get("file") or f"{name}.onnx"), f"graph {name!r}")
        except graphset.GraphSetError:
            continue  # a manifest entry pointing outside the directory: not ours to delete
        if os.path.isfile(path):
            os.remove(path)
            _progress(f"  removed {os.path.basename(path)} (no longer in the graph set)")


def _progress(msg: str) -> None:
    print(msg, flush=True)


def resolve_config(cfg: ModelConfig, hf_dir: str | None) -> ModelConfig:
    """The config whose graphs are built: the YAML, with model dimensions from the checkpoint if given."""
    if not hf_dir:
        return cfg
    from ..graphkit.torch_models import config_from_hf
    return config_from_hf(hf_dir, cfg)


def check_serves(cfg: ModelConfig, hf_dir: str | None) -> None:
    """Refuse (BuildError), before anything is exported, a chat config that ``vlm_node`` would refuse at start with
    the tokenizer and chat template the graph set ships (:func:`synflux_ros.runtimes.vlm.check_chat_setup`). A set
    that ships no tokenizer (the config names none, the checkpoint has no tokenizer.json) is not checked: its
    tokenizer is given at run time."""
    shipped = os.path.join(hf_dir, "tokenizer.json") if hf_dir else ""
    shipped = shipped if os.path.isfile(shipped) else ""
    if cfg.mode != "vlm" or not (shipped or cfg.tokenizer.path):
        return
    from ..model.tokenizer import load_tokenizer
    from ..runtimes.vlm import chat_template_of, check_chat_setup
    try:
        tokenizer = load_tokenizer(cfg, shipped)
        check_chat_setup(cfg, tokenizer, chat_template_of(cfg, tokenizer))
    except ConfigError as exc:
        raise BuildError(f"{cfg.name}: vlm_node would refuse this graph set at start: {exc}") from None


def build(cfg: ModelConfig, out: str, backend: str = "onnxruntime", hf_dir: str | None = None, seed: int = 0,
          force: bool = False, threads: int | None = None, weights: str = "float32", block: int = 32,
          options=None) -> dict:
    """Build (or bring up to date) the graph set of ``cfg`` in ``out``; returns the manifest. A backend with a
    build step of its own (``BUILDERS``) then compiles the graphs beside it, with ``options`` (its options
    dataclass, e.g. :class:`~synflux_ros.backends.tensorrt.build.TensorRTOptions`). ``weights`` ``int8``/``int4``
    quantizes the decoder's MatMul weights block-wise (``block`` rows per scale; see
    :mod:`synflux_ros.buildtool.quantize`), for the onnxruntime backend only."""
    try:
        builder = resolve_builder(backend)
    except UnknownBackendError as exc:
        raise BuildError(str(exc)) from exc
    from .quantize import QuantizeError, check_weights
    try:
        check_weights(weights, block)
    except QuantizeError as exc:
        raise BuildError(str(exc)) from exc
    takes = builder.weight_dtypes if builder else PORTABLE_WEIGHT_DTYPES
    if weights not in takes:
        raise BuildError(f"--weights {weights}: --backend {backend!r} compiles {', '.join(takes)} graph sets only "
                         f"(quantized sets are for a backend that loads the portable set as it is: onnxruntime)")
    wanted = builder.options_type if builder else None
    if options is not None and (wanted is None or not isinstance(options, wanted)):
        takes = f"it takes {wanted.__name__}" if wanted else "it takes none"
        raise BuildError(f"{type(options).__name__} is not an options type of --backend {backend!r} ({takes})")
    if builder:
        options = builder.prepare(options, weights)  # before exporting anything
    cfg = resolve_config(cfg, hf_dir)  # the checkpoint's dimensions, read once
    if builder:
        builder.check_config(cfg)
    check_serves(cfg, hf_dir)
    manifest = _build_onnx(cfg, out, backend, hf_dir, seed, force, threads, weights, block)
    if builder:
        builder.compile(cfg, out, manifest, options, hf_dir=hf_dir, seed=seed, force=force, progress=_progress)
    return manifest


def _build_onnx(cfg: ModelConfig, out: str, backend: str, hf_dir: str | None, seed: int, force: bool,
                threads: int | None, weight_dtype: str = "float32", block: int = 32) -> dict:
    """The portable ONNX graph set of ``cfg`` (resolved against ``hf_dir``: :func:`resolve_config`) in ``out``
    (graphs whose key is unchanged are kept)."""
    t_start = time.perf_counter()
    import torch
    if threads:
        torch.set_num_threads(threads)
    os.makedirs(out, exist_ok=True)
    versions = _versions()
    weights = weights_fingerprint(seed, hf_dir)
    metas = graph_set(cfg)
    previous = {}  # the last build's graphs: kept when up to date (not with --force), removed when gone
    if os.path.isfile(os.path.join(out, graphset.MANIFEST_FILE)):
        try:
            previous = {g["name"]: g for g in graphset.read_manifest(out).get("graphs", [])}
        except (ValueError, OSError):
            previous = {}
    old = {} if force else previous
    from . import quantize
    quantized = weight_dtype != "float32"
    carry = quantize.load_ggml_blocks(hf_dir) if quantized else None

    def weights_of(meta):  # the quantized graphs depend on the weight format too
        if quantized and meta.kind in quantize.QUANTIZED_KINDS:
            return f"{weights};{weight_dtype}/{block}" + (";ggml-carried/1" if carry else "")
        return weights
    keys = {m.name: graph_key(cfg, m, weights_of(m), versions) for m in metas}
    stale = [m for m in metas if old.get(m.name, {}).get("key") != keys[m.name]
             or not os.path.isfile(os.path.join(out, old[m.name].get("file", "")))]
    gone = sorted(set(previous) - set(keys))  # graphs of the last build that this config's set no longer has
    _progress(f"synflux-build: {cfg.name} ({len(metas)} graphs, weights {weights}) -> {out}")
    if not stale:
        _progress("  all graphs up to date, nothing to do")
        manifest = graphset.read_manifest(out)
        if manifest.get("backend") != backend or gone:  # the same graphs for another backend, or fewer of them
            manifest["backend"] = backend
            if gone:  # the config differs in the graphs it no longer has (e.g. a bucket dropped)
                manifest["graphs"] = [g for g in manifest.get("graphs", []) if g.get("name") in keys]
                manifest["config"], manifest["config_hash"] = cfg.to_dict(), cfg.graph_hash()
            graphset_writer.write_manifest(out, manifest)
            _write_effective_config(cfg, out, backend, manifest.get("tokenizer") or "")
            _remove_graph_files(out, previous, gone)
        return manifest
    from ..graphkit.torch_models import build_graph_modules
    gm = build_graph_modules(cfg, seed=seed, hf_dir=hf_dir)
    modules, tokenizer = gm.modules, gm.tokenizer_path
    missing = [m.name for m in metas if m.name not in modules]
    if missing:
        raise BuildError(f"no exporter for graphs {missing} of {cfg.name!r}")
    stale_names = {m.name for m in stale}
    exported = {}
    qcache: dict = {}  # the same weight in every bucket's graph is quantized once
    carried: dict = {}
    with tempfile.TemporaryDirectory(prefix="synflux_export_") as tmp:
        for i, meta in enumerate(metas):
            tag = f"  [{i + 1}/{len(metas)}] {meta.name}"
            if meta.name not in stale_names:
                _progress(f"{tag}: unchanged, skipped")
                continue
            t0 = time.perf_counter()
            _progress(f"{tag}: exporting ...")
            exported[meta.name] = export_graph(modules[meta.name], meta, tmp)
            if quantized and meta.kind in quantize.QUANTIZED_KINDS:
                import onnx
                q = quantize.quantize_model(exported[meta.name], weight_dtype, block, qcache, carry)
                onnx.checker.check_model(exported[meta.name])
                carried = q["carried"] or carried  # the same weights in every bucket's graph
                kept = "".join(f", {n} carried over from GGUF {t}" for t, n in sorted(q["carried"].items()))
                _progress(f"{tag}: {q['tensors']} weights in {weight_dtype} (block {block}{kept}): "
                          f"{q['fp32_bytes'] / 2**20:.1f} -> {q['quantized_bytes'] / 2**20:.1f} MiB")
            _progress(f"{tag}: done in {time.perf_counter() - t0:.1f} s")
        # Unchanged graphs keep their files; tensors already in weights.bin are reused, new ones appended.
        kept = len(exported) < len(metas)
        info = graphset_writer.write_weights_and_models(exported, out, append=kept)
        if quantized and not any(m.kind in quantize.QUANTIZED_KINDS for m in stale):  # kept from the last build
            carried = (graphset.read_manifest(out).get("weights") or {}).get("ggml_carried", {})
        info.update(quantize.weights_info(weight_dtype, block, carried))
    tok_file = ""
    if tokenizer:
        shutil.copyfile(tokenizer, os.path.join(out, "tokenizer.json"))
        tok_file = "tokenizer.json"
        for name in TOKENIZER_SIDE_FILES:  # the chat template and special tokens travel with the tokenizer
            side = os.path.join(os.path.dirname(tokenizer), name)
            if os.path.isfile(side):
                shutil.copyfile(side, os.path.join(out, name))
    graphs = []
    for meta in metas:
        d = dataclasses.replace(meta, file=f"{meta.name}.onnx").to_dict()
        d["key"] = keys[meta.name]
        graphs.append(d)
    manifest = {"format": graphset.FORMAT, "model": cfg.name, "config_hash": cfg.graph_hash(),
                "config": cfg.to_dict(), "weights": info, "tokenizer": tok_file,
                "source": {"weights": weights, "hf_dir": os.path.abspath(hf_dir) if hf_dir else ""},
                "tools": versions, "backend": backend, "graphs": graphs}
    graphset_writer.write_manifest(out, manifest)
    _write_effective_config(cfg, out, backend, tok_file)
    _remove_graph_files(out, previous, gone)
    _progress(f"  wrote {len(exported)} graphs, weights {info['bytes'] / 2**20:.1f} MiB "
              f"in {time.perf_counter() - t_start:.1f} s")
    return manifest


FAST_TOKENIZER = "fast_tokenizer.json"
"""The FAST tokenizer a pi0-FAST graph set ships (``action.fast_tokenizer``)."""


def _write_effective_config(cfg: ModelConfig, out: str, backend: str, tok_file: str) -> None:
    shipped = {}
    if cfg.mode == "vla" and cfg.action.token_codec == "fast":  # the FAST tokenizer travels with the graph set
        src, dst = cfg.relative_to_source(cfg.action.fast_tokenizer), os.path.join(out, FAST_TOKENIZER)
        if not os.path.isfile(src):
            raise BuildError(f"action.fast_tokenizer: {src!r} is not a file (the FAST tokenizer.json)")
        if os.path.abspath(src) != os.path.abspath(dst):
            shutil.copyfile(src, dst)
        shipped["action"] = {"fast_tokenizer": FAST_TOKENIZER}
    effective = cfg.with_overrides(executor={"backend": backend, "graph_dir": "."},
                                   tokenizer={"path": tok_file} if tok_file else {}, **shipped)
    with open(os.path.join(out, "config.yaml"), "w", encoding="utf-8") as fh:
        fh.write(f"# Effective config of the graph set in this directory (written by synflux-build).\n")
        yaml.safe_dump(_yaml_ready(effective.to_dict()), fh, sort_keys=False)


def _yaml_ready(obj):
    if isinstance(obj, dict):
        return {k: _yaml_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_yaml_ready(v) for v in obj]
    return obj


def _builder_groups(ap: argparse.ArgumentParser) -> dict:
    """An option group per backend with a build step, holding that backend's flags: backend -> (builder, group)."""
    groups = {}
    for name in sorted(builder_table()):
        builder = resolve_builder(name)
        if builder is not None:
            group = ap.add_argument_group(f"--backend {name}", builder.description or None)
            builder.add_arguments(group)
            groups[name] = (builder, group)
    return groups


def _backend_options(args, groups: dict):
    """The build-step options of ``--backend`` from the command line; another backend's flag is an error."""
    for name, (_, group) in groups.items():
        given = flags_given(group, args)
        if given and name != args.backend:
            raise BuildError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for --backend {name}, "
                             f"not {args.backend!r}")
    if args.backend not in groups:
        if args.calib:
            raise BuildError(f"--calib is for a backend that compiles int8 graphs ({', '.join(sorted(groups))}), "
                             f"not {args.backend!r}")
        return None
    return groups[args.backend][0].options_from_args(args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="synflux-build", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="model YAML (e.g. config/vlm_demo.yaml)")
    ap.add_argument("--out", required=True, help="output directory of the graph set")
    ap.add_argument("--backend", default="onnxruntime", help=f"target backend ({', '.join(buildable_backends())})")
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--from-hf", dest="hf_dir", default=None,
                        help="local Hugging Face checkpoint directory (Qwen3, Qwen3-VL, Llama); "
                             "default: random weights")
    source.add_argument("--from-gguf", dest="gguf_file", default=None, metavar="FILE",
                        help="llama.cpp GGUF file (llama, qwen3), dequantized to float32, with its tokenizer and "
                             "chat template; read as a temporary --from-hf checkpoint (see build/gguf_import.py)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    ap.add_argument("--force", action="store_true", help="rebuild every graph")
    ap.add_argument("--threads", type=int, default=None, help="torch threads while exporting")
    ap.add_argument("--weights", default="float32", choices=("float32", "int8", "int4"),
                    help="weight-only quantization of the decoder's MatMul weights (symmetric, per block of "
                         "--block input rows; DequantizeLinear, opset 21; onnxruntime fuses it into MatMulNBits)")
    ap.add_argument("--block", type=int, default=32, help="--weights int8|int4: rows per scale (16 .. 256)")
    ap.add_argument("--calib", default=None, metavar="DIR",
                    help="calibration data of an int8 build (--backend rknn --quantize int8, --backend tensorrt "
                         "--int8): npz batches of the graphs' inputs")
    ap.add_argument("--check", nargs="?", const="", metavar="BACKEND",
                    help="after building, load each graph on BACKEND (default: --backend; e.g. openvino) and report "
                         "per graph whether it compiles and which operators it does not support; exit 1 if any")
    ap.add_argument("--check-options", default="{}", help="with --check: executor options of that backend, JSON")
    groups = _builder_groups(ap)
    args = ap.parse_args(argv)
    for flag, value in (("--from-hf", args.hf_dir), ("--from-gguf", args.gguf_file)):
        if value is not None and not value.strip():  # e.g. a shell lookup that found nothing
            print(f"synflux-build: error: {flag} is empty: give the checkpoint's path", file=sys.stderr)
            return 2
    try:
        cfg = load_config(args.config)
        options = _backend_options(args, groups)
        with contextlib.ExitStack() as stack:
            hf_dir = args.hf_dir
            if args.gguf_file:  # converted into a temporary checkpoint inside --out, then the --from-hf path
                from .gguf_import import gguf_checkpoint, record_source, text_only
                cfg = text_only(cfg, args.gguf_file, _progress)
                hf_dir = stack.enter_context(gguf_checkpoint(args.gguf_file, args.out, progress=_progress))
            build(cfg, args.out, args.backend, hf_dir, args.seed, args.force, args.threads, weights=args.weights,
                  block=args.block, options=options)
            if args.gguf_file:
                record_source(args.out, args.gguf_file, hf_dir)
    except (ConfigError, BuildError) as exc:
        print(f"synflux-build: error: {exc}", file=sys.stderr)
        return 2
    if args.check is not None:
        from .check import check_graph_set, report
        backend = args.check or args.backend
        try:
            check_options = json.loads(args.check_options)
        except json.JSONDecodeError as exc:
            print(f"synflux-build: error: --check-options: not JSON ({exc})", file=sys.stderr)
            return 2
        builder, _ = groups.get(backend, (None, None))
        try:
            rows = builder.check(args.out, graphset.graph_metas(args.out, graphset.read_manifest(args.out)),
                                 options if backend == args.backend else None) if builder else None
        except BuildError as exc:
            print(f"synflux-build: error: {exc}", file=sys.stderr)
            return 2
        if rows is None:
            rows = check_graph_set(args.out, backend, check_options)
        print(report(rows, backend))
        return 0 if all(r.ok for r in rows) else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
