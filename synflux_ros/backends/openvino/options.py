"""``executor.options`` of the openvino executor."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...core.config import setting

PRECISIONS = ("f32", "f16", "bf16", "default")


@dataclass(frozen=True, kw_only=True)
class OpenVINOExecutorOptions:
    """``executor.options`` of ``executor: openvino``."""
    device: str = setting("CPU", doc="CPU, GPU, GPU.1, NPU, AUTO, AUTO:GPU,CPU, HETERO:GPU,CPU; a device this machine "
                                      "does not have is an error that lists the available ones")
    precision: str | None = setting(None, choices=PRECISIONS,
                                     doc="INFERENCE_PRECISION_HINT; default f32 on the CPU, f16 on GPU and NPU; "
                                         "default = the plugin's own choice")
    cache_dir: str | None = setting("", doc="compiled-model cache (relative to the graph set), keyed by OpenVINO "
                                             "version, device, properties and the graph files; default: compile at "
                                             "every load")
    num_streams: int = setting(0, min=0, doc="NUM_STREAMS; 0 = the latency hint's (one stream)")
    inference_num_threads: int = setting(0, min=0, doc="CPU threads (INFERENCE_NUM_THREADS); 0 = OpenVINO's default")
    properties: dict[str, Any] = setting(
        default_factory=dict, doc="further OpenVINO properties passed to compile_model as they are, e.g. "
                                  "{ENABLE_CPU_PINNING: false}; they override the ones above")
