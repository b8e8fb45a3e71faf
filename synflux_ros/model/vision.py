"""Fixed-resolution vision encoder: HxWx3 uint8 frame -> tiles -> one static graph -> vision tokens."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.executor import Executor
from ..core.config import PreprocessSpec
from .image import Preprocessor
from ..core.config import ModelConfig


@dataclass(frozen=True)
class ImageFeatures:
    """What the language model receives for one image: ``embeds`` [N, H] at its N image-token positions and,
    for Qwen3-VL, ``deepstack`` [K, N, H] (added after decoder layers 0 .. K-1 at those positions)."""
    embeds: np.ndarray
    deepstack: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return self.embeds.shape[0]


class VisionEncoder:
    """Preprocesses a frame to the fixed resolution and runs the vision encoder graph -> vision tokens."""

    def __init__(self, cfg: ModelConfig, executor: Executor):
        v = cfg.vision
        self.ex = executor
        self.num_tokens = v.num_tokens
        self.preprocess = Preprocessor(PreprocessSpec(
            resolution=tuple(v.resolution), tile_size=tuple(v.tile_size), resize=v.resize,
            pad_value=v.pad_value, mean=tuple(v.mean), std=tuple(v.std), interpolation=v.interpolation,
            crop_fraction=v.crop_fraction, crop_edge=v.crop_edge))

    def encode(self, pixel_values: np.ndarray) -> np.ndarray:
        """Preprocessed tiles [T, 3, th, tw] -> vision embeddings [num_tokens, H]."""
        return self.ex.run("vision_encoder", {"pixel_values": pixel_values})["vision_embeds"]

    def __call__(self, rgb: np.ndarray) -> np.ndarray:
        return self.encode(self.preprocess(rgb))

    def features(self, rgb: np.ndarray) -> ImageFeatures:
        """A frame -> every output of the vision encoder graph (the DeepStack maps too, when it has them)."""
        out = self.ex.run("vision_encoder", {"pixel_values": self.preprocess(rgb)})
        return ImageFeatures(out["vision_embeds"], out.get("deepstack_embeds"))
