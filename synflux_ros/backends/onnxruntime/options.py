"""``executor.options`` of the onnxruntime executor (and the ORT side of the qnn executor's sessions)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...core.config import setting

LEVELS = ("disable", "basic", "extended", "all")
THREAD_POOLS = ("session", "shared")


@dataclass(frozen=True, kw_only=True)
class OrtSessionOptions:
    """The options of an onnxruntime session that every backend running on onnxruntime takes."""
    intra_op_num_threads: int = setting(0, min=0, doc="threads per operator; 0 = onnxruntime's default (one per "
                                                       "physical core)")
    inter_op_num_threads: int = setting(0, min=0, doc="threads between operators; 0 = onnxruntime's default")
    graph_optimization_level: str = setting(
        "all", choices=LEVELS, doc="onnxruntime's optimiser, where fused operators come from; the files on disk "
                                   "stay portable")
    share_weights: bool = setting(True, doc="read weights.bin once and give every session views of it (N bucket "
                                             "graphs hold one copy)")
    mmap_weights: bool = setting(False, doc="map the weights file instead of reading it (file-backed pages, "
                                             "evictable under memory pressure)")
    allow_spinning: bool | None = setting(
        None, doc="idle intra-op threads spin instead of sleeping; default false, so that a pool that just ran "
                  "does not take the cores the next graph's pool needs (thread_pool: shared always spins)")


@dataclass(frozen=True, kw_only=True)
class OnnxRuntimeExecutorOptions(OrtSessionOptions):
    """``executor.options`` of ``executor: onnxruntime``."""
    providers: Any = setting(
        ("CPUExecutionProvider",),
        doc="onnxruntime execution providers, each a name or [name, {provider options}]; CUDA and TensorRT "
            "where onnxruntime-gpu is installed")
    thread_pool: str = setting("session", choices=THREAD_POOLS,
                                doc="session: a pool per graph's session; shared: one pool of intra_op_num_threads "
                                    "for every session of the process")
    optimized_model_dir: str | None = setting(
        "", doc="a writable directory caching the ORT-optimised graphs; with prepack: true the prepacked weights "
                "are saved there once and mapped by every session. Not with the TensorRT execution provider "
                "(use its engine cache)")
    prepack: Any = setting(
        None, doc="true, false, or a list of graph names, kinds or groups whose sessions prepack their weights; "
                  "default: false with share_weights, true for a quantized graph set")
    fusions: Any = setting(False, doc="true, or a list of rms_norm, skip_rms_norm, rotary, attention, padded_keys: "
                                       "rewrite the decoder graphs at load into onnxruntime's fused kernels (needs "
                                       "onnxscript)")
    matmulnbits_accuracy_level: int | None = setting(
        None, min=0, max=4, doc="quantized sets: accuracy_level of the MatMulNBits kernels; 0 computes what the "
                                "dequantized weights compute, 4 (onnxruntime's default) quantizes activations "
                                "to int8 per block")


DEFAULTS = OnnxRuntimeExecutorOptions()
"""The value of each option a narrower options type (the qnn executor's) leaves out."""
