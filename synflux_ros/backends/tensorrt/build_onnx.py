"""Shape-polymorphic ONNX graphs, one per graph kind, for engines with one optimization profile per bucket.

Exported from the same torch modules (same weights) as the static per-bucket graph set, with two dynamic
dims, ``T`` (new rows) and ``D`` (cache positions attended, the length of the shape-only input
``attention_span``): ``llm`` at (T = p, D = S) is ``prefill_<p>``, ``embed`` then ``llm`` at T = 1 is
``decode_<d>``, ``action_expert`` at D = d is ``action_expert_<d>`` (``action_expert_vjp`` likewise); GR00T's
``features``, ``vl_context``, ``dit`` and ``dit_vjp`` at T = p are ``<kind>_<p>`` (the prompt's rows). The graphs
share one ``weights.bin``
(external data, as TensorRT's ``OnnxParser.parse_from_file`` reads it). Each kind's inputs and outputs are
listed in docs/internals/build.md.

    gm = build_graph_modules(cfg, seed=0)
    paths = export_profiled_graphs(cfg, gm, "engines/x/tensorrt/onnx")   # {"embed": ".../embed.onnx", ...}
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import warnings

from .plan import GROOT_KINDS, PROFILED_KINDS, SPAN_DTYPE, SPAN_INPUT
from ...graphset import reader as graphset, writer as graphset_writer
from ...core.config import ModelConfig
from ...core.contract import graph_set, reads_logits, time_embedding_dim
from ...graphkit.builder import BuildError
from ...graphkit.onnx_export import OPSET, example_tensors, restore_unused_inputs

DYNAMIC_DIMS = ("T", "D")
STANDARD_DOMAINS = ("", "ai.onnx")


def profiled_graph_names(cfg: ModelConfig) -> list[str]:
    """The kinds of :data:`PROFILED_KINDS` this config's graph set has, in that order."""
    kinds = {m.kind for m in graph_set(cfg)}
    have = {"embed": bool(kinds & {"embed", "decode"}), "llm": bool(kinds & {"prefill", "decode"})}
    return [k for k in PROFILED_KINDS if have.get(k, k in kinds)]


def _kv_views(cfg: ModelConfig) -> list[tuple[str, tuple, str]]:
    llm = cfg.llm
    shape = llm.kv_shape
    lead = graphset.VIEW_INPUTS["past_kv"]
    return [(graphset.view_name("past_kv", idx), tuple(shape[lead:]), llm.kv_dtype)
            for idx in graphset.view_indices(shape, lead)]


def profiled_io(cfg: ModelConfig, kind: str) -> tuple[list[tuple[str, tuple, str]], list[tuple[str, tuple, str]]]:
    """(inputs, outputs) of the profiled graph ``kind``: (name, shape, dtype) each, in order; a dynamic
    dim is its name (``"T"``, ``"D"``)."""
    llm, act = cfg.llm, cfg.action
    L, KV, Dh, H, V = llm.num_layers, llm.num_kv_heads, llm.head_dim, llm.hidden_dim, llm.vocab_size
    span = (SPAN_INPUT, ("D",), SPAN_DTYPE)
    if kind == "embed":
        return [("input_ids", (1, "T"), llm.token_id_dtype)], [("inputs_embeds", (1, "T", H), "float32")]
    if kind == "llm":
        state = cfg.prefix_state_dim
        ins = [("inputs_embeds", (1, "T", H), "float32"), ("num_tokens", (1,), "int64"),
               ("cache_position", (1,), "int64"), *_kv_views(cfg), span,
               *([("state", (1, state), "float32")] if state else [])]
        logits = [("logits", (1, V), "float32")] if reads_logits(cfg) else []
        return ins, [*logits, ("new_kv", (L, 2, KV, "T", Dh), llm.kv_dtype)]
    if kind == "action_expert":
        ha = (1, act.action_horizon, act.action_dim)
        ins = [("noisy_actions", ha, "float32"), ("time_embedding", (1, time_embedding_dim(cfg)), "float32"), ("prefix_len", (1,), "int64"),
               *_kv_views(cfg), span,
               *([("state", (1, act.state_token_dim), "float32")] if act.state_token_dim else [])]
        return ins, [("velocity", ha, "float32")]
    if kind == "action_expert_vjp":
        ins, outs = profiled_io(cfg, "action_expert")
        ha = (1, act.action_horizon, act.action_dim)
        ins += [("target", ha, "float32"), ("weights", (1, act.action_horizon, 1), "float32"),
                ("flow_time", (1,), "float32")]
        return ins, outs + [("correction", ha, "float32")]
    if kind in GROOT_KINDS:  # the static graphs' tensors with the prompt's rows as T
        meta = next(m for m in graph_set(cfg) if m.kind == kind)
        axes = GROOT_KINDS[kind]

        def io(specs):
            return [(t.name, tuple("T" if i == axes.get(t.name) else d for i, d in enumerate(t.shape)), t.dtype)
                    for t in specs]
        return io(meta.inputs), io(meta.outputs)
    raise ValueError(f"unknown profiled graph kind {kind!r} (kinds: {', '.join(PROFILED_KINDS)})")


def example_sizes(cfg: ModelConfig) -> tuple[int, int]:
    """(T, D) to trace with: sizes that equal no other dim of the model (nor 1, nor a bucket), so that no
    shape computation can be mistaken for, or folded into, a constant of the example."""
    llm, act = cfg.llm, cfg.action
    taken = {0, 1, 2, llm.num_layers, llm.num_heads, llm.num_kv_heads, llm.head_dim, llm.hidden_dim,
             llm.vocab_size, llm.intermediate_size, llm.max_seq_len, llm.num_heads * llm.head_dim,
             llm.num_kv_heads * llm.head_dim, llm.head_dim // 2, *llm.prefill_buckets, *llm.decode_buckets}
    if act is not None:
        taken |= {act.action_horizon, act.action_dim, act.expert_hidden_dim or 0, act.expert_intermediate_size or 0}
        if cfg.groot_dit:
            taken |= {act.state_dim, act.dit_cross_blocks, act.dit_heads, act.dit_head_dim, act.dit_width,
                      act.dit_hidden_dim, cfg.vision.num_deepstack}
    t = next(n for n in range(3, 10 ** 9) if n not in taken)
    d = next((n for n in range(llm.max_seq_len - 1, 2, -1) if n not in taken and n != t), None)
    if d is None:  # a cache too short to avoid every dim: any length but T
        d = llm.max_seq_len if llm.max_seq_len != t else llm.max_seq_len - 1
    return t, d


def _example(cfg: ModelConfig, kind: str, t: int, d: int):
    sizes = {"T": t, "D": d}
    return example_tensors([(name, tuple(sizes.get(x, x) for x in shape), dtype)
                            for name, shape, dtype in profiled_io(cfg, kind)[0]])


def _module(cfg: ModelConfig, kind: str, modules):
    """The torch module of ``kind`` (taking the flat inputs of :func:`profiled_io`), built on the
    weights of the static modules in ``modules`` (a GraphModules or its ``.modules`` dict)."""
    from .build_models import FlatViews, ProfiledActionExpert, ProfiledActionExpertVJP, ProfiledEmbed, ProfiledLLM
    mods = getattr(modules, "modules", modules)
    if kind in GROOT_KINDS:
        from ...graphkit.torch_models.groot import DiTGraph, FeaturesGraph, VLContextGraph
        from ...graphkit.torch_models.groot_vjp import DiTVJPGraph
        cls = {"features": FeaturesGraph, "vl_context": VLContextGraph, "dit": DiTGraph, "dit_vjp": DiTVJPGraph}[kind]
        static = next((m for m in mods.values() if type(m) is cls), None)
        if static is None:
            raise BuildError(f"no {kind} module to take the weights of the {kind!r} graph from")
        if kind == "features":
            return FeaturesGraph(static.lm, None, static.deepstack).eval()
        return cls(static.head, None).eval()
    lm = next((m.lm for m in mods.values() if hasattr(m, "lm")), None)
    if kind in ("embed", "llm") and lm is None:
        raise BuildError(f"no embed/prefill/decode module to take the decoder of the {kind!r} graph from")
    L = cfg.llm.num_layers
    if kind == "embed":
        return ProfiledEmbed(lm).eval()
    if kind == "llm":
        state_proj = next((m.state_proj for m in mods.values() if getattr(m, "state_proj", None) is not None), None)
        if cfg.prefix_state_dim and state_proj is None:
            raise BuildError("no prefill module with the state projection (action.state_input: prefix) to build the "
                             "llm graph from")
        prefill = next((m for m in mods.values() if getattr(m, "expert", None) is not None and hasattr(m, "lm")), None)
        return FlatViews(ProfiledLLM(lm, cfg.llm.kv_dtype, logits=reads_logits(cfg), state_proj=state_proj,
                                     expert=prefill.expert if prefill is not None else None), 3, L).eval()
    expert = next((m.expert for m in mods.values() if getattr(m, "expert", None) is not None), None)
    if expert is None:
        raise BuildError(f"no action_expert module to take the action expert of the {kind!r} graph from")
    return FlatViews((ProfiledActionExpert if kind == "action_expert" else ProfiledActionExpertVJP)(expert), 3, L).eval()


def _dynamic_axes(cfg: ModelConfig, kind: str) -> dict:
    ins, outs = profiled_io(cfg, kind)
    axes = {}
    for name, shape, _ in ins + outs:
        named = {i: s for i, s in enumerate(shape) if isinstance(s, str)}
        if named:
            axes[name] = named
    return axes


def export_profiled_graph(cfg: ModelConfig, kind: str, modules, workdir: str):
    """Trace the ``kind`` graph into ``workdir/<kind>.onnx`` (the exporter's layout: weights inline or,
    beyond 2 GB, in files beside it) and return it as an ``onnx.ModelProto`` loaded without its external
    data, after the ONNX checker and :func:`check_profiled_io`."""
    import onnx
    import torch
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, f"{kind}.onnx")
    module = _module(cfg, kind, modules)
    ins, outs = profiled_io(cfg, kind)
    t, d = example_sizes(cfg)
    with torch.no_grad(), warnings.catch_warnings():
        # Same exporter settings as the static graphs (export.export_graph), plus the dynamic axes.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning, module=r".*\.torch_models\.")
        torch.onnx.export(module, _example(cfg, kind, t, d), path, dynamo=False, opset_version=OPSET,
                          input_names=[n for n, _, _ in ins], output_names=[n for n, _, _ in outs],
                          dynamic_axes=_dynamic_axes(cfg, kind), do_constant_folding=True)
    model = onnx.load(path, load_external_data=False)
    if restore_unused_inputs(model, ins):  # a flow-matching VLA's llm graph reads no last-layer past_kv
        onnx.save(model, path)
    onnx.checker.check_model(path)  # by path: external data (beyond 2 GB) is found beside the file
    check_profiled_io(model, cfg, kind)
    return model


def check_profiled_io(model, cfg: ModelConfig, kind: str) -> None:
    """``model``'s inputs/outputs must be exactly :func:`profiled_io` (names, order, dtypes, shapes with
    the dynamic dims named ``T`` / ``D``) and its nodes standard ONNX ops. Raises BuildError."""
    from onnx import helper

    def describe(values):
        res = []
        for v in values:
            tt = v.type.tensor_type
            shape = tuple(dim.dim_param if dim.HasField("dim_param") else dim.dim_value for dim in tt.shape.dim)
            res.append((v.name, shape, helper.tensor_dtype_to_np_dtype(tt.elem_type).name))
        return res

    init = {i.name for i in model.graph.initializer}
    got_in = [x for x in describe(model.graph.input) if x[0] not in init]
    got_out = describe(model.graph.output)
    want_in, want_out = profiled_io(cfg, kind)
    if got_in != [tuple(x) for x in want_in] or got_out != [tuple(x) for x in want_out]:
        raise BuildError(f"exported profiled graph {kind!r} does not match its contract:\n  inputs  {got_in}\n"
                         f"  expected {want_in}\n  outputs {got_out}\n  expected {want_out}")
    custom = sorted({f"{n.domain}::{n.op_type}" for n in model.graph.node if n.domain not in STANDARD_DOMAINS})
    if custom:
        raise BuildError(f"exported profiled graph {kind!r} has non-standard ops: {custom}")


def _relocate(model, prefix: str) -> None:
    """Make the model's external-data locations relative to the parent of its directory (``prefix/...``)."""
    from onnx import TensorProto
    for tensor in model.graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = f"{prefix}/{entry.value}"


def export_profiled_graphs(cfg: ModelConfig, modules, out_dir: str) -> dict[str, str]:
    """Export the profiled graphs of ``cfg`` (:func:`profiled_graph_names`) from ``modules`` (what
    ``build_graph_modules(cfg, ...)`` returns; the graphs reuse its decoder and action expert, so the
    weights are those of the static graph set) into ``out_dir``: ``<kind>.onnx`` each, their weights in
    one shared ``out_dir/weights.bin`` (external data, deduplicated across the graphs). A profiled graph
    of another kind left in ``out_dir`` by an earlier export is removed (it would refer to the old
    weights file). Returns ``{kind: absolute path}``. Raises BuildError if a graph does not match
    :func:`profiled_io`."""
    names = profiled_graph_names(cfg)
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="synflux_profiled_") as tmp:
        models = {}
        for kind in names:
            model = export_profiled_graph(cfg, kind, modules, os.path.join(tmp, kind))
            _relocate(model, kind)
            models[kind] = model
        graphset_writer.write_weights_and_models(models, out_dir, base_dir=tmp)
        del models
    for kind in PROFILED_KINDS:
        if kind not in names:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(out_dir, f"{kind}.onnx"))
    return {kind: os.path.abspath(os.path.join(out_dir, f"{kind}.onnx")) for kind in names}
