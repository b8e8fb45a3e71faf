"""``executor.options`` of the mock executor: simulated latency and injected faults."""
from __future__ import annotations

from dataclasses import dataclass

from ...core.config import setting


FAULT_KINDS = ("raise", "nan", "inf")


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """One ``faults`` entry: which graphs it hits, how, and on which calls."""
    graph: str = setting(doc="a graph name, kind or group")
    kind: str = setting("raise", choices=FAULT_KINDS, doc="raise fails the call as a device error would; nan/inf fill "
                                                           "the graph's floating-point outputs")
    every: int = setting(1, min=1, doc="hit every N-th matching call")
    first: int = setting(1, min=1, doc="the first matching call hit (1-based, counted per entry)")


@dataclass(frozen=True, kw_only=True)
class MockExecutorOptions:
    """``executor.options`` of ``executor: mock``."""
    latency_ms: dict[str, float] = setting(
        default_factory=dict,
        doc="simulated device time per graph name, graph kind (prefill) or group; a call then takes at least that "
            "long (a sleep, which releases the GIL as a device wait does). Also executor.latency_ms in the config")
    faults: tuple[FaultSpec, ...] = setting(
        default_factory=tuple,
        doc="injected device faults, each entry as in the table below; an entry hits the calls of its graph first, "
            "first + every, first + 2 every, ... (counted per entry)")
    device: str = setting("", doc="a device name the executor reports (device_of), for placement tests")
