"""Backend registry: a backend name maps to ``module:Class`` plus the packages it needs.

Modules are imported lazily, only when their backend is selected, so a machine without TensorRT can
still run the mock backend. Two different errors:

* ``UnknownBackendError``: the name is not in the table ("unknown backend 'trt' (choices: ...)");
* ``BackendUnavailableError``: the name is known but a package it needs is not installed.

Adding a backend = one module implementing the five hooks of :class:`synflux_ros.core.executor.Executor`
and one row in ``EXECUTORS``.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from ..core.config import choices_hint


class UnknownBackendError(ValueError):
    """The configured backend name is not in the registry."""


class BackendUnavailableError(ImportError):
    """The backend is registered but its SDK (Python package) is not installed."""


@dataclass(frozen=True)
class BackendEntry:
    """A registry row: ``module:Class`` to import, the packages it needs and how to install them."""
    target: str  # "package.module:ClassName"
    requires: tuple[str, ...] = ()  # importable module names the backend needs
    install_hint: str = ""


EXECUTORS: dict[str, BackendEntry] = {
    "mock": BackendEntry("synflux_ros.backends.mock.executor:MockExecutor"),
    "onnxruntime": BackendEntry("synflux_ros.backends.onnxruntime.executor:OnnxRuntimeExecutor", requires=("onnxruntime",),
                                install_hint="pip install onnxruntime; onnxruntime-gpu for CUDA/TensorRT providers"),
    "openvino": BackendEntry("synflux_ros.backends.openvino.executor:OpenVINOExecutor", requires=("openvino",),
                             install_hint="pip install openvino; Intel GPU and NPU devices also need their "
                                          "drivers"),
    "qnn": BackendEntry("synflux_ros.backends.qnn.executor:QNNExecutor", requires=("onnxruntime", "onnxruntime_qnn"),
                        install_hint="pip install onnxruntime-qnn (Qualcomm's QNN execution provider for "
                                     "onnxruntime, with the HTP libraries; on x86-64 the HTP simulator)"),
    "rknn": BackendEntry("synflux_ros.backends.rknn.executor:RKNNExecutor",
                         install_hint="on an RK3588/RK3576 board: rknn-toolkit-lite2 and librknnrt.so; elsewhere "
                                      "`make rknn-venv` for rknn-toolkit2's simulator"),
    "tensorrt": BackendEntry("synflux_ros.backends.tensorrt.executor:TensorRTExecutor", requires=("tensorrt", "cuda"),
                             install_hint="TensorRT 10 comes with JetPack 6 on a Jetson (python3-libnvinfer); "
                                          "cuda-python: pip install cuda-python; engines: synflux-build --backend "
                                          "tensorrt on the device"),
}


def available_backends() -> list[str]:
    return sorted(EXECUTORS)


def resolve_executor_class(name: str):
    """Return the executor class registered as ``name`` (importing its module now)."""
    entry = EXECUTORS.get(name)
    if entry is None:
        raise UnknownBackendError(f"unknown backend {name!r}{choices_hint(name, available_backends())}")
    for pkg in entry.requires:
        if importlib.util.find_spec(pkg) is None:
            hint = f" ({entry.install_hint})" if entry.install_hint else ""
            raise BackendUnavailableError(
                f"backend {name!r} needs the Python package {pkg!r}, which is not installed{hint}")
    module_name, _, cls_name = entry.target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, cls_name)


def build_executor(name: str, graphs, graph_dir: str = "", options: dict | None = None):
    """Instantiate (not load) the executor registered as ``name``."""
    cls = resolve_executor_class(name)
    return cls(graphs, graph_dir=graph_dir, options=options)
