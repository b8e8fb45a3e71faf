"""How a graph set maps onto TensorRT engines: engines, optimization profiles, routes, addresses, keys.

Pure Python (no TensorRT, no CUDA): the builder (:mod:`synflux_ros.backends.tensorrt.build`) and the executor
(:mod:`synflux_ros.backends.tensorrt.executor`) both follow this plan, and it is unit-tested on any machine.
A graph kind's buckets become one engine with a profile per bucket (a kind placed on DLA: one static engine per
bucket), and each contract graph runs as one or two engine calls (:class:`Step`) whose bindings (:class:`Bind`)
say where each engine tensor lives. The engine table: docs/backends/tensorrt.md#engine-plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ...graphset import cache, reader as graphset
from ...core.contract import GraphMeta, TensorSpec

FORMAT = "synflux-tensorrt/1"
SIDECAR = "tensorrt.json"
ONNX_SUBDIR = "tensorrt/onnx"
SPAN_INPUT = "attention_span"
SPAN_DTYPE = "float32"
PROFILED_KINDS = ("embed", "llm", "action_expert", "action_expert_vjp", "features", "vl_context", "dit", "dit_vjp")
GROOT_KINDS = {"features": {"inputs_embeds": 1, "position_ids": 1, "deepstack_embeds": 1, "features": 1},
               "vl_context": {"features": 1, "image_rows": 1, "cross_kv": 3, "cross_bias": 1},
               "dit": {"cross_kv": 3, "cross_bias": 1},
               "dit_vjp": {"cross_kv": 3, "cross_bias": 1}}
"""GR00T N1.7's kinds (backbone features, VL context, DiT step and its RTC vjp) and, per tensor, the axis of the
prompt's rows: the bucket, which a profile sets on the inputs."""
DLA_CAPABLE = ("vision_encoder", "action_expert")
"""Kinds that may be placed on a DLA core (static, fp16/int8, no KV-length-dependent control flow)."""


class PlanError(ValueError):
    """The graph set does not have what an engine needs (a bucket's graph, the KV input)."""


@dataclass(frozen=True)
class Profile:
    """One optimization profile: the graph it serves and the shape of every dynamic engine input."""
    graph: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]

    def shape(self, name: str) -> tuple[int, ...] | None:
        return dict(self.shapes).get(name)


@dataclass(frozen=True)
class EngineSpec:
    """One engine: what it is built from and its profiles (one for a static engine)."""
    name: str
    kind: str
    onnx: str
    """ONNX file, relative to the graph set directory."""
    profiles: tuple[Profile, ...]
    dla: bool = False

    def profile_index(self, graph: str) -> int:
        for i, p in enumerate(self.profiles):
            if p.graph == graph:
                return i
        raise PlanError(f"engine {self.name!r} has no profile for {graph!r}")


@dataclass(frozen=True)
class Bind:
    """Where one engine tensor lives. ``source``: ``input`` / ``output`` (a contract tensor of the graph
    being run, ``name``, at ``offset`` bytes), ``scratch`` (a device buffer of the route, ``name``),
    ``span`` (the shared shape-only buffer) or ``one`` (the device constant int64 1)."""
    source: str
    name: str = ""
    offset: int = 0


@dataclass(frozen=True)
class Step:
    engine: str
    profile: int
    bindings: tuple[tuple[str, Bind], ...]
    """engine tensor name -> where it lives, inputs and outputs alike."""


@dataclass(frozen=True)
class Route:
    graph: str
    steps: tuple[Step, ...]
    scratch: tuple[TensorSpec, ...] = field(default=())
    """Device buffers the route needs between its steps (allocated once per graph group)."""


# ---------------------------------------------------------------------------------------------- plan

def _by_kind(metas) -> dict[str, list[GraphMeta]]:
    out: dict[str, list[GraphMeta]] = {}
    for m in metas:
        out.setdefault(m.kind, []).append(m)
    for kind in out:
        out[kind].sort(key=lambda m: m.attrs.get("bucket", 0))
    return out


def _kv(metas) -> TensorSpec:
    for m in metas:
        for spec in m.inputs:
            if spec.name == "past_kv":
                return spec
    raise PlanError("the graph set has no graph reading past_kv")


def plan_engines(metas: list[GraphMeta], dla_kinds=()) -> list[EngineSpec]:
    """The engines of a graph set (see docs/backends/tensorrt.md#engine-plan). ``dla_kinds`` (subset of
    :data:`DLA_CAPABLE`) are built per graph from the static ONNX files, for a DLA core."""
    bad = set(dla_kinds) - set(DLA_CAPABLE)
    if bad:
        raise PlanError(f"graph kinds {sorted(bad)} cannot run on DLA (DLA-capable: {', '.join(DLA_CAPABLE)})")
    kinds = _by_kind(metas)
    multimodal = sorted({t.name for m in kinds.get("prefill", []) + kinds.get("decode", []) for t in m.inputs
                         if t.name in ("position_ids", "deepstack_embeds")})
    if multimodal:
        raise PlanError(f"the tensorrt backend does not take the LLM inputs {', '.join(multimodal)} yet (Qwen3-VL's "
                        f"multimodal positions and DeepStack maps); run this model on onnxruntime, openvino, qnn "
                        f"or rknn")
    engines: list[EngineSpec] = []

    def static(meta: GraphMeta, dla: bool) -> EngineSpec:
        return EngineSpec(meta.name, meta.kind, meta.file or f"{meta.name}.onnx", (Profile(meta.name, ()),), dla)

    for meta in kinds.get("vision_encoder", []):
        engines.append(static(meta, "vision_encoder" in dla_kinds))
    embeds, prefills, decodes = kinds.get("embed", []), kinds.get("prefill", []), kinds.get("decode", [])
    if embeds or decodes:
        profiles = [Profile(m.name, (("input_ids", tuple(m.inputs[0].shape)),)) for m in embeds]
        if decodes:
            profiles.append(Profile("embed_1", (("input_ids", (1, 1)),)))
        engines.append(EngineSpec("embed", "embed", f"{ONNX_SUBDIR}/embed.onnx", tuple(profiles)))
    if prefills or decodes:
        kv = _kv(metas)
        s = kv.shape[3]
        hidden = _hidden(embeds, decodes)
        profiles = [Profile(m.name, (("inputs_embeds", tuple(m.input("inputs_embeds").shape)), (SPAN_INPUT, (s,))))
                    for m in prefills]
        profiles += [Profile(m.name, (("inputs_embeds", (1, 1, hidden)), (SPAN_INPUT, (m.attrs["bucket"],))))
                     for m in decodes]
        engines.append(EngineSpec("llm", "llm", f"{ONNX_SUBDIR}/llm.onnx", tuple(profiles)))
    experts = kinds.get("action_expert", [])
    if experts and "action_expert" in dla_kinds:
        engines += [static(m, True) for m in experts]
    elif experts:
        engines.append(EngineSpec("action_expert", "action_expert", f"{ONNX_SUBDIR}/action_expert.onnx",
                                  tuple(Profile(m.name, ((SPAN_INPUT, (m.attrs["bucket"],)),)) for m in experts)))
    for kind, axes in GROOT_KINDS.items():  # a profile per prompt bucket, shaping the inputs with its rows
        if kinds.get(kind):
            engines.append(EngineSpec(kind, kind, f"{ONNX_SUBDIR}/{kind}.onnx", tuple(
                Profile(m.name, tuple((t.name, tuple(t.shape)) for t in m.inputs if t.name in axes))
                for m in kinds[kind])))
    vjp = kinds.get("action_expert_vjp", [])
    if vjp:  # on the GPU even when the expert is on DLA: the backward pass is no DLA network
        engines.append(EngineSpec("action_expert_vjp", "action_expert_vjp", f"{ONNX_SUBDIR}/action_expert_vjp.onnx",
                                  tuple(Profile(m.name, ((SPAN_INPUT, (m.attrs["bucket"],)),)) for m in vjp)))
    return engines


def _hidden(embeds, decodes) -> int:
    for m in embeds:
        return int(m.outputs[0].shape[-1])
    for m in decodes:
        if "hidden_dim" in m.attrs:
            return int(m.attrs["hidden_dim"])
    raise PlanError("cannot tell the hidden size: no embed graph and no hidden_dim on the decode graphs")


def kv_view_offsets(spec: TensorSpec) -> list[tuple[str, int, tuple[int, ...]]]:
    """The per-layer views of a KV input as the engines take them: (tensor name, byte offset in the
    contract tensor, view shape), in memory order. ``past_kv`` [L, 2, KV, S, Dh] gives ``past_kv.<l>.<j>``
    at ``(2l + j) * KV*S*Dh * itemsize``: the views are bound by address, nothing is copied."""
    lead = graphset.VIEW_INPUTS.get(spec.name, 0)
    if not lead:
        return [(spec.name, 0, tuple(spec.shape))]
    size = np.dtype(spec.dtype).itemsize
    out = []
    for index in graphset.view_indices(spec.shape, lead):
        name = graphset.view_name(spec.name, index)
        offset, shape = graphset.input_views(spec.name, spec.shape, size, name)
        out.append((name, offset, shape))
    return out


def misaligned_views(spec: TensorSpec, alignment: int) -> list[str]:
    """The views of ``spec`` (see :func:`kv_view_offsets`) whose byte offset is not a multiple of
    ``alignment`` (the slot itself comes from the allocator, aligned)."""
    return [name for name, offset, _ in kv_view_offsets(spec) if offset % alignment]


def _contract_binds(meta: GraphMeta, skip=()) -> list[tuple[str, Bind]]:
    binds = []
    for spec in meta.inputs:
        if spec.name in skip:
            continue
        for name, offset, _ in kv_view_offsets(spec):
            binds.append((name, Bind("input", spec.name, offset)))
    binds += [(spec.name, Bind("output", spec.name)) for spec in meta.outputs]
    return binds


def plan_routes(metas: list[GraphMeta], engines: list[EngineSpec]) -> dict[str, Route]:
    """How each graph of the contract runs on ``engines``."""
    by_engine = {e.name: e for e in engines}
    owner: dict[str, EngineSpec] = {}
    for e in engines:
        for p in e.profiles:
            owner[p.graph] = e
    routes: dict[str, Route] = {}
    for meta in metas:
        if meta.kind == "decode":
            embed, llm = by_engine.get("embed"), by_engine.get("llm")
            if embed is None or llm is None:
                raise PlanError(f"{meta.name}: needs the embed and llm engines")
            hidden = dict(llm.profiles[llm.profile_index(meta.name)].shapes)["inputs_embeds"]
            scratch = TensorSpec("inputs_embeds", tuple(hidden), "float32")
            first = Step("embed", embed.profile_index("embed_1"),
                         (("input_ids", Bind("input", "input_ids")), ("inputs_embeds", Bind("scratch", scratch.name))))
            binds = [("inputs_embeds", Bind("scratch", scratch.name)), ("num_tokens", Bind("one"))]
            binds += _contract_binds(meta, skip=("input_ids",)) + [(SPAN_INPUT, Bind("span"))]
            routes[meta.name] = Route(meta.name, (first, Step("llm", llm.profile_index(meta.name), tuple(binds))),
                                      (scratch,))
            continue
        engine = owner.get(meta.name)
        if engine is None:
            raise PlanError(f"no engine serves graph {meta.name!r}")
        binds = _contract_binds(meta)
        if engine.kind in ("llm", "action_expert", "action_expert_vjp") and not engine.dla:
            binds.append((SPAN_INPUT, Bind("span")))
        routes[meta.name] = Route(meta.name, (Step(engine.name, engine.profile_index(meta.name), tuple(binds)),))
    return routes


def span_elements(engines: list[EngineSpec]) -> int:
    """Length of the shared ``attention_span`` buffer: the longest span of any profile."""
    return max([p.shape(SPAN_INPUT)[0] for e in engines for p in e.profiles if p.shape(SPAN_INPUT)] or [0])


# ---------------------------------------------------------------------------------------------- copies

def region_copy(shape, dtype: str, index: tuple) -> tuple[int, int, int, int]:
    """``tensor[index]`` of a C-contiguous tensor as one 2-D copy: ``(offset, pitch, width, height)`` in
    bytes / rows, for ``cudaMemcpy2DAsync``. ``index`` is full slices over leading axes, then one slice
    (the KV append ``[:, :, :, a:b]``), then full trailing axes. Raises ValueError for other indices."""
    shape = tuple(int(d) for d in shape)
    index = index if isinstance(index, tuple) else (index,)
    index = index + (slice(None),) * (len(shape) - len(index))
    if len(index) != len(shape):
        raise ValueError(f"index {index} has more axes than the tensor {list(shape)}")
    cut = [i for i, s in enumerate(index) if not (isinstance(s, slice) and s.indices(shape[i]) == (0, shape[i], 1))]
    if len(cut) > 1:
        raise ValueError(f"index {index}: only one axis may be cut for a 2-D copy")
    if not cut:  # one row; its pitch is its width (CUDA wants width <= pitch)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return 0, nbytes, nbytes, 1
    axis = cut[0]
    sel = index[axis]
    if not isinstance(sel, slice):
        sel = slice(int(sel), int(sel) + 1)
    start, stop, step = sel.indices(shape[axis])
    if step != 1 or stop <= start:
        raise ValueError(f"index {index}: axis {axis} must be a non-empty slice with step 1")
    item = np.dtype(dtype).itemsize
    inner = math.prod(shape[axis + 1:]) * item
    return start * inner, shape[axis] * inner, (stop - start) * inner, math.prod(shape[:axis])


# ---------------------------------------------------------------------------------------------- keys

def device_tag(sm: str, dla_core: int | None, precision: str) -> str:
    """Directory name of one build of the engines, e.g. ``sm87-fp16`` or ``sm87-fp16-dla0``: several
    devices and precisions live side by side under ``<graph set>/tensorrt/``."""
    tag = f"sm{sm.replace('.', '')}-{precision}"
    return f"{tag}-dla{dla_core}" if dla_core is not None else tag


def engine_key(spec: EngineSpec, onnx_digest: str, tensorrt_version: str, sm: str, dla_core: int | None,
               flags: dict) -> str:
    """What an engine depends on: its ONNX (bytes), profiles, TensorRT version, the device (SM, DLA core)
    and the build flags. An engine whose key is unchanged is not rebuilt."""
    return cache.key({"engine": spec.name, "onnx": onnx_digest, "profiles": [[p.graph, p.shapes] for p in spec.profiles],
                      "dla": spec.dla, "tensorrt": tensorrt_version, "sm": sm, "dla_core": dla_core,
                      "flags": flags}, default=list)
