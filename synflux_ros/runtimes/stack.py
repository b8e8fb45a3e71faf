"""Create the executor a config asks for: registry lookup, graph set, load."""
from __future__ import annotations

import json
import os

from ..backends import build_executor
from ..core.executor import Executor, GraphMeta
from ..core.config import ConfigError, ModelConfig
from ..core.graphs import graph_set


def resolve_graph_dir(cfg: ModelConfig) -> str:
    """``executor.graph_dir`` as an absolute path; a relative one is relative to the config file."""
    gdir = cfg.executor.graph_dir
    if gdir and not os.path.isabs(gdir) and cfg.source:
        gdir = os.path.join(os.path.dirname(cfg.source), gdir)
    return os.path.abspath(gdir) if gdir else ""


def load_graph_metas(cfg: ModelConfig) -> list[GraphMeta]:
    """Graph metas from ``graph_dir/manifest.json`` when present (checked against the config), else the
    config's own graph set (backends such as the mock need no files)."""
    expected = graph_set(cfg)
    gdir = resolve_graph_dir(cfg)
    manifest = os.path.join(gdir, "manifest.json") if gdir else ""
    if not manifest or not os.path.isfile(manifest):
        return expected
    with open(manifest, encoding="utf-8") as fh:
        data = json.load(fh)
    metas = [GraphMeta.from_dict(g) for g in data.get("graphs", [])]
    by_name = {m.name: m for m in metas}
    for want in expected:
        got = by_name.get(want.name)
        if got is None:
            raise ConfigError(f"executor.graph_dir: {manifest} has no graph {want.name!r}; rebuild the graph "
                              f"set for this config")
        if got.inputs != want.inputs or got.outputs != want.outputs:
            raise ConfigError(f"executor.graph_dir: graph {want.name!r} in {manifest} was built for other shapes "
                              f"than this config; rebuild the graph set")
    return [by_name[w.name] for w in expected]


def create_executor(cfg: ModelConfig) -> Executor:
    """Instantiate and load the configured backend. Errors name the backend or the missing package."""
    options = dict(cfg.executor.options)
    if cfg.executor.latency_ms:
        options["latency_ms"] = dict(cfg.executor.latency_ms)
    ex = build_executor(cfg.executor.backend, load_graph_metas(cfg), resolve_graph_dir(cfg), options)
    return ex.load()
