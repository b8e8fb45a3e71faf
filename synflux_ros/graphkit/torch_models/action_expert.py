"""Flow-matching action expert (pi0 style), random weights.

The expert is a transformer of its own width (``action.expert_hidden_dim``, 0 = LLM width) with the
backbone's number of layers, attention heads, KV heads and head dim, so that its layer ``l`` can attend
to the prefix keys/values that backbone layer ``l`` left in the KV cache:

* input: ``action_in_proj(noisy_actions)`` concatenated with the sinusoidal embedding of the flow time (an
  input, computed on the host: ``synflux_ros.model.time_embedding``), mixed by a two-layer MLP with SiLU
  (pi0's ``action_time_mlp_in`` / ``action_time_mlp_out``);
* layer ``l``: queries, keys and values of the action tokens from the expert's own projections (RoPE at
  positions ``prefix_len + i``, looked up in a build-time table of positions 0 .. max_seq_len + h - 1 as
  in the decoder, see ``decoder.rope_table``); keys = [cache positions j < prefix_len of layer l | action
  tokens]; action tokens see each other bidirectionally;
* output: final norm and ``action_out_proj`` to the action dimension -> velocity [1, h, a].

With a state token (``action.state_dim`` and ``state_input: token``) the robot state is pi0's state token:
``state_proj(state)`` goes before the action tokens (positions ``prefix_len + 0`` for the state,
``prefix_len + 1 + i`` for the actions); the state token attends to the prefix and itself, the action tokens
to the prefix, the state token and each other, and the velocity is read from the action tokens.

With ``action.expert_attention: cross_attn`` (SmolVLA) the layers l with ``action.cross_attention_layer(l)``
attend to the prefix alone: their k/v projections (KV * Dh wide) re-project the keys (after RoPE) and values of
backbone layer l, and their queries take RoPE at positions ``i``. The re-projection is the same in every
denoising step, so the prefill graphs make it once (:meth:`ActionExpert.project_prefix`): for those layers the
cache holds the expert's keys and values, which the expert reads as they are. ``action.action_attention: causal``
lets action token i see tokens <= i only.

With ``action.time_conditioning: adarms`` (pi0.5) the action tokens are ``action_in_proj(noisy_actions)``
alone, and the time embedding passes a two-layer MLP with SiLU after each layer (``time_mlp_in`` /
``time_mlp_out``) whose output conditions every norm of the expert (:class:`~.decoder.AdaRMSNorm`: scale,
shift and the gate of the residual it feeds, final norm included).

The blocks follow the backbone architecture (norm style, MLP activation, q/k norms).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ...core.config import ModelConfig
from ...core.contract import time_embedding_dim
from .decoder import (
    GEMMA_FAMILY, AdaRMSNorm, Attention, DecoderLayer, RMSNorm, _param, apply_rope, attend, attention_bias, layer_kv,
    rope_inv_freq, rope_lookup, rope_table)


class CrossAttention(Attention):
    """SmolVLA's cross-attention: queries from the action tokens, keys and values re-projected from a backbone
    layer's cached keys and values ([KV, S, Dh] each, flattened per position head-major to KV * Dh)."""

    def __init__(self, width: int, num_heads: int, num_kv_heads: int, head_dim: int):
        # no q/k norms and no biases: cross_attn is for llama and gemma backbones (core.config)
        super().__init__(width, num_heads, num_kv_heads, head_dim, False, 0.0, False)
        kv = num_kv_heads * head_dim
        self.k_proj = nn.Linear(kv, kv, bias=False)
        self.v_proj = nn.Linear(kv, kv, bias=False)

    def fuse(self, join: bool = True) -> None:
        """q and o as [in, out] matrices; k and v per pair of heads, [KV_out, KV_in, Dh, Dh], so that the cache is
        re-projected head by head as it lies ([KV, S, Dh]), with no transpose of it."""
        kv, dh = self.num_kv_heads, self.head_dim

        def per_heads(w):
            return _param(w.t().reshape(kv, dh, kv, dh).permute(2, 0, 1, 3))

        self.q_t, self.o_t = _param(self.q_proj.weight.t()), _param(self.o_proj.weight.t())
        self.k_t, self.v_t = per_heads(self.k_proj.weight), per_heads(self.v_proj.weight)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, W] -> q [nh, T, Dh] after RoPE."""
        q = (torch.matmul(x, self.q_t) if self.q_t is not None else self.q_proj(x))
        return apply_rope(q.reshape(x.shape[0], self.num_heads, self.head_dim).transpose(0, 1), cos, sin)

    def keys_values(self, past_k: torch.Tensor, past_v: torch.Tensor):
        """Cached keys/values [KV, S, Dh] -> this layer's keys/values [KV, S, Dh] (no RoPE)."""
        kv, span, dh = past_k.shape

        def proj(t, w, linear):
            if w is not None:  # sum over the input heads of [S, Dh] @ [Dh, Dh] products
                return torch.matmul(t.unsqueeze(0), w).sum(1)
            return linear(t.transpose(0, 1).reshape(span, kv * dh)).reshape(span, kv, dh).transpose(0, 1)

        return proj(past_k, self.k_t, self.k_proj), proj(past_v, self.v_t, self.v_proj)


class ActionExpert(nn.Module):
    """The expert's weights; one instance is shared by every ``ActionExpertGraph`` bucket."""

    def __init__(self, cfg: ModelConfig, rope: dict | None = None):
        super().__init__()
        llm, act = cfg.llm, cfg.action
        width = act.expert_hidden_dim or llm.hidden_dim
        inter = act.expert_intermediate_size or 4 * width
        self.llm = llm
        self.rope = dict(rope or {})
        self.horizon, self.action_dim, self.width = act.action_horizon, act.action_dim, width
        self.time_dim = time_embedding_dim(cfg)
        self.adaptive = act.time_conditioning == "adarms"
        self.action_in_proj = nn.Linear(act.action_dim, width)
        if self.adaptive:  # pi0.5: the time conditions the norms
            self.time_mlp_in = nn.Linear(self.time_dim, width)
            self.time_mlp_out = nn.Linear(width, width)
        else:  # pi0: the time joins each action token
            self.action_time_mlp_in = nn.Linear(width + self.time_dim, width)
            self.action_time_mlp_out = nn.Linear(width, width)
        cond = width if self.adaptive else 0
        self.layers = nn.ModuleList(
            DecoderLayer(width, inter, llm.num_heads, llm.num_kv_heads, llm.head_dim, llm.architecture,
                         llm.rms_norm_eps, cond_dim=cond) for _ in range(llm.num_layers))
        self.cross = [act.cross_attention_layer(i) for i in range(llm.num_layers)]
        for i, layer in enumerate(self.layers):
            layer.join_past = True  # a prefix of a few hundred keys, joined with the chunk's own each step
            if self.cross[i]:
                layer.self_attn = CrossAttention(width, llm.num_heads, llm.num_kv_heads, llm.head_dim)
        self.causal = act.action_attention == "causal"
        self.norm = AdaRMSNorm(width, llm.rms_norm_eps, cond) if self.adaptive else \
            RMSNorm(width, llm.rms_norm_eps, llm.architecture in GEMMA_FAMILY)
        self.action_out_proj = nn.Linear(width, act.action_dim)
        self.state_dim = act.state_token_dim
        self.state_proj = nn.Linear(self.state_dim, width) if self.state_dim else None
        self.register_buffer("inv_freq", torch.empty(llm.head_dim // 2), persistent=False)
        # Rotary cos/sin [max_seq_len + h, Dh] of every position an action token can take (prefix_len <=
        # max_seq_len, plus row i < h), see decoder.rope_table: parameters, so each is one initializer that
        # every action_expert graph shares; set by fill_buffers.
        self.rope_rows = llm.max_seq_len + act.action_horizon + (1 if self.state_dim else 0)
        self.rope_cos: nn.Parameter | None = None
        self.rope_sin: nn.Parameter | None = None

    def fill_buffers(self) -> None:
        self.inv_freq = rope_inv_freq(self.llm.head_dim, self.llm.rope_theta, self.rope)
        self.rope_cos, self.rope_sin = (_param(t) for t in rope_table(self.rope_rows, self.inv_freq))

    def tokens(self, noisy_actions, time_embedding, prefix_len, span: int, state=None, embed=None):
        """The expert's input rows and what every layer shares: x [n, W] (the state token first, if any, then
        the h action tokens), n, rotary cos/sin [n, Dh] and the attention bias [n, span + n]. ``embed``
        replaces :meth:`action_embed` (the vjp graph's, which keeps what its backward pass needs)."""
        h = self.horizon
        x = (embed or self.action_embed)(noisy_actions[0], time_embedding)  # [h, W]
        n = h
        if self.causal:
            rows = torch.arange(h, dtype=torch.int64)
            own = rows[None, :] <= rows[:, None]
        else:
            own = torch.ones(h, h, dtype=torch.bool)  # the action tokens see each other
        if self.state_proj is not None:
            x = torch.cat((self.state_proj(state), x), dim=0)  # [1 + h, W]: the state token first
            n = h + 1
            rows = torch.arange(n, dtype=torch.int64)
            own = (rows[None, :] == 0) | (rows[:, None] > 0)  # the state token sees only itself among them
        rows = torch.arange(n, dtype=torch.int64)
        cos, sin = rope_lookup(self.rope_cos, self.rope_sin, prefix_len + rows)
        prefix_ok = (torch.arange(span, dtype=torch.int64)[None, :] < prefix_len).expand(n, span)
        bias = attention_bias(torch.cat((prefix_ok, own), dim=1))
        return x, n, cos, sin, bias

    def action_mlp_in(self, actions, time_embedding):
        """actions [h, a] -> the pre-activation of pi0's action-time MLP [h, W]."""
        t_emb = time_embedding.expand(actions.shape[0], self.time_dim)
        return self.action_time_mlp_in(torch.cat((self.action_in_proj(actions), t_emb), dim=-1))

    def action_embed(self, actions, time_embedding):
        """actions [h, a] -> the action tokens [h, W] (pi0's action-time MLP; pi0.5's projection alone)."""
        if self.adaptive:
            return self.action_in_proj(actions)
        return self.action_time_mlp_out(F.silu(self.action_mlp_in(actions, time_embedding)))

    def time_condition(self, time_embedding):
        """time_embedding [1, E] -> pi0.5's conditioning of the norms [W] (None for pi0)."""
        if not self.adaptive:
            return None
        return F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(time_embedding[0]))))

    def cross_inputs(self, prefix_len, span: int):
        """What the cross-attention layers share: rotary cos/sin [h, Dh] of positions 0 .. h-1 and the bias
        [h, span] of the prefix positions < prefix_len (None without such layers)."""
        if not any(self.cross):
            return None
        cos, sin = self.rope_cos[:self.horizon], self.rope_sin[:self.horizon]
        ok = (torch.arange(span, dtype=torch.int64)[None, :] < prefix_len).expand(self.horizon, span)
        return cos, sin, attention_bias(ok)

    def cross_layer(self, layer: DecoderLayer, x, past_k, past_v, cross):
        """A cross-attention layer (pre-norm, residuals) on the action tokens x [h, W]; past_k/v: the layer's
        projections of the prefix (:meth:`project_prefix`)."""
        cos, sin, bias = cross
        attn = layer.self_attn
        q = attn.query(layer.input_layernorm(x), cos, sin)
        x = x + attn.output(attend(q, past_k, past_v, bias, attn.scale))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def project_prefix(self, new_kv: torch.Tensor) -> torch.Tensor:
        """new_kv [L, 2, KV, T, Dh] of a prefill -> the same with each cross-attention layer's keys and values
        re-projected by that layer's k/v projections (computed in float32, stored in new_kv's dtype)."""
        if not any(self.cross):
            return new_kv
        layers = []
        for i, cross in enumerate(self.cross):
            if cross:
                k, v = self.layers[i].self_attn.keys_values(new_kv[i, 0].to(torch.float32),
                                                            new_kv[i, 1].to(torch.float32))
                layers.append(torch.stack((k, v)).to(new_kv.dtype))
            else:
                layers.append(new_kv[i])
        return torch.stack(layers)

    def velocity(self, noisy_actions, time_embedding, prefix_len, past_kv, span: int, state=None):
        x, n, cos, sin, bias = self.tokens(noisy_actions, time_embedding, prefix_len, span, state)
        cond = self.time_condition(time_embedding)
        cross = self.cross_inputs(prefix_len, span)
        for i, layer in enumerate(self.layers):
            if self.cross[i]:
                x = self.cross_layer(layer, x, *layer_kv(past_kv, i, span), cross)
                continue
            x, _, _ = layer(x, cos, sin, *layer_kv(past_kv, i, span), bias, cond=cond)
        out = x[n - self.horizon:]
        out = self.norm(out, cond)[0] if self.adaptive else self.norm(out)
        return self.action_out_proj(out).unsqueeze(0)


class ActionExpertGraph(nn.Module):
    """action_expert_<d>: noisy_actions [1,h,a], time_embedding [1,E], prefix_len [1], past_kv (, state [1,s])
    -> velocity [1,h,a]."""

    def __init__(self, expert: ActionExpert, bucket: int):
        super().__init__()
        self.expert, self.bucket = expert, bucket

    def forward(self, noisy_actions, time_embedding, prefix_len, past_kv, state=None):
        return (self.expert.velocity(noisy_actions, time_embedding, prefix_len, past_kv, self.bucket, state),)
