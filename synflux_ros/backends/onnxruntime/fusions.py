"""Load-time rewrite of the portable decoder graphs into ONNX Runtime's fused CPU kernels (the onnxruntime
executor's ``fusions`` option): RMSNorm, residual add + RMSNorm, the rotary embedding and attention, with
onnxscript's pattern rewriter and our own rules (:mod:`.fusion_rules`, imported only when fusions are enabled)
where our graphs' forms differ from what onnxscript's rules expect. A decode graph's attention then appends to
the KV slot in place (``graphset.IN_PLACE_SUFFIX``, ``graphset.ROWS_IN_PLACE``). :func:`fused_graph_set`
caches the rewritten set. Needs ``onnxscript`` (and ``onnx``), imported on first use; what each rule does and
why: docs/backends/onnxruntime.md#fusions.
"""
from __future__ import annotations

import os
import shutil

from ...core.config import choices_hint
from ...graphset import cache, reader as graphset

FUSIONS = ("rms_norm", "skip_rms_norm", "rotary", "attention", "padded_keys")
"""The rewrites this module knows, in the order they are applied."""
DEFAULT_FUSIONS = ("rms_norm", "rotary", "attention", "padded_keys")
"""What ``fusions: true`` applies (``skip_rms_norm`` gains nothing for decoding: docs/backends/onnxruntime.md)."""
CACHE_KEY = "ort_fusions"
"""Manifest key of a fused set's fingerprint."""
_MIN_OPSET = 18
_INSTALL_HINT = "pip install onnxscript"


def _onnxscript():
    try:
        import onnxscript  # noqa: F401
        from onnxscript import rewriter  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"onnxruntime executor: the fusions option needs the 'onnxscript' package "
                           f"({_INSTALL_HINT}), or set fusions: false") from exc
    return onnxscript


def parse(value) -> tuple[str, ...]:
    """The ``fusions`` option (true, false or a list of :data:`FUSIONS` names) -> the fusions to apply."""
    if value is False or value is None:
        return ()
    if value is True:
        return DEFAULT_FUSIONS
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        unknown = [v for v in value if v not in FUSIONS]
        if unknown:
            raise ValueError(f"onnxruntime executor: executor.options.fusions: unknown fusion {unknown[0]!r}"
                             f"{choices_hint(unknown[0], FUSIONS)}")
        return tuple(f for f in FUSIONS if f in value)
    raise ValueError(f"onnxruntime executor: executor.options.fusions: expected true, false or a list of "
                     f"{', '.join(FUSIONS)}, got {value!r}")


def versions() -> dict:
    """What a fused set depends on besides its source: onnxscript, onnx (its opset converter) and the source of
    this module and of its rules (:mod:`.fusion_rules`).
    Read from the installed packages' metadata: loading a fused set that is up to date imports neither (their
    modules would add some 70 MB to the process)."""
    from importlib import metadata

    found = {}
    for package in ("onnxscript", "onnx"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError as exc:
            raise RuntimeError(f"onnxruntime executor: the fusions option needs the 'onnxscript' package "
                               f"({_INSTALL_HINT}), or set fusions: false") from exc
    here = os.path.dirname(os.path.abspath(__file__))
    return {**found, "rules": cache.digest([os.path.join(here, "fusions.py"), os.path.join(here, "fusion_rules.py")],
                                           length=16)}


# ---------------------------------------------------------------------------------------------- rewriting
def fuse_model(path: str, fusions=DEFAULT_FUSIONS):
    """Rewrite the graph file ``path`` (its weights stay in the external data files beside it; they are
    read only where a rule checks a table). Returns ``(onnx.ModelProto, {fusion: count})``; external
    initializers keep their references (relative to the file's directory), new ones are in memory."""
    _onnxscript()
    import onnx
    import onnx_ir as ir
    import onnx_ir.passes.common as common_passes
    from onnxscript.rewriter import RewriteRuleSet
    from onnxscript.rewriter.ort_fusions import rms_normalization
    from onnxscript.rewriter.rules.common import _basic_rules

    from . import fusion_rules as rules

    reciprocal, skip_rms, rotary = rules.ReciprocalOfDivision, rules.SkipRmsNorm, rules.TableRotaryEmbedding
    attention, padded_keys = rules.CacheAttention, rules.PaddedKeysAttention
    proto = onnx.load(path, load_external_data=False)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < _MIN_OPSET:  # onnx's converter: ReduceMean/Split/... take their axes as inputs from opset 18
        proto = onnx.version_converter.convert_version(proto, _MIN_OPSET)
    model = ir.from_proto(proto)
    del proto
    ir.external_data.set_base_dir(model.graph, os.path.dirname(os.path.abspath(path)))
    common_passes.ShapeInferencePass()(model)

    counts = {}
    if "rms_norm" in fusions or "skip_rms_norm" in fusions:
        RewriteRuleSet([reciprocal.rule()]).apply_to_model(model)
        for node in model.graph:  # the rule spells out this default attribute (0: no axes = reduce all)
            if node.op_type == "ReduceMean" and node.domain == "" and "noop_with_empty_axes" not in node.attributes:
                node.attributes["noop_with_empty_axes"] = ir.AttrInt64("noop_with_empty_axes", 0)
        counts["rms_norm"] = rms_normalization.rms_normalization_ruleset.apply_to_model(model)
    if "skip_rms_norm" in fusions:
        rules = [skip_rms.rule("SkipRmsNormPreBias", has_bias=True, bias_pre_add=True),
                 skip_rms.rule("SkipRmsNormBias", has_bias=True, bias_pre_add=False),
                 skip_rms.rule("SkipRmsNorm", has_bias=False)]
        counts["skip_rms_norm"] = RewriteRuleSet(rules).apply_to_model(model)
    if "rotary" in fusions:
        counts["rotary"] = RewriteRuleSet([rotary.rule()]).apply_to_model(model)
    if "attention" in fusions:
        in_place: list[rules.InPlace] = []
        counts["attention"] = RewriteRuleSet([attention.rule(in_place)]).apply_to_model(model)
        common_passes.RemoveUnusedNodesPass()(model)  # the matched nodes' leftovers (a view's Slice)
        if in_place:
            counts["kv_in_place"], counts["packed_qkv"] = rules.kv_in_place(model, in_place)
    if "padded_keys" in fusions:
        sliced = RewriteRuleSet([padded_keys.rule()]).apply_to_model(model)
        if sliced:  # (decoder graphs attend causally: recorded where it applies)
            counts["padded_keys"] = sliced
    if "rms_norm" not in fusions and counts.get("rms_norm"):
        counts.pop("rms_norm")  # only the precursor of skip_rms_norm
    if not any(counts.values()):
        return onnx.load(path, load_external_data=False), counts  # nothing to fuse: the file as it is
    # reshapes of reshapes around the new kernels become one (onnxscript's rule); the per-layer copies of
    # the sequence lengths collapse into one
    RewriteRuleSet([_basic_rules.reshape_reshape_rule]).apply_to_model(model)
    common_passes.CommonSubexpressionEliminationPass()(model)
    common_passes.RemoveUnusedNodesPass()(model)
    if any(n.domain == "com.microsoft" for n in model.graph) and "com.microsoft" not in model.opset_imports:
        model.opset_imports["com.microsoft"] = 1
    out = ir.to_proto(model)
    del out.graph.value_info[:]  # inferred shapes of the source; ORT infers its own
    return out, counts


def count_ops(model) -> dict[str, int]:
    """``{op_type: count}`` of an ``onnx.ModelProto``'s main graph (domain-qualified for non-ONNX ops)."""
    counts: dict[str, int] = {}
    for node in model.graph.node:
        key = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        counts[key] = counts.get(key, 0) + 1
    return counts


# ---------------------------------------------------------------------------------------------- cache
def fingerprint(graph_dir: str, paths: dict[str, str], manifest: dict, fusions) -> dict:
    """What a fused set is keyed by: the fusions, :func:`versions` and the source files (size, mtime)."""
    return {"fusions": list(fusions), **versions(), **cache.source_fingerprint(graph_dir, manifest, paths)}


def fused_graph_set(graph_dir: str, metas, paths: dict[str, str], cache_dir: str, fusions) -> str:
    """Directory of the fused copy of a graph set (``<cache_dir>/<model>-fused-<digest>``), written when
    missing or stale. ``metas``: the GraphMeta of every graph to load; ``paths``: name -> source file.
    Its manifest holds the graph metas, the rewrite counts per graph (``fusion_counts``) and the
    fingerprint (:data:`CACHE_KEY`). Writing one removes the fused sets it supersedes
    (:func:`~synflux_ros.graphset.cache.prune_cache`)."""
    from ...graphset import writer as graphset_writer
    from ...core.contract import GraphMeta

    manifest = graphset.read_manifest(graph_dir)
    key = fingerprint(graph_dir, paths, manifest, fusions)
    target = cache.entry_dir(cache_dir, manifest, key, "fused")
    names = [m.name for m in metas]
    if cache.cached_copy_valid(target, CACHE_KEY, key, names):
        return target
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as exc:
        raise RuntimeError(f"onnxruntime executor: cannot write the fused graphs to {cache_dir} ({exc}); set "
                           f"optimized_model_dir to a writable directory") from exc
    work = f"{target}.partial-{os.getpid()}"
    counts = {}

    class _Fused:  # name -> fused ModelProto, made on access (one model in memory at a time)
        def items(self):
            for name in names:
                model, counts[name] = fuse_model(paths[name], fusions)
                yield name, model

        def __iter__(self):
            return iter(names)

    try:
        info = graphset_writer.write_weights_and_models(_Fused(), work, base_dir=graph_dir)
        # the weight format (dtype, block, scheme, carried GGUF blocks) stays what the source set says
        info = {**{k: v for k, v in (manifest.get("weights") or {}).items() if k not in info}, **info}
        fused_metas = [GraphMeta(m.name, m.kind, m.inputs, m.outputs, m.group, f"{m.name}.onnx", dict(m.attrs))
                       for m in metas]
        graphset_writer.write_manifest(work, fused_metas, info, model=manifest.get("model", ""),
                                       config_hash=manifest.get("config_hash", ""), fusion_counts=counts,
                                       **{CACHE_KEY: key})
        cache.publish_directory(work, target, lambda d: cache.cached_copy_valid(d, CACHE_KEY, key, names))
        cache.prune_cache(cache_dir, CACHE_KEY, key, target, versions=("onnxscript", "onnx", "rules"))
    finally:
        if os.path.isdir(work):
            shutil.rmtree(work, ignore_errors=True)
    return target
