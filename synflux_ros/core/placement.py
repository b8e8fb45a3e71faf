"""Several executors behind one: each graph runs where its kind is placed (``executor.placement``).

A VLA can put its vision encoder on an NPU and its LLM and action head on the GPU: the runtime keeps
calling one executor, and :class:`PlacedExecutor` routes each graph to the member that holds it.
Tensors cross members as host arrays: a graph's outputs come back to the host (as on any executor) and
become the next graph's inputs, copied into the receiving member's staging buffers, which were
allocated at load. Graphs that read the KV cache (prefill, decode, action expert) must share one member,
which owns the cache slots; placing them apart would copy the whole cache every step, so it is refused.
"""
from __future__ import annotations

import numpy as np

from .executor import DeviceTensor, Executor, GraphStats

KV_KINDS = ("prefill", "decode", "action_expert", "action_expert_vjp")


class PlacementError(ValueError):
    """A placement that cannot run as asked."""


class PlacedExecutor:
    """Routes :meth:`run` by graph to member executors; KV tensors live on the member of the KV graphs.

    ``members`` maps a label (``onnxruntime``, ``openvino:NPU``) to a loaded executor; each member holds
    the graphs placed on it.
    """

    name = "placed"

    def __init__(self, members: dict[str, Executor]):
        if not members:
            raise PlacementError("a placement needs at least one executor")
        self.members = dict(members)
        self._owner: dict[str, str] = {}
        for label, ex in self.members.items():
            for graph in ex.graphs:
                if graph in self._owner:
                    raise PlacementError(f"graph {graph!r} is placed on both {self._owner[graph]} and {label}")
                self._owner[graph] = label
        kv_labels = {self._owner[g] for g, meta in self.graphs.items() if meta.kind in KV_KINDS}
        if len(kv_labels) > 1:
            raise PlacementError(f"the graphs that read the KV cache ({', '.join(KV_KINDS)}) must run on one "
                                 f"executor, they are placed on {', '.join(sorted(kv_labels))}")
        self.kv_label = kv_labels.pop() if kv_labels else next(iter(self.members))
        self._kv = self.members[self.kv_label]

    # ---------------------------------------------------------------- the executor interface runtimes use
    @property
    def graphs(self) -> dict:
        return {name: meta for ex in self.members.values() for name, meta in ex.graphs.items()}

    @property
    def stats(self) -> dict[str, GraphStats]:
        return {name: st for ex in self.members.values() for name, st in ex.stats.items()}

    @property
    def device_bytes(self) -> int:
        return sum(ex.device_bytes for ex in self.members.values())

    @property
    def pool(self):
        """The static pool of the member that owns the KV cache (where the runtime allocates)."""
        return self._kv.pool

    def device_of(self, graph: str) -> str:
        """Label of the member that runs ``graph`` (``openvino:NPU``)."""
        return self._owner[graph]

    def _member(self, graph: str) -> Executor:
        label = self._owner.get(graph)
        if label is None:
            raise KeyError(f"no graph {graph!r} (have: {', '.join(sorted(self._owner))})")
        return self.members[label]

    def run(self, graph: str, feeds: dict) -> dict[str, np.ndarray]:
        return self._member(graph).run(graph, feeds)

    def bind(self, graph: str, resident: dict, outputs=None):
        """``graph`` bound by the member that runs it (:meth:`Executor.bind`)."""
        return self._member(graph).bind(graph, resident, outputs)

    def updates_in_place(self, graph: str, name: str) -> bool:
        """Whether the member that runs ``graph`` writes its new entries into input ``name`` itself."""
        return self._member(graph).updates_in_place(graph, name)

    def alloc_tensor(self, name: str, shape, dtype: str, zero: bool = True) -> DeviceTensor:
        return self._kv.alloc_tensor(name, shape, dtype, zero)

    def write(self, tensor: DeviceTensor, index: tuple, data: np.ndarray) -> None:
        self._kv.write(tensor, index, data)

    def read(self, tensor: DeviceTensor) -> np.ndarray:
        return self._kv.read(tensor)

    def set_gate(self, gate) -> None:
        for ex in self.members.values():
            ex.set_gate(gate)

    def freeze(self) -> None:
        for ex in self.members.values():
            ex.freeze()

    def close(self) -> None:
        for ex in self.members.values():
            ex.close()
