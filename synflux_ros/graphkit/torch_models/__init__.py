"""torch modules implementing the graph contracts of ``synflux_ros.core.contract.graph_set`` (build time only).

::

    gm = build_graph_modules(cfg, seed=0)                      # random weights of the configured architecture
    gm = build_graph_modules(config_from_hf(d, cfg), hf_dir=d)  # weights from a local HF checkpoint
    logits, new_kv = gm.modules["prefill_64"](inputs_embeds, num_tokens, cache_position, past_kv)

Every module's ``forward`` takes the graph's inputs in order (exact shapes and dtypes) and returns a
tuple of its outputs in order. All embed / prefill / decode modules reference one backbone
(:class:`~.decoder.CausalLM`), all action-expert modules one :class:`~.action_expert.ActionExpert`, so
they share parameter objects. The modules trace with ``torch.onnx.export(..., dynamo=False)`` into
standard ONNX ops.

Weights: seeded random ones (normal(0, 0.02) for linear / embedding / conv weights, zero biases, norms at
identity), or, with ``hf_dir``, the decoder of a Qwen3 / Llama / Gemma / Qwen3-VL checkpoint
(safetensors, single file or sharded, read by :mod:`.checkpoint`) and the vision tower of a Qwen3-VL one
(``vision.architecture: qwen3_vl``). The ``vit`` vision encoder and the action expert are always random.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from ...core.config import ConfigError, ModelConfig
from ...core.contract import graph_set
from .action_expert import ActionExpert, ActionExpertGraph
from .action_expert_vjp import ActionExpertVJPGraph
from .decoder import CausalLM, DecodeGraph, EmbedGraph, PrefillGraph, fuse_projections, init_random, materialize
from .hf_decoder import hf_llm_fields, load_hf_weights, read_hf_config
from .lerobot_groot import config_from_lerobot_groot, is_lerobot_groot
from .lerobot_pi0 import config_from_lerobot_pi0, is_lerobot_pi0, load_lerobot_pi0
from .lerobot_smolvla import config_from_lerobot_smolvla, is_lerobot_smolvla, load_lerobot_smolvla
from .qwen3_vl_vision import build_qwen3_vl_vision, vision_config_from_hf
from .vision import VitVisionEncoder

__all__ = ["GraphModules", "build_graph_modules", "config_from_hf"]

# Independent random streams per component, so that e.g. changing the vision tower leaves the decoder's
# weights unchanged.
_STREAM = {"decoder": 0, "vision": 1, "action_expert": 2, "state_proj": 3}


@dataclass
class GraphModules:
    """What :func:`build_graph_modules` returns: a module per graph name, the graphs it has no module
    for, the checkpoint's tokenizer.json (if any) and where the weights came from."""

    modules: dict[str, nn.Module]
    missing: list[str] = field(default_factory=list)
    tokenizer_path: str | None = None
    source: dict = field(default_factory=dict)


def _generator(seed: int, stream: str) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + _STREAM[stream])


def _random(module_factory, seed: int, stream: str) -> nn.Module:
    with torch.device("meta"):
        module = module_factory()
    materialize(module)
    init_random(module, _generator(seed, stream))
    return module.eval()


def config_from_hf(hf_dir: str, base: ModelConfig) -> ModelConfig:
    """``base`` with the model dimensions of the checkpoint in ``hf_dir``: the LLM's, and the vision
    tower's when ``base`` has ``vision.architecture: qwen3_vl`` (buckets, kv dtype, resolution, action,
    ... kept from ``base``); for a LeRobot pi0 checkpoint, everything it fixes (:mod:`.lerobot_pi0`).
    Raises ConfigError for an unsupported checkpoint."""
    if is_lerobot_groot(hf_dir):
        return config_from_lerobot_groot(hf_dir, base)
    if is_lerobot_pi0(hf_dir):
        return config_from_lerobot_pi0(hf_dir, base)
    if is_lerobot_smolvla(hf_dir):
        return config_from_lerobot_smolvla(hf_dir, base)
    model_type, fields, _ = hf_llm_fields(hf_dir)
    cfg = base.with_overrides(llm=fields)
    window = read_hf_config(hf_dir)[1].get("sliding_window") if model_type in ("phi3", "mistral") else None
    if window and cfg.llm.max_seq_len > int(window):
        # every position within the window attends to all earlier ones: the graphs' full attention is exact
        raise ConfigError(f"{hf_dir}: sliding_window {window}: the graphs attend to every cached position, so "
                          f"llm.max_seq_len ({cfg.llm.max_seq_len}) must be at most {window}")
    if cfg.vision is not None and cfg.vision.architecture == "qwen3_vl":
        cfg = vision_config_from_hf(hf_dir, cfg)
    return cfg


def _check_matches_checkpoint(cfg: ModelConfig, fields: dict, hf_dir: str) -> None:
    diff = [f"{k}: config {getattr(cfg.llm, k)!r}, checkpoint {v!r}" for k, v in fields.items()
            if getattr(cfg.llm, k) != v]
    if diff:
        raise ConfigError(f"llm section does not match the checkpoint {hf_dir} ({'; '.join(diff)}); "
                          f"use config_from_hf to take the dimensions from it")


def _state_proj(cfg: ModelConfig) -> nn.Module:
    """The prefill graphs' projection of the robot state into the prefix (``action.state_input: prefix``)."""
    return nn.Linear(cfg.prefix_state_dim, cfg.llm.hidden_dim)


def _load_lerobot(cfg: ModelConfig, hf_dir: str) -> dict:
    """The language model, vision encoder and action expert (and SmolVLA's state projection; pi0-FAST has no
    expert) of a LeRobot pi0 / pi0.5 / pi0-FAST / SmolVLA checkpoint (``cfg`` must be :func:`config_from_hf` of
    it), weights loaded; the expert's projections fused for export."""
    smolvla = is_lerobot_smolvla(hf_dir)
    flow = cfg.action.head_type == "flow_matching"
    with torch.device("meta"):
        parts = {"lm": CausalLM(cfg.llm), "vision": VitVisionEncoder(cfg)}
        if flow:
            parts["expert"] = ActionExpert(cfg)
        if smolvla:
            parts["state_proj"] = _state_proj(cfg)
    for module in parts.values():
        materialize(module)
    if smolvla:
        load_lerobot_smolvla(hf_dir, parts["lm"], parts["vision"], parts["expert"], parts["state_proj"])
    else:
        load_lerobot_pi0(hf_dir, parts["lm"], parts["vision"], parts.get("expert"))
    if flow:
        fuse_projections(parts["expert"])
    return {name: module.eval() for name, module in parts.items()}


def build_graph_modules(cfg: ModelConfig, seed: int = 0, hf_dir: str | None = None) -> GraphModules:
    """One torch module per graph of ``graph_set(cfg)``."""
    if cfg.groot_dit:
        from .lerobot_groot import groot_graph_modules
        modules, tokenizer, source = groot_graph_modules(cfg, seed, hf_dir)
        return GraphModules(modules, [], tokenizer, source)
    llm = cfg.llm
    rope = None
    model_type = None
    pi0 = None
    if hf_dir and (is_lerobot_pi0(hf_dir) or is_lerobot_smolvla(hf_dir)):
        pi0 = _load_lerobot(cfg, hf_dir)
        lm = pi0["lm"]
        model_type = ("lerobot_smolvla" if "state_proj" in pi0 else "lerobot_pi0" if "expert" in pi0
                      else "lerobot_pi0_fast")
    elif hf_dir:
        model_type, fields, rope = hf_llm_fields(hf_dir)
        _check_matches_checkpoint(cfg, fields, hf_dir)
        with torch.device("meta"):
            lm = CausalLM(llm, rope)
        materialize(lm)
        load_hf_weights(lm, hf_dir, model_type)
        lm.eval()
    else:
        lm = _random(lambda: CausalLM(llm), seed, "decoder")
    metas = graph_set(cfg)
    # joined projections only where a decode step reads them (see fuse_projections)
    lm.finalize_weights(join=any(m.kind == "decode" for m in metas))
    modules: dict[str, nn.Module] = {}
    missing: list[str] = []
    state_proj = None
    random_parts: list[str] = []
    experts: list = []

    def the_expert():
        """The action expert every action_expert graph (and SmolVLA's prefill) shares, made once."""
        if not experts:
            experts.append(pi0["expert"] if pi0 is not None else
                           fuse_projections(_random(lambda: ActionExpert(cfg, rope), seed, "action_expert")))
        return experts[0]

    cross = cfg.mode == "vla" and cfg.action.expert_attention == "cross_attn"  # (flow-matching heads only)
    for meta in metas:
        bucket = meta.attrs.get("bucket")
        if meta.kind == "vision_encoder" and cfg.vision.architecture == "qwen3_vl":
            # Random weights come from the tower's own generator, seeded with ``seed``.
            modules[meta.name] = build_qwen3_vl_vision(cfg, seed=seed, hf_dir=hf_dir)
            if not hf_dir:
                random_parts.append(meta.name)
        elif meta.kind == "vision_encoder" and pi0 is not None:
            modules[meta.name] = pi0["vision"]
        elif meta.kind == "vision_encoder" and cfg.vision.architecture == "vit":
            modules[meta.name] = _random(lambda: VitVisionEncoder(cfg), seed, "vision")
            random_parts.append(meta.name)
        elif meta.kind == "embed":
            modules[meta.name] = EmbedGraph(lm, bucket).eval()
        elif meta.kind == "prefill":
            if meta.has_input("state") and state_proj is None:
                state_proj = pi0["state_proj"] if pi0 is not None else _random(lambda: _state_proj(cfg), seed,
                                                                               "state_proj")
            modules[meta.name] = PrefillGraph(lm, bucket, llm.max_seq_len, llm.kv_dtype,
                                              logits=meta.has_output("logits"),
                                              deepstack=meta.has_input("deepstack_embeds"),
                                              state_proj=state_proj if meta.has_input("state") else None,
                                              expert=the_expert() if cross else None).eval()
        elif meta.kind == "decode":
            modules[meta.name] = DecodeGraph(lm, bucket, llm.kv_dtype).eval()
        elif meta.kind in ("action_expert", "action_expert_vjp"):
            graph = ActionExpertGraph if meta.kind == "action_expert" else ActionExpertVJPGraph
            modules[meta.name] = graph(the_expert(), bucket).eval()
            if pi0 is None:
                random_parts.append(meta.name)
        else:
            missing.append(meta.name)

    tokenizer = None
    if hf_dir:
        tok = os.path.join(hf_dir, "tokenizer.json")
        tokenizer = tok if os.path.isfile(tok) else None
        source = {"weights": "hf", "path": os.path.abspath(hf_dir), "model_type": model_type,
                  "random": random_parts, "seed": seed}
    else:
        source = {"weights": "random", "seed": seed}
    return GraphModules(modules, missing, tokenizer, source)
