"""Patch ViT vision encoder (``vision.architecture: vit``), random weights.

pixel_values [T, 3, th, tw] (already normalised) -> patch embedding (a strided convolution) + learned
position embeddings -> ``vision.num_layers`` pre-norm transformer blocks -> final LayerNorm -> the patch grid
merged down to ``tokens_per_tile`` tokens per tile (``vision.token_merge``: the mean of each block of patches,
or SmolVLM's pixel shuffle, each block's patches side by side in one token) -> linear projector to the LLM
width (times ``vision.output_scale``) -> vision_embeds [T * tokens_per_tile, H]. Parameter names follow
SigLIP's layout.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ...core.config import ConfigError, ModelConfig
from .decoder import gelu_tanh


def _factor_pairs(n: int):
    return [(a, n // a) for a in range(1, n + 1) if n % a == 0]


def vit_geometry(cfg: ModelConfig) -> dict:
    """Patch size, patch grid and token grid of one tile.

    With ``patch_size`` set, the patch grid is (th // p, tw // p) and it is average-pooled to a token grid
    (gh, gw) with gh * gw = tokens_per_tile that divides it. With ``patch_size: 0`` the token grid *is*
    the patch grid (patch = tile side / sqrt(tokens_per_tile) for square tiles).
    """
    vis = cfg.vision
    th, tw = vis.tile_size
    n = vis.tokens_per_tile
    if vis.patch_size:
        ph = pw = vis.patch_size
        grid_h, grid_w = th // ph, tw // pw
        if grid_h < 1 or grid_w < 1:
            raise ConfigError(f"vision.patch_size: {ph} is larger than the tile {th}x{tw}")
        pairs = [(a, b) for a, b in _factor_pairs(n) if grid_h % a == 0 and grid_w % b == 0]
        if not pairs:
            raise ConfigError(f"vision.tokens_per_tile: {n} tokens cannot be pooled from a {grid_h}x{grid_w} "
                              f"patch grid (patch_size {ph}, tile {th}x{tw})")
        target = grid_h / grid_w
        gh, gw = min(pairs, key=lambda ab: (abs(math.log(ab[0] / ab[1] / target)), ab))
        if vis.token_merge == "pixel_shuffle" and grid_h // gh != grid_w // gw:
            raise ConfigError(f"vision.tokens_per_tile: pixel_shuffle merges square blocks of patches; {n} tokens "
                              f"from a {grid_h}x{grid_w} patch grid would take {grid_h // gh}x{grid_w // gw} blocks")
    else:
        if vis.token_merge == "pixel_shuffle":
            raise ConfigError("vision.token_merge: pixel_shuffle merges blocks of patches; set vision.patch_size")
        pairs = [(a, b) for a, b in _factor_pairs(n) if th % a == 0 and tw % b == 0]
        if not pairs:
            raise ConfigError(f"vision.tokens_per_tile: {n} tokens do not tile a {th}x{tw} tile into whole "
                              f"patches; set vision.patch_size")
        gh, gw = min(pairs, key=lambda ab: (abs(math.log((th / ab[0]) / (tw / ab[1]))), ab))
        ph, pw = th // gh, tw // gw
        grid_h, grid_w = gh, gw
    return {"patch": (ph, pw), "grid": (grid_h, grid_w), "tokens": (gh, gw)}


class VisionAttention(nn.Module):
    def __init__(self, width: int, heads: int, tiles: int, patches: int):
        super().__init__()
        self.width, self.heads, self.head_dim = width, heads, width // heads
        self.tiles, self.patches = tiles, patches
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x):
        t, n = self.tiles, self.patches

        def split(y):
            return y.reshape(t, n, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * self.head_dim ** -0.5, dim=-1)
        ctx = torch.matmul(probs, v).transpose(1, 2).reshape(t * n, self.width)
        return self.out_proj(ctx)


class VisionMLP(nn.Module):
    def __init__(self, width: int, intermediate: int):
        super().__init__()
        self.fc1 = nn.Linear(width, intermediate)
        self.fc2 = nn.Linear(intermediate, width)

    def forward(self, x):
        return self.fc2(gelu_tanh(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, width: int, heads: int, intermediate: int, tiles: int, patches: int, eps: float = 1e-6):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(width, eps=eps)
        self.self_attn = VisionAttention(width, heads, tiles, patches)
        self.layer_norm2 = nn.LayerNorm(width, eps=eps)
        self.mlp = VisionMLP(width, intermediate)

    def forward(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class PatchEmbeddings(nn.Module):
    def __init__(self, width: int, patch: tuple[int, int], tiles: int, num_patches: int):
        super().__init__()
        self.width, self.tiles, self.num_patches = width, tiles, num_patches
        self.patch_embedding = nn.Conv2d(3, width, kernel_size=patch, stride=patch)
        self.position_embedding = nn.Parameter(torch.empty(num_patches, width))

    def init_extra(self, generator: torch.Generator, std: float) -> None:
        with torch.no_grad():
            self.position_embedding.normal_(0.0, std, generator=generator)

    def forward(self, pixel_values):
        x = self.patch_embedding(pixel_values)  # [T, W, grid_h, grid_w]
        x = x.reshape(self.tiles, self.width, self.num_patches).transpose(1, 2)  # [T, patches, W], row-major
        return x + self.position_embedding


class VitVisionEncoder(nn.Module):
    """vision_encoder graph: pixel_values [T, 3, th, tw] -> vision_embeds [T * tokens_per_tile, H]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        vis = cfg.vision
        width = vis.hidden_dim or cfg.llm.hidden_dim
        if width % vis.num_heads:
            raise ConfigError(f"vision.num_heads: {vis.num_heads} does not divide the vision width {width}")
        geo = vit_geometry(cfg)
        self.grid = geo["grid"]
        self.tokens = geo["tokens"]
        self.num_tiles, self.width = vis.num_tiles, width
        patches = self.grid[0] * self.grid[1]
        self.embeddings = PatchEmbeddings(width, geo["patch"], self.num_tiles, patches)
        eps = vis.layer_norm_eps
        self.encoder = nn.ModuleList(
            VisionBlock(width, vis.num_heads, vis.intermediate_size or 4 * width, self.num_tiles, patches, eps)
            for _ in range(vis.num_layers))
        self.post_layernorm = nn.LayerNorm(width, eps=eps)
        self.shuffle = vis.token_merge == "pixel_shuffle"
        block = (self.grid[0] // self.tokens[0]) * (self.grid[1] // self.tokens[1]) if self.shuffle else 1
        self.multi_modal_projector = nn.Linear(width * block, cfg.llm.hidden_dim, bias=vis.projector_bias)
        self.output_scale = vis.output_scale if vis.output_scale != 1.0 else None

    def forward(self, pixel_values):
        # The blocks run on [T * patches, W] rows: a [T, patches, W] activation makes ONNX Runtime wrap each of
        # the block's six biased products (fused into Gemm, which takes 2-D operands) in two Reshapes.
        x = self.embeddings(pixel_values).reshape(-1, self.width)
        for block in self.encoder:
            x = block(x)
        x = self.post_layernorm(x)
        (grid_h, grid_w), (gh, gw) = self.grid, self.tokens
        if self.shuffle:  # token (I, J) = patches (I s + r, J s + c) side by side, feature (r s + c) W + d
            s = grid_h // gh
            x = x.reshape(self.num_tiles, gh, s, gw, s, self.width).permute(0, 1, 3, 2, 4, 5)
            x = x.reshape(self.num_tiles * gh * gw, s * s * self.width)
        else:
            if (grid_h, grid_w) != (gh, gw):
                x = x.reshape(self.num_tiles, gh, grid_h // gh, gw, grid_w // gw, self.width).mean(dim=(2, 4))
            x = x.reshape(self.num_tiles * gh * gw, self.width)
        x = self.multi_modal_projector(x)
        return (x * self.output_scale if self.output_scale is not None else x,)
