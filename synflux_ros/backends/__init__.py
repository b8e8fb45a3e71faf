"""Backend registry, two tables: ``EXECUTORS`` (run side: ``executor:=NAME``) maps a backend to its executor
class and the packages it needs; ``BUILDERS`` (build side: ``synflux-build --backend NAME``) to its build
step, empty for a backend that loads the portable ONNX graph set as it is.

Modules are imported lazily, only when their backend is selected, so a machine without TensorRT can still
run the mock backend. Two different errors:

* ``UnknownBackendError``: the name is not in the table ("unknown backend 'trt' (choices: ...)");
* ``BackendUnavailableError``: the name is known but a package it needs is not installed.

Adding a backend = a folder ``backends/<name>/`` with ``executor.py`` (the five hooks of
:class:`synflux_ros.core.executor.Executor`) and, if it compiles the graphs, ``build.py`` (a
:class:`synflux_ros.graphkit.builder.Builder`), and one row in each table. A backend in another package
registers the same two entries under the entry-point groups ``synflux_ros.executors`` and
``synflux_ros.builders`` (values ``module:Class``).
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
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


BUILDERS: dict[str, str] = {
    # backend -> its build step after the portable ONNX graph set ("module:Class"; "": the portable set alone)
    "onnxruntime": "",
    "rknn": "synflux_ros.backends.rknn.build:RKNNBuilder",
    "tensorrt": "synflux_ros.backends.tensorrt.build:TensorRTBuilder",
}

EXECUTOR_GROUP, BUILDER_GROUP = "synflux_ros.executors", "synflux_ros.builders"


@functools.lru_cache(maxsize=None)
def _plugins(group: str) -> dict[str, str]:
    """``name -> module:Class`` registered by installed packages under an entry-point group."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=group)}


def executor_table() -> dict[str, BackendEntry]:
    """``EXECUTORS`` and the executors other packages register (a built-in name keeps its own row)."""
    return {**{n: BackendEntry(v) for n, v in _plugins(EXECUTOR_GROUP).items()}, **EXECUTORS}


def builder_table() -> dict[str, str]:
    """``BUILDERS`` and the build steps other packages register (a built-in name keeps its own row)."""
    return {**_plugins(BUILDER_GROUP), **BUILDERS}


def available_backends() -> list[str]:
    return sorted(executor_table())


def buildable_backends() -> list[str]:
    return sorted(builder_table())


def _import(target: str):
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def resolve_builder(name: str):
    """The build step registered for ``name`` (an instance), ``None`` for the portable graph set alone."""
    table = builder_table()
    if name not in table:
        raise UnknownBackendError(f"no graph builder for backend {name!r}{choices_hint(name, sorted(table))}")
    return _import(table[name])() if table[name] else None


def resolve_executor_class(name: str):
    """Return the executor class registered as ``name`` (importing its module now)."""
    entry = executor_table().get(name)
    if entry is None:
        raise UnknownBackendError(f"unknown backend {name!r}{choices_hint(name, available_backends())}")
    for pkg in entry.requires:
        if importlib.util.find_spec(pkg) is None:
            hint = f" ({entry.install_hint})" if entry.install_hint else ""
            raise BackendUnavailableError(
                f"backend {name!r} needs the Python package {pkg!r}, which is not installed{hint}")
    return _import(entry.target)


def build_executor(name: str, graphs, graph_dir: str = "", options: dict | None = None):
    """Instantiate (not load) the executor registered as ``name``."""
    cls = resolve_executor_class(name)
    return cls(graphs, graph_dir=graph_dir, options=options)
