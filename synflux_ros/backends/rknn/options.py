"""``executor.options`` of the rknn executor."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...core.config import setting

RUNTIMES = ("auto", "board", "simulator")
CORE_MASKS = {"auto": "NPU_CORE_AUTO", "0": "NPU_CORE_0", "1": "NPU_CORE_1", "2": "NPU_CORE_2",
              "0_1": "NPU_CORE_0_1", "0_1_2": "NPU_CORE_0_1_2", "all": "NPU_CORE_ALL"}
"""core_mask values -> RKNNLite's constants."""


@dataclass(frozen=True, kw_only=True)
class RKNNExecutorOptions:
    """``executor.options`` of ``executor: rknn``."""
    target: str = setting("", doc="SoC the graphs were compiled for (rk3588, rk3576, ...); default: on a board the "
                                   "SoC read from the device tree, in the simulator the one target the graph set has")
    runtime: str = setting("auto", choices=RUNTIMES, doc="auto: board on aarch64 with rknnlite importable, else "
                                                          "simulator")
    simulator_python: str = setting("", doc="Python of the venv holding rknn-toolkit2; default: .venv-rknn/bin/python "
                                             "beside the venv this package runs from, else beside the source tree")
    core_mask: Any = setting("auto", doc="board only: the NPU cores a graph runs on: auto, 0, 1, 2, 0_1, 0_1_2 or "
                                          "all (a number given as a YAML integer is read as its digits)")
    check_toolkit_version: bool = setting(True, doc="board only: the installed rknn-toolkit-lite2 must have "
                                                     "the major.minor version of the rknn-toolkit2 that compiled "
                                                     "the graphs")
