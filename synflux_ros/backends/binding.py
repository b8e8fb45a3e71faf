"""What the backends that run a graph set's ONNX files out of host memory share (onnxruntime, OpenVINO):
aligned host buffers as their "device" memory, and the binding plan that maps a loaded model's inputs
and outputs onto the graph contract.

Host buffers
------------
:class:`HostBuffer` is one 64-byte-aligned, zero-filled numpy byte array with its address; a backend mixes
in :class:`HostBufferHooks` to get ``_alloc_device`` and the copy hooks of
:class:`~synflux_ros.core.executor.HostMemoryHooks` over such buffers. A runtime binds its inputs and
outputs by address, so a staging buffer or a KV-cache slot is read and written in place.

Binding plan
------------
A model's inputs are the contract's inputs, except that a contract input may come as several views
(``past_kv`` as ``past_kv.<l>.<j>``, see :data:`synflux_ros.graphset.reader.VIEW_INPUTS`). :func:`binding_plan`
checks a model's ports against its :class:`~synflux_ros.core.executor.GraphMeta` and returns, per contract
input, where each model input lies in that input's buffer; a port missing, extra, of another dtype or
shape fails with the graph and tensor named.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from ..graphset import reader as graphset
from ..core.contract import GraphMeta
from ..core.executor import HostMemoryHooks, ShapeError

ALIGNMENT = 64
"""Byte alignment of every host buffer (enough for any element type and SIMD loads)."""


class HostBuffer:
    """A device buffer of a CPU 'device': an aligned, zero-filled numpy byte array and its address."""

    __slots__ = ("array", "ptr")

    def __init__(self, nbytes: int, alignment: int = ALIGNMENT):
        raw = np.zeros(nbytes + alignment, np.uint8)
        start = (-raw.ctypes.data) % alignment
        self.array = raw[start:start + nbytes]
        self.ptr = self.array.ctypes.data

    def view(self, shape, dtype, offset: int = 0) -> np.ndarray:
        """A typed view of ``prod(shape)`` elements starting ``offset`` bytes into the buffer."""
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        return self.array[offset:offset + n].view(dt).reshape(shape)


class HostBufferHooks(HostMemoryHooks):
    """``_alloc_device`` and ``_view`` over :class:`HostBuffer`; mix in before
    :class:`~synflux_ros.core.executor.Executor`."""

    alloc_is_zeroed = True  # HostBuffer is np.zeros

    def _alloc_device(self, nbytes: int) -> HostBuffer:
        return HostBuffer(nbytes)

    @staticmethod
    def _view(buf: HostBuffer, shape, dtype) -> np.ndarray:
        return buf.view(shape, dtype)


class Port(NamedTuple):
    """One input or output of a loaded model as its runtime reports it."""
    name: str
    dtype: str
    """numpy dtype name (as GraphMeta spells it), or the runtime's own type name when it has none."""
    shape: Sequence | None
    """Dimensions; a dimension that is not an int is dynamic and matches any size; None: unknown rank."""


Plan = dict[str, list[tuple[str, int, tuple]]]
"""contract input -> [(model input name, byte offset in the contract input's buffer, shape)]: one entry at
offset 0 for an input the model takes whole, one per view for an input it takes as views. A view may carry
leading axes of length 1 (``[1, KV, S, Dh]`` for a ``[KV, S, Dh]`` view); the shape is the model's."""


def binding_plan(meta: GraphMeta, inputs: Sequence[Port], outputs: Sequence[Port], where: str,
                 hint: str, in_place: Plan | None = None, derived: set | None = None) -> Plan:
    """Check a model's ports against ``meta`` and return its input :data:`Plan`. Errors are
    :class:`ShapeError` naming the graph, ``where`` (its file) and the tensor, and end with ``hint``.

    Outputs that update an input in place (``<input>`` + :data:`graphset.IN_PLACE_SUFFIX`, of the input's dtype
    and shape) are accepted only when ``in_place`` is given, which is then filled like the plan: contract input
    -> [(model output name, byte offset, shape)], to be bound to the same memory as that input. With ``derived``
    given too, a contract output of :data:`graphset.ROWS_IN_PLACE` may be missing when the model updates every
    view of its input in place; its name is added to ``derived`` (the runtime reads it from the input)."""
    plan: Plan = {}
    model_inputs: dict[str, tuple] = {}  # model input name -> (contract name, port, offset, shape)
    for what, declared, actual in (("input", meta.inputs, inputs), ("output", meta.outputs, outputs)):
        specs = {s.name: s for s in declared}
        parts: dict[str, list] = {s.name: [] for s in declared}  # contract name -> [(port, offset, shape)]
        extra = []
        for port in actual:
            if port.name in specs:
                parts[port.name].append((port, 0, tuple(specs[port.name].shape)))
                continue
            view = None
            if what == "input":
                for spec in declared:
                    view = graphset.input_views(spec.name, spec.shape, np.dtype(spec.dtype).itemsize, port.name)
                    if view is not None:
                        parts[spec.name].append((port, view[0], _leading_ones(port.shape, view[1])))
                        break
            elif in_place is not None and port.name.endswith(graphset.IN_PLACE_SUFFIX):
                view = model_inputs.get(port.name[:-len(graphset.IN_PLACE_SUFFIX)])
                if view is not None:
                    contract, source, offset, shape = view
                    if port.dtype != source.dtype or list(port.shape or ()) != list(shape):
                        raise ShapeError(f"graph {meta.name!r} ({where}): output {port.name!r} updates input "
                                         f"{source.name!r} in place but is {port.dtype}{port.shape}, not "
                                         f"{source.dtype}{list(shape)}; {hint}")
                    in_place.setdefault(contract, []).append((port.name, offset, shape))
            if view is None:
                extra.append(port.name)
        missing = [name for name, found in parts.items() if not found]
        if what == "output" and derived is not None and in_place is not None:
            for name in [m for m in missing if m in graphset.ROWS_IN_PLACE]:
                source, position = graphset.ROWS_IN_PLACE[name]
                if source in plan and position in plan and len(in_place.get(source, ())) == len(plan[source]):
                    missing.remove(name)
                    derived.add(name)
        if missing or extra:
            raise ShapeError(f"graph {meta.name!r} ({where}): {what}s differ from the manifest: missing "
                             f"{missing}, unexpected {extra} (the ONNX model has {[p.name for p in actual]}); "
                             f"{hint}")
        for spec in declared:
            for port, offset, want in parts[spec.name]:
                shape = list(port.shape) if port.shape is not None else None
                ok_shape = shape is not None and len(shape) == len(want) and all(
                    not isinstance(d, int) or d == s for d, s in zip(shape, want))
                if port.dtype != spec.dtype or not ok_shape:
                    part = repr(spec.name) if port.name == spec.name else f"{port.name!r} (a view of {spec.name!r})"
                    raise ShapeError(f"graph {meta.name!r} ({where}): {what} {part} is {port.dtype}{shape} in the "
                                     f"ONNX model but {spec.dtype}{list(want)} in the graph contract; {hint}")
            if what == "input":
                plan[spec.name] = [(port.name, offset, want) for port, offset, want in parts[spec.name]]
                model_inputs.update((port.name, (spec.name, port, offset, want))
                                    for port, offset, want in parts[spec.name])
    return plan


def _leading_ones(shape, view: tuple) -> tuple:
    """``view`` with the leading length-1 axes that the model's port ``shape`` has in front of it."""
    extra = len(shape) - len(view) if shape is not None else 0
    if extra > 0 and all(d == 1 for d in shape[:extra]):
        return (1,) * extra + tuple(view)
    return tuple(view)
