"""Tracing a graph's torch module to ONNX against its contract (:class:`~synflux_ros.core.contract.GraphMeta`):
the exported inputs (a KV cache as its per-layer views), example tensors in range, the export itself and the
check of the result. What ``synflux-build`` exports the portable set with, and what a backend's build step
(TensorRT's shape-polymorphic graphs) reuses. Needs torch and onnx, imported where they are used.
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings

from ..core.contract import GraphMeta
from ..graphset import reader as graphset
from ..model.time_embedding import time_embedding
from .builder import BuildError

OPSET = 17
"""The ONNX opset of every exported graph."""


def onnx_inputs(meta: GraphMeta) -> list[tuple[str, tuple, str]]:
    """The exported graph's inputs (name, shape, dtype): the contract's, with each of
    ``graphset.VIEW_INPUTS`` replaced by its views (``past_kv.<layer>.<k|v>``)."""
    out = []
    for spec in meta.inputs:
        lead = graphset.VIEW_INPUTS.get(spec.name, 0)
        if lead:
            out += [(graphset.view_name(spec.name, idx), tuple(spec.shape[lead:]), spec.dtype)
                    for idx in graphset.view_indices(spec.shape, lead)]
        else:
            out.append((spec.name, tuple(spec.shape), spec.dtype))
    return out


def example_inputs(meta: GraphMeta):
    """Valid example tensors for tracing the exported inputs (:func:`onnx_inputs`)."""
    return example_tensors(onnx_inputs(meta))


def example_tensors(inputs):
    """Example tensors for ``inputs`` (name, shape, dtype): zeros, with counts/positions that are in range."""
    import numpy as np
    import torch
    out = []
    for name, shape, dtype in inputs:
        arr = np.zeros(shape, dtype)
        if name in ("num_tokens", "prefix_len"):
            arr[...] = 1
        elif name == "time_embedding":
            arr[...] = time_embedding(1.0, shape[-1])
        out.append(torch.from_numpy(arr))
    return tuple(out)


def _with_views(module, meta: GraphMeta):
    """``module`` (which takes the contract inputs) as a module taking :func:`onnx_inputs`: the views of
    an input are handed to it nested by index (``past_kv[layer] == (keys, values)``)."""
    import torch

    class Views(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, *flat):
            args, pos = [], 0
            for spec in meta.inputs:
                lead = graphset.VIEW_INPUTS.get(spec.name, 0)
                if not lead:
                    args.append(flat[pos])
                    pos += 1
                    continue
                count = math.prod(int(d) for d in spec.shape[:lead])
                views = list(flat[pos:pos + count])
                pos += count
                for d in reversed(spec.shape[1:lead]):
                    views = [tuple(views[i:i + int(d)]) for i in range(0, len(views), int(d))]
                args.append(views)
            return self.inner(*args)

    return Views().eval()


def export_graph(module, meta: GraphMeta, workdir: str):
    """Trace ``module`` to an ONNX ModelProto (weights loaded in memory) named after ``meta``, taking the
    inputs of :func:`onnx_inputs`."""
    import onnx
    import torch
    path = os.path.join(workdir, f"{meta.name}.onnx")
    module.eval()
    # Modules may offer a context that turns resolution-dependent tables into constants for export.
    folded = module.folded() if hasattr(module, "folded") else contextlib.nullcontext()
    with torch.no_grad(), folded, warnings.catch_warnings():
        # The TorchScript exporter is chosen on purpose: static shapes, opset 17, no dynamo dependency.
        warnings.simplefilter("ignore", DeprecationWarning)
        # The graphs are static-shape by design: the model code's decisions on tensor sizes are meant to
        # be constants of the trace.
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning, module=r".*\.torch_models\.")
        torch.onnx.export(_with_views(module, meta), example_inputs(meta), path, dynamo=False, opset_version=OPSET,
                          input_names=[n for n, _, _ in onnx_inputs(meta)],
                          output_names=[t.name for t in meta.outputs], do_constant_folding=True)
    model = onnx.load(path, load_external_data=True)
    restore_unused_inputs(model, onnx_inputs(meta))
    check_model_io(model, meta)
    return model


def restore_unused_inputs(model, declared) -> list[str]:
    """Put back the ``declared`` inputs (``(name, shape, dtype)``, shape dims ints or symbolic names) that
    the exporter dropped because nothing reads them, in the declared order; returns their names.

    A flow-matching VLA's prefill computes the new cache entries alone, so the last layer's attention, the
    only reader of that layer's ``past_kv`` views, is dead code; a bidirectional prefill reads no view at all
    (``core.contract``). The graph still takes every view of the contract: the same bindings serve every graph
    set, and a backend is handed one input list per kind."""
    import numpy as np
    from onnx import helper
    have = {v.name: v for v in model.graph.input}
    missing = [d for d in declared if d[0] not in have]
    if not missing:
        return []
    ordered = [have[name] if name in have else
               helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), list(shape))
               for name, shape, dtype in declared]
    rest = [v for v in model.graph.input if v.name not in {d[0] for d in declared}]  # initializers listed as inputs
    del model.graph.input[:]
    model.graph.input.extend(ordered + rest)
    return [d[0] for d in missing]


def check_model_io(model, meta: GraphMeta) -> None:
    """The exported model's inputs/outputs must be exactly the GraphMeta's (names, order, shapes, dtypes;
    inputs as :func:`onnx_inputs`)."""
    import onnx
    from onnx import helper

    def describe(values):
        res = []
        for v in values:
            t = v.type.tensor_type
            shape = tuple(d.dim_value for d in t.shape.dim)
            res.append((v.name, shape, helper.tensor_dtype_to_np_dtype(t.elem_type).name))
        return res
    init = {i.name for i in model.graph.initializer}
    got_in = [x for x in describe(model.graph.input) if x[0] not in init]
    want_in = onnx_inputs(meta)
    got_out = describe(model.graph.output)
    want_out = [(t.name, t.shape, t.dtype) for t in meta.outputs]
    if got_in != want_in or got_out != want_out:
        raise BuildError(f"exported graph {meta.name!r} does not match its contract:\n  inputs  {got_in}\n"
                         f"  expected {want_in}\n  outputs {got_out}\n  expected {want_out}")
    onnx.checker.check_model(model)
