"""``executor.options`` of the tensorrt executor (which engines to load and how to run them)."""
from __future__ import annotations

from dataclasses import dataclass

from ...core.config import setting

PRECISIONS = ("fp32", "fp16", "int8")


@dataclass(frozen=True, kw_only=True)
class TensorRTExecutorOptions:
    """``executor.options`` of ``executor: tensorrt``."""
    precision: str = setting("fp16", choices=PRECISIONS, doc="the build to load (synflux-build --precision)")
    dla_core: int | None = setting(None, min=0, doc="the DLA build to load (synflux-build --dla-core); default none")
    engine_dir: str | None = setting("", doc="the engines' directory; default tensorrt/<sm..-precision[-dlaN]> in the "
                                              "graph set")
    device: int = setting(0, min=0, doc="CUDA device index")
    cuda_graphs: bool = setting(False, doc="capture each decode step once per bucket and bound addresses and replay "
                                            "it as a CUDA graph")
    module: str = setting("tensorrt", doc="the TensorRT Python module to import")
