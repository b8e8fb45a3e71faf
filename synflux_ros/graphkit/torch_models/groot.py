"""GR00T N1.7's action head (``action.expert_type: dit``) and the graphs built of it: ``features_<p>`` (the cut
Qwen3-VL language model's last hidden states), ``vl_context_<p>`` (once per frame) and ``dit_<p>`` (each
denoising step); see :func:`synflux_ros.core.contract.groot_graphs`.

The parameter names are those of a GR00T checkpoint's ``action_head.*`` (LeRobot prefixes them with
``_groot_model.``), so weights load by name. The per-embodiment linears hold one embodiment's slice
(``action.embodiment``), chosen when the weights are read: the graphs carry no other embodiment's weights.

Arithmetic, as the checkpoint's model computes it in float32:

* the backbone features pass ``vlln`` (LayerNorm) and ``vl_layers`` transformer blocks (LayerNorm, self-attention
  with biases, LayerNorm, tanh-GELU MLP, residuals), padded rows masked out as keys;
* the state is encoded by a two-layer ReLU MLP into one token of the DiT's width;
* at time bucket b the actions are encoded as ``W3(swish(W2([W1(a), sin/cos(b)])))`` plus a learned position
  embedding; [state token, action tokens] pass the DiT's blocks: even blocks cross-attend to the VL features
  (block 2k to the text rows when k is a multiple of ``dit_text_every_n_blocks``, else to the image rows), odd
  blocks self-attend; every block's first norm is an adaptive LayerNorm (scale, shift from the time embedding);
  the output norm is modulated (shift, scale) and projected, and the decoder MLP gives the velocity of the last
  ``action_horizon`` tokens.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from ...core.config import ModelConfig
from ...core.contract import MASKED_SCORE
from .decoder import CausalLM, attention_bias, gelu_tanh

LN_EPS = 1e-5  # the blocks' LayerNorms
OUT_NORM_EPS = 1e-6  # the DiT's output norm
TIME_CHANNELS = 256  # the DiT's sinusoidal timestep projection


def masked_bias(allowed: torch.Tensor) -> torch.Tensor:
    """The additive mask a graph outputs: 0 where allowed, :data:`MASKED_SCORE` (finite) elsewhere."""
    return torch.where(allowed, torch.tensor(0.0), torch.tensor(MASKED_SCORE))


class CategoryLinear(nn.Module):
    """One embodiment's slice of a per-embodiment linear: ``x @ W + b`` (W [in, out], as the checkpoint stores
    it per embodiment)."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.W = nn.Parameter(torch.empty(dim_in, dim_out))
        self.b = nn.Parameter(torch.empty(dim_out))

    def init_extra(self, generator: torch.Generator, std: float) -> None:
        self.W.normal_(0.0, std, generator=generator)
        self.b.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.W) + self.b


class CategoryMLP(nn.Module):
    def __init__(self, dim_in: int, hidden: int, dim_out: int):
        super().__init__()
        self.layer1 = CategoryLinear(dim_in, hidden)
        self.layer2 = CategoryLinear(hidden, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(torch.relu(self.layer1(x)))


class ActionEncoder(nn.Module):
    """``W3(swish(W2([W1(actions), sinusoid(bucket)])))`` (GR00T's multi-embodiment action encoder)."""

    def __init__(self, action_dim: int, width: int):
        super().__init__()
        self.W1 = CategoryLinear(action_dim, width)
        self.W2 = CategoryLinear(2 * width, width)
        self.W3 = CategoryLinear(width, width)
        half = width // 2
        self.register_buffer("freqs", torch.empty(half), persistent=False)

    def fill_buffers(self) -> None:
        half = self.freqs.shape[0]
        # the frequencies in float32 as the reference makes them: exp(-k * (ln 1e4 / half))
        self.freqs = torch.exp(-torch.arange(half, dtype=torch.float32) * (torch.log(torch.tensor(10000.0)) / half))

    def forward(self, actions: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        x = self.W1(actions)  # [1, T, W]
        f = timestep.reshape(1, 1) * self.freqs[None, :]  # [1, W/2]
        t = torch.cat((torch.sin(f), torch.cos(f)), dim=-1)[:, None, :].expand(x.shape[0], x.shape[1], -1)
        x = F.silu(self.W2(torch.cat((x, t), dim=-1)))
        return self.W3(x)


class Attention(nn.Module):
    """Multi-head attention with biases (names of a diffusers ``Attention``: to_q, to_k, to_v, to_out.0)."""

    def __init__(self, dim: int, heads: int, head_dim: int, kv_dim: int | None = None):
        super().__init__()
        inner = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(kv_dim or dim, inner)
        self.to_v = nn.Linear(kv_dim or dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[T, heads * head_dim] -> [heads, T, head_dim]."""
        return x.reshape(x.shape[0], self.heads, self.head_dim).transpose(0, 1)

    def keys_values(self, ctx: torch.Tensor) -> torch.Tensor:
        """The keys and values of ``ctx`` [S, kv_dim] -> [2, heads, S, head_dim]."""
        return torch.stack((self.split(self.to_k(ctx)), self.split(self.to_v(ctx))))

    def attend(self, x: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, dim] attends to kv [2, heads, S, head_dim] (``bias`` [S] or [T, S] added to the scores)."""
        q = self.split(self.to_q(x))
        scores = torch.matmul(q, kv[0].transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        if bias is not None:
            scores = scores + bias
        ctx = torch.matmul(torch.softmax(scores, dim=-1), kv[1])  # [heads, T, head_dim]
        return self.to_out[0](ctx.transpose(0, 1).reshape(x.shape[0], -1))


class GeluProjection(nn.Module):
    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh(self.proj(x))


class FeedForward(nn.Module):
    """``net.2(gelu_tanh(net.0.proj(x)))``, 4x wide (diffusers' ``FeedForward``, dropouts at eval)."""

    def __init__(self, dim: int):
        super().__init__()
        self.net = nn.ModuleList([GeluProjection(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class AdaLayerNorm(nn.Module):
    """LayerNorm without affine, then ``* (1 + scale) + shift`` with ``scale, shift = linear(silu(temb))``."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, LN_EPS, elementwise_affine=False)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb)).chunk(2, dim=-1)
        return self.norm(x) * (1 + scale) + shift


class Block(nn.Module):
    """A transformer block: norm1, attention (self, or cross with ``kv_dim``), residual; norm3, MLP, residual.
    ``ada``: norm1 is an :class:`AdaLayerNorm` and norm3 has no affine (the DiT's); else both are affine
    LayerNorms (the VL self-attention's)."""

    def __init__(self, dim: int, heads: int, head_dim: int, kv_dim: int | None = None, ada: bool = False):
        super().__init__()
        self.norm1 = AdaLayerNorm(dim) if ada else nn.LayerNorm(dim, LN_EPS)
        self.attn1 = Attention(dim, heads, head_dim, kv_dim)
        self.norm3 = nn.LayerNorm(dim, LN_EPS, elementwise_affine=not ada)
        self.ff = FeedForward(dim)

    def forward(self, x: torch.Tensor, kv: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                temb: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm1(x, temb) if temb is not None else self.norm1(x)
        x = x + self.attn1.attend(h, self.attn1.keys_values(h) if kv is None else kv, bias)
        return x + self.ff(self.norm3(x))


class TimestepEmbedder(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear_1 = nn.Linear(TIME_CHANNELS, width)
        self.linear_2 = nn.Linear(width, width)


class TimestepEncoder(nn.Module):
    """diffusers' ``Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=1)`` then linear, SiLU, linear."""

    def __init__(self, width: int):
        super().__init__()
        self.timestep_embedder = TimestepEmbedder(width)
        self.register_buffer("freqs", torch.empty(TIME_CHANNELS // 2), persistent=False)

    def fill_buffers(self) -> None:
        half = TIME_CHANNELS // 2
        self.freqs = torch.exp(-math.log(10000) * torch.arange(0, half, dtype=torch.float32) / (half - 1))

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        f = timestep.reshape(1, 1) * self.freqs[None, :]
        e = self.timestep_embedder
        return e.linear_2(F.silu(e.linear_1(torch.cat((torch.cos(f), torch.sin(f)), dim=-1))))  # [1, W]


class DiT(nn.Module):
    """The DiT (``action_head.model.*``)."""

    def __init__(self, layers: int, heads: int, head_dim: int, out_dim: int, kv_dim: int):
        super().__init__()
        width = heads * head_dim
        self.timestep_encoder = TimestepEncoder(width)
        self.transformer_blocks = nn.ModuleList(
            Block(width, heads, head_dim, kv_dim if i % 2 == 0 else None, ada=True) for i in range(layers))
        self.norm_out = nn.LayerNorm(width, OUT_NORM_EPS, elementwise_affine=False)
        self.proj_out_1 = nn.Linear(width, 2 * width)
        self.proj_out_2 = nn.Linear(width, out_dim)


class VLSelfAttention(nn.Module):
    def __init__(self, layers: int, heads: int, head_dim: int):
        super().__init__()
        self.transformer_blocks = nn.ModuleList(Block(heads * head_dim, heads, head_dim) for _ in range(layers))


class GrootHead(nn.Module):
    """GR00T N1.7's action head (``action_head.*`` of its checkpoint), one embodiment's encoders."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        act, hb = cfg.action, cfg.llm.hidden_dim
        width = act.dit_width
        self.act = act
        self.vlln = nn.LayerNorm(hb, LN_EPS)
        self.vl_self_attention = VLSelfAttention(act.vl_layers, act.vl_heads, act.vl_head_dim)
        self.state_encoder = CategoryMLP(act.state_dim, act.dit_hidden_dim, width)
        self.action_encoder = ActionEncoder(act.action_dim, width)
        self.action_decoder = CategoryMLP(act.dit_hidden_dim, act.dit_hidden_dim, act.action_dim)
        self.position_embedding = nn.Embedding(act.action_horizon, width)
        self.model = DiT(act.dit_layers, act.dit_heads, act.dit_head_dim, act.dit_hidden_dim, hb)

    def text_block(self, index: int) -> bool:
        """Whether DiT block ``index`` (even) cross-attends to the text rows (else to the image rows)."""
        return index % (2 * self.act.dit_text_every_n_blocks) == 0

    def context(self, features: torch.Tensor, valid: torch.Tensor, image: torch.Tensor, state: torch.Tensor):
        """features [S, Hb], valid/image [S] bool, state [1, state_dim] -> cross_kv [C, 2, heads, S, head_dim],
        cross_bias [2, S] (text rows, image rows), state_features [1, 1, width]."""
        x = self.vlln(features)
        keys_ok = attention_bias(valid)  # [S]: padded rows are no key of any row
        for block in self.vl_self_attention.transformer_blocks:
            x = block(x, bias=keys_ok)
        blocks = self.model.transformer_blocks
        kv = torch.stack([blocks[i].attn1.keys_values(x) for i in range(0, len(blocks), 2)])
        bias = torch.stack((masked_bias(valid & ~image), masked_bias(valid & image)))
        return kv, bias, self.state_encoder(state)[None]

    def velocity(self, actions: torch.Tensor, timestep: torch.Tensor, state_features: torch.Tensor,
                 cross_kv: torch.Tensor, cross_bias: torch.Tensor) -> torch.Tensor:
        """actions [1, T, A] at time bucket ``timestep`` [1] -> velocity [1, T, A]."""
        dit = self.model
        temb = dit.timestep_encoder(timestep)  # [1, W]
        horizon = actions.shape[1]
        a = self.action_encoder(actions, timestep) + self.position_embedding.weight[None, :horizon]
        x = torch.cat((state_features, a), dim=1)[0]  # [1 + T, W]
        for i, block in enumerate(dit.transformer_blocks):
            if i % 2:
                x = block(x, temb=temb)
            else:
                x = block(x, cross_kv[i // 2], cross_bias[0 if self.text_block(i) else 1], temb)
        shift, scale = dit.proj_out_1(F.silu(temb)).chunk(2, dim=-1)
        x = dit.proj_out_2(dit.norm_out(x) * (1 + scale) + shift)
        return self.action_decoder(x[-horizon:])[None]


# ---------------------------------------------------------------------------------------------- graphs

class FeaturesGraph(nn.Module):
    """features_<p>: the prompt's rows attend causally among themselves (one call, no cache); the last decoder
    layer's hidden states before the final norm, padded rows (>= num_tokens) zero. ``bucket`` None: the
    prompt's length is the input's (TensorRT's profiled export; VLContextGraph likewise)."""

    def __init__(self, lm: CausalLM, bucket: int, deepstack: bool):
        super().__init__()
        self.lm, self.bucket, self.deepstack = lm, bucket, deepstack

    def forward(self, inputs_embeds, num_tokens, position_ids, deepstack_embeds=None):
        rows = torch.arange(inputs_embeds.shape[1] if self.bucket is None else self.bucket, dtype=torch.int64)
        causal = rows[None, :] <= rows[:, None]
        h, _ = self.lm.run(inputs_embeds[0], position_ids, None, causal, span=0,
                           deepstack=deepstack_embeds if self.deepstack else None)
        return (h * (rows < num_tokens).to(h.dtype)[:, None])[None]


class VLContextGraph(nn.Module):
    """vl_context_<p>: :meth:`GrootHead.context` of a prompt's features."""

    def __init__(self, head: GrootHead, bucket: int):
        super().__init__()
        self.head, self.bucket = head, bucket

    def forward(self, features, num_tokens, image_rows, state):
        rows = features.shape[1] if self.bucket is None else self.bucket
        valid = torch.arange(rows, dtype=torch.int64) < num_tokens
        return self.head.context(features[0], valid, image_rows[0] > 0.5, state)


class DiTGraph(nn.Module):
    """dit_<p>: :meth:`GrootHead.velocity`."""

    def __init__(self, head: GrootHead, bucket: int):
        super().__init__()
        self.head, self.bucket = head, bucket

    def forward(self, noisy_actions, timestep, state_features, cross_kv, cross_bias):
        return (self.head.velocity(noisy_actions, timestep, state_features, cross_kv, cross_bias),)
