"""The action expert with the Real-Time Chunking correction of the ``vjp`` guidance (``action_expert_vjp_<d>``).

Given the expert's inputs and the guidance's target (the previous chunk's leftover, padded), prefix weights and
flow time t, the graph returns the velocity v(x) and the vector-Jacobian product of the denoised estimate
``x1 = x - t * v(x)`` with the weighted error ``e = (target - x1) * weights``: ``J^T e = e - t * (dv/dx)^T e``
(the paper's Algorithm 1; docs/real-time-chunking.md). The guidance weight stays on the host.

The backward pass is written out here rather than recorded from autograd: it computes only the gradient of the
action rows' inputs (no weight gradients, no gradient of the prefix keys and values, which do not depend on x),
from the forward pass's saved activations, so one call costs about two forward passes. The forward pass is the
expert's own code path, and every product reads the expert's parameters as they are (no transposed copies), so
the graph set stores the weights once. Products of the backward pass put the weight on the left, ``(W @ dᵀ)ᵀ``,
where the forward pass has it on the right (see :func:`_times_t`).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .action_expert import ActionExpert
from .decoder import _SQRT_2_OVER_PI, apply_rope, gelu_tanh, layer_kv


def _times_t(d: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``d @ wᵀ`` for a weight ``w`` that the forward pass multiplies by as ``x @ w``, computed as ``(w @ dᵀ)ᵀ``.

    With the weight as the left operand no transposed copy of it is made (the exporter would fold a
    ``Transpose`` of a parameter into a second initializer), and OpenVINO's CPU plugin (2026.4), which computes
    ``y @ Wᵀ`` with the layout of ``x @ W`` when one square constant feeds both, sees two different products.
    """
    return torch.matmul(w, d.t()).t()


def _linear_back(d: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """The input gradient of ``F.linear(x, W, b)``: ``d @ W``. Where W is square (``action_time_mlp_out``) the
    forward pass of this graph computes ``(W @ xᵀ)ᵀ``, the weight on the left, for OpenVINO (:func:`_times_t`)."""
    return torch.matmul(d, linear.weight)


def _rms(x, norm):
    """RMSNorm forward (:class:`decoder.RMSNorm`'s value) and what its backward pass needs. Written ``x * (r * g)``
    and the backward's ``x * r`` made anew: rknn-toolkit2 fuses the chain ``(x * r) * g`` into one op and drops
    ``x * r`` even when another node reads it."""
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    gain = norm.weight + 1.0 if norm.unit_offset else norm.weight
    return x * (r * gain), (x, r, gain)


def _ada_rms(x, norm, cond):
    """AdaRMSNorm forward (:class:`decoder.AdaRMSNorm`'s value), what :func:`_rms_back` needs (its gain is
    ``1 + scale``; the shift and gate do not depend on x) and the gate of the residual it feeds."""
    scale, shift, gate = norm.modulation(cond)
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    gain = 1.0 + scale
    return x * (r * gain) + shift, (x, r, gain), gate


def _norm(x, norm, cond):
    """A layer's norm, plain or adaptive: (value, saved for the backward pass, residual gate or None)."""
    if cond is None:
        return (*_rms(x, norm), None)
    return _ada_rms(x, norm, cond)


def _rms_back(d, saved):
    x, r, gain = saved
    xhat = x * r
    dxhat = d * gain
    return r * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))


def _rope_back(d, cos, sin):
    """The transpose of :func:`decoder.apply_rope` (a rotation by -angle)."""
    half = d.shape[-1] // 2
    ds = d * sin
    return d * cos + torch.cat((ds[..., half:], -ds[..., :half]), dim=-1)


def _act(g, kind: str):
    return gelu_tanh(g) if kind == "gelu_tanh" else F.silu(g)


def _act_grad(g, kind: str):
    if kind == "gelu_tanh":
        # Spelled so that no subexpression equals one of gelu_tanh's export form (``0.5 * x``, its tanh): the
        # exporter would share it, and onnxruntime's FastGelu fusion removes the nodes it fuses even when
        # another node reads them (an invalid graph).
        th = torch.tanh(_SQRT_2_OVER_PI * g * (1.0 + 0.044715 * g * g))
        return 0.5 * (1.0 + th) + g * (1.0 - th * th) * (0.5 * _SQRT_2_OVER_PI) * (1.0 + 3 * 0.044715 * g * g)
    s = torch.sigmoid(g)
    return s * (1.0 + g * (1.0 - s))


def _matrices(module, joined: str, parts: tuple[str, ...], linears: tuple[str, ...]):
    """The [in, out] matrices a block multiplies by: the joined one, the separate ones, or the Linear weights'
    transposes (a module that was not fused)."""
    if getattr(module, joined) is not None:
        return [getattr(module, joined)]
    if getattr(module, parts[0]) is not None:
        return [getattr(module, p) for p in parts]
    return [getattr(module, name).weight.t() for name in linears]


def _project(x, mats):
    outs = [torch.matmul(x, m) for m in mats]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _project_back(d, mats):
    if len(mats) == 1:
        return _times_t(d, mats[0])
    out, at = None, 0
    for m in mats:
        part = _times_t(d[:, at:at + m.shape[1]], m)
        out, at = (part if out is None else out + part), at + m.shape[1]
    return out


class _Layer:
    """One expert layer's forward pass with its saved activations, and its input gradient."""

    def __init__(self, layer, x, cos, sin, past_k, past_v, bias, cond=None):
        att, mlp = layer.self_attn, layer.mlp
        self.cos, self.sin = cos, sin
        n, nh, kvh, dh = x.shape[0], att.num_heads, att.num_kv_heads, att.head_dim
        self.shape = (n, nh, kvh, dh)
        self.gate_up = _matrices(mlp, "gate_up_t", ("gate_t", "up_t"), ("gate_proj", "up_proj"))
        self.o = att.o_t if att.o_t is not None else att.o_proj.weight.t()
        self.down = mlp.down_t if mlp.down_t is not None else mlp.down_proj.weight.t()
        h1, self.n1, self.gate1 = _norm(x, layer.input_layernorm, cond)
        qg, keys, values = self._queries_keys_values(att, h1, past_k, past_v)
        self.keys, self.values = keys.unsqueeze(1), values.unsqueeze(1)  # [KV, 1, S, Dh]
        self.qg = qg
        self.scale = att.scale
        # the scale on q: rknn-toolkit2 fuses (q @ kᵀ) * scale + bias -> softmax -> @ v and drops the probabilities
        self.probs = torch.softmax(torch.matmul(self.qg * att.scale, self.keys.transpose(-1, -2)) + bias, dim=-1)
        self.ctx = torch.matmul(self.probs, self.values)  # [KV, G, n, Dh]
        attn = torch.matmul(self.ctx.reshape(nh, n, dh).transpose(0, 1).reshape(n, nh * dh), self.o)
        x = x + (attn if self.gate1 is None else attn * self.gate1)  # pi0.5: gated residuals
        h2, self.n2, self.gate2 = _norm(x, layer.post_attention_layernorm, cond)
        gu = _project(h2, self.gate_up)
        inter = gu.shape[-1] // 2
        self.g, self.u = gu[:, :inter], gu[:, inter:]
        self.act = mlp.act
        self.a = _act(self.g, mlp.act)
        out = torch.matmul(self.a * self.u, self.down)
        self.out = x + (out if self.gate2 is None else out * self.gate2)

    def _queries_keys_values(self, att, h1, past_k, past_v):
        """The grouped queries [KV, G, n, Dh] and the keys and values [KV, S + n, Dh]: the prefix's, then the
        layer's own."""
        n, nh, kvh, dh = self.shape
        self.qkv = _matrices(att, "qkv_t", ("q_t", "k_t", "v_t"), ("q_proj", "k_proj", "v_proj"))
        qkv = _project(h1, self.qkv)
        if att.qkv_b is not None or att.q_proj.bias is not None:  # Qwen2's biases: no part of the input gradient
            qkv = qkv + (att.qkv_b if att.qkv_b is not None else
                         torch.cat((att.q_proj.bias, att.k_proj.bias, att.v_proj.bias)))
        q = qkv[:, :nh * dh].reshape(n, nh, dh)
        k = qkv[:, nh * dh:(nh + kvh) * dh].reshape(n, kvh, dh)
        v = qkv[:, (nh + kvh) * dh:].reshape(n, kvh, dh).transpose(0, 1)
        self.qn = self.kn = None
        if att.q_norm is not None:  # per head, on [rows * heads, Dh]: QNN's HTP computes this chain wrong in 3-D
            q, self.qn = _rms(q.reshape(n * nh, dh), att.q_norm)
            k, self.kn = _rms(k.reshape(n * kvh, dh), att.k_norm)
            q, k = q.reshape(n, nh, dh), k.reshape(n, kvh, dh)
        q = apply_rope(q.transpose(0, 1), self.cos, self.sin)
        k = apply_rope(k.transpose(0, 1), self.cos, self.sin)
        self.span = past_k.shape[1]
        return q.reshape(kvh, nh // kvh, n, dh), torch.cat((past_k, k), dim=1), torch.cat((past_v, v), dim=1)

    def _attention_back(self, dctx, dscores):
        """The gradient of the normed input h1 [n, W] from those of the context and the scores."""
        n, nh, kvh, dh = self.shape
        dq = torch.matmul(dscores, self.keys).reshape(nh, n, dh)
        own = dscores[..., self.span:]  # the layer's own keys; the prefix's do not depend on x
        dk = torch.matmul(own.transpose(-1, -2), self.qg).sum(1)  # [KV, n, Dh]
        dv = torch.matmul(self.probs[..., self.span:].transpose(-1, -2), dctx).sum(1)
        dq = _rope_back(dq, self.cos, self.sin).transpose(0, 1)  # [n, nh, Dh]
        dk = _rope_back(dk, self.cos, self.sin).transpose(0, 1)
        if self.qn is not None:
            dq = _rms_back(dq.reshape(n * nh, dh), self.qn).reshape(n, nh, dh)
            dk = _rms_back(dk.reshape(n * kvh, dh), self.kn).reshape(n, kvh, dh)
        dqkv = torch.cat((dq.reshape(n, nh * dh), dk.reshape(n, kvh * dh), dv.transpose(0, 1).reshape(n, kvh * dh)),
                         dim=-1)
        return _project_back(dqkv, self.qkv)

    def backward(self, d):
        """d: the gradient of the layer's output [n, W] -> the gradient of its input."""
        n, nh, kvh, dh = self.shape
        dh_mlp = _times_t(d if self.gate2 is None else d * self.gate2, self.down)
        dg = dh_mlp * self.u * _act_grad(self.g, self.act)
        du = dh_mlp * self.a
        d = d + _rms_back(_project_back(torch.cat((dg, du), dim=-1), self.gate_up), self.n2)
        dctx = _times_t(d if self.gate1 is None else d * self.gate1, self.o)
        dctx = dctx.reshape(n, nh, dh).transpose(0, 1).reshape(kvh, nh // kvh, n, dh)
        dprobs = torch.matmul(dctx, self.values.transpose(-1, -2))
        dscores = self.probs * (dprobs - (dctx * self.ctx).sum(-1, keepdim=True)) * self.scale
        return d + _rms_back(self._attention_back(dctx, dscores), self.n1)


class _CrossLayer(_Layer):
    """A cross-attention layer (SmolVLA): the keys and values are the cached projections of the prefix, no
    function of x; only the queries carry the gradient."""

    def _queries_keys_values(self, att, h1, past_k, past_v):
        n, nh, kvh, dh = self.shape
        self.q = att.q_t if att.q_t is not None else att.q_proj.weight.t()
        q = att.query(h1, self.cos, self.sin)
        return q.reshape(kvh, nh // kvh, n, dh), past_k, past_v  # the prefill's projections (project_prefix)

    def _attention_back(self, dctx, dscores):
        n, nh, kvh, dh = self.shape
        dq = _rope_back(torch.matmul(dscores, self.keys).reshape(nh, n, dh), self.cos, self.sin)
        return _times_t(dq.transpose(0, 1).reshape(n, nh * dh), self.q)


class ActionExpertVJPGraph(nn.Module):
    """action_expert_vjp_<d>: noisy_actions, time_embedding, prefix_len, past_kv (, state), target [1,h,a],
    weights [1,h,1], flow_time [1] -> velocity [1,h,a], correction [1,h,a]."""

    def __init__(self, expert: ActionExpert, bucket: int):
        super().__init__()
        self.expert, self.bucket = expert, bucket

    def forward(self, noisy_actions, time_embedding, prefix_len, past_kv, *rest):
        state, (target, weights, flow_time) = (rest[0], rest[1:]) if len(rest) == 4 else (None, rest)
        return self.guided(noisy_actions, time_embedding, prefix_len, past_kv, self.bucket, state, target, weights,
                           flow_time)

    def guided(self, noisy_actions, time_embedding, prefix_len, past_kv, span, state, target, weights, flow_time):
        """Velocity and correction over the first ``span`` cache positions (an int, or a traced size: the
        shape-polymorphic graph of :mod:`synflux_ros.backends.tensorrt.build_models`)."""
        e = self.expert
        h = e.horizon
        saved: list = []

        def embed(actions, temb):
            """The expert's action embedding; its output product with the weight on the left (``_linear_back``)."""
            if e.adaptive:  # pi0.5: the actions' projection alone
                return e.action_in_proj(actions)
            saved.append(e.action_mlp_in(actions, temb))
            out = e.action_time_mlp_out
            return torch.matmul(out.weight, F.silu(saved[0]).t()).t() + out.bias

        x, n, cos, sin, bias = e.tokens(noisy_actions, time_embedding, prefix_len, span, state, embed)
        cond = e.time_condition(time_embedding)  # pi0.5's conditioning of the norms (no function of x)
        cross = e.cross_inputs(prefix_len, span)  # SmolVLA's cross-attention layers: positions 0 .. h-1
        layers = []
        for i, layer in enumerate(e.layers):
            if e.cross[i]:
                layers.append(_CrossLayer(layer, x, cross[0], cross[1], *layer_kv(past_kv, i, span), cross[2]))
            else:
                layers.append(_Layer(layer, x, cos, sin, *layer_kv(past_kv, i, span), bias, cond))
            x = layers[-1].out
        final, norm_saved, _ = _norm(x[n - h:], e.norm, cond)
        velocity = e.action_out_proj(final).unsqueeze(0)
        error = (target - (noisy_actions - flow_time * velocity)) * weights
        # the gradient of the velocity's inner product with the error, down to the action rows' inputs
        d = _rms_back(_linear_back(error[0], e.action_out_proj), norm_saved)
        if n > h:  # the state token does not depend on x; its own gradient never reaches the action rows
            d = torch.cat((torch.zeros(n - h, d.shape[1], dtype=d.dtype), d), dim=0)
        for layer in reversed(layers):
            d = layer.backward(d)
        if e.adaptive:
            return velocity, error - flow_time * _linear_back(d[n - h:], e.action_in_proj).unsqueeze(0)
        (z,) = saved
        d = _linear_back(d[n - h:], e.action_time_mlp_out) * _act_grad(z, "silu")
        d = _linear_back(d, e.action_time_mlp_in)[:, :e.width]
        vjp = _linear_back(d, e.action_in_proj).unsqueeze(0)
        return velocity, error - flow_time * vjp
