"""The static graph set of a model: one spec that drives the mock backend, the build tool and the tests.

:func:`graph_set` lists, for a config, every graph (vision encoder, embed and prefill per prefill bucket, decode
or action expert per span) with the names, shapes and dtypes of its inputs and outputs (:class:`GraphMeta`,
:class:`TensorSpec`); every backend runs exactly these. The table of graphs and what each input means:
docs/graph-set-format.md#graph-contract.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .config import ModelConfig

F32, I64 = "float32", "int64"
MASKED_SCORE = -30000.0
"""What a graph that outputs an attention mask adds to the score of a key a row may not see (GR00T's
``cross_bias``): its softmax weight is exactly 0, as with -inf, and the value stays finite in float16."""


class ShapeError(ValueError):
    """A tensor does not match the graph's declared shape or dtype."""


class GraphNotFoundError(KeyError):
    """A graph name that the loaded graph set does not have."""


class NonFiniteOutputError(RuntimeError):
    """A graph produced NaN or Inf: the result must not reach the robot or the caller."""


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of a graph with its static shape and dtype; ``resident`` tensors stay on the device."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    resident: bool = False
    """Inputs only: always bound to a caller-owned device tensor (e.g. a KV-cache slot), so the executor
    allocates no staging buffer for it."""

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def to_dict(self) -> dict:
        d = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        if self.resident:
            d["resident"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TensorSpec":
        return cls(d["name"], tuple(int(x) for x in d["shape"]), str(d["dtype"]), bool(d.get("resident", False)))


@dataclass(frozen=True)
class GraphMeta:
    """Static description of one graph: what goes in, what comes out, which kind of computation."""

    name: str
    kind: str  # vision_encoder | embed | prefill | decode | action_expert
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    group: str = ""
    """Graphs of one group never run at the same time and share staging buffers (e.g. all prefill
    buckets), so memory is sized by the largest member instead of the sum."""
    file: str = ""
    attrs: dict = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self):
        if not self.group:
            object.__setattr__(self, "group", self.name)

    def input(self, name: str) -> TensorSpec:
        for t in self.inputs:
            if t.name == name:
                return t
        raise KeyError(f"graph {self.name!r} has no input {name!r}")

    def output(self, name: str) -> TensorSpec:
        for t in self.outputs:
            if t.name == name:
                return t
        raise KeyError(f"graph {self.name!r} has no output {name!r}")

    def has_input(self, name: str) -> bool:
        return any(t.name == name for t in self.inputs)

    def has_output(self, name: str) -> bool:
        return any(t.name == name for t in self.outputs)

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "group": self.group, "file": self.file,
                "inputs": [t.to_dict() for t in self.inputs],
                "outputs": [t.to_dict() for t in self.outputs], "attrs": dict(self.attrs)}

    @classmethod
    def from_dict(cls, d: dict) -> "GraphMeta":
        return cls(d["name"], d["kind"], tuple(TensorSpec.from_dict(t) for t in d["inputs"]),
                   tuple(TensorSpec.from_dict(t) for t in d["outputs"]), d.get("group", ""),
                   d.get("file", ""), dict(d.get("attrs", {})))


@dataclass(frozen=True)
class DeviceTensor:
    """A caller-owned tensor that lives in device memory (KV-cache slots)."""

    name: str
    handle: object
    shape: tuple[int, ...]
    dtype: str


@dataclass
class GraphStats:
    """Call count and timing of one graph."""
    calls: int = 0
    total_ms: float = 0.0
    last_ms: float = 0.0

    @property
    def mean_ms(self) -> float:
        return self.total_ms / self.calls if self.calls else 0.0

TIME_MIN_PERIOD, TIME_MAX_PERIOD = 4e-3, 4.0
"""Periods of the flow-time embedding (pi0's): the sinusoids span 2*pi/4e-3 .. 2*pi/4 rad per unit of t."""


def time_embedding_dim(cfg: ModelConfig) -> int:
    """E of ``time_embedding``: the action expert's width (even)."""
    width = cfg.action.expert_hidden_dim or cfg.llm.hidden_dim
    return 2 * max(width // 2, 1)


def reads_logits(cfg: ModelConfig) -> bool:
    """Whether the model reads the LLM's logits: every model but a flow-matching VLA (whose head reads only
    the prefix's KV cache). Without them the graph set has no decode graphs and prefill returns new_kv
    alone."""
    return not (cfg.mode == "vla" and cfg.action is not None and cfg.action.head_type == "flow_matching")


def select_bucket(buckets, needed: int) -> int:
    """Smallest bucket >= needed."""
    for b in buckets:
        if b >= needed:
            return b
    raise ValueError(f"{needed} exceeds the largest bucket {buckets[-1]}")


def kv_spec(cfg: ModelConfig) -> TensorSpec:
    return TensorSpec("past_kv", cfg.llm.kv_shape, cfg.llm.kv_dtype, resident=True)


def graph_set(cfg: ModelConfig) -> list[GraphMeta]:
    llm, vis = cfg.llm, cfg.vision
    L, KV, Dh, H, V = llm.num_layers, llm.num_kv_heads, llm.head_dim, llm.hidden_dim, llm.vocab_size
    kv = kv_spec(cfg)
    ids = llm.token_id_dtype
    graphs = []
    K = vis.num_deepstack if vis is not None else 0
    mrope = bool(llm.mrope_section)
    text_head = reads_logits(cfg)
    logits = (TensorSpec("logits", (1, V), F32),) if text_head else ()
    if vis is not None:  # text-only chat models have no vision encoder
        n = cfg.vision_images_per_call
        deepstack_out = (TensorSpec("deepstack_embeds", (K, n * vis.num_tokens, H), F32),) if K else ()
        graphs.append(GraphMeta(
            "vision_encoder", "vision_encoder",
            (TensorSpec("pixel_values", (n * vis.num_tiles, 3, *vis.tile_size), F32),),
            (TensorSpec("vision_embeds", (n * vis.num_tokens, H), F32), *deepstack_out),
            file="vision_encoder.onnx"))
    act = cfg.action
    if cfg.groot_dit:
        return graphs + groot_graphs(cfg)
    prefix_state = (TensorSpec("state", (1, cfg.prefix_state_dim), F32),) if cfg.prefix_state_dim else ()
    for p in llm.prefill_buckets:
        graphs.append(GraphMeta(
            f"embed_{p}", "embed", (TensorSpec("input_ids", (1, p), ids),),
            (TensorSpec("inputs_embeds", (1, p, H), F32),), group="embed", file=f"embed_{p}.onnx",
            attrs={"bucket": p}))
        graphs.append(GraphMeta(
            f"prefill_{p}", "prefill",
            (TensorSpec("inputs_embeds", (1, p, H), F32), TensorSpec("num_tokens", (1,), I64),
             TensorSpec("cache_position", (1,), I64), kv,
             *((TensorSpec("position_ids", (3, p), I64),) if mrope else ()),
             *((TensorSpec("deepstack_embeds", (K, p, H), F32),) if K else ()), *prefix_state),
            (*logits, TensorSpec("new_kv", (L, 2, KV, p, Dh), llm.kv_dtype)),
            group="prefill", file=f"prefill_{p}.onnx", attrs={"bucket": p}))
    for d in (llm.decode_buckets if text_head else ()):
        graphs.append(GraphMeta(
            f"decode_{d}", "decode",
            (TensorSpec("input_ids", (1, 1), ids), TensorSpec("cache_position", (1,), I64), kv,
             *((TensorSpec("position_ids", (3, 1), I64),) if mrope else ())),
            (TensorSpec("logits", (1, V), F32), TensorSpec("new_kv", (L, 2, KV, 1, Dh), llm.kv_dtype)),
            group="decode", file=f"decode_{d}.onnx", attrs={"bucket": d, "hidden_dim": H}))
    if cfg.mode == "vla" and act.head_type == "flow_matching":
        for d in llm.decode_buckets:
            graphs.append(GraphMeta(
                f"action_expert_{d}", "action_expert",
                (TensorSpec("noisy_actions", (1, act.action_horizon, act.action_dim), F32),
                 TensorSpec("time_embedding", (1, time_embedding_dim(cfg)), F32),
                 TensorSpec("prefix_len", (1,), I64), kv,
                 *((TensorSpec("state", (1, act.state_token_dim), F32),) if act.state_token_dim else ())),
                (TensorSpec("velocity", (1, act.action_horizon, act.action_dim), F32),),
                group="action_expert", file=f"action_expert_{d}.onnx", attrs={"bucket": d}))
        if cfg.rtc_vjp_graphs:
            chunk = (1, act.action_horizon, act.action_dim)
            for expert in [g for g in graphs if g.kind == "action_expert"]:
                d = expert.attrs["bucket"]
                graphs.append(GraphMeta(
                    f"action_expert_vjp_{d}", "action_expert_vjp",
                    (*expert.inputs, TensorSpec("target", chunk, F32),
                     TensorSpec("weights", (1, act.action_horizon, 1), F32), TensorSpec("flow_time", (1,), F32)),
                    (TensorSpec("velocity", chunk, F32), TensorSpec("correction", chunk, F32)),
                    group="action_expert_vjp", file=f"action_expert_vjp_{d}.onnx", attrs={"bucket": d}))
    return graphs


def groot_graphs(cfg: ModelConfig) -> list[GraphMeta]:
    """GR00T N1.7's graphs after the vision encoder, per prefill bucket p (the prompt, its image rows included,
    is one call): ``embed_<p>``; ``features_<p>``, the cut backbone over the prompt (causal, multimodal rope,
    DeepStack) returning its last layer's hidden states before the final norm; ``vl_context_<p>``, once per
    frame: those features through the VL LayerNorm and self-attention, the keys/values every cross-attention
    block of the DiT reads of them, the additive masks of the text rows and of the image rows, and the encoded
    robot state; ``dit_<p>``, each denoising step: the velocity of the noisy chunk at a time bucket; with the
    ``vjp`` guidance ``dit_vjp_<p>``, that velocity and Real-Time Chunking's correction at GR00T time
    ``flow_time``."""
    llm, vis, act = cfg.llm, cfg.vision, cfg.action
    H, K, ids = llm.hidden_dim, vis.num_deepstack, llm.token_id_dtype
    C, nh, dh = act.dit_cross_blocks, act.dit_heads, act.dit_head_dim
    chunk = (1, act.action_horizon, act.action_dim)
    state_features = TensorSpec("state_features", (1, 1, act.dit_width), F32)
    graphs = []
    for p in llm.prefill_buckets:
        kv = TensorSpec("cross_kv", (C, 2, nh, p, dh), F32)
        bias = TensorSpec("cross_bias", (2, p), F32)
        graphs += [
            GraphMeta(f"embed_{p}", "embed", (TensorSpec("input_ids", (1, p), ids),),
                      (TensorSpec("inputs_embeds", (1, p, H), F32),), group="embed", file=f"embed_{p}.onnx",
                      attrs={"bucket": p}),
            GraphMeta(f"features_{p}", "features",
                      (TensorSpec("inputs_embeds", (1, p, H), F32), TensorSpec("num_tokens", (1,), I64),
                       TensorSpec("position_ids", (3, p), I64), *((TensorSpec("deepstack_embeds", (K, p, H), F32),)
                                                                  if K else ())),
                      (TensorSpec("features", (1, p, H), F32),), group="features", file=f"features_{p}.onnx",
                      attrs={"bucket": p}),
            GraphMeta(f"vl_context_{p}", "vl_context",
                      (TensorSpec("features", (1, p, H), F32), TensorSpec("num_tokens", (1,), I64),
                       TensorSpec("image_rows", (1, p), F32), TensorSpec("state", (1, act.state_dim), F32)),
                      (kv, bias, state_features), group="vl_context", file=f"vl_context_{p}.onnx",
                      attrs={"bucket": p}),
            GraphMeta(f"dit_{p}", "dit",
                      (TensorSpec("noisy_actions", chunk, F32), TensorSpec("timestep", (1,), F32), state_features,
                       kv, bias),
                      (TensorSpec("velocity", chunk, F32),), group="dit", file=f"dit_{p}.onnx",
                      attrs={"bucket": p, "time_buckets": act.time_buckets}),
        ]
        if cfg.rtc_vjp_graphs:
            graphs.append(GraphMeta(
                f"dit_vjp_{p}", "dit_vjp",
                (*graphs[-1].inputs, TensorSpec("target", chunk, F32),
                 TensorSpec("weights", (1, act.action_horizon, 1), F32), TensorSpec("flow_time", (1,), F32)),
                (TensorSpec("velocity", chunk, F32), TensorSpec("correction", chunk, F32)),
                group="dit_vjp", file=f"dit_vjp_{p}.onnx", attrs={"bucket": p, "time_buckets": act.time_buckets}))
    return graphs
