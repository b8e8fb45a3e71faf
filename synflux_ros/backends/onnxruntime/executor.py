"""ONNX Runtime executor: runs a graph set written by ``synflux-build`` (:mod:`synflux_ros.graphset`).

One session per graph, all given views of one copy of ``weights.bin``; every input and output bound by address
to the static buffers (a KV slot's per-layer views at their offsets, an in-place attention's outputs to the slot
itself); optional load-time fusions, a cache of ORT-optimised (and prepacked) graphs and a process-wide thread
pool. How and why: docs/backends/onnxruntime.md; the options: :mod:`synflux_ros.backends.onnxruntime.options`.
"""
from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Mapping

import numpy as np

from ...graphset import cache, reader as graphset, writer as graphset_writer
from ...core.config import ConfigError
from ..binding import HostBufferHooks, Port, binding_plan
from ...core.executor import Executor
from ...core.contract import GraphMeta
from ...graphset.reader import GraphSetError, GraphSetNotFoundError
from ..options import parse_options
from . import fusions as ort_fusions
from .options import DEFAULTS, OnnxRuntimeExecutorOptions

_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
           "all": "ORT_ENABLE_ALL"}

# ORT's type strings -> numpy dtype names (as GraphMeta spells them).
_ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
              "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int16)": "int16", "tensor(int8)": "int8",
              "tensor(uint64)": "uint64", "tensor(uint32)": "uint32", "tensor(uint16)": "uint16",
              "tensor(uint8)": "uint8", "tensor(bool)": "bool", "tensor(bfloat16)": "bfloat16"}

# ONNX TensorProto data types -> numpy storage of the same item size (bfloat16 and float8 are
# reinterpreted by ORT through ortvalue_from_numpy_with_onnx_type). Sub-byte types are not shared.
_ONNX_STORAGE = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64,
                 9: np.bool_, 10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64, 16: np.uint16,
                 17: np.uint8, 18: np.uint8, 19: np.uint8, 20: np.uint8}


_CACHE_KEY = "ort_optimized"
_QUANTIZED_DISABLED_OPTIMIZERS = ["MatMulAddFusion"]
"""ORT optimisers turned off for quantized graph sets (see ``_create_session``)."""


_process_pool: tuple[int, int] | None = None
"""(intra, inter) threads of this process's shared onnxruntime pool once an executor created it."""


def _join_process_pool(ort, shared: bool, intra: int, inter: int) -> None:
    """Create the process's shared pool (``thread_pool: shared``) or check that the one in use matches; an
    executor with a pool per session is refused once the shared pool exists (onnxruntime would refuse its
    sessions)."""
    global _process_pool
    if not shared:
        if _process_pool is not None:
            raise ValueError(f"onnxruntime executor: this process already runs onnxruntime on a shared thread pool "
                             f"(thread_pool: shared, {_process_pool[0]} intra-op threads) and onnxruntime refuses "
                             f"sessions with a pool of their own after it: set thread_pool: shared here too")
    elif _process_pool is None:
        from onnxruntime.capi import _pybind_state
        setter = getattr(_pybind_state, "set_global_thread_pool_sizes", None)
        if setter is None:
            raise RuntimeError(f"onnxruntime executor: thread_pool: shared needs an onnxruntime whose Python API "
                               f"creates the process thread pool (set_global_thread_pool_sizes); "
                               f"{ort.__version__} has none: use thread_pool: session")
        setter(intra, inter)
        _process_pool = (intra, inter)
    elif _process_pool != (intra, inter):
        raise ValueError(f"onnxruntime executor: this process already runs onnxruntime on a shared thread pool of "
                         f"{_process_pool[0]} intra-op / {_process_pool[1]} inter-op threads (0 = ORT's default); "
                         f"thread_pool: shared with {intra} / {inter} cannot resize it: give every executor of the "
                         f"process the same intra_op_num_threads and inter_op_num_threads")


def _quantized_set(graph_dir: str) -> bool:
    """Whether ``graph_dir`` holds a quantized graph set (``synflux-build --weights``); False when it cannot
    be read (load() reports that)."""
    try:
        return graphset.weight_format(graphset.find_manifest(graph_dir))["dtype"] != "float32"
    except (GraphSetError, OSError):
        return False


class _Graph:
    """A loaded graph: its session, its IO binding and the pointers currently bound."""

    __slots__ = ("session", "binding", "bound", "verified", "path", "shared_initializers", "views", "in_place",
                 "derived", "last", "rows")

    def __init__(self, session, path: str, shared: int, views: dict, in_place: dict, derived: set):
        self.session = session
        self.binding = session.io_binding()
        self.bound: dict[str, int] = {}
        self.verified = False
        self.path = path
        self.shared_initializers = shared
        # contract input -> [(ONNX input name, byte offset, shape)]: one entry at offset 0 for an input the
        # graph takes whole, one per view for an input it takes as views (graphset.VIEW_INPUTS)
        self.views: dict[str, list[tuple[str, int, tuple]]] = views
        # contract input -> [(ONNX output name, byte offset, shape)]: outputs bound to that input's own memory
        # (graphset.IN_PLACE_SUFFIX; a fused graph's attention appending to the KV views)
        self.in_place: dict[str, list[tuple[str, int, tuple]]] = in_place
        # contract outputs the graph leaves out, read from an input updated in place (graphset.ROWS_IN_PLACE)
        self.derived: set[str] = derived
        # the device_inputs and device_outputs dicts of the last binding: a caller passing the same dicts
        # again (a BoundGraph) finds every pointer bound already
        self.last: tuple | None = None
        # derived output -> (view of the updated input, view of the position, view of the output)
        self.rows: dict[str, tuple] = {}


class _LazyModels(Mapping):
    """name -> onnx.ModelProto (without its external data) loaded on access."""

    def __init__(self, paths: dict[str, str]):
        self._paths = paths

    def __getitem__(self, name):
        import onnx

        return onnx.load(self._paths[name], load_external_data=False)

    def __iter__(self):
        return iter(self._paths)

    def __len__(self):
        return len(self._paths)


class OnnxRuntimeExecutor(HostBufferHooks, Executor):
    """Runs a synflux-build graph set with ONNX Runtime: weights loaded once for all graphs, every input
    and output bound to the static buffers (see docs/backends/onnxruntime.md)."""
    name = "onnxruntime"
    weight_dtypes: tuple[str, ...] = ("float32", "int8", "int4")
    """Quantized sets (``synflux-build --weights``): DequantizeLinear + MatMul, fused by ORT's optimiser
    (level ``extended``/``all``) into ``com.microsoft.MatMulNBits``."""
    options_type: type = OnnxRuntimeExecutorOptions
    """The dataclass ``executor.options`` is read into (a subclass running ORT with another execution provider
    narrows or extends it; an option its type leaves out keeps its default)."""

    def __init__(self, graphs, graph_dir: str = "", options: dict | None = None):
        super().__init__(graphs, graph_dir, options)
        import onnxruntime as ort

        self._ort = ort
        opts = self.opts = parse_options(self.options_type, options, self.name)

        def get(name):  # an option a narrower options type (qnn's) leaves out keeps its default
            return getattr(opts, name, getattr(DEFAULTS, name))

        self.providers = self._parse_providers(get("providers"))
        self.intra_op_num_threads = opts.intra_op_num_threads
        self.inter_op_num_threads = opts.inter_op_num_threads
        self.graph_optimization_level = opts.graph_optimization_level
        self.share_weights = opts.share_weights
        self.mmap_weights = opts.mmap_weights
        self.allow_spinning = bool(opts.allow_spinning)
        self.thread_pool = get("thread_pool")
        if self.thread_pool == "shared" and opts.allow_spinning is False:
            raise ConfigError("onnxruntime executor: executor.options.allow_spinning: thread_pool: shared always "
                              "spins (onnxruntime's Python API creates the process pool with spinning on); remove "
                              "allow_spinning: false, or use thread_pool: session")
        self.matmulnbits_accuracy_level = get("matmulnbits_accuracy_level")
        # MatMulNBits (quantized sets) runs at speed only from its prepacked weights, so quantized sets prepack
        # by default.
        prepack = get("prepack")
        if prepack is None:
            prepack = not self.share_weights or _quantized_set(graph_dir)
        if isinstance(prepack, bool):
            self._prepack: bool | frozenset = prepack
        elif isinstance(prepack, (list, tuple)) and all(isinstance(p, str) for p in prepack):
            self._prepack = frozenset(prepack)
        else:
            raise ConfigError(f"onnxruntime executor: executor.options.prepack: expected true, false or a list of "
                              f"graph names, kinds or groups, got {prepack!r}")
        self.optimized_model_dir = str(get("optimized_model_dir") or "")
        if self.optimized_model_dir and any(n == "TensorrtExecutionProvider" for n, _ in self.providers):
            raise ConfigError("onnxruntime executor: executor.options.optimized_model_dir cannot be used with the "
                              "TensorRT execution provider (ORT cannot save compiled TensorRT nodes); use its engine "
                              "cache instead (provider options trt_engine_cache_enable / trt_engine_cache_path)")
        self.fusions = ort_fusions.parse(get("fusions"))
        self._cpu_only = all(n == "CPUExecutionProvider" for n, _ in self.providers)
        self._load_dir = graph_dir
        self._from_cache = False
        self._cache_level = "disable"  # ORT's optimiser level for the graphs of a cached set
        self._manifest: dict | None = None
        self._weights: np.ndarray | None = None
        self._weights_file = ""
        self._weight_values: dict[tuple, object] = {}
        self._affine = None  # quant.AffineWeights of a set with carried Q4_1 weights (made at load)

    # ------------------------------------------------------------------ options
    def _parse_providers(self, value) -> list[tuple[str, dict]]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not value:
            raise ConfigError(f"onnxruntime executor: executor.options.providers: expected a non-empty list, got "
                              f"{value!r}")
        available = self._ort.get_available_providers()
        out = []
        for entry in value:
            if isinstance(entry, str):
                name, popts = entry, {}
            elif (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)
                  and isinstance(entry[1], dict)):
                name, popts = entry[0], dict(entry[1])
            else:
                raise ConfigError(f"onnxruntime executor: executor.options.providers: a provider is a name or "
                                  f"[name, {{options}}], got {entry!r}")
            if name not in available:
                raise ConfigError(
                    f"onnxruntime executor: executor.options.providers: execution provider {name!r} is not available "
                    f"in this onnxruntime build "
                    f"({self._ort.__version__}; available: {', '.join(available)}). CUDA and TensorRT need the "
                    f"onnxruntime-gpu package and a matching CUDA/TensorRT installation")
            out.append((name, popts))
        return out

    def _prepack_for(self, meta: GraphMeta) -> bool:
        if isinstance(self._prepack, bool):
            return self._prepack
        return bool({meta.name, meta.kind, meta.group} & self._prepack)

    # ------------------------------------------------------------------ graph set
    def load(self) -> "OnnxRuntimeExecutor":
        if self._loaded:
            return self
        _join_process_pool(self._ort, self.thread_pool == "shared", self.intra_op_num_threads,
                           self.inter_op_num_threads)
        cached = self._cached_graph_set()
        if cached:
            self._load_dir, self._from_cache = cached, True
        try:
            super().load()
        except BaseException:
            self._release_sessions()
            raise
        return self

    def _cached_graph_set(self) -> str:
        """Directory of a compiled copy of the graph set to load instead of ``graph_dir`` ('' = none); its
        graphs are ``<name>.onnx`` and load with ORT's optimiser off (``_cache_level``). Here: the
        ``optimized_model_dir`` cache, made from the fused set with ``fusions``, or the fused set alone
        (loaded with the optimiser on); an execution provider with a compiled form of its own overrides
        this."""
        fused = self._fused_graph_set() if self.fusions else ""
        if self.optimized_model_dir:
            return self._optimized_graph_set(fused)
        self._cache_level = self.graph_optimization_level
        return fused

    def _fused_graph_set(self) -> str:
        """Directory of the graph set rewritten into ORT's fused kernels (``fusions``,
        :mod:`synflux_ros.backends.onnxruntime.fusions`), in ``optimized_model_dir`` or else ``ort_fused/`` in the
        graph set's directory; written on the first load, reused while the sources and versions match."""
        paths = {meta.name: self._source_path(meta) for meta in self.graphs.values()}
        cache = self.optimized_model_dir or os.path.join(self.graph_dir, "ort_fused")
        return ort_fusions.fused_graph_set(self.graph_dir, list(self.graphs.values()), paths, cache, self.fusions)

    def _source_path(self, meta: GraphMeta, source: str = "") -> str:
        """The file of ``meta`` in the graph set (``source``: a cached copy) to build a cache from."""
        path = os.path.join(source, f"{meta.name}.onnx") if source else super().graph_path(meta)
        if not os.path.isfile(path):
            raise GraphSetNotFoundError(f"onnxruntime executor: graph {meta.name!r}: {path} not found; "
                                        f"{graphset.BUILD_HINT.format(dir=self.graph_dir)}")
        return path

    def graph_path(self, meta: GraphMeta) -> str:
        if self._from_cache:
            return os.path.join(self._load_dir, f"{meta.name}.onnx")
        return super().graph_path(meta)

    def _open_graph_set(self, graph_dir: str) -> dict:
        """Read the manifest and (when sharing) the weights file of ``graph_dir``, once."""
        manifest = graphset.read_manifest(graph_dir)
        self._manifest = manifest
        self._weights_file = (manifest.get("weights") or {}).get("file", "")
        self._weights = None
        self._weight_values.clear()
        if self.share_weights and self._weights_file:
            path = os.path.join(graph_dir, self._weights_file)
            # Graphs loaded with saved prepacked weights let ORT map the file itself: map it here too, so the
            # tensors both use are the same page-cache pages.
            if self.mmap_weights or (self._from_cache and self._prepack is not False):
                self._weights = np.memmap(path, np.uint8, mode="r") if os.path.getsize(path) else np.zeros(0, np.uint8)
            else:
                self._weights = np.fromfile(path, np.uint8)
        return manifest

    def _shared_value(self, t: graphset.ExternalTensor, model_path: str):
        """An OrtValue over the weights buffer for one external initializer (None: let ORT load it)."""
        storage = _ONNX_STORAGE.get(t.data_type)
        if storage is None or self._weights is None or t.location != self._weights_file:
            return None
        itemsize = np.dtype(storage).itemsize
        count = int(np.prod(t.dims, dtype=np.int64))
        length = t.length if t.length >= 0 else count * itemsize
        if length != count * itemsize or t.offset < 0 or t.offset + length > self._weights.size:
            raise GraphSetError(
                f"{model_path}: initializer {t.name!r} ({t.dims}, {length} bytes at offset {t.offset}) does not fit "
                f"{self._weights_file} ({self._weights.size} bytes): the graph set is inconsistent; "
                f"{graphset.BUILD_HINT.format(dir=self._load_dir)}")
        key = (t.offset, length, t.data_type, t.dims)
        cached = self._weight_values.get(key)
        if cached is None:
            if t.offset % itemsize:
                raise GraphSetError(f"{model_path}: initializer {t.name!r} is not aligned in {self._weights_file}; "
                                    f"{graphset.BUILD_HINT.format(dir=self._load_dir)}")
            view = self._weights[t.offset:t.offset + length].view(storage).reshape(t.dims)
            value = self._ort.OrtValue.ortvalue_from_numpy_with_onnx_type(view, t.data_type)
            cached = self._weight_values[key] = (view, value)
        return cached[1]

    def _session_options(self, meta: GraphMeta, path: str, level: str, prepack: bool):
        ort = self._ort
        so = ort.SessionOptions()
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _LEVELS[level])
        if self.thread_pool == "shared":
            so.use_per_session_threads = False  # the process pool, sized by _join_process_pool
        else:
            if self.intra_op_num_threads:
                so.intra_op_num_threads = self.intra_op_num_threads
            if self.inter_op_num_threads:
                so.inter_op_num_threads = self.inter_op_num_threads
            so.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.allow_spinning else "0")
            so.add_session_config_entry("session.inter_op.allow_spinning", "1" if self.allow_spinning else "0")
        if not prepack:
            so.add_session_config_entry("session.disable_prepacking", "1")
        if self.matmulnbits_accuracy_level is not None:
            so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level",
                                        str(self.matmulnbits_accuracy_level))
        shared = 0
        if self.share_weights:
            for t in graphset.external_initializers(path):
                if prepack and t.prepacked:
                    continue  # ORT maps this tensor's saved prepacked copy from the weights file
                value = self._shared_value(t, path)
                if value is not None:
                    so.add_initializer(t.name, value)
                    shared += 1
        return so, shared

    def _affine_weights(self):
        """The shared MatMulNBits tensors of a set whose weights include carried Q4_1 blocks, else None."""
        if "Q4_1" not in (graphset.weight_format(self._manifest).get("ggml_carried") or {}):
            return None
        if self._affine is None:
            from .quant import AffineWeights
            whole = self._weights if self._weights is not None else np.memmap(
                os.path.join(self._load_dir, self._weights_file), np.uint8, mode="r")

            def read(t):
                return np.asarray(whole[t.offset:t.offset + t.length])
            self._affine = AffineWeights(read, self._ort.OrtValue.ortvalue_from_numpy, self._weights_file)
        return self._affine

    def _model_source(self, path: str, so):
        """What to create the session from: ``path``, or the bytes of the model with its affine 4-bit weights
        rewritten to MatMulNBits (their tensors added to ``so``; see the module docstring)."""
        affine = self._affine_weights()
        if affine is None:
            return path
        import onnx
        model = onnx.load(path, load_external_data=False)
        externals = {t.name: t for t in graphset.external_initializers(path)}
        level = 4 if self.matmulnbits_accuracy_level is None else self.matmulnbits_accuracy_level
        added = affine.rewrite(model, externals, level)
        if not added:
            return path
        for name, value in added.items():
            so.add_initializer(name, value)
        # tensors not handed over are read from the weights file beside the graph, as for a model file
        so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                    os.path.dirname(os.path.abspath(path)))
        return model.SerializeToString()

    def _create_session(self, meta: GraphMeta, path: str, so):
        # Quantized sets: ORT's MatMul+Add -> Gemm fusion (level basic) runs before its DequantizeLinear +
        # MatMul -> MatMulNBits fusion (level extended) and would leave every projection followed by a
        # residual add (o, down) as DequantizeLinear + Gemm, dequantizing the weight on every run.
        quantized = graphset.weight_format(self._manifest)["dtype"] != "float32"
        disabled = _QUANTIZED_DISABLED_OPTIMIZERS if quantized else None
        try:
            source = self._model_source(path, so)
            return self._ort.InferenceSession(source, so, providers=[n for n, _ in self.providers],
                                              provider_options=[o for _, o in self.providers],
                                              disabled_optimizers=disabled)
        except Exception as exc:  # ORT raises its own exception types; name the graph and file
            raise RuntimeError(f"onnxruntime executor: cannot load graph {meta.name!r} from {path}: {exc}") from exc

    # ------------------------------------------------------------------ the five hooks
    def _load_graph(self, path: str, meta: GraphMeta) -> object:
        if self._manifest is None:
            self._open_graph_set(self._load_dir)
        if not path:
            raise GraphSetError(f"onnxruntime executor: graph {meta.name!r} names no file; "
                                f"{graphset.BUILD_HINT.format(dir=self._load_dir)}")
        if not os.path.isfile(path):
            raise GraphSetNotFoundError(f"onnxruntime executor: graph {meta.name!r}: {path} not found; "
                                        f"{graphset.BUILD_HINT.format(dir=self._load_dir)}")
        level = self._cache_level if self._from_cache else self.graph_optimization_level
        so, shared = self._session_options(meta, path, level, self._prepack_for(meta))
        session = self._create_session(meta, path, so)
        in_place: dict = {}
        derived: set = set()
        views = self._check_io(session, meta, path, in_place, derived)
        return _Graph(session, path, shared, views, in_place, derived)

    def _execute(self, graph_handle, device_inputs, device_outputs, meta: GraphMeta) -> None:
        g: _Graph = graph_handle
        last = g.last
        if last is None or last[0] is not device_inputs or last[1] is not device_outputs:
            self._bind(g, device_inputs, device_outputs, meta)
        g.session.run_with_iobinding(g.binding)
        if not self._cpu_only:
            g.binding.synchronize_outputs()
        for source, position, out in g.rows.values():  # graphset.ROWS_IN_PLACE: new_kv = past_kv[..., pos]
            pos = int(position[0])
            out[...] = source[:, :, :, pos:pos + 1]
        if not g.verified:
            self._verify_outputs(g, device_outputs, meta)

    def _bind(self, g: _Graph, device_inputs: dict, device_outputs: dict, meta: GraphMeta) -> None:
        """Bind the buffers whose pointers changed, and make the views the derived outputs are read with."""
        binding, bound = g.binding, g.bound
        for spec in meta.inputs:
            buf = device_inputs[spec.name]
            if bound.get(spec.name) != buf.ptr:
                element = np.dtype(spec.dtype).type
                for name, offset, shape in g.views[spec.name]:
                    binding.bind_input(name, "cpu", 0, element, shape, buf.ptr + offset)
                bound[spec.name] = buf.ptr
        for spec in meta.outputs:
            buf = device_outputs[spec.name]
            key = "\0out:" + spec.name
            if bound.get(key) != buf.ptr and spec.name not in g.derived:
                binding.bind_output(spec.name, "cpu", 0, np.dtype(spec.dtype).type, spec.shape, buf.ptr)
                bound[key] = buf.ptr
        for contract, outputs in g.in_place.items():  # after the contract's outputs: _verify_outputs's order
            buf = device_inputs[contract]
            key = "\0in_place:" + contract
            if bound.get(key) != buf.ptr:
                element = next(np.dtype(s.dtype).type for s in meta.inputs if s.name == contract)
                for name, offset, shape in outputs:
                    binding.bind_output(name, "cpu", 0, element, shape, buf.ptr + offset)
                bound[key] = buf.ptr
        specs = {s.name: s for s in (*meta.inputs, *meta.outputs)}
        g.rows = {}
        for name in g.derived:  # the row the run wrote into the input in place: new_kv = past_kv[:, :, :, pos]
            source, position = graphset.ROWS_IN_PLACE[name]
            g.rows[name] = tuple(self._view(buffers[n], specs[n].shape, specs[n].dtype) for buffers, n in
                                 ((device_inputs, source), (device_inputs, position), (device_outputs, name)))
        g.last = (device_inputs, device_outputs)

    def updates_in_place(self, graph: str, name: str) -> bool:
        """True when ``graph`` writes its new entries into every view of input ``name`` itself (a fused decode
        graph's attention appending to the KV slot), so that writing its ``new_kv`` back is not needed."""
        self._require_loaded()
        g: _Graph = self._handles[graph]
        return name in g.in_place and len(g.in_place[name]) == len(g.views[name])

    def _unload_graph(self, graph_handle) -> None:
        g: _Graph = graph_handle
        g.binding.clear_binding_inputs()
        g.binding.clear_binding_outputs()
        g.bound.clear()
        g.last = None
        g.rows = {}

    def close(self) -> None:
        super().close()
        self._release_sessions()

    def _release_sessions(self) -> None:
        self._handles.clear()
        self._affine = None
        self._manifest = None
        self._weight_values.clear()
        self._weights = None

    # ------------------------------------------------------------------ checks and helpers
    def _check_io(self, session, meta: GraphMeta, path: str, in_place: dict | None = None,
                  derived: set | None = None) -> dict:
        """The session's inputs and outputs must be the contract's (an input may come as views, see
        ``graphset.VIEW_INPUTS``; a fused graph may update views in place, filled into ``in_place``, and then
        leave out the outputs named in ``derived``). Returns the input binding plan of :class:`_Graph`."""
        def ports(args):
            return [Port(a.name, _ORT_TYPES.get(a.type, a.type), a.shape) for a in args]

        rebuild = ("the graph set was built for another config or model; "
                   + graphset.BUILD_HINT.format(dir=self._load_dir))
        return binding_plan(meta, ports(session.get_inputs()), ports(session.get_outputs()), path, rebuild,
                            in_place=in_place if in_place is not None else {},
                            derived=derived if derived is not None else set())

    def _verify_outputs(self, g: _Graph, device_outputs: dict, meta: GraphMeta) -> None:
        values = g.binding.get_outputs()
        expected = [(spec.name, device_outputs[spec.name].ptr) for spec in meta.outputs if spec.name not in g.derived]
        for contract, outputs in g.in_place.items():
            expected += [(name, g.bound["\0in_place:" + contract] + offset) for name, offset, _ in outputs]
        for (name, ptr), value in zip(expected, values, strict=True):
            if value.data_ptr() != ptr:
                raise RuntimeError(f"onnxruntime executor: graph {meta.name!r} wrote output {name!r} to memory "
                                   f"of its own instead of the bound buffer")
        g.verified = True

    def shared_initializers(self, graph: str) -> int:
        """How many initializers of ``graph`` use the shared weights buffer."""
        self._require_loaded()
        return self._handles[graph].shared_initializers

    # ------------------------------------------------------------------ optimised-model cache
    def _cache_fingerprint(self, manifest: dict, source: str = "") -> dict:
        paths = {meta.name: self._source_path(meta, source) for meta in self.graphs.values()}
        return {"onnxruntime": self._ort.__version__, "machine": platform.machine(),
                "providers": [n for n, _ in self.providers],
                "graph_optimization_level": self.graph_optimization_level,
                "matmulnbits_accuracy_level": self.matmulnbits_accuracy_level,
                "prepacked": sorted(m.name for m in self.graphs.values() if self._prepack_for(m)),
                **cache.source_fingerprint(source or self.graph_dir, manifest, paths)}

    def _cache_valid(self, directory: str, fingerprint: dict, key: str = _CACHE_KEY) -> bool:
        return cache.cached_copy_valid(directory, key, fingerprint, self.graphs)

    def _optimized_graph_set(self, source: str = "") -> str:
        """Directory of the ORT-optimised graph set for this configuration, built when missing from the graph
        set (or from its cached copy ``source``, the fused set); writing one removes the optimised sets it
        supersedes (:func:`~synflux_ros.graphset.cache.prune_cache`)."""
        manifest = graphset.read_manifest(source or self.graph_dir)
        fingerprint = self._cache_fingerprint(manifest, source)
        target = cache.entry_dir(self.optimized_model_dir, manifest, fingerprint)
        if self._cache_valid(target, fingerprint):
            return target
        try:
            import onnx  # noqa: F401
        except ImportError as exc:
            raise RuntimeError("onnxruntime executor: optimized_model_dir needs the 'onnx' package to write the "
                               "optimised graph set (pip install onnx), or remove the option") from exc
        os.makedirs(self.optimized_model_dir, exist_ok=True)
        work = f"{target}.partial-{os.getpid()}"
        raw_dir = os.path.join(work, "ort")
        os.makedirs(raw_dir, exist_ok=True)
        try:
            self._open_graph_set(source or self.graph_dir)
            paths = {}
            for meta in self.graphs.values():
                src = self._source_path(meta, source)
                prepack = self._prepack_for(meta)
                so, _ = self._session_options(meta, src, self.graph_optimization_level, prepack)
                so.log_severity_level = 3  # the "hardware specific optimisations" warning is expected here
                if prepack:
                    so.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
                out = os.path.join(raw_dir, f"{meta.name}.onnx")
                so.optimized_model_filepath = out
                so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                            f"{meta.name}.data")
                so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                            str(graphset.EXTERNAL_MIN_BYTES))
                session = self._create_session(meta, src, so)
                self._check_io(session, meta, src)
                del session
                paths[meta.name] = out
            self._release_sessions()
            info = graphset_writer.write_weights_and_models(_LazyModels(paths), work, base_dir=raw_dir)
            shutil.rmtree(raw_dir)
            metas = [GraphMeta(m.name, m.kind, m.inputs, m.outputs, m.group, f"{m.name}.onnx", dict(m.attrs))
                     for m in self.graphs.values()]
            graphset_writer.write_manifest(work, metas, info, model=manifest.get("model", ""),
                                    config_hash=manifest.get("config_hash", ""), **{_CACHE_KEY: fingerprint})
            cache.publish_directory(work, target, lambda d: self._cache_valid(d, fingerprint))
            cache.prune_cache(self.optimized_model_dir, _CACHE_KEY, fingerprint, target,
                                        versions=("onnxruntime",))
        finally:
            self._release_sessions()
            if os.path.isdir(work):
                shutil.rmtree(work, ignore_errors=True)
        return target
