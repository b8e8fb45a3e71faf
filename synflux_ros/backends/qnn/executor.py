"""Qualcomm QNN executor: a synflux-build graph set on a Snapdragon NPU (Hexagon HTP) through ONNX Runtime's QNN
execution provider (``onnxruntime-qnn``).

Everything but how a session is created is the onnxruntime executor's: the provider's plugin library is
registered with onnxruntime once per process and added to each session for the devices it reports, with CPU
fallback off, so a graph runs on QNN whole or fails at load naming the operators QNN cannot run. Graph sets
need int32 token ids; compiled context binaries can be cached. How and why: docs/backends/qnn.md; the options:
:mod:`synflux_ros.backends.qnn.options`.
"""
from __future__ import annotations

import os
import platform
import shutil
import threading

from ...graphset import cache, reader as graphset, writer as graphset_writer
from ...core.config import ConfigError
from ...core.contract import GraphMeta
from ...graphset.reader import GraphSetError
from ..onnxruntime.executor import OnnxRuntimeExecutor
from .options import QNNExecutorOptions
from .weights import private_weights

# Provider options the executor sets from its own options (not to be given again in provider_options).
_OWN_PROVIDER_KEYS = ("backend_type", "backend_path", "soc_model", "enable_htp_fp16_precision",
                      "htp_performance_mode")
# Provider options that change the run, not the compiled binary: left out of the context-cache key.
_RUN_ONLY_PROVIDER_KEYS = ("htp_performance_mode", "rpc_control_latency", "device_id", "profiling_level",
                           "profiling_file_path")
_DEVICE_TYPE = {"htp": "NPU", "gpu": "GPU"}
_SIMULATOR_HOSTS = ("x86_64", "amd64")
_CONTEXT_DIR = "qnn_context"
_CACHE_KEY = "qnn_context"
_CPU_FALLBACK = "assigned to the default CPU EP"

_register_lock = threading.Lock()


def qnn_ep_devices(ort, qnn) -> list:
    """The ``OrtEpDevice`` entries of the QNN execution provider, registering its library with onnxruntime
    on first use (once per process; onnxruntime refuses a second registration under the same name)."""
    name = qnn.get_ep_name()
    with _register_lock:
        devices = [d for d in ort.get_ep_devices() if d.ep_name == name]
        if not devices:
            ort.register_execution_provider_library(name, qnn.get_library_path())
            devices = [d for d in ort.get_ep_devices() if d.ep_name == name]
    if not devices:
        raise RuntimeError(f"qnn executor: onnxruntime {ort.__version__} loaded {qnn.get_library_path()} but "
                           f"the QNN execution provider reports no device")
    return devices


class QNNExecutor(graphset.ChecksWeightFormat, OnnxRuntimeExecutor):
    """Runs a synflux-build graph set (int32 token ids) on a Qualcomm NPU with ONNX Runtime's QNN execution
    provider; buffers, binding and weights as :class:`OnnxRuntimeExecutor` (see docs/backends/qnn.md)."""
    name = "qnn"
    weight_dtypes: tuple[str, ...] = ("float32",)  # quantized sets (--weights) are ORT-CPU only for now
    options_type = QNNExecutorOptions

    def __init__(self, graphs, graph_dir: str = "", options: dict | None = None):
        super().__init__(graphs, graph_dir, options)
        import onnxruntime_qnn

        self._qnn = onnxruntime_qnn
        opts = self.opts
        self.backend = opts.backend
        self.precision = opts.precision
        self.performance_mode = opts.performance_mode
        soc = opts.soc_model
        self.soc_model: int | None = soc
        if self.backend == "htp" and soc is None and platform.machine().lower() in _SIMULATOR_HOSTS:
            raise ConfigError("qnn executor: on an x86-64 host the HTP backend is Qualcomm's simulator, which "
                              "needs the target SoC: set executor.options.soc_model (e.g. 43 = SM8550, "
                              "57 = SM8650, 69 = SM8750); on a Snapdragon device the HTP backend reads it from "
                              "the device")
        extra = opts.provider_options
        taken = sorted(set(extra) & set(_OWN_PROVIDER_KEYS))
        if taken:
            raise ConfigError(f"qnn executor: executor.options.provider_options.{taken[0]}: set by the executor's "
                              f"own options (backend, soc_model, precision, performance_mode)")
        self.provider_options = self._provider_options(extra)
        cache = opts.context_cache
        if cache is True:
            cache = _CONTEXT_DIR
        if cache is False or cache is None:
            cache = ""
        if not isinstance(cache, str):
            raise ConfigError(f"qnn executor: executor.options.context_cache: expected true, false or a directory "
                              f"path, got {cache!r}")
        self.context_cache = cache
        self._ep_name = onnxruntime_qnn.get_ep_name()
        self.providers = [(self._ep_name, dict(self.provider_options))]
        self._cpu_only = False
        self._devices = self._pick_devices(qnn_ep_devices(self._ort, onnxruntime_qnn))
        self._context_path = ""

    # ------------------------------------------------------------------ options
    def _provider_options(self, extra: dict) -> dict[str, str]:
        """The QNN provider options (ORT takes them as strings)."""
        opts = {"backend_type": self.backend,
                "enable_htp_fp16_precision": "1" if self.precision == "fp16" else "0"}
        if self.soc_model is not None:
            opts["soc_model"] = str(self.soc_model)
        if self.performance_mode != "default":
            opts["htp_performance_mode"] = self.performance_mode
        for key, value in extra.items():
            opts[key] = str(int(value)) if isinstance(value, bool) else str(value)
        return opts

    def _pick_devices(self, devices: list) -> list:
        """The QNN devices of the backend's kind (the NPU for htp, the GPU for gpu); all of them where the
        provider reports none of that kind (the simulator on a host reports the CPU)."""
        kind = _DEVICE_TYPE[self.backend]
        chosen = [d for d in devices if getattr(d.device.type, "name", str(d.device.type)).endswith(kind)]
        return chosen or devices

    def device_of(self, graph: str) -> str:
        return f"{self.name}:{self.backend}"

    # ------------------------------------------------------------------ graph set
    def load(self) -> "QNNExecutor":
        if self._loaded:
            return self
        self.check_weight_format()
        self._check_token_ids()
        return super().load()

    def _check_token_ids(self) -> None:
        for meta in self.graphs.values():
            for spec in meta.inputs:
                if spec.name == "input_ids" and spec.dtype != "int32":
                    raise GraphSetError(
                        f"qnn executor: graph {meta.name!r} ({self.graph_path(meta)}) takes input_ids as "
                        f"{spec.dtype}; the QNN backend needs int32 token ids: rebuild the graph set with "
                        f"`llm.token_id_dtype: int32` in the config "
                        f"({graphset.BUILD_HINT.format(dir=self.graph_dir)})")

    def _create_session(self, meta: GraphMeta, path: str, so):
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        # The provider warns on every session about features of other platforms; errors still show.
        so.log_severity_level = max(so.log_severity_level, 3)
        so.add_provider_for_devices(self._devices, self.provider_options)
        try:
            return self._ort.InferenceSession(self._model_source(path, so), so)
        except Exception as exc:  # ORT raises its own exception types; name the graph, file and operators
            raise RuntimeError(self._load_error(meta, path, exc)) from exc

    def _model_source(self, path: str, so):
        """``path``, or the bytes of the graph with a private copy of each weight that its products read in two
        roles (:mod:`.weights`; the vjp guidance's graph), its other tensors read from the weights beside it."""
        import onnx
        model = onnx.load(path, load_external_data=False)
        if not private_weights(model):
            return path
        so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                    os.path.dirname(os.path.abspath(path)))
        return model.SerializeToString()

    def _where(self) -> str:
        soc = f", soc_model {self.soc_model}" if self.soc_model is not None else ""
        return f"QNN {self.backend}{soc}"

    def _load_error(self, meta: GraphMeta, path: str, exc: Exception) -> str:
        text = str(exc)
        head = f"qnn executor: cannot load graph {meta.name!r} from {path} on {self._where()}"
        if _CPU_FALLBACK in text:
            ops, on_qnn = self._unsupported_nodes(meta, path)
            if ops and not on_qnn:
                return (f"{head}: QNN took none of its {len(ops)} operators: the QNN {self.backend} backend did "
                        f"not start on this machine or rejects the whole graph (onnxruntime's log above says why)")
            if ops:
                return (f"{head}: QNN cannot run {len(ops)} of its operators ({'; '.join(ops)}); this backend "
                        f"runs a graph only when every node is on QNN (no CPU fallback)")
            return f"{head}: some of its operators cannot run on QNN (no CPU fallback): {text}"
        if "finalize" in text.lower() and self.soc_model is None:
            return f"{head}: {text} (is soc_model set to the target's SoC?)"
        return f"{head}: {text}"

    def _unsupported_nodes(self, meta: GraphMeta, path: str) -> tuple[list[str], int]:
        """The nodes ORT would place on the CPU, as 'OpType name', and how many it would place on QNN (a
        second session with fallback allowed and ORT recording where each node went); ([], 0) when that
        cannot be told."""
        try:
            so, _ = self._session_options(meta, path, self.graph_optimization_level, False)
            so.log_severity_level = 3
            so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
            so.add_provider_for_devices(self._devices, self.provider_options)
            session = self._ort.InferenceSession(self._model_source(path, so), so)
            found, on_qnn = [], 0
            for sub in session.get_provider_graph_assignment_info():
                if sub.ep_name == self._ep_name:
                    on_qnn += len(sub.get_nodes())
                else:
                    found += [f"{n.op_type} {n.name!r}" for n in sub.get_nodes()]
            return found, on_qnn
        except Exception:  # noqa: BLE001 - the diagnosis is best effort; the first error is reported anyway
            return [], 0

    # ------------------------------------------------------------------ context binaries
    @property
    def context_path(self) -> str:
        """The context-binary cache directory in use ('' without ``context_cache``)."""
        return self._context_path

    def _cached_graph_set(self) -> str:
        if not self.context_cache:
            return ""
        self._context_path = self._context_graph_set()
        return self._context_path

    def _context_fingerprint(self, manifest: dict) -> dict:
        fingerprint = self._cache_fingerprint(manifest)
        fingerprint.pop("prepacked", None)
        fingerprint["providers"] = [self._ep_name]
        fingerprint.update({
            "onnxruntime_qnn": getattr(self._qnn, "__version__", ""),
            "qnn_sdk": getattr(getattr(self._qnn, "build_and_package_info", None), "qnn_version", ""),
            "provider_options": {k: v for k, v in sorted(self.provider_options.items())
                                 if k not in _RUN_ONLY_PROVIDER_KEYS}})
        return fingerprint

    def _context_valid(self, directory: str, fingerprint: dict) -> bool:
        """A cache of these settings with every file it was written with (EPContext models and binaries)."""
        if not self._cache_valid(directory, fingerprint, _CACHE_KEY):
            return False
        try:
            files = graphset.read_manifest(directory).get("files") or []
        except (GraphSetError, OSError):
            return False
        return all(os.path.isfile(os.path.join(directory, f)) for f in files)

    def _context_graph_set(self) -> str:
        """Directory of the EPContext graph set for these settings, compiled when missing or stale."""
        root = self.context_cache if os.path.isabs(self.context_cache) else \
            os.path.join(self.graph_dir, self.context_cache)
        manifest = graphset.read_manifest(self.graph_dir)
        fingerprint = self._context_fingerprint(manifest)
        target = cache.entry_dir(root, manifest, fingerprint)
        if self._context_valid(target, fingerprint):
            return target
        work = f"{target}.partial-{os.getpid()}"
        try:
            os.makedirs(work, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"qnn executor: context_cache {root} is not writable ({exc}); set executor.options."
                             f"context_cache to a writable directory or remove it") from exc
        try:
            self._open_graph_set(self.graph_dir)
            for meta in self.graphs.values():
                src = self.graph_path(meta)
                so, _ = self._session_options(meta, src, self.graph_optimization_level, False)
                so.add_session_config_entry("ep.context_enable", "1")
                so.add_session_config_entry("ep.context_file_path", os.path.join(work, f"{meta.name}.onnx"))
                so.add_session_config_entry("ep.context_embed_mode", "0")  # the binary beside: <name>_qnn.bin
                session = self._create_session(meta, src, so)
                self._check_io(session, meta, src)
                del session
            self._release_sessions()
            metas = [GraphMeta(m.name, m.kind, m.inputs, m.outputs, m.group, f"{m.name}.onnx", dict(m.attrs))
                     for m in self.graphs.values()]
            graphset_writer.write_manifest(work, {"model": manifest.get("model", ""),
                                                  "config_hash": manifest.get("config_hash", ""),
                                                  "graphs": metas, _CACHE_KEY: fingerprint,
                                                  "files": sorted(os.listdir(work))})
            cache.publish_directory(work, target, lambda d: self._context_valid(d, fingerprint))
        finally:
            self._release_sessions()
            if os.path.isdir(work):
                shutil.rmtree(work, ignore_errors=True)
        return target

    def loaded_from_context(self, graph: str) -> bool:
        """Whether ``graph`` was loaded from a context binary of the cache instead of compiled."""
        self._require_loaded()
        return self._from_cache and graph in self.graphs
