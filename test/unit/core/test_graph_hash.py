"""ModelConfig.graph_hash covers every field the graph contract reads.

Each field of a config is changed on its own to other values; where the changed config loads and its graph set
(names, kinds, shapes, dtypes, attributes: ``graph_set``) differs from the original's, its graph hash must
differ too. A field declared ``setting(graph=False)`` that the contract reads fails here, as does a contract
input the hash leaves out (``execution.mode`` and ``execution.rtc.guidance`` decide RTC's vjp graphs).
"""
from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest

from synflux_ros.core.config import ConfigError, ModelConfig, from_dict, graph_values, load_config
from synflux_ros.core.contract import graph_set

CONFIG_DIR = Path(__file__).resolve().parents[3] / "config"
YAMLS = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))
# The flow-matching configs again with the vjp guidance: their sets hold the vjp graphs, which mode, delta_mask
# and guidance changes take away.
VJP = ["vla_pi0.yaml", "vla_sim_arm.yaml"]


def load(name: str, vjp: bool = False) -> ModelConfig:
    cfg = load_config(str(CONFIG_DIR / name))
    return changed(cfg, "execution.rtc.guidance", "vjp") if vjp else cfg


def changed(cfg: ModelConfig, path: str, value) -> ModelConfig:
    """``cfg`` with the field at the dotted ``path`` set to ``value``, loaded (and validated) again."""
    raw = cfg.to_dict()
    *sections, name = path.split(".")
    node = raw
    for section in sections:
        node = node[section]
    node[name] = value
    return from_dict(raw, source=cfg.source)


def contract(cfg: ModelConfig) -> str:
    return json.dumps([g.to_dict() for g in graph_set(cfg)], sort_keys=True)


def _numbers(value, tp, meta) -> list:
    out = [value + 1, value * 2, value - 1, 0] if tp is int else [value * 2, value / 2, value + 1.0]
    lo, hi = meta.get("min"), meta.get("max")
    return [v for v in out if v != value and (lo is None or v >= lo) and (hi is None or v <= hi)]


def other_values(value, tp, meta) -> list:
    """A few other values of a field's type (the config may refuse some; those are skipped)."""
    if meta.get("choices"):
        return [c for c in meta["choices"] if c != value]
    if tp is bool:
        return [not value]
    if tp in (int, float):
        return _numbers(value, tp, meta)
    if tp is str:
        return [value + "_x", ""] if value else ["x"]
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        item = args[0]
        if len(args) == 2 and args[1] is Ellipsis:
            if item is typing.Any:
                return []
            if not value:
                return [({bool: True, int: 1, float: 1.0, str: "extra"}[item],)]
            grown = value + (value[-1] if item is not str else "extra",)
            if item is bool:
                return [value[1:], grown, tuple(not v for v in value)]
            if item is str:
                return [value[1:], grown]
            return [value[1:], value[:-1], grown, tuple(v * 2 for v in value), tuple(v + 1 for v in value)]
        if all(a in (int, float) for a in args):
            return [tuple(v * 2 for v in value), (value[0] * 2, *value[1:])]
    return []  # mappings and Any: nothing a graph reads


def fields(section, prefix: str = ""):
    """(dotted path, value, type, metadata) of every leaf field of a config, nested sections walked."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield from fields(value, f"{prefix}{f.name}.")
        elif f.name != "source":
            yield f"{prefix}{f.name}", value, hints[f.name], f.metadata


def changes(cfg: ModelConfig):
    """(path, value, changed config) for every single-field change of ``cfg`` that still loads."""
    for path, value, tp, meta in fields(cfg):
        for other in other_values(value, tp, meta):
            try:
                yield path, other, changed(cfg, path, other)
            except ValueError:  # ConfigError among them: another field forbids this value
                continue


@pytest.mark.parametrize("name,vjp", [(n, False) for n in YAMLS] + [(n, True) for n in VJP])
def test_every_field_the_graph_set_reads_is_hashed(name, vjp):
    base = load(name, vjp)
    base_contract, base_hash = contract(base), base.graph_hash()
    shaping = set()
    for path, value, cfg in changes(base):
        if contract(cfg) != base_contract:
            assert cfg.graph_hash() != base_hash, f"{path}: {value!r} changes the graph set but not graph_hash()"
            shaping.add(path)
    # the walk reached the contract (GR00T's keeps no KV cache: its shapes follow the DiT's blocks, not the LLM's)
    assert ({"action.dit_layers", "llm.prefill_buckets"} if base.groot_dit else
            {"llm.num_layers", "llm.prefill_buckets"}) <= shaping
    if vjp:
        assert {"execution.mode", "execution.rtc.guidance"} <= shaping


def test_rtc_guidance_and_mode_enter_the_hash_as_the_contract_reads_them():
    plain, vjp = load("vla_sim_arm.yaml"), load("vla_sim_arm.yaml", vjp=True)
    assert plain.resolved_execution.mode == "rtc" and not plain.rtc_vjp_graphs
    assert vjp.rtc_vjp_graphs and any(g.kind == "action_expert_vjp" for g in graph_set(vjp))
    assert vjp.graph_hash() != plain.graph_hash()
    # the same graphs, the same hash: auto resolves to rtc here; replace and delta actions take no vjp graphs
    assert changed(vjp, "execution.mode", "rtc").graph_hash() == vjp.graph_hash()
    assert changed(vjp, "execution.mode", "replace").graph_hash() == plain.graph_hash()
    delta = changed(vjp, "execution.delta_mask", [True] + [False] * 6)
    assert delta.resolved_execution.mode == "replace" and delta.graph_hash() == plain.graph_hash()
    # a chat model has no action expert: the guidance shapes nothing there
    chat = load("vlm_demo.yaml")
    assert changed(chat, "execution.rtc.guidance", "vjp").graph_hash() == chat.graph_hash()


def test_graph_false_fields_stay_out_of_the_hash():
    cfg = load("vla_pi0.yaml")
    assert set(graph_values(cfg)) == {"mode", "vision", "llm", "action"}
    assert "step_period" not in graph_values(cfg.action) and "cameras" not in graph_values(cfg.vision)
    for path, value in (("action.step_period", 0.05), ("vision.interpolation", "nearest"), ("name", "other"),
                        ("execution.control_rate_hz", 50.0), ("tokenizer.max_instruction_tokens", 12),
                        ("executor.backend", "onnxruntime")):
        assert changed(cfg, path, value).graph_hash() == cfg.graph_hash(), path

