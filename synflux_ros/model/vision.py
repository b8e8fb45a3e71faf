"""Fixed-resolution vision encoder: HxWx3 uint8 frame -> tiles -> one static graph -> vision tokens."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
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
        self.per_call = cfg.vision_images_per_call
        spec = PreprocessSpec(
            resolution=tuple(v.resolution), tile_size=tuple(v.tile_size), resize=v.resize,
            pad_value=v.pad_value, mean=tuple(v.mean), std=tuple(v.std), interpolation=v.interpolation,
            crop_fraction=v.crop_fraction, crop_edge=v.crop_edge)
        self.preprocess = Preprocessor(spec)
        # The other images of a call are resized on threads of their own, each with its own Preprocessor (one is
        # not thread-safe); numpy releases the interpreter lock in the resampling's array operations.
        self._others = [Preprocessor(spec) for _ in range(self.per_call - 1)]
        self._pool = (ThreadPoolExecutor(len(self._others), thread_name_prefix="synflux-preprocess")
                      if self._others else None)

    def encode(self, pixel_values: np.ndarray) -> np.ndarray:
        """Preprocessed tiles [T, 3, th, tw] -> vision embeddings [num_tokens, H]."""
        return self.ex.run("vision_encoder", {"pixel_values": pixel_values})["vision_embeds"]

    def __call__(self, rgb: np.ndarray) -> np.ndarray:
        return self.encode(self.preprocess(rgb))

    def features(self, rgb: np.ndarray) -> ImageFeatures:
        """A frame -> every output of the vision encoder graph (the DeepStack maps too, when it has them)."""
        out = self.ex.run("vision_encoder", {"pixel_values": self.preprocess(rgb)})
        return ImageFeatures(out["vision_embeds"], out.get("deepstack_embeds"))

    def features_of(self, images: list[np.ndarray]) -> list[ImageFeatures]:
        """Several frames -> each one's features (views of the calls' outputs), in calls of the graph's
        ``pixel_values [n * T, 3, th, tw]``: n = ``ModelConfig.vision_images_per_call`` images at a time."""
        tiles, n = self.preprocess.output_shape, self.per_call
        rows, feats = self.num_tokens, []
        for first in range(0, len(images), n):
            group = images[first:first + n]
            if len(group) != n:
                raise ValueError(f"the vision encoder takes {n} images per call, got {len(images)} images")
            pixels = np.empty((n * tiles[0], *tiles[1:]), np.float32)
            rows_of = [pixels[i * tiles[0]:(i + 1) * tiles[0]] for i in range(n)]
            pending = [self._pool.submit(pre, rgb, out=rows)
                       for pre, rgb, rows in zip(self._others, group[1:], rows_of[1:])]
            try:
                self.preprocess(group[0], out=rows_of[0])
            finally:
                for done in pending:
                    done.result()  # its ImageError, if the image was bad
            out = self.ex.run("vision_encoder", {"pixel_values": pixels})
            embeds, deepstack = out["vision_embeds"], out.get("deepstack_embeds")
            feats += [ImageFeatures(embeds[i * rows:(i + 1) * rows],
                                    None if deepstack is None else deepstack[:, i * rows:(i + 1) * rows])
                      for i in range(n)]
        return feats
