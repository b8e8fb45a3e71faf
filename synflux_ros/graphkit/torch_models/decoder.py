"""Decoder-only language model (Qwen3 / Llama / Gemma) and its embed / prefill / decode graph modules.

Everything here works on one sequence (batch 1) and on static shapes, so that ``torch.onnx.export``
(TorchScript tracing) yields graphs of standard ONNX ops only:

* attention is written out (MatMul, masked Softmax, MatMul), grouped-query heads by broadcasting;
* which cache positions a query may see is a boolean mask built by comparing constant position ranges
  against the ``cache_position`` / ``num_tokens`` *input values*, never by Python control flow;
* RoPE (rotate-half convention) is looked up, not computed, in the graph: a float32 table of
  ``cos/sin(pos * inv_freq)`` built at build time (:func:`rope_table`), which the graphs ``Gather`` by the
  clamped position (:func:`rope_lookup`), so fp16 devices round table values instead of computing angles
  in fp16 (docs/internals/build.md).

Parameter names follow the Hugging Face layout (``model.embed_tokens.weight``,
``model.layers.N.self_attn.q_proj.weight``, ..., ``model.norm.weight``, ``lm_head.weight``), so a
checkpoint's safetensors load with strict name matching (:func:`.hf_decoder.load_hf_weights`).

KV entries are computed in float32. The K/V of the new tokens are rounded to the cache dtype before
they are attended to, so a sequence gives the same numbers whether it is prefilled at once, in chunks
or token by token (the cache only ever holds rounded values).
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from ...core.config import ConfigError, LLMConfig

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


# ---------------------------------------------------------------------------------------------- RoPE

def rope_inv_freq(head_dim: int, theta: float, rope: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] of rotary embeddings, with the scalings Llama checkpoints use.

    ``rope`` is a Hugging Face ``rope_parameters``/``rope_scaling`` dict (or None): ``default`` (also the
    multimodal-rope variants, identical for text positions), ``linear`` and ``llama3`` are supported.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv = 1.0 / (float(theta) ** exponent)
    rope = rope or {}
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if float(rope.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise ConfigError("rope: partial_rotary_factor != 1 is not supported")
    if kind in ("default", "mrope"):
        return inv
    if kind == "linear":
        return inv / float(rope["factor"])
    if kind == "llama3":
        factor = float(rope["factor"])
        lo_f = float(rope.get("low_freq_factor", 1.0))
        hi_f = float(rope.get("high_freq_factor", 4.0))
        ctx = float(rope["original_max_position_embeddings"])
        wavelen = 2.0 * math.pi / inv
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
        blend = ((ctx / wavelen) - lo_f) / (hi_f - lo_f)
        blended = (1.0 - blend) * inv / factor + blend * inv
        out = torch.where(wavelen > ctx / lo_f, inv / factor, inv)
        middle = (wavelen >= ctx / hi_f) & (wavelen <= ctx / lo_f)
        return torch.where(middle, blended, out)
    raise ConfigError(f"rope: rope_type {kind!r} is not supported (supported: default, linear, llama3)")


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor):
    """positions [T] int64 -> cos, sin [T, Dh] (frequencies repeated over both halves)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rope_table(rows: int, inv_freq: torch.Tensor):
    """cos, sin [rows, Dh] of positions 0 .. rows - 1: ``rope_cos_sin(arange(rows), inv_freq)``, the float32
    values the positions give (computed here, at build time, so the graphs only look them up)."""
    return rope_cos_sin(torch.arange(rows, dtype=torch.int64), inv_freq)


def rope_lookup(cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor):
    """positions [T] int64 -> cos, sin [T, Dh]: the rows of :func:`rope_table`'s tables (one ``Gather``
    each). Positions are clamped to the table (``Clip``): a position beyond it (a padded prefill row at
    the end of the cache, whose keys and logits are discarded) reads the last row instead of failing."""
    idx = positions.clamp(0, cos_table.shape[0] - 1)
    return cos_table[idx], sin_table[idx]


def mrope_axis_masks(head_dim: int, section) -> torch.Tensor:
    """[3, head_dim] float 0/1: which position axis (t, h, w) drives each rotary column under Qwen3-VL's
    interleaved multimodal rope. Frequency i < head_dim/2 follows h when i % 3 == 1 and i < 3 * section[1],
    w when i % 3 == 2 and i < 3 * section[2], else t; both halves of the rotate-half layout alike."""
    half = head_dim // 2
    axis = torch.zeros(half, dtype=torch.int64)
    i = torch.arange(half)
    axis[(i % 3 == 1) & (i < 3 * section[1])] = 1
    axis[(i % 3 == 2) & (i < 3 * section[2])] = 2
    axis = torch.cat((axis, axis))
    return torch.stack([(axis == a).to(torch.float32) for a in range(3)])


def mrope_lookup(cos_table, sin_table, positions: torch.Tensor, masks: torch.Tensor):
    """positions [3, T] int64 -> cos, sin [T, Dh]: each column from the table row of its axis' position
    (three lookups, combined with the 0/1 ``masks`` of :func:`mrope_axis_masks`: exact, one term is nonzero)."""
    cos = sin = None
    for a in range(3):
        c, s_ = rope_lookup(cos_table, sin_table, positions[a])
        cos = c * masks[a] if cos is None else cos + c * masks[a]
        sin = s_ * masks[a] if sin is None else sin + s_ * masks[a]
    return cos, sin


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh-approximated GELU (Gemma's and SigLIP's ``gelu_pytorch_tanh``): torch's kernel when run, and in an
    ONNX export spelled ``(0.5 x) (1 + tanh(sqrt(2/pi) (x + 0.044715 Pow(x, 3))))``, the form ONNX Runtime's
    optimiser fuses into one ``FastGelu`` kernel (``FastGeluFusion``; the exporter's own spelling of
    ``F.gelu(approximate="tanh")`` multiplies ``x * x * x`` and halves last, matches none of its patterns and
    stays a chain of element-wise kernels). Standard ops only; other backends' compilers see the same
    function."""
    if not torch.onnx.is_in_onnx_export():
        return F.gelu(x, approximate="tanh")
    return (0.5 * x) * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention: x [..., T, Dh], cos/sin [T, Dh] (the decoder's and the
    vision towers' rotary tables alike)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------------------------- blocks

class RMSNorm(nn.Module):
    """x / rms(x) * w, or * (1 + w) for Gemma (``unit_offset``)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = float(eps)
        self.unit_offset = unit_offset

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.unit_offset:
                self.weight.zero_()
            else:
                self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * (self.weight + 1.0) if self.unit_offset else x * self.weight


class AdaRMSNorm(nn.Module):
    """pi0.5's adaptive RMSNorm: no gain of its own; ``dense(cond)`` gives a scale, a shift and a gate, and
    :meth:`forward` returns ``(x / rms(x) * (1 + scale) + shift, gate)``, the gate for the residual it feeds
    (``x + y * gate``). ``cond`` [W_c] is one vector for every row (the flow time's)."""

    def __init__(self, dim: int, eps: float, cond_dim: int):
        super().__init__()
        self.eps, self.dim = float(eps), dim
        self.dense = nn.Linear(cond_dim, 3 * dim)

    def modulation(self, cond: torch.Tensor):
        """(scale, shift, gate) of ``cond``: static slices of ``dense(cond)`` (a chunk would export its sizes
        as Shape ops)."""
        m, d = self.dense(cond), self.dim
        return m[..., :d], m[..., d:2 * d], m[..., 2 * d:]

    def forward(self, x: torch.Tensor, cond: torch.Tensor):
        scale, shift, gate = self.modulation(cond)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * (1.0 + scale) + shift, gate


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().contiguous(), requires_grad=False)


def fuse_projections(module: nn.Module, join: bool = True) -> nn.Module:
    """Give every attention block and gated MLP in ``module`` its export layout, derived from the final
    weights (call after random init or checkpoint load; the Hugging Face ``[out, in]`` Linear weights stay
    for loading and for the reference forward):

    * with ``join`` (models with decode steps): Q, K and V projections as one ``[W, (nh + 2 KV) Dh]`` matrix,
      gate and up as one ``[W, 2 I]`` matrix, so a decode step runs two matrix-vector products per block
      instead of five; without (a backbone that only prefills, a flow-matching VLA's): one matrix each, since
      a product of hundreds of rows gains nothing from the join and pays a copy to split it (ONNX
      ``Slice``/``Split`` copy). The action expert keeps the join: at its few dozen rows the split costs
      less than launching the extra products;
    * every matrix stored ``[in, out]`` and used by a plain ``MatMul``: ONNX Runtime's CPU kernels run a
      one-row product against an ``[in, out]`` constant faster than ``Gemm(transB=1)`` against ``[out, in]``,
      and compilers (TensorRT, NPU toolchains) take either form.

    Standard ops only (MatMul, Slice); the graphs read only the derived tensors, so the weights file holds
    each matrix once. Returns ``module``.
    """
    for m in module.modules():
        if isinstance(m, (Attention, GatedMLP)):
            m.fuse(join)
    return module


def layer_kv(past, layer: int, span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [KV, span, Dh] (float32) of ``layer`` from the cache ``past``: either the contract
    tensor [L, 2, KV, S, Dh] or its per-layer views, a sequence of L (keys, values) pairs [KV, S, Dh]
    (how the build tool exports the graphs, see ``graphset.reader.VIEW_INPUTS``: each view is bound in
    place, so a layer that reads the whole cache copies nothing). Only the first ``span`` positions are read
    (default all); reading fewer copies just those. ``span`` is an int (static graphs: a span equal to the
    cache length exports no Slice) or a traced size (a 0-d tensor, e.g. ``attention_span.shape[0]`` of the
    shape-polymorphic graphs, see :mod:`synflux_ros.backends.tensorrt.build_models`): then the views are
    always sliced, to that dynamic length."""
    if isinstance(past, torch.Tensor):
        kv, s, dh = past.shape[2], past.shape[3], past.shape[4]
        span = s if span is None else span
        # one multi-axis Slice per tensor: ONNX Slice/Split copy, so cut exactly what is read
        pk = past[layer:layer + 1, 0:1, :, :span].reshape(kv, span, dh)
        pv = past[layer:layer + 1, 1:2, :, :span].reshape(kv, span, dh)
    else:
        pk, pv = past[layer]
        if span is not None and (isinstance(span, torch.Tensor) or span < pk.shape[1]):
            pk, pv = pk[:, :span], pv[:, :span]
    if pk.dtype != torch.float32:
        pk, pv = pk.to(torch.float32), pv.to(torch.float32)
    return pk, pv


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (Gemma 2's capped attention scores and logits); ``x`` itself for cap 0."""
    return torch.tanh(x / cap) * cap if cap else x


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
           cap: float = 0.0) -> torch.Tensor:
    """Masked attention with grouped-query heads.

    q [nh, T, Dh], k/v [KV, S, Dh], bias [T, S] (:func:`attention_bias`: 0 = may attend, -inf = may not)
    -> [nh, T, Dh]; scores capped by :func:`softcap` before the mask. Every query row must allow at least one
    key (callers always allow the token itself).
    """
    nh, t, dh = q.shape
    kv = k.shape[0]
    qg = q.reshape(kv, nh // kv, t, dh)
    scores = softcap(torch.matmul(qg, k.unsqueeze(1).transpose(-1, -2)) * scale, cap)  # [KV, G, T, S]
    probs = torch.softmax(scores + bias, dim=-1)
    return torch.matmul(probs, v.unsqueeze(1)).reshape(nh, t, dh)


def sliding_window_allowed(allowed: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """``allowed`` [T, P + T] (P cache positions 0 .. P-1, then the new rows at ``positions`` [T]) narrowed to
    the keys of the last ``window`` positions of each query: key position > query position - window
    (transformers' sliding-window mask)."""
    t = positions.shape[0]
    keys = torch.cat((torch.arange(allowed.shape[1] - t, dtype=torch.int64), positions))
    return allowed & (keys[None, :] > positions[:, None] - window)


def attention_bias(allowed: torch.Tensor) -> torch.Tensor:
    """allowed [T, S + T] bool -> the additive mask every layer adds to its scores: 0 where attention is
    allowed, -inf elsewhere (float32). Built once per graph. Adding it gives the scores masked_fill would,
    bit for bit, and onnxruntime runs the per-layer Add + Softmax far faster than a Where broadcast over the
    heads."""
    return torch.where(allowed, torch.tensor(0.0), torch.tensor(float("-inf")))


def attend_past_and_new(q, past_k, past_v, k, v, bias, scale: float, cap: float = 0.0) -> torch.Tensor:
    """``attend`` over [past | new] keys without concatenating the key/value tensors: only the (small)
    score rows are joined, so the graph copies no cache-sized tensor. bias [T, S + T]: the
    :func:`attention_bias` of the allowed positions."""
    nh, t, dh = q.shape
    kv, s = past_k.shape[0], past_k.shape[1]
    qg = q.reshape(kv, nh // kv, t, dh)
    s_past = torch.matmul(qg, past_k.unsqueeze(1).transpose(-1, -2))  # [KV, G, T, S]
    s_new = torch.matmul(qg, k.unsqueeze(1).transpose(-1, -2))  # [KV, G, T, T]
    scores = softcap(torch.cat((s_past, s_new), dim=-1) * scale, cap)
    probs = torch.softmax(scores + bias, dim=-1)
    ctx = torch.matmul(probs[..., :s], past_v.unsqueeze(1)) + torch.matmul(probs[..., s:], v.unsqueeze(1))
    return ctx.reshape(nh, t, dh)


class Attention(nn.Module):
    """Grouped-query self-attention projections (optional Q/K norms, RoPE); the attention itself is
    :func:`attend_past_and_new` (:func:`attend` without a past), called by :class:`DecoderLayer`."""

    def __init__(self, width: int, num_heads: int, num_kv_heads: int, head_dim: int, qk_norm: bool,
                 eps: float, unit_offset: bool, qkv_bias: bool = False, query_pre_attn_scalar: float = 0.0):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = (query_pre_attn_scalar or head_dim) ** -0.5
        self.q_proj = nn.Linear(width, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(width, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(width, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, width, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps, unit_offset)
            self.k_norm = RMSNorm(head_dim, eps, unit_offset)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_t: nn.Parameter | None = None
        self.q_t = self.k_t = self.v_t = None
        self.o_t: nn.Parameter | None = None
        self.qkv_b: nn.Parameter | None = None  # Qwen2's q/k/v biases, joined [(nh + 2 KV) Dh]

    def fuse(self, join: bool = True) -> None:
        """Export layout (see :func:`fuse_projections`): Q, K and V as one [W, (nh + 2 KV) Dh] matrix, or
        (``join=False``) as three [in, out] matrices; their biases (if any) as one vector either way."""
        if join:
            self.qkv_t = _param(torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)).t())
        else:
            self.q_t, self.k_t, self.v_t = (_param(p.weight.t()) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.q_proj.bias is not None:
            self.qkv_b = _param(torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)))
        self.o_t = _param(self.o_proj.weight.t())

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, W] -> q [nh, T, Dh], k [KV, T, Dh] (both after RoPE), v [KV, T, Dh]."""
        t = x.shape[0]
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv_t is not None:
            qkv = torch.matmul(x, self.qkv_t)
            qkv = qkv + self.qkv_b if self.qkv_b is not None else qkv
            q, k, v = qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:]
        elif self.q_t is not None:
            q, k, v = torch.matmul(x, self.q_t), torch.matmul(x, self.k_t), torch.matmul(x, self.v_t)
            if self.qkv_b is not None:
                q, k, v = q + self.qkv_b[:nq], k + self.qkv_b[nq:nq + nkv], v + self.qkv_b[nq + nkv:]
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim).transpose(0, 1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(0, 1), cos, sin)
        k = apply_rope(k.transpose(0, 1), cos, sin)
        return q, k, v

    def output(self, ctx: torch.Tensor) -> torch.Tensor:
        """ctx [nh, T, Dh] -> [T, W]."""
        t = ctx.shape[1]
        flat = ctx.transpose(0, 1).reshape(t, self.num_heads * self.head_dim)
        return torch.matmul(flat, self.o_t) if self.o_t is not None else self.o_proj(flat)


class GatedMLP(nn.Module):
    """act(gate(x)) * up(x) -> down, SiLU or tanh-GELU (Gemma)."""

    def __init__(self, width: int, intermediate: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(width, intermediate, bias=False)
        self.up_proj = nn.Linear(width, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, width, bias=False)
        self.act = act
        self.gate_up_t: nn.Parameter | None = None
        self.gate_t = self.up_t = None
        self.down_t: nn.Parameter | None = None

    def fuse(self, join: bool = True) -> None:
        """Export layout (see :func:`fuse_projections`): gate and up as one [W, 2 I] matrix, or (``join=False``)
        as two [in, out] matrices."""
        if join:
            self.gate_up_t = _param(torch.cat((self.gate_proj.weight, self.up_proj.weight)).t())
        else:
            self.gate_t, self.up_t = _param(self.gate_proj.weight.t()), _param(self.up_proj.weight.t())
        self.down_t = _param(self.down_proj.weight.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_t is not None:
            gu = torch.matmul(x, self.gate_up_t)
            inter = gu.shape[-1] // 2
            g, u = gu[..., :inter], gu[..., inter:]
        elif self.gate_t is not None:
            g, u = torch.matmul(x, self.gate_t), torch.matmul(x, self.up_t)
        else:
            g, u = self.gate_proj(x), self.up_proj(x)
        g = gelu_tanh(g) if self.act == "gelu_tanh" else F.silu(g)
        h = g * u
        return torch.matmul(h, self.down_t) if self.down_t is not None else self.down_proj(h)


GEMMA_FAMILY = ("gemma", "gemma2", "gemma3")
"""Architectures with (1 + w) norms, tanh-GELU MLPs and embeddings scaled by sqrt(hidden)."""
SANDWICH_NORMS = ("gemma2", "gemma3")
"""Architectures that also norm the attention and MLP outputs before adding them (Gemma 2/3)."""


class DecoderLayer(nn.Module):
    """Pre-norm block (Gemma 2/3: sandwich-norm). ``forward`` attends the layer's tokens to ``past``
    keys/values followed by their own."""

    join_past = False
    """Attend to ``past`` by joining its keys/values with the new ones (:func:`attend`) instead of joining score
    rows (:func:`attend_past_and_new`). For many new rows against a short past (the action expert: 51 rows, a
    prefix of a few hundred) the joined keys are the smaller copy, and one product, one mask add and one softmax
    per layer replace two products, the score join and split and a sum; a decode step keeps the default, which
    copies no cache-sized tensor."""

    def __init__(self, width: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 architecture: str, eps: float, query_pre_attn_scalar: float = 0.0, attn_softcap: float = 0.0,
                 cond_dim: int = 0):
        super().__init__()
        gemma = architecture in GEMMA_FAMILY
        self.self_attn = Attention(width, num_heads, num_kv_heads, head_dim, architecture in ("qwen3", "gemma3"),
                                   eps, gemma, qkv_bias=architecture == "qwen2",
                                   query_pre_attn_scalar=query_pre_attn_scalar)
        self.attn_softcap = float(attn_softcap)
        self.mlp = GatedMLP(width, intermediate, "gelu_tanh" if gemma else "silu")
        self.adaptive = bool(cond_dim)  # pi0.5's expert: both norms adaptive (AdaRMSNorm), gated residuals
        if self.adaptive:
            self.input_layernorm = AdaRMSNorm(width, eps, cond_dim)
            self.post_attention_layernorm = AdaRMSNorm(width, eps, cond_dim)
        else:
            self.input_layernorm = RMSNorm(width, eps, gemma)
            self.post_attention_layernorm = RMSNorm(width, eps, gemma)
        if architecture in SANDWICH_NORMS and not self.adaptive:
            # Hugging Face's names: Gemma 2/3's post_attention_layernorm norms the attention output (above), these
            # the MLP's input and output
            self.pre_feedforward_layernorm = RMSNorm(width, eps, gemma)
            self.post_feedforward_layernorm = RMSNorm(width, eps, gemma)
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None

    def forward(self, x, cos, sin, past_k, past_v, bias, kv_dtype: torch.dtype = torch.float32, cond=None):
        """x [T, W]; past_k/v [KV, S, Dh] f32 (None: no past, the new rows attend among themselves); bias
        [T, S + T] (:func:`attention_bias`); ``cond`` [W_c]: an adaptive layer's conditioning -> (x, k, v) with
        k/v [KV, T, Dh] in kv_dtype."""
        gate = None
        if self.adaptive:
            h, gate = self.input_layernorm(x, cond)
        else:
            h = self.input_layernorm(x)
        q, k, v = self.self_attn.project(h, cos, sin)
        if kv_dtype != torch.float32:
            k, v = k.to(kv_dtype), v.to(kv_dtype)
            k_use, v_use = k.to(torch.float32), v.to(torch.float32)
        else:
            k_use, v_use = k, v
        scale, cap = self.self_attn.scale, self.attn_softcap
        if past_k is None:
            ctx = attend(q, k_use, v_use, bias, scale, cap)
        elif self.join_past:
            ctx = attend(q, torch.cat((past_k, k_use), dim=1), torch.cat((past_v, v_use), dim=1), bias, scale, cap)
        else:
            ctx = attend_past_and_new(q, past_k, past_v, k_use, v_use, bias, scale, cap)
        if self.adaptive:
            x = x + self.self_attn.output(ctx) * gate
            h, gate = self.post_attention_layernorm(x, cond)
            return x + self.mlp(h) * gate, k, v
        if self.pre_feedforward_layernorm is None:
            x = x + self.self_attn.output(ctx)
            return x + self.mlp(self.post_attention_layernorm(x)), k, v
        x = x + self.post_attention_layernorm(self.self_attn.output(ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), k, v


class TextModel(nn.Module):
    """Token embedding, decoder layers and final norm (the ``model.*`` part of the checkpoint)."""

    def __init__(self, llm: LLMConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(llm.vocab_size, llm.hidden_dim)
        self.layers = nn.ModuleList(
            DecoderLayer(llm.hidden_dim, llm.intermediate_size, llm.num_heads, llm.num_kv_heads, llm.head_dim,
                         llm.architecture, llm.rms_norm_eps, llm.query_pre_attn_scalar, llm.attn_logit_softcapping)
            for _ in range(llm.num_layers))
        self.norm = RMSNorm(llm.hidden_dim, llm.rms_norm_eps, llm.architecture in GEMMA_FAMILY)


class CausalLM(nn.Module):
    """The language model behind every embed / prefill / decode graph: one instance holds the weights
    (Hugging Face parameter names, so checkpoints load by name) and offers the pieces the graph modules
    are made of (:meth:`embed`, :meth:`run`, :meth:`head`)."""

    def __init__(self, llm: LLMConfig, rope: dict | None = None):
        super().__init__()
        self.llm = llm
        self.rope = dict(rope or {})
        self.model = TextModel(llm)
        self.lm_head = nn.Linear(llm.hidden_dim, llm.vocab_size, bias=False)
        self.embed_scale = llm.embed_scale or (math.sqrt(llm.hidden_dim) if llm.architecture in GEMMA_FAMILY else None)
        if self.embed_scale == 1.0:
            self.embed_scale = None
        self.tie()
        self.register_buffer("inv_freq", torch.empty(llm.head_dim // 2), persistent=False)
        self.head_t: nn.Parameter | None = None
        # rotary cos/sin [max_seq_len, Dh] of every cache position (rope_table), set by finalize_weights; the
        # sliding-window layers' own with llm.rope_local_theta
        self.rope_cos: nn.Parameter | None = None
        self.rope_sin: nn.Parameter | None = None
        self.rope_cos_local: nn.Parameter | None = None
        self.rope_sin_local: nn.Parameter | None = None
        if llm.rope_local_theta:
            self.register_buffer("inv_freq_local", torch.empty(llm.head_dim // 2), persistent=False)
        if llm.mrope_section:
            self.register_buffer("mrope_masks", torch.empty(3, llm.head_dim), persistent=False)

    def tie(self) -> None:
        if self.llm.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fill_buffers(self) -> None:
        self.inv_freq = rope_inv_freq(self.llm.head_dim, self.llm.rope_theta, self.rope)
        if self.llm.rope_local_theta:
            self.inv_freq_local = rope_inv_freq(self.llm.head_dim, self.llm.rope_local_theta)
        if self.llm.mrope_section:
            self.mrope_masks = mrope_axis_masks(self.llm.head_dim, self.llm.mrope_section)

    # -------------------------------------------------------------- pieces used by the graph modules
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 or int32 -> [T, H] (Gemma: times sqrt(H)). The ids index the table as they come (no
        Cast): int32 ids (``llm.token_id_dtype: int32``) export an int32 Gather."""
        x = self.model.embed_tokens(ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        return x

    def run(self, x: torch.Tensor, positions: torch.Tensor, past, allowed: torch.Tensor,
            kv_dtype: torch.dtype = torch.float32, span: int | None = None, deepstack: torch.Tensor | None = None):
        """x [T, H] at ``positions`` [T] (or [3, T] t/h/w positions with ``llm.mrope_section``); past: the
        cache (see :func:`layer_kv`); only its first ``span`` positions are read (default all; 0: none, the new
        rows attend among themselves); allowed [T, span + T]. The rotary cos/sin are the rows ``positions`` of
        the tables (:func:`rope_lookup`); a position >= max_seq_len (only padded prefill rows get one) reads
        the last row. ``deepstack`` [K, T, H]:
        map k is added to the hidden states after layer k (Qwen3-VL's DeepStack).

        Returns the last hidden states [T, H] (before the final norm) and new_kv [L, 2, KV, T, Dh].
        """
        if self.rope_cos is None:
            raise RuntimeError("CausalLM.finalize_weights() must run after the weights are set")
        if self.llm.mrope_section:
            cos, sin = mrope_lookup(self.rope_cos, self.rope_sin, positions, self.mrope_masks)
        else:
            cos, sin = rope_lookup(self.rope_cos, self.rope_sin, positions)
        new = []
        bias = attention_bias(allowed)
        sliding = set(self.llm.sliding_window_layers)
        if sliding:  # Gemma 2/3: those layers see the last sliding_window positions, with their own rope base
            bias_local = attention_bias(sliding_window_allowed(allowed, positions, self.llm.sliding_window))
            local = rope_lookup(self.rope_cos_local, self.rope_sin_local, positions) \
                if self.rope_cos_local is not None else (cos, sin)
        for i, layer in enumerate(self.model.layers):
            pk, pv = (None, None) if isinstance(span, int) and span == 0 else layer_kv(past, i, span)
            if i in sliding:
                x, k, v = layer(x, *local, pk, pv, bias_local, kv_dtype)
            else:
                x, k, v = layer(x, cos, sin, pk, pv, bias, kv_dtype)
            if deepstack is not None and i < deepstack.shape[0]:
                x = x + deepstack[i]
            new.append(torch.stack((k, v)))
        return x, torch.stack(new)

    def prefill_outputs(self, h, new_kv, rows, num_tokens, logits: bool) -> tuple:
        """What a prefill graph returns from the last hidden states ``h`` [T, H] and ``new_kv``: the logits of
        row ``num_tokens - 1`` (only with ``logits``) and new_kv with its rows >= num_tokens zeroed."""
        valid = (rows < num_tokens).to(new_kv.dtype)[None, None, None, :, None]
        if not logits:
            return (new_kv * valid,)
        return self.head(torch.index_select(h, 0, num_tokens - 1)), new_kv * valid

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, H] -> logits [N, V] (final norm, then the head).

        The head reads one contiguous [H, V] matrix (``finalize_weights``) with a plain MatMul, the layout
        CPU matrix-vector kernels read fastest; the token lookup keeps the [V, H] embedding, so a tied model
        stores the table twice, each copy shared by all graphs."""
        if self.head_t is None:
            raise RuntimeError("CausalLM.finalize_weights() must run after the weights are set")
        return softcap(torch.matmul(self.model.norm(h), self.head_t), self.llm.final_logit_softcapping)

    def finalize_weights(self, join: bool = True) -> None:
        """Derive the export-time tables from the final weights (call after init or checkpoint load):
        the head as one [H, V] matrix, the fused projections of :func:`fuse_projections` and the rotary
        cos/sin of every cache position (:func:`rope_table`). Parameters, so the exporter emits one named
        initializer per table that every graph shares (a buffer would be folded into each graph as a
        Constant node); made here, after loading, so a checkpoint is not expected to hold them."""
        head = self.model.embed_tokens.weight if self.llm.tie_word_embeddings else self.lm_head.weight
        self.head_t = _param(head.t())
        self.rope_cos, self.rope_sin = (_param(t) for t in rope_table(self.llm.max_seq_len, self.inv_freq))
        if self.llm.rope_local_theta:
            self.rope_cos_local, self.rope_sin_local = (
                _param(t) for t in rope_table(self.llm.max_seq_len, self.inv_freq_local))
        fuse_projections(self, join=join)


# ---------------------------------------------------------------------------------------------- graphs

class EmbedGraph(nn.Module):
    """embed_<p>: input_ids [1, p] -> inputs_embeds [1, p, H]."""

    def __init__(self, lm: CausalLM, bucket: int):
        super().__init__()
        self.lm, self.bucket = lm, bucket

    def forward(self, input_ids):
        return (self.lm.embed(input_ids[0]).unsqueeze(0),)


def state_row(x, rows, num_tokens, state_proj: nn.Module, state):
    """SmolVLA's prefix (``action.state_input: prefix``): row ``num_tokens - 1`` of x [T, H] replaced by
    ``state_proj(state)`` ([1, s]), and which new rows each valid row sees [T, T]: every valid one, except that
    only the state row sees itself."""
    last = rows == num_tokens - 1
    x = torch.where(last[:, None], state_proj(state), x)
    return x, (rows[None, :] < num_tokens) & (~last[None, :] | last[:, None])


class PrefillGraph(nn.Module):
    """prefill_<p>: rows i < num_tokens at positions cache_position + i attend to the cache below
    cache_position and to new rows i' <= i (``llm.prefill_attention: bidirectional``: to every valid new
    row and to no cache entry: pi0's prefix starts the cache, one call at cache_position 0, which the
    backbone enforces, so the graph computes no scores against the cache); logits of row num_tokens - 1
    (not with ``logits=False``: new_kv alone, and the exporter drops what only the logits need, down to the
    last layer's key/value projections). Padded rows
    (i >= num_tokens) are seen by no valid row, give no logits and their new_kv rows are zero; their
    positions may pass the end of the cache (clamped in the rotary lookup)."""

    def __init__(self, lm: CausalLM, bucket: int, max_seq_len: int, kv_dtype: str, logits: bool = True,
                 deepstack: bool = False, state_proj: nn.Module | None = None, expert: nn.Module | None = None):
        super().__init__()
        self.lm, self.bucket, self.max_seq_len = lm, bucket, max_seq_len
        self.kv_dtype = torch_dtype(kv_dtype)
        self.bidirectional = lm.llm.prefill_attention == "bidirectional"
        self.logits = logits
        self.mrope, self.deepstack = bool(lm.llm.mrope_section), deepstack
        self.state_proj = state_proj
        self.expert = expert  # SmolVLA's: its cross-attention layers' projections of the prefix go into the cache

    def forward(self, inputs_embeds, num_tokens, cache_position, past_kv, *extra):
        """The contract's inputs in order; after past_kv: position_ids (multimodal rope), deepstack_embeds
        (DeepStack) and state (SmolVLA's state row, ``action.state_input: prefix``), each where the graph has it."""
        extra = list(extra)
        position_ids = extra.pop(0) if self.mrope else None
        deepstack_embeds = extra.pop(0) if self.deepstack else None
        p, s = self.bucket, self.max_seq_len
        rows = torch.arange(p, dtype=torch.int64)
        positions = cache_position + rows if position_ids is None else position_ids
        x = inputs_embeds[0]
        if self.state_proj is not None:
            x, new_ok = state_row(x, rows, num_tokens, self.state_proj, extra.pop(0))
            h, new_kv = self.lm.run(x, positions, past_kv, new_ok, self.kv_dtype, span=0, deepstack=deepstack_embeds)
        elif self.bidirectional:  # every valid new row, no cache entry (span 0)
            new_ok = (rows[None, :] < num_tokens).expand(p, p)
            h, new_kv = self.lm.run(x, positions, past_kv, new_ok, self.kv_dtype, span=0,
                                    deepstack=deepstack_embeds)
        else:
            past_ok = (torch.arange(s, dtype=torch.int64)[None, :] < cache_position).expand(p, s)
            allowed = torch.cat((past_ok, rows[None, :] <= rows[:, None]), dim=1)
            h, new_kv = self.lm.run(x, positions, past_kv, allowed, self.kv_dtype,
                                    deepstack=deepstack_embeds)
        if self.expert is not None:
            new_kv = self.expert.project_prefix(new_kv)
        return self.lm.prefill_outputs(h, new_kv, rows, num_tokens, self.logits)


class DecodeGraph(nn.Module):
    """decode_<d>: one token at cache_position attends to cache positions < cache_position (of the first d)
    and to itself."""

    def __init__(self, lm: CausalLM, bucket: int, kv_dtype: str):
        super().__init__()
        self.lm, self.bucket = lm, bucket
        self.kv_dtype = torch_dtype(kv_dtype)

    def forward(self, input_ids, cache_position, past_kv, position_ids=None):
        d = self.bucket
        x = self.lm.embed(input_ids[0])
        past_ok = torch.arange(d, dtype=torch.int64)[None, :] < cache_position
        allowed = torch.cat((past_ok, torch.ones(1, 1, dtype=torch.bool)), dim=1)
        positions = cache_position if position_ids is None else position_ids
        h, new_kv = self.lm.run(x, positions, past_kv, allowed, self.kv_dtype, span=d)
        return self.lm.head(h), new_kv


# ---------------------------------------------------------------------------------------------- init

def init_random(module: nn.Module, generator: torch.Generator, std: float = 0.02) -> None:
    """Normal(0, std) for linear / embedding / conv weights, zero biases, norms at identity."""
    seen: set[int] = set()
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv2d)):
                if id(m.weight) not in seen:
                    seen.add(id(m.weight))
                    m.weight.normal_(0.0, std, generator=generator)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
            elif isinstance(m, RMSNorm):
                m.reset_parameters()
            elif isinstance(m, nn.LayerNorm) and m.weight is not None:
                m.weight.fill_(1.0)
                m.bias.zero_()
            if hasattr(m, "init_extra"):
                m.init_extra(generator, std)


def materialize(module: nn.Module) -> nn.Module:
    """Give a module built on the meta device real (uninitialised) CPU storage, re-tie shared weights and
    compute its constant buffers."""
    module.to_empty(device="cpu")
    for m in module.modules():
        if hasattr(m, "tie"):
            m.tie()
        if hasattr(m, "fill_buffers"):
            m.fill_buffers()
    module.requires_grad_(False)
    return module
