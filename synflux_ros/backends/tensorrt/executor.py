"""TensorRT executor (Jetson Orin with JetPack 6, or an x86 workstation with an NVIDIA GPU): runs the engines
``synflux-build --backend tensorrt`` built, with the TensorRT 10 Python API on device memory managed with
cuda-python.

It follows the plan of :mod:`synflux_ros.backends.tensorrt.plan` (one engine per graph kind, a profile per
bucket, the route of each contract graph); every buffer comes from the static pool, a CUDA stream serves each
graph group, and decode steps may be replayed as CUDA graphs. How and why: docs/backends/tensorrt.md; the
options: :mod:`synflux_ros.backends.tensorrt.options`.
"""
from __future__ import annotations

import ctypes
import dataclasses
import importlib
import os
import threading

import numpy as np

from ...graphset import reader as graphset
from ...core.executor import Executor
from ...core.contract import GraphMeta
from ..options import parse_options
from . import plan, sidecar
from .options import TensorRTExecutorOptions

MAX_CUDA_GRAPHS = 64
MIN_VERSION = (10, 1)
"""``set_device_memory(ptr, size)`` and the per-profile memory sizes came with TensorRT 10.1 (JetPack 6.1)."""
BIND_ALIGNMENT = 256
"""TensorRT wants every bound address 256-byte aligned (KV views included)."""


class TensorRTError(RuntimeError):
    """Engines missing, built for another device or TensorRT version, or a CUDA / TensorRT call failed."""


def rebuild_command(graph_dir: str, precision: str, dla_core) -> str:
    flag = {"fp16": " --fp16", "int8": " --int8 --calib <dir>"}.get(precision, "")
    dla = f" --dla-core {dla_core}" if dla_core is not None else ""
    return f"synflux-build --config <model.yaml> --out {graph_dir or '<graph_dir>'} --backend tensorrt{flag}{dla}"


class DeviceBuffer:
    """``nbytes`` of device memory at ``ptr``, with an optional pinned host mirror of the same size."""
    __slots__ = ("ptr", "nbytes", "host", "host_ptr")

    def __init__(self, ptr: int, nbytes: int):
        self.ptr, self.nbytes, self.host, self.host_ptr = int(ptr), int(nbytes), None, 0


class _Engine:
    def __init__(self, name, engine, entry):
        self.name, self.engine, self.entry = name, engine, entry
        self.profiles: list[str] = list(entry.profiles)


class TensorRTExecutor(graphset.ChecksWeightFormat, Executor):
    name = "tensorrt"
    options_type = TensorRTExecutorOptions

    def __init__(self, graphs, graph_dir: str = "", options: dict | None = None):
        super().__init__(graphs, graph_dir, options)
        opts = self.opts = parse_options(self.options_type, options, self.name)
        self.precision = opts.precision
        self.dla_core = opts.dla_core
        self.device = opts.device
        self.cuda_graphs = opts.cuda_graphs
        self.trt = importlib.import_module(opts.module)
        from cuda.bindings import runtime as cudart
        self.cudart = cudart
        self._engines: dict[str, _Engine] = {}
        self._contexts: dict[tuple[str, int], object] = {}
        self._bound: dict[tuple[str, int], dict[str, int]] = {}
        self._streams: dict[str, object] = {}
        self._events: dict[str, object] = {}
        self._graphs_exec: dict[tuple, object] = {}
        self._extra: dict[str, DeviceBuffer] = {}
        self._region_host: DeviceBuffer | None = None
        self._region_lock = threading.Lock()
        self._engine_bytes = 0
        self.sidecar: sidecar.Sidecar | None = None

    # ------------------------------------------------------------------ CUDA helpers
    def _cuda(self, result, what: str):
        """Unpack a cuda-python call: raise on an error code, return the value(s)."""
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            name = self.cudart.cudaGetErrorName(err)[1]
            name = name.decode() if isinstance(name, bytes) else str(name)
            raise TensorRTError(f"tensorrt executor: {what} failed: {name}")
        return rest[0] if len(rest) == 1 else (rest or None)

    def _device_sm(self) -> str:
        attr = self.cudart.cudaDeviceAttr
        major = self._cuda(self.cudart.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMajor, self.device),
                           f"reading CUDA device {self.device}")
        minor = self._cuda(self.cudart.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMinor, self.device),
                           f"reading CUDA device {self.device}")
        return f"{major}.{minor}"

    # ------------------------------------------------------------------ load
    def engine_dir(self, sm: str) -> str:
        explicit = self.opts.engine_dir
        if explicit:
            return explicit if os.path.isabs(explicit) else os.path.join(self.graph_dir, explicit)
        return os.path.join(self.graph_dir, "tensorrt", plan.device_tag(sm, self.dla_core, self.precision))

    def load(self) -> "TensorRTExecutor":
        if self._loaded:
            return self
        self.check_weight_format()
        self._cuda(self.cudart.cudaSetDevice(self.device), f"cudaSetDevice({self.device})")
        try:
            self._open_engines()
            super().load()
            self._allocate_extras()
        except BaseException:
            self.close()
            raise
        return self

    def _open_engines(self) -> None:
        sm = self._device_sm()
        edir = self.engine_dir(sm)
        side_path = os.path.join(edir, plan.SIDECAR)
        hint = rebuild_command(self.graph_dir, self.precision, self.dla_core)
        if not os.path.isfile(side_path):
            raise TensorRTError(f"tensorrt executor: no engines for this device (sm {sm}, {self.precision}"
                                f"{'' if self.dla_core is None else f', DLA core {self.dla_core}'}): {side_path} "
                                f"is missing; build them on this device with: {hint}")
        try:
            side = sidecar.read(edir)
        except sidecar.SidecarError as exc:
            raise TensorRTError(f"tensorrt executor: {side_path}: {exc}; rebuild with: {hint}") from None
        self.sidecar = side
        version = getattr(self.trt, "__version__", "")
        if tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) < MIN_VERSION:
            raise TensorRTError(f"tensorrt executor: TensorRT {version} is too old: this backend needs TensorRT >= "
                                f"{MIN_VERSION[0]}.{MIN_VERSION[1]} (JetPack 6.1 or later)")
        if side.tensorrt != version or side.sm != sm:
            raise TensorRTError(f"tensorrt executor: the engines in {edir} were built with TensorRT "
                                f"{side.tensorrt} for sm {side.sm}; this device is sm {sm} with "
                                f"TensorRT {version}: rebuild them with: {hint}")
        manifest = graphset.read_manifest(self.graph_dir)
        stale = self._stale_graphs(manifest, side)
        if stale:
            raise TensorRTError(f"tensorrt executor: the graph set changed after the engines in {edir} were built "
                                f"({', '.join(stale[:4])}); rebuild them with: {hint}")
        dla_kinds = plan.DLA_CAPABLE if self.dla_core is not None else ()
        specs = plan.plan_engines(list(self.graphs.values()), dla_kinds)
        runtime = self.trt.Runtime(self.trt.Logger(self.trt.Logger.WARNING))
        if self.dla_core is not None:
            runtime.DLA_core = int(self.dla_core)
        self._runtime = runtime
        for spec in specs:
            entry = side.engines.get(spec.name)
            path = os.path.join(edir, entry.file if entry is not None else f"{spec.name}.engine")
            if entry is None or not os.path.isfile(path):
                raise TensorRTError(f"tensorrt executor: engine {spec.name!r} is missing ({path}); rebuild with: {hint}")
            with open(path, "rb") as fh:
                blob = fh.read()
            engine = runtime.deserialize_cuda_engine(blob)
            if engine is None:
                raise TensorRTError(f"tensorrt executor: TensorRT {version} cannot load {path} (built for another "
                                    f"device or TensorRT version?); rebuild with: {hint}")
            self._engines[spec.name] = _Engine(spec.name, engine, entry)
            self._engine_bytes += len(blob)
        for meta in self.graphs.values():
            for spec in meta.inputs:
                bad = plan.misaligned_views(spec, BIND_ALIGNMENT)
                if bad:
                    raise TensorRTError(f"tensorrt executor: graph {meta.name!r}: the KV views {bad[:3]} start at "
                                        f"offsets that are not {BIND_ALIGNMENT}-byte aligned, which TensorRT needs; "
                                        f"choose llm.max_seq_len so that num_kv_heads * max_seq_len * head_dim * "
                                        f"itemsize is a multiple of {BIND_ALIGNMENT}")
        self._specs = {s.name: s for s in specs}
        self._routes = {name: self._engine_order(route) for name, route in
                        plan.plan_routes(list(self.graphs.values()), specs).items()}

    def _engine_order(self, route: plan.Route) -> plan.Route:
        """``route`` with profile indices as the built engines number them (the plan numbers the profiles of
        this executor's graphs, which may be a subset of those the engine was built with)."""
        steps = []
        for step in route.steps:
            graph = self._specs[step.engine].profiles[step.profile].graph
            built = self._engines[step.engine].profiles
            if graph not in built:
                raise TensorRTError(f"tensorrt executor: engine {step.engine!r} has no profile for {graph!r} (has "
                                    f"{built}); rebuild with: "
                                    f"{rebuild_command(self.graph_dir, self.precision, self.dla_core)}")
            # TensorRT may drop a network input that no layer reads (a flow-matching VLA's prefill does not read
            # the last layer's past_kv views); the engine then has no tensor to bind for it
            engine = self._engines[step.engine].engine
            names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
            binds = tuple((tensor, bind) for tensor, bind in step.bindings
                          if tensor in names or bind.source != "input")
            steps.append(dataclasses.replace(step, profile=built.index(graph), bindings=binds))
        return dataclasses.replace(route, steps=tuple(steps))

    def _stale_graphs(self, manifest: dict, side: sidecar.Sidecar) -> list[str]:
        """Graphs whose manifest key differs from the one the engines were built from."""
        built = side.graph_keys
        now = {g["name"]: g.get("key", "") for g in manifest.get("graphs", [])}
        return [n for n in self.graphs if n in built and built[n] != now.get(n)]

    def _load_graph(self, path: str, meta: GraphMeta) -> object:
        return self._routes[meta.name]

    @staticmethod
    def _stream(meta: GraphMeta) -> str:
        return meta.group

    def _allocate_extras(self) -> None:
        """Streams, events, contexts with their activation memory, route scratch, the span buffer and the
        constant 1: all before freeze."""
        cudart = self.cudart
        for meta in self.graphs.values():
            stage = self._stream(meta)
            if stage not in self._streams:
                self._streams[stage] = self._cuda(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking),
                                                  "cudaStreamCreateWithFlags")
                self._events[stage] = self._cuda(cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming),
                                                 "cudaEventCreateWithFlags")
        span = plan.span_elements(list(self._specs.values()))
        if span:
            self._extra["span"] = self.pool.allocate("tensorrt/attention_span", span * 4)
            self._zero_device(self._extra["span"], (span,), "float32")
        if any(b.source == "one" for r in self._routes.values() for s in r.steps for _, b in s.bindings):
            self._extra["one"] = self.pool.allocate("tensorrt/one", 8)
            self._h2d(np.ones(1, np.int64), self._extra["one"])
        # contexts: one per (engine, profile) in use; activation memory shared within a graph group
        strategy = self.trt.ExecutionContextAllocationStrategy.USER_MANAGED
        need: dict[tuple[str, str], int] = {}
        uses: list[tuple[str, int, str]] = []
        for meta in self.graphs.values():
            for step in self._routes[meta.name].steps:
                eng = self._engines[step.engine].engine
                size = int(eng.get_device_memory_size_for_profile_v2(step.profile))
                key = (step.engine, meta.group)
                need[key] = max(need.get(key, 0), size)
                uses.append((step.engine, step.profile, meta.group))
            for spec in self._routes[meta.name].scratch:
                k = f"scratch/{meta.group}/{spec.name}"
                if k not in self._extra:
                    self._extra[k] = self.pool.allocate(f"tensorrt/{k}", spec.nbytes)
        activations = {key: self.pool.allocate(f"tensorrt/activations/{key[0]}/{key[1]}", max(n, 256))
                       for key, n in need.items()}
        for engine_name, profile, group in uses:
            if (engine_name, profile) in self._contexts:
                continue
            eng = self._engines[engine_name].engine
            ctx = eng.create_execution_context(strategy)
            if ctx is None:
                raise TensorRTError(f"tensorrt executor: cannot create an execution context of {engine_name!r}")
            # as trtexec does it: profile, then input shapes, then the activation memory for that profile
            if eng.num_optimization_profiles > 1 or profile:
                ctx.set_optimization_profile_async(profile, int(self._streams[group]))
            for i in range(eng.num_io_tensors):
                name = eng.get_tensor_name(i)
                if eng.get_tensor_mode(name) == self.trt.TensorIOMode.INPUT and -1 in tuple(eng.get_tensor_shape(name)):
                    if not ctx.set_input_shape(name, tuple(eng.get_tensor_profile_shape(name, profile)[1])):
                        raise TensorRTError(f"tensorrt executor: {engine_name}: cannot set the shape of {name!r} "
                                            f"for profile {profile}")
            mem = activations[(engine_name, group)]
            ctx.set_device_memory(mem.ptr, mem.nbytes)
            self._contexts[(engine_name, profile)] = ctx
            self._bound[(engine_name, profile)] = {}
        # memsets and pageable copies of the load ran on the legacy stream: finish them before any call
        self._cuda(cudart.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        for buf in self._staging.values():  # pinned host mirrors: host copies at full PCIe / DMA speed
            self._attach_pinned(buf)
        largest = max([s.nbytes for m in self.graphs.values() for s in m.outputs if s.name == "new_kv"] or [0])
        if largest:
            self._region_host = self._attach_pinned(DeviceBuffer(0, largest))

    def _attach_pinned(self, buf: DeviceBuffer) -> DeviceBuffer:
        ptr = self._cuda(self.cudart.cudaMallocHost(max(buf.nbytes, 1)), "cudaMallocHost")
        buf.host_ptr = int(ptr)
        buf.host = np.ctypeslib.as_array((ctypes.c_uint8 * max(buf.nbytes, 1)).from_address(int(ptr)))
        return buf

    # ------------------------------------------------------------------ hooks
    def _alloc_device(self, nbytes: int) -> DeviceBuffer:
        ptr = self._cuda(self.cudart.cudaMalloc(max(int(nbytes), 1)), f"cudaMalloc({nbytes})")
        return DeviceBuffer(ptr, nbytes)

    def _free_device(self, buf: DeviceBuffer) -> None:
        self.cudart.cudaFree(buf.ptr)
        if buf.host is not None:
            buf.host = None
            self.cudart.cudaFreeHost(buf.host_ptr)

    def _zero_device(self, buf: DeviceBuffer, shape, dtype) -> None:
        self._cuda(self.cudart.cudaMemset(buf.ptr, 0, buf.nbytes), "cudaMemset")
        # cudaMemset may return before it is done, and the executor's streams are non-blocking (not ordered
        # after the legacy stream): finish it before a call can read the tensor (a fresh KV slot)
        self._cuda(self.cudart.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def _h2d(self, data: np.ndarray, buf: DeviceBuffer) -> None:
        data = np.ascontiguousarray(data)
        src = data.ctypes.data
        if buf.host is not None:
            buf.host[:data.nbytes] = data.reshape(-1).view(np.uint8)
            src = buf.host_ptr
        self._cuda(self.cudart.cudaMemcpy(buf.ptr, src, data.nbytes,
                                          self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice), "cudaMemcpy H2D")

    def _d2h(self, buf: DeviceBuffer, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        kind = self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        if buf.host is None:
            self._cuda(self.cudart.cudaMemcpy(out.ctypes.data, buf.ptr, out.nbytes, kind), "cudaMemcpy D2H")
            return out
        self._cuda(self.cudart.cudaMemcpy(buf.host_ptr, buf.ptr, out.nbytes, kind), "cudaMemcpy D2H")
        out.reshape(-1).view(np.uint8)[...] = buf.host[:out.nbytes]
        return out

    def _write_region(self, buf: DeviceBuffer, shape, dtype, index, data) -> None:
        offset, pitch, width, height = plan.region_copy(shape, dtype, index)
        data = np.ascontiguousarray(data, dtype)
        if data.nbytes != width * height:
            raise ValueError(f"tensorrt executor: region {index} of {list(shape)} holds {width * height} bytes, "
                             f"data has {data.nbytes}")
        with self._region_lock:
            host = self._region_host
            src = data.ctypes.data
            if host is not None and data.nbytes <= host.nbytes:
                host.host[:data.nbytes] = data.reshape(-1).view(np.uint8)
                src = host.host_ptr
            self._cuda(self.cudart.cudaMemcpy2D(buf.ptr + offset, pitch, src, width, width, height,
                                                self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice), "cudaMemcpy2D")

    def _address(self, bind: plan.Bind, device_inputs, device_outputs, meta: GraphMeta) -> int:
        if bind.source == "input":
            return device_inputs[bind.name].ptr + bind.offset
        if bind.source == "output":
            return device_outputs[bind.name].ptr + bind.offset
        if bind.source == "scratch":
            return self._extra[f"scratch/{meta.group}/{bind.name}"].ptr
        return self._extra[bind.source].ptr

    def _execute(self, route: plan.Route, device_inputs, device_outputs, meta: GraphMeta) -> None:
        if self.device:
            self._cuda(self.cudart.cudaSetDevice(self.device), "cudaSetDevice")  # per calling thread
        stage = self._stream(meta)
        stream = self._streams[stage]
        addresses = []
        for step in route.steps:
            ctx = self._contexts[(step.engine, step.profile)]
            bound = self._bound[(step.engine, step.profile)]
            for tensor, bind in step.bindings:
                ptr = self._address(bind, device_inputs, device_outputs, meta)
                addresses.append(ptr)
                if bound.get(tensor) != ptr:
                    if not ctx.set_tensor_address(tensor, ptr):
                        raise TensorRTError(f"tensorrt executor: {step.engine}: cannot bind {tensor!r}")
                    bound[tensor] = ptr
        key = (meta.name, tuple(addresses))
        capture = self.cuda_graphs and meta.kind == "decode"
        exec_graph = self._graphs_exec.get(key) if capture else None
        if exec_graph:
            self._cuda(self.cudart.cudaGraphLaunch(exec_graph, stream), "cudaGraphLaunch")
        else:
            self._enqueue(route, stream, meta)
            if capture and exec_graph is None and len(self._graphs_exec) < MAX_CUDA_GRAPHS:
                self._capture(key, route, stream, meta)
        self._cuda(self.cudart.cudaEventRecord(self._events[stage], stream), "cudaEventRecord")
        self._cuda(self.cudart.cudaEventSynchronize(self._events[stage]), "cudaEventSynchronize")

    def _enqueue(self, route: plan.Route, stream, meta: GraphMeta) -> None:
        for step in route.steps:
            if not self._contexts[(step.engine, step.profile)].execute_async_v3(int(stream)):
                raise TensorRTError(f"tensorrt executor: graph {meta.name!r}: engine {step.engine!r} failed to run "
                                    f"(profile {step.profile})")

    def _capture(self, key, route: plan.Route, stream, meta: GraphMeta) -> None:
        """Capture the steps of a decode call that has just run (TensorRT did its deferred work then). If
        an engine cannot be captured, the key is marked (False) and the steps keep running uncaptured."""
        cudart = self.cudart
        self._cuda(cudart.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
        self._cuda(cudart.cudaStreamBeginCapture(stream, cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
                   "cudaStreamBeginCapture")
        captured = all(self._contexts[(s.engine, s.profile)].execute_async_v3(int(stream)) for s in route.steps)
        err, graph = cudart.cudaStreamEndCapture(stream)
        if int(err) == 0 and captured:
            err, exec_graph = cudart.cudaGraphInstantiate(graph, 0)
            cudart.cudaGraphDestroy(graph)
            if int(err) == 0:
                self._graphs_exec[key] = exec_graph
                return
        elif graph is not None:
            cudart.cudaGraphDestroy(graph)
        cudart.cudaGetLastError()  # clear the capture's error: the call itself has already run
        self._graphs_exec[key] = False

    # ------------------------------------------------------------------ bookkeeping
    def device_of(self, graph: str) -> str:
        meta = self.graphs.get(graph)
        if meta is not None and self.dla_core is not None and meta.kind in plan.DLA_CAPABLE:
            return f"tensorrt:dla{self.dla_core}"
        return f"tensorrt:cuda{self.device}"

    @property
    def device_bytes(self) -> int:
        """Engines (weights and kernels) + the static pool (staging, KV, activations, scratch)."""
        return self._engine_bytes + super().device_bytes

    def close(self) -> None:
        for exec_graph in self._graphs_exec.values():
            if exec_graph:
                self.cudart.cudaGraphExecDestroy(exec_graph)
        self._graphs_exec.clear()
        self._contexts.clear()
        self._bound.clear()
        super().close()
        self._extra.clear()
        if self._region_host is not None:
            self.cudart.cudaFreeHost(self._region_host.host_ptr)
            self._region_host = None
        for s in self._streams.values():
            self.cudart.cudaStreamDestroy(s)
        for e in self._events.values():
            self.cudart.cudaEventDestroy(e)
        self._streams.clear()
        self._events.clear()
        self._engines.clear()
        self._engine_bytes = 0
