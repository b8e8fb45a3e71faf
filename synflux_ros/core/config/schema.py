"""The loader behind every config section: ``setting`` declares a field (default, choices, range, doc and
whether it shapes the graphs), and a mapping becomes a dataclass with type, choice and range checks, each
error naming the field's path."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


def setting(default=dataclasses.MISSING, *, choices=None, min=None, max=None, doc="", default_factory=None,
            graph=True):
    """A config field: its default (none = required), the values it may take (``choices``, ``min``, ``max``,
    checked at load) and ``doc``, the line ``describe_fields`` prints. Every section and every backend's
    ``executor.options`` declares its fields with it.

    ``graph=False`` marks a field that neither shapes nor fills a compiled graph (run-time behaviour only): a
    graph set built for one value serves every other, so ``ModelConfig.graph_hash`` leaves it out. On a
    section, it leaves out the whole section."""
    meta = {"choices": choices, "min": min, "max": max, "doc": doc, "graph": graph}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def graph_values(section) -> dict:
    """The fields of the dataclass ``section`` that shape its graphs (``setting(graph=True)``, the default),
    nested sections reduced the same way, as plain values for a hash."""
    out = {}
    for f in dataclasses.fields(section):
        if f.metadata.get("graph", True):
            value = getattr(section, f.name)
            out[f.name] = graph_values(value) if dataclasses.is_dataclass(value) else value
    return out


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _convert(value, tp, path: str, meta: dict):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(value, inner[0], path, meta)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return _build(tp, value, path + ".")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            items = [_convert(v, args[0], f"{path}[{i}]", meta) for i, v in enumerate(value)]
        else:
            if len(value) != len(args):
                raise ConfigError(f"{path}: expected {len(args)} values, got {len(value)} ({list(value)})")
            items = [_convert(v, a, f"{path}[{i}]", meta) for i, (v, a) in enumerate(zip(value, args))]
        return tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return {str(k): (_convert(v, args[1], f"{path}.{k}", {}) if args[1] is not Any else v)
                for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
    elif tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise ConfigError(f"{path}: {value!r} is not allowed (choices: {', '.join(meta['choices'])})")
    if isinstance(value, (int, float)):
        if meta.get("min") is not None and value < meta["min"]:
            raise ConfigError(f"{path}: {value!r} is below the minimum {meta['min']}")
        if meta.get("max") is not None and value > meta["max"]:
            raise ConfigError(f"{path}: {value!r} is above the maximum {meta['max']}")
    return value


def choices_hint(name, choices) -> str:
    """`` (choices: a, b; did you mean 'a'?)`` for a ``name`` that is not one of ``choices``: the one
    wording of every "unknown name" error (config fields, backends, backend options)."""
    choices = [str(c) for c in choices]
    close = difflib.get_close_matches(str(name), choices, n=1)
    return f" (choices: {', '.join(choices)}" + (f"; did you mean {close[0]!r}?" if close else "") + ")"


@functools.cache
def _type_hints(cls) -> dict:
    """The resolved annotations of a section, once per class: resolving them is most of a load's time."""
    return typing.get_type_hints(cls)


def _build(cls, raw: dict, prefix: str):
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise ConfigError(f"{prefix}{key}: unknown field{choices_hint(key, fields)}")
    kwargs = {}
    for name, f in fields.items():
        path = prefix + name
        if name in raw:
            kwargs[name] = _convert(raw[name], hints[name], path, dict(f.metadata))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{path}: required field is missing")
    # __post_init__ checks raise ConfigError with their own field paths (relative ones for sections that can
    # sit in several places, prefixed here).
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if getattr(cls, "_RELATIVE_ERRORS", False):
            raise ConfigError(f"{prefix}{exc}") from None
        raise


def options_from_dict(cls, raw, prefix: str = "executor.options."):
    """Validate the mapping ``raw`` into the dataclass ``cls`` as a config section is validated (types, choices,
    ranges, unknown keys with "did you mean"), errors naming ``prefix`` + the field: how a backend checks the
    ``executor.options`` it takes."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.')}: expected a mapping, got {raw!r}")
    return _build(cls, raw, prefix)
