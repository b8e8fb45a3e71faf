"""Qwen3-VL vision tower at a fixed resolution, as the ``vision_encoder`` graph (``vision.architecture: qwen3_vl``).

Graph contract (``core/contract.py``)::

    pixel_values [T, 3, th, tw] f32  ->  vision_embeds [T * tokens_per_tile, llm.hidden_dim] f32

Each tile is encoded as one independent image and yields what Qwen3-VL's vision tower and patch merger
produce for it: the embeddings the language model receives at the image-pad positions, in their order.
What depends only on the resolution is computed at construction, and under :meth:`Qwen3VLVision.folded`
(which the exporter enters) the weight-only terms too, so the graph is a Conv followed by the transformer in
standard ONNX ops. DeepStack and M-RoPE are applied on the language-model side. The tower's stages and the
DeepStack / M-RoPE contract are described in docs/internals/build.md.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...core.config import ConfigError, ModelConfig
from .checkpoint import read_config, read_json, read_tensors, tensor_files
from .decoder import apply_rope, gelu_tanh

__all__ = [
    "Qwen3VLVision",
    "build_qwen3_vl_vision",
    "vision_config_from_hf",
    "vision_geometry",
    "load_hf_vision_state_dict",
]

#: Prefixes of the vision tower's tensors in Qwen3-VL checkpoints (current layout first).
HF_PREFIXES = ("model.visual.", "visual.")
#: ``model_type`` values whose vision tower this module implements.
HF_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")

_DEFAULT_NUM_POSITION_EMBEDDINGS = 2304   # 48 x 48 learned positions
_DEFAULT_HIDDEN_ACT = "gelu_pytorch_tanh"
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_TEMPORAL_PATCH = 2
_LN_EPS = 1e-6

_ACTIVATIONS = {
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_new": gelu_tanh,
    "gelu": F.gelu,
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


# ----------------------------------------------------------------------------------------------
# Static tables for one resolution

def _block_order(grid_h: int, grid_w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every patch, listed in merge-block order."""
    br, bc, ir, ic = torch.meshgrid(torch.arange(grid_h // merge), torch.arange(grid_w // merge),
                                    torch.arange(merge), torch.arange(merge), indexing="ij")
    return (br * merge + ir).flatten(), (bc * merge + ic).flatten()


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two bilinear taps (corners aligned) into a ``side``-long table for positions ``index`` of ``size``."""
    src = index.double() * (side - 1) / max(size - 1, 1)
    lo = src.floor()
    frac = src - lo
    lo = lo.long().clamp(0, side - 1)
    hi = (lo + 1).clamp(max=side - 1)
    return torch.stack([lo, hi], 1), torch.stack([1 - frac, frac], 1)


def _position_taps(rows, cols, grid_h, grid_w, side):
    """Indices [N, 4] into the flattened ``side x side`` table and their weights [N, 4]."""
    r_idx, r_w = _axis_taps(rows, grid_h, side)
    c_idx, c_w = _axis_taps(cols, grid_w, side)
    index = (r_idx[:, :, None] * side + c_idx[:, None, :]).reshape(-1, 4)
    weight = (r_w[:, :, None] * c_w[:, None, :]).reshape(-1, 4)
    return index, weight.float()


def _rotary_tables(rows, cols, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [N, head_dim] of the 2-D rotary embedding: frequencies laid out [h | w | h | w]."""
    quarter = head_dim // 4
    inv_freq = 1.0 / theta ** (torch.arange(quarter, dtype=torch.float64) * 2 / (head_dim // 2))
    ang = torch.cat([rows.double()[:, None] * inv_freq, cols.double()[:, None] * inv_freq], 1)
    ang = torch.cat([ang, ang], 1)
    return ang.cos().float(), ang.sin().float()


# ----------------------------------------------------------------------------------------------
# Modules (attribute names follow the checkpoint's tensor names)

class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cos, sin):
        t, n, d = x.shape
        # Three projections from the rows of the fused weight, the values of qkv(x) split in three:
        # rknn-toolkit2 2.5.0 fails to compile one MatMul followed by a split into q, k, v (its fusion rule
        # _p_seperate_exmatmul_rs_split raises).
        w, b = self.qkv.weight, self.qkv.bias
        q, k, v = (F.linear(x, w[i * d:(i + 1) * d], b[i * d:(i + 1) * d])
                   .reshape(t, n, self.heads, self.head_dim).transpose(1, 2)  # [T, heads, N, head_dim]
                   for i in range(3))
        q = apply_rope(q, cos, sin) * (self.head_dim ** -0.5)
        k = apply_rope(k, cos, sin)
        attn = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(t, n, d)
        return self.proj(out)


class _MLP(nn.Module):
    def __init__(self, dim: int, inner: int, act):
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, inner)
        self.linear_fc2 = nn.Linear(inner, dim)
        self.act = act

    def forward(self, x):
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, inner: int, act):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=_LN_EPS)
        self.norm2 = nn.LayerNorm(dim, eps=_LN_EPS)
        self.attn = _Attention(dim, heads)
        self.mlp = _MLP(dim, inner, act)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    """m*m neighbouring tokens -> one LLM embedding. ``pre_concat_norm``: LayerNorm over D before the
    concatenation (final merger) instead of over m*m*D after it (DeepStack mergers)."""

    def __init__(self, dim: int, unit: int, out_dim: int, pre_concat_norm: bool):
        super().__init__()
        self.unit, self.width, self.pre = unit, dim * unit, pre_concat_norm
        self.norm = nn.LayerNorm(dim if pre_concat_norm else dim * unit, eps=_LN_EPS)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, out_dim)

    def forward(self, x):                                       # [T, N, D] -> [T * N / unit, out]
        if self.pre:
            x = self.norm(x).reshape(-1, self.width)
        else:
            x = self.norm(x.reshape(-1, self.width))
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class _PatchEmbed(nn.Module):
    def __init__(self, dim: int, patch: int, temporal: int):
        super().__init__()
        self.patch = patch
        self.proj = nn.Conv3d(3, dim, kernel_size=(temporal, patch, patch), stride=(temporal, patch, patch))

    def kernel(self) -> torch.Tensor:
        """2-D kernel [D, 3, p, p]: a still frame repeated over the temporal kernel sees its sum over time."""
        return self.proj.weight.sum(2)

    def forward(self, x, kernel=None):                          # [T, 3, H, W] -> [T, D, H/p, W/p]
        return F.conv2d(x, self.kernel() if kernel is None else kernel, self.proj.bias, stride=self.patch)


class Qwen3VLVision(nn.Module):
    """Qwen3-VL vision tower + patch merger for fixed ``tile_size`` tiles.

    ``forward(pixel_values [T, 3, th, tw]) -> (vision_embeds [T * tokens_per_tile, out_dim],)``;
    :meth:`forward_with_deepstack` also returns the DeepStack features.
    """

    def __init__(self, *, tile_size: Sequence[int], patch_size: int, hidden_dim: int, num_layers: int,
                 num_heads: int, intermediate_size: int, out_dim: int, spatial_merge_size: int = 2,
                 deepstack_layers: Sequence[int] = (), temporal_patch_size: int = _DEFAULT_TEMPORAL_PATCH,
                 num_position_embeddings: int = _DEFAULT_NUM_POSITION_EMBEDDINGS,
                 hidden_act: str = _DEFAULT_HIDDEN_ACT, rope_theta: float = _DEFAULT_ROPE_THETA):
        super().__init__()
        th, tw = (int(v) for v in tile_size)
        p, m = int(patch_size), int(spatial_merge_size)
        if th % (p * m) or tw % (p * m):
            raise ConfigError(f"vision.tile_size: {th}x{tw} is not a multiple of patch_size * spatial_merge_size "
                              f"= {p}*{m} = {p * m}")
        if hidden_dim % num_heads or (hidden_dim // num_heads) % 4:
            raise ConfigError(f"vision.num_heads: hidden_dim {hidden_dim} / num_heads {num_heads} must be a "
                              f"whole head size divisible by 4 (2-D rotary embedding)")
        side = math.isqrt(num_position_embeddings)
        if side * side != num_position_embeddings:
            raise ConfigError(f"num_position_embeddings {num_position_embeddings} is not a square number")
        bad = [i for i in deepstack_layers if not 0 <= i < num_layers]
        if bad:
            raise ConfigError(f"vision.deepstack_layers: {bad} outside 0..{num_layers - 1}")
        if hidden_act not in _ACTIVATIONS:
            raise ConfigError(f"vision hidden_act {hidden_act!r} is not supported "
                              f"(choices: {', '.join(_ACTIVATIONS)})")
        self.tile_size = (th, tw)
        self.patch_size, self.merge = p, m
        self.grid = (th // p, tw // p)
        self.tokens_per_tile = (self.grid[0] // m) * (self.grid[1] // m)
        self.hidden_dim, self.out_dim = hidden_dim, out_dim
        self.deepstack_layers = tuple(int(i) for i in deepstack_layers)
        self.hparams = dict(tile_size=(th, tw), patch_size=p, hidden_dim=hidden_dim, num_layers=num_layers,
                            num_heads=num_heads, intermediate_size=intermediate_size, out_dim=out_dim,
                            spatial_merge_size=m, deepstack_layers=self.deepstack_layers,
                            temporal_patch_size=temporal_patch_size,
                            num_position_embeddings=num_position_embeddings, hidden_act=hidden_act,
                            rope_theta=rope_theta)
        act = _ACTIVATIONS[hidden_act]
        unit = m * m

        self.patch_embed = _PatchEmbed(hidden_dim, p, temporal_patch_size)
        self.pos_embed = nn.Embedding(num_position_embeddings, hidden_dim)
        self.blocks = nn.ModuleList(_Block(hidden_dim, num_heads, intermediate_size, act) for _ in range(num_layers))
        self.merger = _Merger(hidden_dim, unit, out_dim, pre_concat_norm=True)
        self.deepstack_merger_list = nn.ModuleList(
            _Merger(hidden_dim, unit, out_dim, pre_concat_norm=False) for _ in self.deepstack_layers)

        rows, cols = _block_order(*self.grid, m)
        index, weight = _position_taps(rows, cols, *self.grid, side)
        cos, sin = _rotary_tables(rows, cols, hidden_dim // num_heads, rope_theta)
        self.register_buffer("pos_index", index, persistent=False)
        self.register_buffer("pos_weight", weight, persistent=False)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._folded: tuple[torch.Tensor, torch.Tensor] | None = None

    def position_embeddings(self) -> torch.Tensor:
        """The learned position table resampled to this resolution, [N, D] in merge-block order."""
        return (self.pos_embed.weight[self.pos_index] * self.pos_weight[..., None]).sum(1)

    @contextlib.contextmanager
    def folded(self):
        """Within this context the weight-only terms (resampled position table, time-summed patch kernel)
        are computed once and used as constants, so an exported graph holds them folded."""
        with torch.no_grad():
            self._folded = (self.position_embeddings(), self.patch_embed.kernel())
        try:
            yield self
        finally:
            self._folded = None

    # -- weights

    @torch.no_grad()
    def init_random(self, seed: int = 0, std: float = 0.02) -> "Qwen3VLVision":
        """Seeded random weights (normal(0, std) matrices and position table, zero biases, unit norms)."""
        gen = torch.Generator().manual_seed(int(seed))
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif ".norm" in name or name.startswith("norm"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
        return self

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor], source: str = "checkpoint") -> "Qwen3VLVision":
        """Load tensors named as in the checkpoint without the ``model.visual.`` prefix; every parameter
        must be present with its shape, and no other tensor may be given."""
        own = self.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        wrong = sorted(f"{k}: {tuple(state[k].shape)} (expected {tuple(own[k].shape)})"
                       for k in set(own) & set(state) if tuple(state[k].shape) != tuple(own[k].shape))
        if missing or unexpected or wrong:
            parts = []
            for what, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
                if items:
                    shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
                    parts.append(f"{what}: {shown}")
            raise ConfigError(f"{source}: vision weights do not match the Qwen3-VL vision tower "
                              f"({'; '.join(parts)})")
        for k, v in own.items():
            v.copy_(state[k].to(v.dtype))
        return self

    # -- forward

    def _encode(self, pixel_values: torch.Tensor, deepstack: bool):
        pos, kernel = self._folded or (self.position_embeddings(), self.patch_embed.kernel())
        x = self.patch_embed(pixel_values, kernel)              # [T, D, gh, gw]
        d, m = self.hidden_dim, self.merge
        gh, gw = self.grid
        # Patches into merge-block order, (tile, block row, block col, row in block, col in block), in tensors of
        # rank 4 at most (QNN's HTP takes no 6-D transpose once several tiles are batched).
        x = x.permute(0, 2, 3, 1).reshape(-1, m, gw // m, m * d)    # [T * gh/m, m, gw/m, m * D]
        x = x.transpose(1, 2).reshape(-1, gh * gw, d)
        x = x + pos
        cos, sin = self.rope_cos, self.rope_sin
        features = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin)
            if deepstack and i in self.deepstack_layers:
                features.append(self.deepstack_merger_list[self.deepstack_layers.index(i)](x))
        return self.merger(x), features

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The vision encoder graph's outputs: ``(vision_embeds,)``, plus ``deepstack_embeds`` [K, N, out_dim]
        (the features of :meth:`forward_with_deepstack`, stacked) when the tower has DeepStack layers."""
        embeds, features = self._encode(pixel_values, deepstack=bool(self.deepstack_layers))
        return (embeds, torch.stack(features)) if features else (embeds,)

    def forward_with_deepstack(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(vision_embeds, deepstack)``: ``deepstack[k]`` [T * tokens_per_tile, out_dim] is the k-th feature in
        block order (block ``deepstack_layers[k]`` for the usual sorted list), in the same token order as
        ``vision_embeds``; the language model adds it, at the image-token positions, to the hidden states
        output by its decoder layer k."""
        return self._encode(pixel_values, deepstack=True)


# ----------------------------------------------------------------------------------------------
# Configs and checkpoints

def _as_int(value, name: str, path: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ConfigError(f"{path}: vision_config.{name} {value} must be the same on every axis")
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}: vision_config.{name} must be an integer, got {value!r}")
    return value


def _hf_vision(hf_dir: str) -> dict:
    """The vision tower's hyper-parameters from a checkpoint's config.json (our field names)."""
    path, raw = read_config(hf_dir)
    vc = raw.get("vision_config")
    if not isinstance(vc, dict):
        raise ConfigError(f"{path}: no vision_config (not a Qwen3-VL checkpoint)")
    model_type = raw.get("model_type", "")
    if model_type not in HF_MODEL_TYPES:
        raise ConfigError(f"{path}: model_type {model_type!r} is not a Qwen3-VL model "
                          f"(supported: {', '.join(HF_MODEL_TYPES)})")
    req = ("patch_size", "hidden_size", "depth", "num_heads", "intermediate_size", "out_hidden_size")
    absent = [k for k in req if k not in vc]
    if absent:
        raise ConfigError(f"{path}: vision_config lacks {', '.join(absent)}")
    if vc.get("in_channels", 3) != 3:
        raise ConfigError(f"{path}: vision_config.in_channels {vc['in_channels']} (only RGB, 3, is supported)")
    rope = vc.get("rope_parameters") or {}
    return dict(
        patch_size=_as_int(vc["patch_size"], "patch_size", path),
        hidden_dim=_as_int(vc["hidden_size"], "hidden_size", path),
        num_layers=_as_int(vc["depth"], "depth", path),
        num_heads=_as_int(vc["num_heads"], "num_heads", path),
        intermediate_size=_as_int(vc["intermediate_size"], "intermediate_size", path),
        spatial_merge_size=_as_int(vc.get("spatial_merge_size", 2), "spatial_merge_size", path),
        deepstack_layers=tuple(int(i) for i in vc.get("deepstack_visual_indexes", ())),
        out_dim=_as_int(vc["out_hidden_size"], "out_hidden_size", path),
        temporal_patch_size=_as_int(vc.get("temporal_patch_size", _DEFAULT_TEMPORAL_PATCH),
                                    "temporal_patch_size", path),
        num_position_embeddings=_as_int(vc.get("num_position_embeddings", _DEFAULT_NUM_POSITION_EMBEDDINGS),
                                        "num_position_embeddings", path),
        hidden_act=str(vc.get("hidden_act", _DEFAULT_HIDDEN_ACT)),
        rope_theta=float(rope.get("rope_theta", vc.get("rope_theta", _DEFAULT_ROPE_THETA))),
    )


def vision_geometry(cfg: ModelConfig, patch_size: int | None = None,
                    merge: int | None = None) -> tuple[int, int, int]:
    """``(grid_h, grid_w, tokens_per_tile)`` of one tile: patches per side and merged tokens; ConfigError
    when the tile is not a multiple of ``patch_size * spatial_merge_size``."""
    vis = cfg.vision
    p = vis.patch_size if patch_size is None else patch_size
    m = vis.spatial_merge_size if merge is None else merge
    if p <= 0:
        raise ConfigError("vision.patch_size: required for architecture qwen3_vl")
    (h, w), (th, tw) = vis.resolution, vis.tile_size
    if th % (p * m) or tw % (p * m):
        where = f"resolution {h}x{w}" if (th, tw) == (h, w) else f"tile_size {th}x{tw} (resolution {h}x{w})"
        raise ConfigError(f"vision: {where} is not a multiple of patch_size * spatial_merge_size = "
                          f"{p}*{m} = {p * m}; choose a size that is, e.g. "
                          f"{max(1, round(th / (p * m))) * p * m}x{max(1, round(tw / (p * m))) * p * m}")
    return th // p, tw // p, (th // (p * m)) * (tw // (p * m))


def vision_config_from_hf(hf_dir: str, base: ModelConfig) -> ModelConfig:
    """``base`` with the vision fields of the checkpoint's ``vision_config`` (architecture qwen3_vl) and
    ``tokens_per_tile`` recomputed for ``base``'s fixed resolution; the image mean/std come from its
    ``preprocessor_config.json`` when present. ConfigError when the resolution is not a multiple of
    ``patch_size * spatial_merge_size`` or the vision output width differs from ``llm.hidden_dim``."""
    hf = _hf_vision(hf_dir)
    src = os.path.join(hf_dir, "config.json")
    if hf["out_dim"] != base.llm.hidden_dim:
        raise ConfigError(f"{src}: vision_config.out_hidden_size {hf['out_dim']} differs from llm.hidden_dim "
                          f"{base.llm.hidden_dim}")
    vision = dict(architecture="qwen3_vl", patch_size=hf["patch_size"], hidden_dim=hf["hidden_dim"],
                  num_layers=hf["num_layers"], num_heads=hf["num_heads"],
                  intermediate_size=hf["intermediate_size"], spatial_merge_size=hf["spatial_merge_size"],
                  deepstack_layers=list(hf["deepstack_layers"]))
    try:
        _, _, tokens = vision_geometry(base, hf["patch_size"], hf["spatial_merge_size"])
    except ConfigError as exc:
        raise ConfigError(f"{src}: {exc}") from None
    vision["tokens_per_tile"] = tokens
    pre = os.path.join(hf_dir, "preprocessor_config.json")
    if os.path.isfile(pre):
        pc = read_json(pre)
        for ours, theirs in (("mean", "image_mean"), ("std", "image_std")):
            v = pc.get(theirs)
            if isinstance(v, (list, tuple)) and len(v) == 3:
                vision[ours] = [float(x) for x in v]
    return base.with_overrides(vision=vision)


def load_hf_vision_state_dict(hf_dir: str) -> dict[str, torch.Tensor]:
    """The vision tower's tensors (float32, names without the ``model.visual.`` prefix)."""
    files = tensor_files(hf_dir, keep=lambda key: key.startswith(HF_PREFIXES))
    # One layout per checkpoint: the first prefix that names any tensor.
    prefix = next((p for p in HF_PREFIXES if any(key.startswith(p) for key in files)), None)
    if prefix is None:
        raise ConfigError(f"{hf_dir}: no vision tower tensors ({' or '.join(p + '*' for p in HF_PREFIXES)}) "
                          f"in its safetensors files")
    chosen = {key: path for key, path in files.items() if key.startswith(prefix)}
    return {key[len(prefix):]: tensor for key, tensor in read_tensors(chosen)}


_ARCH_FIELDS = ("patch_size", "hidden_dim", "num_layers", "num_heads", "intermediate_size",
                "spatial_merge_size", "deepstack_layers")


def build_qwen3_vl_vision(cfg: ModelConfig, seed: int = 0, hf_dir: str | None = None,
                          state_dict: dict | None = None) -> Qwen3VLVision:
    """The ``vision_encoder`` module of ``cfg`` (``vision.architecture == "qwen3_vl"``), in eval mode.

    Random weights from ``seed`` unless ``hf_dir`` names a Qwen3-VL checkpoint, whose vision fields must
    then equal ``cfg``'s (pass ``cfg`` through :func:`vision_config_from_hf` first); its tensors, or those of
    ``state_dict`` (names without the ``model.visual.`` prefix: a model that holds the tower elsewhere, GR00T)."""
    vis = cfg.vision
    if vis.architecture != "qwen3_vl":
        raise ConfigError(f"vision.architecture: {vis.architecture!r}, this builder is for 'qwen3_vl'")
    extra = dict(temporal_patch_size=_DEFAULT_TEMPORAL_PATCH,
                 num_position_embeddings=_DEFAULT_NUM_POSITION_EMBEDDINGS,
                 hidden_act=_DEFAULT_HIDDEN_ACT, rope_theta=_DEFAULT_ROPE_THETA)
    hidden = vis.hidden_dim or cfg.llm.hidden_dim
    dims = dict(patch_size=vis.patch_size, hidden_dim=hidden, num_layers=vis.num_layers,
                num_heads=vis.num_heads, intermediate_size=vis.intermediate_size or 4 * hidden,
                spatial_merge_size=vis.spatial_merge_size, deepstack_layers=tuple(vis.deepstack_layers))
    if hf_dir:
        hf = _hf_vision(hf_dir)
        diff = [f"vision.{k}: {dims[k]!r} in the config, {hf[k]!r} in the checkpoint"
                for k in _ARCH_FIELDS if dims[k] != hf[k]]
        if hf["out_dim"] != cfg.llm.hidden_dim:
            diff.append(f"llm.hidden_dim: {cfg.llm.hidden_dim} in the config, vision out_hidden_size "
                        f"{hf['out_dim']} in the checkpoint")
        if diff:
            raise ConfigError(f"{hf_dir}: config does not match the checkpoint (use vision_config_from_hf): "
                              + "; ".join(diff))
        extra = {k: hf[k] for k in extra}
    _, _, tokens = vision_geometry(cfg, dims["patch_size"], dims["spatial_merge_size"])
    if tokens != vis.tokens_per_tile:
        raise ConfigError(f"vision.tokens_per_tile: {vis.tokens_per_tile}, but a {vis.tile_size[0]}x"
                          f"{vis.tile_size[1]} tile gives {tokens} tokens with patch_size {dims['patch_size']} "
                          f"and spatial_merge_size {dims['spatial_merge_size']}")
    model = Qwen3VLVision(tile_size=vis.tile_size, out_dim=cfg.llm.hidden_dim, **dims, **extra)
    if hf_dir:
        model.load_hf_state_dict(load_hf_vision_state_dict(hf_dir) if state_dict is None else state_dict,
                                 source=hf_dir)
    else:
        model.init_random(seed)
    return model.eval()
