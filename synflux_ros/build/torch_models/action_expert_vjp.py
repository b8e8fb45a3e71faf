"""The action expert with the Real-Time Chunking correction of the ``vjp`` guidance (``action_expert_vjp_<d>``).

Given the expert's inputs and the guidance's target (the previous chunk's leftover, padded), prefix weights and
flow time t, the graph returns the velocity v(x) and the vector-Jacobian product of the denoised estimate
``x1 = x - t * v(x)`` with the weighted error ``e = (target - x1) * weights``: ``J^T e = e - t * (dv/dx)^T e``
(the paper's Algorithm 1; docs/real-time-chunking.md). The guidance weight stays on the host.

torch's autograd computes the product; the TorchScript exporter cannot trace autograd itself, so the forward and
backward pass are first recorded as one graph of ATen operations (``make_fx`` with the core decompositions) on
example inputs, and that graph is exported. Nothing in the expert depends on input values through Python, so
the record holds for any input (prefix_len stays a tensor). The expert's parameters enter the record as the same
tensors, so the exported graph's weights are the action expert graphs' weights, stored once in the graph set.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .action_expert import ActionExpert


def _full(size, fill_value, dtype=None, **_):
    """aten.full with a boolean fill, which the TorchScript tracer cannot record."""
    if isinstance(fill_value, bool):
        return torch.ones(size, dtype=dtype) if fill_value else torch.zeros(size, dtype=dtype)
    return torch.full(size, fill_value, dtype=dtype)


def _to_copy(x, dtype=None, **_):
    return x.clone() if dtype is None else x.to(dtype)


def _softmax(x, dim, half_to_float=False):
    return torch.softmax(x, dim)


def _slice_scatter(base, src, dim=0, start=None, end=None, step=1):
    """aten.slice_scatter (no ONNX symbolic) as a concatenation: base outside [start, end), src inside."""
    if step != 1:
        raise NotImplementedError("slice_scatter with a step")
    dim = dim % base.dim()
    size = base.shape[dim]
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else min(end + size if end < 0 else end, size)
    parts = ([base.narrow(dim, 0, start)] if start > 0 else []) + [src] + \
        ([base.narrow(dim, end, size - end)] if end < size else [])
    return torch.cat(parts, dim) if len(parts) > 1 else src.clone()


def _param_behind(node, gm: torch.fx.GraphModule):
    """The parameter that ``node`` is, or is a transpose (or a transpose of a transpose) of; else None."""
    permute = torch.ops.aten.permute.default
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target == permute \
            and list(node.args[1]) == [1, 0]:
        node = node.args[0]
    return getattr(gm, node.target) if isinstance(node, torch.fx.Node) and node.op == "get_attr" else None


def _square_weight_products(gm: torch.fx.GraphModule) -> None:
    """Products of the backward pass ``x @ B`` with B a square parameter or its transpose, as ``(B.T @ x.T).T``.

    The backward pass multiplies by the transposes of the weights that the forward pass multiplies by. For a
    square W the products ``x @ W`` and ``y @ W.T`` have the same shapes, and OpenVINO's CPU plugin (2026.4) then
    computes the second with the first's weight layout (a silently wrong correction). With the backward's weight
    as the left operand only the forward's product keeps W on the right; onnxruntime computes the same either
    way. The forward's products (``addmm``, and ``mm`` of an untransposed parameter) are left as they are.
    """
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != aten.mm.default:
            continue
        x, b = node.args
        if not (isinstance(b, torch.fx.Node) and b.target == aten.permute.default):
            continue
        weight = _param_behind(b, gm)
        if weight is None or weight.dim() != 2 or weight.shape[0] != weight.shape[1]:
            continue
        with gm.graph.inserting_before(node):
            b_t = gm.graph.call_function(aten.permute.default, (b, [1, 0]))
            x_t = gm.graph.call_function(aten.permute.default, (x, [1, 0]))
            product = gm.graph.call_function(aten.mm.default, (b_t, x_t))
            result = gm.graph.call_function(aten.permute.default, (product, [1, 0]))
        node.replace_all_uses_with(result)
        gm.graph.erase_node(node)


def _exportable(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite the few ATen calls of a make_fx record that the TorchScript ONNX exporter does not take, and the
    products that OpenVINO gets wrong (:func:`_square_weight_products`)."""
    aten = torch.ops.aten
    _square_weight_products(gm)
    swap = {aten.full.default: _full, aten._softmax.default: _softmax, aten.slice_scatter.default: _slice_scatter,
            aten._to_copy.default: _to_copy}
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in (aten.lift_fresh_copy.default, aten.alias.default):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            continue
        node.kwargs = {k: v for k, v in node.kwargs.items() if k not in ("layout", "pin_memory", "device")}
        node.target = swap.get(node.target, node.target)
    gm.graph.lint()
    gm.recompile()
    return gm


class ActionExpertVJPGraph(nn.Module):
    """action_expert_vjp_<d>: noisy_actions, time_embedding, prefix_len, past_kv (, state), target [1,h,a],
    weights [1,h,1], flow_time [1] -> velocity [1,h,a], correction [1,h,a]."""

    def __init__(self, expert: ActionExpert, bucket: int):
        super().__init__()
        self.expert, self.bucket = expert, bucket
        self._record: torch.fx.GraphModule | None = None

    def guided(self, x, time_embedding, prefix_len, kv_flat, state, target, weights, flow_time):
        """Velocity and correction by autograd (flat past_kv: keys and values of layer 0, then layer 1, ...)."""
        past_kv = [(kv_flat[2 * i], kv_flat[2 * i + 1]) for i in range(len(kv_flat) // 2)]
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            v = self.expert.velocity(x, time_embedding, prefix_len, past_kv, self.bucket, state)
            x1 = x - flow_time * v
            error = ((target - x1) * weights).detach()
            (correction,) = torch.autograd.grad(x1, x, error)
        return v.detach(), correction

    def forward(self, noisy_actions, time_embedding, prefix_len, past_kv, *rest):
        state, (target, weights, flow_time) = (rest[0], rest[1:]) if len(rest) == 4 else (None, rest)
        kv_flat = [t for layer in past_kv for t in layer]
        if self._record is None:
            return self.guided(noisy_actions, time_embedding, prefix_len, kv_flat, state, target, weights, flow_time)
        args = (noisy_actions, time_embedding, prefix_len, *kv_flat, *(() if state is None else (state,)),
                target, weights, flow_time)
        return self._record(*args)

    def example_inputs(self):
        """Inputs to record the graph with (the flat form of :meth:`folded`'s record, the contract's dtypes)."""
        e = self.expert
        llm = e.llm
        h, a = e.horizon, e.action_dim
        kv = [torch.zeros(llm.num_kv_heads, llm.max_seq_len, llm.head_dim, dtype=getattr(torch, llm.kv_dtype))
              for _ in range(2 * llm.num_layers)]
        state = (torch.zeros(1, e.state_dim),) if e.state_proj is not None else ()
        return (torch.zeros(1, h, a), torch.zeros(1, e.time_dim), torch.ones(1, dtype=torch.int64), *kv, *state,
                torch.zeros(1, h, a), torch.zeros(1, h, 1), torch.zeros(1))

    @contextlib.contextmanager
    def folded(self):
        """Within this context ``forward`` runs the recorded forward-and-backward graph (what is exported)."""
        from torch._decomp import core_aten_decompositions
        from torch.fx.experimental.proxy_tensor import make_fx

        layers = self.expert.llm.num_layers
        with_state = self.expert.state_proj is not None

        def flat(x, temb, plen, *rest):
            kv, rest = rest[:2 * layers], rest[2 * layers:]
            state, (target, weights, flow_time) = (rest[0], rest[1:]) if with_state else (None, rest)
            return self.guided(x, temb, plen, list(kv), state, target, weights, flow_time)

        self._record = _exportable(make_fx(flat, decomposition_table=core_aten_decompositions())(
            *self.example_inputs()))
        try:
            yield self
        finally:
            self._record = None
