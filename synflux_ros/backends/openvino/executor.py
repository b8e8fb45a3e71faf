"""OpenVINO executor: runs a graph set written by ``synflux-build`` (:mod:`synflux_ros.graphset`) on an Intel CPU,
GPU or NPU.

Each graph's ONNX file is compiled for the configured device and gets one ``InferRequest`` whose inputs and
outputs are ``ov.Tensor`` objects over the static host buffers (no copy; a KV slot's per-layer views at their
offsets); an output a device plugin returns in memory of its own is copied into its buffer instead. How and
why: docs/backends/openvino.md; the options: :mod:`synflux_ros.backends.openvino.options`.
"""
from __future__ import annotations

import json
import os
import platform

import numpy as np

from ...graphset import cache, reader as graphset
from ..binding import HostBufferHooks, Port, binding_plan
from ...core.config import ConfigError
from ...core.executor import Executor
from ...core.contract import GraphMeta
from ...graphset.reader import GraphSetError, GraphSetNotFoundError
from ..options import parse_options
from .options import OpenVINOExecutorOptions

_DEFAULT_PRECISION = {"CPU": "f32"}  # every other device: f16
_VIRTUAL_DEVICES = ("AUTO", "MULTI", "HETERO", "BATCH")
_DRIVER_HINT = ("GPU needs the Intel GPU driver (compute runtime), NPU the Intel NPU driver; "
                "check with: python -c \"import openvino as ov; print(ov.Core().available_devices)\"")
_CACHE_INFO = "synflux-cache.json"


def _message(exc: BaseException) -> str:
    """OpenVINO's exception text without its source-location lines."""
    lines = [ln.strip() for ln in str(exc).splitlines()]
    keep = [ln for ln in lines if ln and not ln.startswith(("Exception from src/", "Check '"))]
    return " ".join(keep or [ln for ln in lines if ln]) or type(exc).__name__


class _Graph:
    """A loaded graph: its compiled model and request, its binding plan and the addresses bound."""

    __slots__ = ("compiled", "request", "plan", "bound", "verified", "copy_out", "path", "from_cache")

    def __init__(self, compiled, path: str, plan: dict, from_cache: bool):
        self.compiled = compiled
        self.request = compiled.create_infer_request()
        self.plan = plan  # contract input -> [(ONNX input, byte offset, shape)] (backends.binding.Plan)
        self.bound: dict[str, int] = {}
        self.verified = False
        self.copy_out: tuple[str, ...] = ()  # outputs the plugin did not write into the bound buffer
        self.path = path
        self.from_cache = from_cache


class OpenVINOExecutor(HostBufferHooks, Executor):
    """Runs a synflux-build graph set with OpenVINO: one compiled model and request per graph, every input
    and output set to the static buffers (see docs/backends/openvino.md)."""
    name = "openvino"
    options_type = OpenVINOExecutorOptions

    def __init__(self, graphs, graph_dir: str = "", options: dict | None = None):
        super().__init__(graphs, graph_dir, options)
        import openvino as ov

        self._ov = ov
        opts = self.opts = parse_options(self.options_type, options, self.name)
        self.core = ov.Core()
        if not opts.device.strip():
            raise ConfigError("openvino executor: executor.options.device: expected a device name such as CPU, GPU, "
                              "NPU or AUTO, got ''")
        self.device = opts.device.strip()
        self._hardware = self._check_device(self.device)
        self.precision = opts.precision
        self.num_streams = opts.num_streams
        self.inference_num_threads = opts.inference_num_threads
        if self.inference_num_threads and "CPU" not in self._hardware:
            raise ConfigError(f"openvino executor: executor.options.inference_num_threads sets CPU threads, but "
                              f"device {self.device!r} does not use the CPU")
        self.properties = dict(opts.properties)
        self.cache_dir = opts.cache_dir or ""
        self.compile_config = self._compile_config()
        self._cache_path = ""

    # ------------------------------------------------------------------ options
    def _check_device(self, device: str) -> list[str]:
        """The hardware devices ``device`` runs on (their plugin names); an error when one is missing."""
        available = list(self.core.available_devices)
        base, _, rest = device.partition(":")
        if base in _VIRTUAL_DEVICES:
            # AUTO:GPU,CPU  AUTO:-CPU (exclude)  BATCH:GPU(4) (batch size)
            names = [n.strip().lstrip("-").split("(")[0] for n in rest.split(",") if n.strip()] if rest else []
            wanted = [n for n in names if n not in _VIRTUAL_DEVICES]
            if not names:
                wanted = available
            if not wanted:
                raise ValueError(f"openvino executor: device {device!r} names no hardware device "
                                 f"(available: {', '.join(available) or 'none'})")
        elif rest:
            raise ValueError(f"openvino executor: device {device!r}: only {', '.join(_VIRTUAL_DEVICES)} take a "
                             f"device list after ':'")
        else:
            wanted = [device]
        for name in wanted:
            if not self._present(name, available):
                raise ValueError(f"openvino executor: device {name!r} is not available on this machine "
                                 f"(available: {', '.join(available) or 'none'}; {_DRIVER_HINT})")
        return sorted({n.split(".")[0] for n in wanted})

    def _present(self, name: str, available: list[str]) -> bool:
        if name in available:
            return True
        base, dot, index = name.partition(".")
        if not dot or base not in {a.split(".")[0] for a in available}:
            return False
        try:
            ids = [str(i) for i in self.core.get_property(base, "AVAILABLE_DEVICES")]
        except Exception:  # noqa: BLE001 - a plugin that cannot list its devices
            return False
        return index in ids

    def _precision_for(self, device: str) -> str | None:
        precision = self.precision or _DEFAULT_PRECISION.get(device, "f16")
        return None if precision == "default" else precision

    def _compile_config(self) -> dict:
        """The properties every graph is compiled with (without the cache directory)."""
        per_device = {}
        for dev in self._hardware:
            props = {}
            precision = self._precision_for(dev)
            if precision:
                props["INFERENCE_PRECISION_HINT"] = precision
            if self.num_streams:
                props["NUM_STREAMS"] = self.num_streams
            if dev == "CPU" and self.inference_num_threads:
                props["INFERENCE_NUM_THREADS"] = self.inference_num_threads
            per_device[dev] = props
        config: dict = {"PERFORMANCE_HINT": "LATENCY"}
        if self.device.partition(":")[0] in _VIRTUAL_DEVICES:
            per_device = {d: p for d, p in per_device.items() if p}
            if per_device:
                config["DEVICE_PROPERTIES"] = per_device
        else:
            config.update(per_device[self._hardware[0]])
        config.update(self.properties)
        return config

    def device_of(self, graph: str) -> str:
        return f"{self.name}:{self.device}"

    # ------------------------------------------------------------------ graph set
    def load(self) -> "OpenVINOExecutor":
        if self._loaded:
            return self
        try:
            manifest = graphset.read_manifest(self.graph_dir)
            graphset.check_weight_format(self.graph_dir, self.name, self.weight_dtypes, manifest)
            self._cache_path = self._cache_subdir(manifest) if self.cache_dir else ""
            super().load()
        except BaseException:
            self._handles.clear()
            raise
        return self

    def _cache_subdir(self, manifest: dict) -> str:
        """The directory of this graph set's compiled blobs for this device and configuration."""
        root = self.cache_dir if os.path.isabs(self.cache_dir) else os.path.join(self.graph_dir, self.cache_dir)
        paths = {os.path.basename(p): p for p in (self.graph_path(m) for m in self.graphs.values())}
        fingerprint = {"openvino": self._ov.get_version(), "machine": platform.machine(), "device": self.device,
                       "config": {k: str(v) for k, v in sorted(self.compile_config.items())},
                       **cache.source_fingerprint(self.graph_dir, manifest, paths, missing_ok=True)}
        path = cache.entry_dir(root, manifest, fingerprint)
        try:
            os.makedirs(path, exist_ok=True)
            info = os.path.join(path, _CACHE_INFO)
            if not os.path.isfile(info):
                with open(info, "w", encoding="utf-8") as fh:
                    json.dump(fingerprint, fh, indent=1, sort_keys=True)
        except OSError as exc:
            raise ValueError(f"openvino executor: cache_dir {root} is not writable ({exc}); set executor.options."
                             f"cache_dir to a writable directory or remove it") from exc
        return path

    # ------------------------------------------------------------------ the five hooks
    def _load_graph(self, path: str, meta: GraphMeta) -> object:
        hint = graphset.BUILD_HINT.format(dir=self.graph_dir)
        if not path:
            raise GraphSetError(f"openvino executor: graph {meta.name!r} names no file; {hint}")
        if not os.path.isfile(path):
            raise GraphSetNotFoundError(f"openvino executor: graph {meta.name!r}: {path} not found; {hint}")
        config = dict(self.compile_config)
        if self._cache_path:
            config["CACHE_DIR"] = self._cache_path
        try:
            # From a path, OpenVINO reads the ONNX file (and its weights) only when the cache has no blob.
            compiled = self.core.compile_model(path, self.device, config)
        except Exception as exc:  # noqa: BLE001 - OpenVINO raises RuntimeError for everything
            raise self._load_error(path, meta, exc, hint) from exc
        names = {t.name for t in (*meta.inputs, *meta.outputs)}
        plan = binding_plan(meta, self._ports(compiled.inputs, names), self._ports(compiled.outputs, names), path,
                            "the graph set was built for another config or model; " + hint)
        try:
            from_cache = bool(compiled.get_property("LOADED_FROM_CACHE"))
        except Exception:  # noqa: BLE001 - not every device reports it
            from_cache = False
        return _Graph(compiled, path, plan, from_cache)

    def unsupported_nodes(self, graph: str) -> list[tuple[str, str]]:
        """(node name, op type) of the operators of ``graph`` that the device does not support, from
        OpenVINO's ``query_model`` (parameters, results and constants are never listed)."""
        self._require_loaded()
        model = self.core.read_model(self.graph_path(self.graphs[graph]))
        supported = self.core.query_model(model, self.device)
        return [(op.get_friendly_name(), op.get_type_name()) for op in model.get_ops()
                if op.get_friendly_name() not in supported
                and op.get_type_name() not in ("Parameter", "Result", "Constant")]

    def _load_error(self, path: str, meta: GraphMeta, exc: Exception, hint: str) -> Exception:
        """A file OpenVINO cannot read is a broken graph set; a file it reads but cannot compile is a device
        problem (a missing driver, an operator the device lacks)."""
        try:
            self.core.read_model(path)
        except Exception as read_exc:  # noqa: BLE001
            return GraphSetError(f"openvino executor: graph {meta.name!r}: {path} is not a readable ONNX model "
                                 f"({_message(read_exc)}); {hint}")
        return RuntimeError(f"openvino executor: cannot compile graph {meta.name!r} ({path}) for device "
                            f"{self.device!r}: {_message(exc)}")

    def _ports(self, ports, known=()) -> list[Port]:
        """Ports as the binding checks them. A port can carry several tensor names (an output that is also
        an intermediate node's result, e.g. the Unsqueeze of a one-map stack); the name in ``known`` (the
        manifest's) is the one reported."""
        out = []
        for p in ports:
            etype = p.get_element_type()
            try:
                dtype = np.dtype(etype.to_dtype()).name
            except Exception:  # noqa: BLE001 - a type numpy has no name for (bf16, u4, ...)
                dtype = etype.get_type_name()
            pshape = p.get_partial_shape()
            shape = None if pshape.rank.is_dynamic else [
                d.get_length() if d.is_static else "?" for d in pshape]
            names = [n for n in p.get_names() if n in known]
            out.append(Port(names[0] if names else p.get_any_name(), dtype, shape))
        return out

    def _tensor(self, buf, offset: int, shape, dtype: str):
        view = buf.view(shape, dtype, offset)
        tensor = self._ov.Tensor(view, shared_memory=True)
        if tensor.data.ctypes.data != buf.ptr + offset:
            raise RuntimeError(f"openvino executor: cannot set a tensor over the buffer at {buf.ptr + offset:#x} "
                               f"without a copy ({dtype}{list(shape)})")
        return tensor

    def _execute(self, graph_handle, device_inputs, device_outputs, meta: GraphMeta) -> None:
        g: _Graph = graph_handle
        request, bound = g.request, g.bound
        for spec in meta.inputs:
            buf = device_inputs[spec.name]
            if bound.get(spec.name) != buf.ptr:
                for name, offset, shape in g.plan[spec.name]:
                    request.set_tensor(name, self._tensor(buf, offset, shape, spec.dtype))
                bound[spec.name] = buf.ptr
        for spec in meta.outputs:
            buf = device_outputs[spec.name]
            key = "\0out:" + spec.name
            if bound.get(key) != buf.ptr:
                request.set_tensor(spec.name, self._tensor(buf, 0, spec.shape, spec.dtype))
                bound[key] = buf.ptr
        request.start_async()
        request.wait()
        if not g.verified:
            self._verify_outputs(g, device_outputs, meta)
        for name in g.copy_out:
            spec = meta.output(name)
            np.copyto(self._view(device_outputs[name], spec.shape, spec.dtype), request.get_tensor(name).data)

    def _verify_outputs(self, g: _Graph, device_outputs: dict, meta: GraphMeta) -> None:
        """Which outputs the plugin left in memory of its own (those are copied from then on)."""
        g.copy_out = tuple(spec.name for spec in meta.outputs
                           if g.request.get_tensor(spec.name).data.ctypes.data != device_outputs[spec.name].ptr)
        g.verified = True

    def _unload_graph(self, graph_handle) -> None:
        g: _Graph = graph_handle
        g.bound.clear()
        g.request = None
        g.compiled = None

    # ------------------------------------------------------------------ introspection
    @property
    def cache_path(self) -> str:
        """The compiled-model cache directory in use ('' without ``cache_dir``)."""
        return self._cache_path

    def loaded_from_cache(self, graph: str) -> bool:
        """Whether ``graph`` was imported from the compiled-model cache instead of compiled."""
        self._require_loaded()
        return self._handles[graph].from_cache

    def copied_outputs(self, graph: str) -> tuple[str, ...]:
        """Outputs of ``graph`` that the plugin does not write into the bound buffers (copied each run)."""
        self._require_loaded()
        return self._handles[graph].copy_out
