"""Executor base class: graph bookkeeping, static device buffers, shape contracts and timing.

A backend (mock, onnxruntime, TensorRT, a vendor NPU SDK) subclasses :class:`Executor` and fills five
hooks::

    _load_graph(path, meta) -> handle        load one compiled graph
    _execute(handle, device_inputs, device_outputs, meta)
                                             run it; inputs and outputs are device buffers that the
                                             base class allocated once at load time
    _alloc_device(nbytes) -> device buffer   allocate device memory
    _h2d(host_array, device_buffer)          host -> device copy
    _d2h(device_buffer, shape, dtype)        device -> host copy, returns a new numpy array

and may override ``_write_region`` (a strided host -> device copy into part of a tensor, used to append
new KV entries to a cache slot; the default goes through ``_d2h``/``_h2d``), ``_free_device`` and
``_unload_graph``.

Everything a graph consumes or produces is declared by its :class:`GraphMeta`; :meth:`Executor.run`
checks every feed against it, so a wrong shape fails with the graph and tensor named instead of
producing garbage on the device. :meth:`Executor.bind` checks a graph's resident inputs (a KV slot) once
and returns a :class:`BoundGraph` whose ``run`` takes the host inputs alone, for calls made per token.
"""
from __future__ import annotations

import abc
import contextlib
import os
import threading
import time

import numpy as np

from .contract import (DeviceTensor, GraphMeta, GraphNotFoundError, GraphStats, NonFiniteOutputError, ShapeError,
                       TensorSpec)
from .memory import StaticMemoryPool


class Executor(abc.ABC):
    """Base class of every backend. Subclasses set ``name`` and implement the five hooks."""

    name = "base"

    def __init__(self, graphs: list[GraphMeta], graph_dir: str = "", options: dict | None = None):
        names = [g.name for g in graphs]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate graph names: {sorted(dup)}")
        self.graphs: dict[str, GraphMeta] = {g.name: g for g in graphs}
        self.graph_dir = graph_dir
        self.options = dict(options or {})
        self.pool: StaticMemoryPool | None = None
        self._handles: dict[str, object] = {}
        self._staging: dict[tuple[str, str], object] = {}
        self._generation = 0  # counts loads and closes: a BoundGraph is valid within one load
        self._group_locks: dict[str, threading.Lock] = {}
        self.stats: dict[str, GraphStats] = {n: GraphStats() for n in self.graphs}
        self._loaded = False
        self.gate = contextlib.nullcontext()  # entered around each graph call (set_gate)

    # ------------------------------------------------------------------ hooks
    @abc.abstractmethod
    def _load_graph(self, path: str, meta: GraphMeta) -> object:
        """Load one compiled graph from ``path`` (empty for backends that need no files)."""

    @abc.abstractmethod
    def _execute(self, graph_handle: object, device_inputs: dict, device_outputs: dict, meta: GraphMeta) -> None:
        """Run a graph. ``device_inputs``/``device_outputs`` map tensor names to device buffers."""

    @abc.abstractmethod
    def _alloc_device(self, nbytes: int) -> object:
        """Allocate ``nbytes`` of device memory and return a handle to it."""

    @abc.abstractmethod
    def _h2d(self, data: np.ndarray, device_buffer: object) -> None:
        """Copy a C-contiguous host array into a device buffer."""

    @abc.abstractmethod
    def _d2h(self, device_buffer: object, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """Copy ``prod(shape)`` elements from a device buffer into a new host array."""

    def _write_region(self, device_buffer: object, shape, dtype: str, index: tuple, data: np.ndarray) -> None:
        """Write ``data`` into ``tensor[index]``. Backends with strided copies should override this."""
        full = self._d2h(device_buffer, shape, dtype)
        full[index] = data
        self._h2d(np.ascontiguousarray(full), device_buffer)

    alloc_is_zeroed = False
    """True when ``_alloc_device`` returns zero-filled memory (then fresh tensors are not cleared again)."""

    def _zero_device(self, device_buffer: object, shape: tuple[int, ...], dtype: str) -> None:
        """Fill a device buffer with zeros. Backends with a device memset should override this."""
        self._h2d(np.zeros(shape, dtype), device_buffer)

    def _free_device(self, device_buffer: object) -> None:  # noqa: B027 - optional hook
        """Release device memory (optional: process exit frees it too)."""

    def _unload_graph(self, graph_handle: object) -> None:  # noqa: B027 - optional hook
        """Release a loaded graph (optional)."""

    # ------------------------------------------------------------------ lifecycle
    weight_dtypes: tuple[str, ...] = ("float32",)
    """Weight formats of graph sets this backend runs (``synflux-build --weights``; see
    :func:`~synflux_ros.graphset.reader.check_weight_format`)."""

    def check_weight_format(self) -> None:
        """Refuse a graph set whose weight format (manifest ``weights.dtype``) this backend cannot run. The
        base accepts every format; backends that read graph sets from disk check the manifest
        (:class:`~synflux_ros.graphset.reader.ChecksWeightFormat`)."""

    def graph_path(self, meta: GraphMeta) -> str:
        if not meta.file:
            return ""
        return meta.file if os.path.isabs(meta.file) else os.path.join(self.graph_dir, meta.file)

    def load(self) -> "Executor":
        """Load every graph and allocate every staging buffer. Idempotent."""
        if self._loaded:
            return self
        self.check_weight_format()
        self.pool = StaticMemoryPool(self._alloc_device, self._free_device)
        sizes: dict[tuple[str, str], int] = {}
        for meta in self.graphs.values():
            self._handles[meta.name] = self._load_graph(self.graph_path(meta), meta)
            self._group_locks.setdefault(meta.group, threading.Lock())
            for spec in meta.inputs + meta.outputs:
                if spec.resident:
                    continue
                key = (meta.group, spec.name)
                sizes[key] = max(sizes.get(key, 0), spec.nbytes)
        for (group, tensor), nbytes in sizes.items():
            self._staging[(group, tensor)] = self.pool.allocate(f"{group}/{tensor}", nbytes)
        self._generation += 1
        self._loaded = True
        return self

    def alloc_tensor(self, name: str, shape: tuple[int, ...], dtype: str, zero: bool = True) -> DeviceTensor:
        """Allocate a caller-owned device tensor (before :meth:`freeze`)."""
        self._require_loaded()
        shape = tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        handle = self.pool.allocate(name, nbytes)
        if zero and not self.alloc_is_zeroed:
            self._zero_device(handle, shape, dtype)
        return DeviceTensor(name, handle, shape, dtype)

    def freeze(self) -> None:
        """End of load: from now on any device allocation is an error."""
        self._require_loaded()
        self.pool.freeze()

    def close(self) -> None:
        for h in self._handles.values():
            self._unload_graph(h)
        self._handles.clear()
        self._staging.clear()
        if self.pool is not None:
            self.pool.release_all()
        self._generation += 1
        self._loaded = False

    def device_of(self, graph: str) -> str:
        """Where ``graph`` runs: the backend name, with the ``device`` option when one is set."""
        device = self.options.get("device", "")
        return f"{self.name}:{device}" if device else self.name

    @property
    def loaded(self) -> bool:
        return self._loaded

    @property
    def device_bytes(self) -> int:
        return self.pool.allocated_bytes if self.pool else 0

    def _require_loaded(self):
        if not self._loaded:
            raise RuntimeError(f"{self.name} executor: call load() first")

    # ------------------------------------------------------------------ running
    def check_feeds(self, meta: GraphMeta, feeds: dict) -> None:
        expected = {t.name for t in meta.inputs}
        missing = expected - feeds.keys()
        extra = feeds.keys() - expected
        if missing or extra:
            raise ShapeError(f"graph {meta.name!r}: missing inputs {sorted(missing)}, unexpected {sorted(extra)}"
                             f" (expects {sorted(expected)})")
        for spec in meta.inputs:
            value = feeds[spec.name]
            if spec.resident and not isinstance(value, DeviceTensor):
                raise ShapeError(f"graph {meta.name!r}: input {spec.name!r} must be a device tensor")
            if not isinstance(value, (DeviceTensor, np.ndarray)):
                raise ShapeError(f"graph {meta.name!r}: input {spec.name!r} must be a numpy array or device "
                                 f"tensor, got {type(value).__name__}")
            _check_shape(meta, spec, value)

    def _meta(self, graph: str) -> GraphMeta:
        """The loaded executor's graph ``graph``."""
        self._require_loaded()
        meta = self.graphs.get(graph)
        if meta is None:
            raise GraphNotFoundError(f"no graph {graph!r} (have: {', '.join(sorted(self.graphs))})")
        return meta

    def set_gate(self, gate) -> None:
        """``gate``, a context manager, is entered before each graph call and left after it: a background
        model's calls wait there while the accelerator arbiter gives the control model its turn
        (:class:`~synflux_ros.core.sharing.Arbiter`); None removes it."""
        self.gate = contextlib.nullcontext() if gate is None else gate

    def run(self, graph: str, feeds: dict) -> dict[str, np.ndarray]:
        """Run ``graph`` on ``feeds`` (numpy arrays or :class:`DeviceTensor`), return host outputs."""
        meta = self._meta(graph)
        self.check_feeds(meta, feeds)
        with self.gate, self._group_locks[meta.group]:
            device_inputs = {}
            for spec in meta.inputs:
                value = feeds[spec.name]
                if isinstance(value, DeviceTensor):
                    device_inputs[spec.name] = value.handle
                else:
                    buf = self._staging[(meta.group, spec.name)]
                    self._h2d(np.ascontiguousarray(value), buf)
                    device_inputs[spec.name] = buf
            device_outputs = {spec.name: self._staging[(meta.group, spec.name)] for spec in meta.outputs}
            t0 = time.perf_counter()
            self._execute(self._handles[graph], device_inputs, device_outputs, meta)
            ms = (time.perf_counter() - t0) * 1e3
            out = {spec.name: self._d2h(device_outputs[spec.name], spec.shape, spec.dtype) for spec in meta.outputs}
        return self._account(graph, ms, out)

    def _account(self, graph: str, ms: float, out: dict) -> dict:
        """Record a run of ``graph`` that took ``ms`` and check its host outputs ``out`` (returned)."""
        st = self.stats[graph]
        st.calls += 1
        st.total_ms += ms
        st.last_ms = ms
        for name, value in out.items():
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                bad = value.size - int(np.count_nonzero(np.isfinite(value)))
                raise NonFiniteOutputError(f"{self.name} executor: graph {graph!r} output {name!r} holds {bad} "
                                           f"non-finite values (NaN/Inf) of {value.size}")
        return out

    def bind(self, graph: str, resident: dict, outputs=None) -> "BoundGraph":
        """``graph`` with its resident inputs (``resident``: name -> :class:`DeviceTensor`, e.g. a KV slot)
        checked and bound once, returning only ``outputs`` (names; default all): :meth:`BoundGraph.run`
        then takes the host inputs alone. For calls repeated per token, where the lookups and checks of
        :meth:`run` cost as much as a run's smallest kernels."""
        return BoundGraph(self, self._meta(graph), resident, outputs)

    def updates_in_place(self, graph: str, name: str) -> bool:
        """True when a run of ``graph`` has already written its new entries into its input ``name`` (a KV
        slot), so that the caller need not write the graph's ``new_kv`` output back into it. False here: a
        backend whose loaded graph appends to the slot itself says so."""
        return False

    def write(self, tensor: DeviceTensor, index: tuple, data: np.ndarray) -> None:
        """Write host ``data`` into ``tensor[index]`` on the device."""
        self._write_region(tensor.handle, tensor.shape, tensor.dtype, index, np.asarray(data, tensor.dtype))

    def read(self, tensor: DeviceTensor) -> np.ndarray:
        return self._d2h(tensor.handle, tensor.shape, tensor.dtype)


def _check_shape(meta: GraphMeta, spec: TensorSpec, value) -> None:
    """``value`` (a numpy array or :class:`DeviceTensor`) fed as ``spec`` must have its shape and dtype."""
    shape = tuple(value.shape)
    dtype = np.dtype(value.dtype).name
    if shape != spec.shape or dtype != spec.dtype:
        raise ShapeError(f"graph {meta.name!r}: input {spec.name!r} expects {spec.dtype}{list(spec.shape)}, "
                         f"got {dtype}{list(shape)}")


class BoundGraph:
    """A graph of an :class:`Executor` with its resident inputs bound (:meth:`Executor.bind`). :meth:`run`
    checks the host inputs' names, shapes and dtypes, stages them, runs the graph under its group's lock
    and returns the chosen outputs, checked for non-finite values and timed as :meth:`Executor.run` does;
    the same device buffers are passed every time, which a backend may use to keep its bindings. Valid
    while the executor stays loaded."""

    def __init__(self, ex: "Executor", meta: GraphMeta, resident: dict, outputs=None):
        unknown = sorted(set(resident) - {t.name for t in meta.inputs})
        if unknown:
            raise ShapeError(f"graph {meta.name!r}: no inputs {unknown} to bind (has: "
                             f"{sorted(t.name for t in meta.inputs)})")
        names = {t.name for t in meta.outputs}
        chosen = list(names if outputs is None else outputs)
        if not set(chosen) <= names:
            raise ShapeError(f"graph {meta.name!r}: no outputs {sorted(set(chosen) - names)} (has: {sorted(names)})")
        self._ex, self.meta = ex, meta
        self._inputs: dict = {}
        self._host: list[tuple[TensorSpec, np.dtype, object]] = []  # (spec, its dtype, staging buffer)
        for spec in meta.inputs:
            value = resident.get(spec.name)
            if value is None:
                if spec.resident:
                    raise ShapeError(f"graph {meta.name!r}: input {spec.name!r} must be bound to a device tensor")
                buf = ex._staging[(meta.group, spec.name)]
                self._host.append((spec, np.dtype(spec.dtype), buf))
                self._inputs[spec.name] = buf
                continue
            if not isinstance(value, DeviceTensor):
                raise ShapeError(f"graph {meta.name!r}: input {spec.name!r} is bound to a "
                                 f"{type(value).__name__}, not a device tensor")
            _check_shape(meta, spec, value)
            self._inputs[spec.name] = value.handle
        self._outputs = {t.name: ex._staging[(meta.group, t.name)] for t in meta.outputs}
        self._read = [(t.name, t.shape, t.dtype) for t in meta.outputs if t.name in chosen]
        self._handle = ex._handles[meta.name]
        self._lock = ex._group_locks[meta.group]
        self._generation = ex._generation

    @property
    def valid(self) -> bool:
        """False once the executor was closed or loaded again since :meth:`Executor.bind`."""
        return self._ex._loaded and self._ex._generation == self._generation

    def run(self, feeds: dict) -> dict[str, np.ndarray]:
        ex, meta = self._ex, self.meta
        if ex._generation != self._generation or not ex._loaded:
            raise RuntimeError(f"{ex.name} executor: graph {meta.name!r} was bound before the executor was "
                               f"closed or loaded again; bind it again")
        if len(feeds) != len(self._host) or any(spec.name not in feeds for spec, _, _ in self._host):
            raise ShapeError(f"graph {meta.name!r} (resident inputs bound): takes inputs "
                             f"{sorted(spec.name for spec, _, _ in self._host)}, got {sorted(feeds)}")
        for spec, dtype, _ in self._host:
            value = feeds[spec.name]
            if not isinstance(value, np.ndarray):
                raise ShapeError(f"graph {meta.name!r}: input {spec.name!r} expects {spec.dtype}{list(spec.shape)}, "
                                 f"got {type(value).__name__}")
            if value.shape != spec.shape or value.dtype != dtype:
                _check_shape(meta, spec, value)
        with ex.gate, self._lock:
            for spec, _, buf in self._host:
                ex._h2d(np.ascontiguousarray(feeds[spec.name]), buf)
            t0 = time.perf_counter()
            ex._execute(self._handle, self._inputs, self._outputs, meta)
            ms = (time.perf_counter() - t0) * 1e3
            out = {name: ex._d2h(self._outputs[name], shape, dtype) for name, shape, dtype in self._read}
        return ex._account(meta.name, ms, out)


class HostMemoryHooks:
    """Copy hooks for backends whose device memory is host memory (the mock, onnxruntime on CPU):
    subclasses provide ``_view(device_buffer, shape, dtype)``, a typed numpy view of a buffer."""

    def _zero_device(self, device_buffer, shape, dtype) -> None:
        self._view(device_buffer, shape, dtype)[...] = 0

    def _view(self, device_buffer, shape, dtype) -> np.ndarray:
        raise NotImplementedError

    def _h2d(self, data: np.ndarray, device_buffer) -> None:
        self._view(device_buffer, data.shape, data.dtype)[...] = data

    def _d2h(self, device_buffer, shape, dtype) -> np.ndarray:
        return self._view(device_buffer, shape, dtype).copy()

    def _write_region(self, device_buffer, shape, dtype, index, data) -> None:
        self._view(device_buffer, shape, dtype)[index] = data
