"""Node parameters and the model config they name.

:class:`Param` declares a parameter with its description and allowed values; :func:`read` checks them and
raises :class:`ParameterError`, whose message names the node, the parameter and the value. The ``config``
parameter is a path or a file name in the package's ``share/<PACKAGE>/config``
(:func:`resolve_config_path`); :func:`load_node_config` loads it with the ``executor``/``graph_dir``
overrides.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from rcl_interfaces.msg import ParameterDescriptor

from ..core.config import ConfigError, ModelConfig, load_config

PACKAGE = "synflux_ros"


class ParameterError(ValueError):
    """A node parameter has a bad value; the message names the node, the parameter and the value."""


@dataclass(frozen=True)
class Param:
    """One node parameter: name, default, description and, where fixed, the allowed values."""
    name: str
    default: Any
    description: str
    choices: tuple = ()
    any_type: bool = False  # a value of another type than the default's is taken (and checked when read)


COMMON_PARAMS = [
    Param("executor", "", "backend overriding the config's executor.backend (empty = keep)"),
    Param("graph_dir", "", "compiled graph directory overriding the config's executor.graph_dir (empty = keep)"),
    Param("diagnostics_period", 1.0, "seconds between /diagnostics messages"),
    Param("autostart", True, "configure and activate at start-up (no lifecycle manager needed)"),
]
"""The parameters every model node has besides its own (``config`` among those)."""


def declare(node, params: list[Param]) -> None:
    for p in params:
        desc = p.description + (f" (choices: {', '.join(map(str, p.choices))})" if p.choices else "")
        node.declare_parameter(p.name, p.default, ParameterDescriptor(description=desc, dynamic_typing=p.any_type))


def read(node, params: list[Param]) -> dict[str, Any]:
    """Read declared parameters and check choices; errors name the node and the value."""
    values = {}
    for p in params:
        v = node.get_parameter(p.name).value
        if p.choices and v not in p.choices:
            raise ParameterError(f"[{node.get_name()}] parameter '{p.name}': {v!r} is not allowed "
                                 f"(choices: {', '.join(map(str, p.choices))})")
        values[p.name] = v
    return values


def share_dir() -> str | None:
    """The package's share directory: from the ament index, else next to this interpreter's prefix."""
    try:
        from ament_index_python.packages import get_package_share_directory
        return get_package_share_directory(PACKAGE)
    except (ImportError, LookupError, OSError):
        pass
    local = os.path.join(sys.prefix, "share", PACKAGE)
    return local if os.path.isdir(local) else None


def resolve_config_path(value: str) -> str:
    """An existing path as given, else a bare name in the package's share/config directory."""
    if not value:
        raise FileNotFoundError("no config given (set the 'config' parameter to a YAML file)")
    if os.path.isfile(value):
        return os.path.abspath(value)
    share = share_dir()
    candidates = [os.path.join(share, "config", value)] if share and not os.path.isabs(value) else []
    for c in candidates:
        if os.path.isfile(c):
            return c
    where = f" or in {os.path.join(share, 'config')}" if share else ""
    raise FileNotFoundError(f"config file {value!r} not found (as a path{where})")


def load_node_config(node, mode: str, config: str, executor: str, graph_dir: str) -> ModelConfig:
    """Load the model YAML named by the node's parameters, with executor/graph_dir overrides."""
    name = node.get_name()
    try:
        cfg = load_config(resolve_config_path(config))
    except (FileNotFoundError, ConfigError) as exc:
        raise ParameterError(f"[{name}] parameter 'config' ({config!r}): {exc}") from None
    if cfg.mode != mode:
        raise ParameterError(f"[{name}] parameter 'config' ({config!r}): a {cfg.mode!r} model, this node serves "
                             f"{mode!r} models")
    overrides = {}
    if executor:
        overrides["backend"] = executor
    if graph_dir:
        if not os.path.isdir(graph_dir):
            raise ParameterError(f"[{name}] parameter 'graph_dir': {graph_dir!r} is not a directory")
        overrides["graph_dir"] = os.path.abspath(graph_dir)
    return cfg.with_overrides(executor=overrides) if overrides else cfg
