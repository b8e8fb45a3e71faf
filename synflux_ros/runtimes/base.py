"""What both runtimes are built from: the executor a config asks for (registry lookup, graph set, load),
the tokenizer, the vision encoder, the LLM backbone and a pool of KV-cache slots, then the executor's
memory pool frozen so that serving allocates nothing."""
from __future__ import annotations

import json
import os

from ..backends import build_executor
from ..graphset import reader as graphset
from ..core.config import ConfigError, ModelConfig
from ..core.executor import Executor
from ..core.contract import GraphMeta
from ..core.contract import graph_set
from ..core.kv_cache import KVCachePool
from ..core.placement import PlacedExecutor
from ..model.backbone import LLMBackbone
from ..model.tokenizer import Tokenizer, load_tokenizer
from ..model.vision import VisionEncoder


def resolve_graph_dir(cfg: ModelConfig) -> str:
    """``executor.graph_dir`` as an absolute path; a relative one is relative to the config file."""
    gdir = cfg.relative_to_source(cfg.executor.graph_dir)
    return os.path.abspath(gdir) if gdir else ""


def load_graph_metas(cfg: ModelConfig, manifest: dict | None = None) -> list[GraphMeta]:
    """Graph metas from the graph set's manifest when there is one (checked against the config), else the
    config's own graph set (backends such as the mock need no files)."""
    expected = graph_set(cfg)
    gdir = resolve_graph_dir(cfg)
    if manifest is None:
        manifest = graphset.find_manifest(gdir)
    if manifest is None:
        return expected
    where = os.path.join(gdir, graphset.MANIFEST_FILE)
    by_name = {m.name: m for m in graphset.graph_metas(gdir, manifest)}
    for want in expected:
        got = by_name.get(want.name)
        if got is None:
            raise ConfigError(f"executor.graph_dir: {where} has no graph {want.name!r}; rebuild the graph "
                              f"set for this config")
        if got.inputs != want.inputs or got.outputs != want.outputs:
            raise ConfigError(f"executor.graph_dir: graph {want.name!r} in {where} was built for other shapes "
                              f"than this config; rebuild the graph set")
    return [by_name[w.name] for w in expected]


VJP_OF = {"action_expert_vjp": "action_expert", "dit_vjp": "dit"}
"""Real-Time Chunking's VJP graph kinds and the kind each runs again."""


def create_executor(cfg: ModelConfig, manifest: dict | None = None) -> Executor:
    """Instantiate and load the configured backend, or with ``executor.placement`` one executor per
    placement behind a :class:`PlacedExecutor`. Errors name the backend or the missing package."""
    metas = load_graph_metas(cfg, manifest)
    placements = cfg.executor.placements()
    if not placements:
        return _load_member(cfg, cfg.executor.backend, cfg.executor.options, metas)
    groups: dict[str, tuple[str, dict, list]] = {}
    for meta in metas:
        # Real-Time Chunking's VJP graph runs the action expert (the DiT) again: it goes where that goes
        where = placements.get(VJP_OF.get(meta.kind, meta.kind))
        backend, options = (where.backend, dict(where.options)) if where else \
            (cfg.executor.backend, dict(cfg.executor.options))
        key = json.dumps([backend, options], sort_keys=True, default=str)
        groups.setdefault(key, (backend, options, []))[2].append(meta)
    members: dict[str, Executor] = {}
    try:
        for backend, options, group in groups.values():
            ex = _load_member(cfg, backend, options, group)
            label = ex.device_of(group[0].name)
            members[label if label not in members else f"{label}#{len(members)}"] = ex
        return PlacedExecutor(members)
    except BaseException:
        for ex in members.values():
            ex.close()
        raise


def _load_member(cfg: ModelConfig, backend: str, options: dict, metas: list[GraphMeta]) -> Executor:
    options = dict(options)
    if cfg.executor.latency_ms:
        options["latency_ms"] = dict(cfg.executor.latency_ms)
    return build_executor(backend, metas, resolve_graph_dir(cfg), options).load()


class ModelRuntime:
    """Base of the VLA and VLM runtimes: checks the config's mode, then loads the executor, the tokenizer,
    the vision encoder, the LLM backbone and ``kv_slots`` KV-cache slots, freezes device memory, and
    then lets the subclass add what only it has (:meth:`_setup`: heads, templates, sessions).

    ``executor`` and ``tokenizer`` may be passed in (tests, benchmarks); otherwise they come from the
    config and its graph set. A runtime that fails to load releases the executor it created.
    """

    mode = ""

    def __init__(self, cfg: ModelConfig, kv_slots: int, kv_name: str, executor: Executor | None = None,
                 tokenizer: Tokenizer | None = None):
        if cfg.mode != self.mode:
            raise ConfigError(f"mode: {type(self).__name__} needs a '{self.mode}' config, {cfg.name!r} is "
                              f"{cfg.mode!r}")
        self.cfg = cfg
        gdir = resolve_graph_dir(cfg)
        manifest = graphset.find_manifest(gdir)
        self.executor = executor if executor is not None else create_executor(cfg, manifest)
        try:
            self.tokenizer = tokenizer if tokenizer is not None else \
                load_tokenizer(cfg, graphset.tokenizer_file(gdir, manifest))
            self.vision = VisionEncoder(cfg, self.executor) if cfg.vision is not None else None
            self.backbone = LLMBackbone(cfg, self.executor)
            self.kv_pool = KVCachePool(self.executor, kv_slots, cfg.llm.kv_shape, cfg.llm.kv_dtype, kv_name) \
                if kv_slots else None  # (GR00T's backbone keeps no cache)
            self.executor.freeze()
            self._setup()
        except BaseException:
            if executor is None:
                self.executor.close()
            raise

    def _setup(self) -> None:
        """Subclass part of loading; runs after device memory is frozen."""

    def close(self) -> None:
        """Free the executor's device memory and graphs."""
        self.executor.close()
