"""``executor.options`` of the qnn executor: the QNN execution provider's and the ORT side of its sessions."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...core.config import setting
from ..onnxruntime.options import OrtSessionOptions

BACKENDS = ("htp", "gpu")
PRECISIONS = ("fp32", "fp16")
PERFORMANCE_MODES = ("default", "burst", "balanced", "high_performance", "sustained_high_performance",
                     "power_saver", "low_power_saver", "high_power_saver", "low_balanced", "extreme_power_saver")


@dataclass(frozen=True, kw_only=True)
class QNNExecutorOptions(OrtSessionOptions):
    """``executor.options`` of ``executor: qnn`` (the onnxruntime options it shares keep their meaning)."""
    backend: str = setting("htp", choices=BACKENDS, doc="htp: the Hexagon NPU; gpu: Adreno, through QNN's GPU "
                                                         "library")
    precision: str = setting("fp32", choices=PRECISIONS,
                              doc="fp16 sets enable_htp_fp16_precision (float32 graphs run as fp16 graphs)")
    soc_model: int | None = setting(None, min=1, doc="QNN SoC id of the target (e.g. 43 = SM8550, 57 = SM8650, "
                                                      "69 = SM8750); required on an x86-64 host (the simulator)")
    performance_mode: str = setting("default", choices=PERFORMANCE_MODES,
                                     doc="htp_performance_mode; default: QNN's")
    context_cache: Any = setting(False, doc="false, true (qnn_context/ beside the graph set) or a directory "
                                             "(relative to the graph set) keeping the compiled context binaries")
    provider_options: dict[str, Any] = setting(
        default_factory=dict, doc="further QNN provider options passed as they are (vtcm_mb, htp_arch, device_id, "
                                  "htp_graph_finalization_optimization_mode, ...)")
