"""GR00T's DiT with the Real-Time Chunking correction of the ``vjp`` guidance (``dit_vjp_<p>``).

GR00T's time τ runs from 0 (noise) to 1 (actions) and its denoised estimate is ``x1 = x + (1 - τ) v(x)``.
Given the DiT's inputs, the guidance's target (the previous chunk's leftover, padded), the prefix weights and
τ (``flow_time``), the graph returns the velocity v(x) and the vector-Jacobian product of x1 with the weighted
error ``e = (target - x1) * weights``: ``J^T e = e + (1 - τ) (dv/dx)^T e`` (the paper's Algorithm 1 in GR00T's
direction; docs/real-time-chunking.md). The guidance weight stays on the host.

As for the π0 expert (:mod:`.action_expert_vjp`), the backward pass is written out: only the gradient of the
action rows' inputs, from the forward pass's saved activations, about two forward passes a call. The
cross-attention keys and values and the state token do not depend on x; the state token's row still carries
gradient through the self-attention blocks. Every product reads the head's own parameters (no transposed
copies), so the graph set stores the DiT's weights once; the forward pass puts each linear's weight on the
left (:func:`_left`) where the backward pass has it on the right.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from .action_expert_vjp import _act_grad, _times_t
from .decoder import gelu_tanh
from .groot import LN_EPS, OUT_NORM_EPS, GrootHead


def _layer_norm(x: torch.Tensor, eps: float):
    """LayerNorm without affine: (value, what :func:`_layer_norm_back` needs). The value is one
    LayerNormalization; what the backward pass reads is computed apart, its variance as a sum times 1/n:
    rknn-toolkit2 (2.5) fuses the chain ``(x - mean) * rsqrt(mean((x - mean)^2) + eps)`` into one LayerNorm and
    then never finishes when other nodes read its intermediate values."""
    xc = x - x.mean(-1, keepdim=True)
    r = torch.rsqrt((xc * xc).sum(-1, keepdim=True) * (1.0 / x.shape[-1]) + eps)
    return F.layer_norm(x, x.shape[-1:], eps=eps), (xc * r, r)


def _layer_norm_back(d: torch.Tensor, saved) -> torch.Tensor:
    """The input gradient of a LayerNorm without affine, given ``d`` of its output."""
    xhat, r = saved
    return r * (d - d.mean(-1, keepdim=True) - xhat * (d * xhat).mean(-1, keepdim=True))


def _left(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``linear(x)`` for 2-D x computed as ``(W @ xᵀ)ᵀ + b``, the weight on the left. The backward pass multiplies
    by the same weight as ``d @ W``; OpenVINO's CPU plugin (2026.4), given one square constant in both products
    with the weight on the same side, computed one with the other's layout (see
    :func:`.action_expert_vjp._times_t`)."""
    return torch.matmul(linear.weight, x.t()).t() + linear.bias


class _Block:
    """One DiT block's forward pass with its saved activations, and its backward pass."""

    def __init__(self, block: nn.Module, temb: torch.Tensor):
        self.block = block
        scale, shift = block.norm1.linear(F.silu(temb)).chunk(2, dim=-1)
        self.gain1, self.shift1 = 1.0 + scale, shift

    def forward(self, x: torch.Tensor, kv: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
        attn, b = self.block.attn1, self.block
        n1, self.ln1 = _layer_norm(x, LN_EPS)
        h = n1 * self.gain1 + self.shift1
        q = attn.split(_left(h, attn.to_q))
        self.cross = kv is not None
        if self.cross:
            self.k, self.v = kv[0], kv[1]
        else:
            self.k, self.v = attn.split(_left(h, attn.to_k)), attn.split(_left(h, attn.to_v))
        self.q = q
        scores = torch.matmul(q, self.k.transpose(-1, -2)) * (1.0 / math.sqrt(attn.head_dim))
        if bias is not None:
            scores = scores + bias
        self.p = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(self.p, self.v)
        x = x + _left(ctx.transpose(0, 1).reshape(x.shape[0], -1), attn.to_out[0])
        n3, self.ln3 = _layer_norm(x, LN_EPS)
        self.f1 = _left(n3, b.ff.net[0].proj)
        return x + _left(gelu_tanh(self.f1), b.ff.net[2])

    def backward(self, d: torch.Tensor) -> torch.Tensor:
        attn, b = self.block.attn1, self.block
        # MLP residual
        dg = torch.matmul(d, b.ff.net[2].weight) * _act_grad(self.f1, "gelu_tanh")
        d = d + _layer_norm_back(torch.matmul(dg, b.ff.net[0].proj.weight), self.ln3)
        # attention residual
        rows = d.shape[0]

        def merge(t: torch.Tensor) -> torch.Tensor:  # [heads, T, head_dim] -> [T, heads * head_dim]
            return t.transpose(0, 1).reshape(rows, -1)
        dctx = attn.split(torch.matmul(d, attn.to_out[0].weight))  # [heads, T, head_dim]
        dp = torch.matmul(dctx, self.v.transpose(-1, -2))
        ds = self.p * (dp - (dp * self.p).sum(-1, keepdim=True)) * (1.0 / math.sqrt(attn.head_dim))
        dh = torch.matmul(merge(torch.matmul(ds, self.k)), attn.to_q.weight)
        if not self.cross:  # the keys and values are the block's own rows too
            dh = dh + torch.matmul(merge(torch.matmul(ds.transpose(-1, -2), self.q)), attn.to_k.weight)
            dh = dh + torch.matmul(merge(torch.matmul(self.p.transpose(-1, -2), dctx)), attn.to_v.weight)
        return d + _layer_norm_back(dh * self.gain1, self.ln1)


class DiTVJPGraph(nn.Module):
    """dit_vjp_<p>: the velocity of :meth:`GrootHead.velocity` and ``J^T e`` (module docstring)."""

    def __init__(self, head: GrootHead, bucket: int):
        super().__init__()
        self.head, self.bucket = head, bucket

    def forward(self, noisy_actions, timestep, state_features, cross_kv, cross_bias, target, weights, flow_time):
        head = self.head
        dit, enc, dec = head.model, head.action_encoder, head.action_decoder
        temb = dit.timestep_encoder(timestep)
        horizon = noisy_actions.shape[1]
        # the action encoder, its activations kept
        a1 = enc.W1(noisy_actions)
        f = timestep.reshape(1, 1) * enc.freqs[None, :]
        t = torch.cat((torch.sin(f), torch.cos(f)), dim=-1)[:, None, :].expand(a1.shape[0], a1.shape[1], -1)
        z2 = enc.W2(torch.cat((a1, t), dim=-1))
        a = enc.W3(F.silu(z2)) + head.position_embedding.weight[None, :horizon]
        x = torch.cat((state_features, a), dim=1)[0]
        blocks = []
        for i, block in enumerate(dit.transformer_blocks):
            blocks.append(_Block(block, temb))
            if i % 2:
                x = blocks[-1].forward(x, None, None)
            else:
                x = blocks[-1].forward(x, cross_kv[i // 2], cross_bias[0 if head.text_block(i) else 1])
        shift, scale = dit.proj_out_1(F.silu(temb)).chunk(2, dim=-1)
        n, ln_out = _layer_norm(x, OUT_NORM_EPS)
        y = _left(n * (1 + scale) + shift, dit.proj_out_2)[-horizon:]
        r1 = dec.layer1(y)
        velocity = dec.layer2(torch.relu(r1))[None]
        # e = (target - x1) * weights with x1 = x + (1 - τ) v
        remaining = 1.0 - flow_time.reshape(1, 1, 1)
        e = (target - (noisy_actions + remaining * velocity)) * weights
        # (dv/dx)^T e, backwards through the decoder, the DiT and the action encoder
        d = _times_t(e[0], dec.layer2.W) * (r1 > 0).to(e.dtype)
        d = _times_t(d, dec.layer1.W)
        d = torch.cat((torch.zeros_like(d[:1].expand(x.shape[0] - horizon, -1)), d), dim=0)
        d = _layer_norm_back(torch.matmul(d, dit.proj_out_2.weight) * (1 + scale), ln_out)
        for block in reversed(blocks):
            d = block.backward(d)
        d = _times_t(d[-horizon:], enc.W3.W) * _act_grad(z2[0], "silu")
        d = _times_t(_times_t(d, enc.W2.W)[:, :a1.shape[-1]], enc.W1.W)
        return velocity, e + remaining * d[None]
