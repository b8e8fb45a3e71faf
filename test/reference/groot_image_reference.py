#!/usr/bin/env python3
"""LeRobot 0.6.1's GR00T N1.7 camera geometry and Qwen image processor, as the reference the project's bicubic
preprocessing is compared with.

Run it with the interpreter of ``.venv-lerobot06`` (``make lerobot06-venv``: LeRobot 0.6.1, torch, torchvision,
transformers 5.5.4):

    groot_image_reference.py --inputs frames.npz --out pixels.npz [--crop-fraction F] [--edge E] [--target T]

``frames.npz`` holds HxWx3 uint8 RGB frames under any names; ``pixels.npz`` gets, under the same names, the
float32 [3, T, T] image the vision tower sees for each: the frame as a (3, H, W) uint8 tensor on the CPU (as
``GrootN17VLMEncodeStep`` hands it over) through ``processor_groot._transform_n1_7_image_for_vlm_torch`` (the
default, non-albumentations path: square resize, centre crop, resize to the target, bicubic with antialias) with
the N1.7 defaults image_crop_size (230, 230) and image_target_size (T, T) unless --crop-fraction or --edge are
given, then transformers' ``Qwen2VLImageProcessor`` with Cosmos-Reason2-2B's preprocessor_config.json values
(patch 16, temporal patch 2, merge 2, mean = std = 0.5, shortest_edge 65536, longest_edge 16777216; the Hub is
not reached, so they are written here). Its flat patches are put back into the image (an exact reshape of the
processor's view/permute); the two temporal copies of each patch must be equal. Nothing is pickled. The last
stdout line is a JSON summary: the names, the grid each frame got and the processor's image size.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

#: Cosmos-Reason2-2B's preprocessor_config.json (the Qwen3-VL image processor settings LeRobot loads for N1.7).
QWEN_IMAGE_PROCESSOR = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16,
                        "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                        "image_std": [0.5, 0.5, 0.5]}


def unpatchify(flat: np.ndarray, grid: tuple[int, int, int], patch: int, temporal: int, merge: int) -> np.ndarray:
    """The processor's flat patches [t*h*w, C*temporal*patch*patch] of one image -> [C, h*patch, w*patch]."""
    t, gh, gw = grid
    assert t == 1, grid
    channels = flat.shape[1] // (temporal * patch * patch)
    # Axes as the processor lays them out: (gh/m, gw/m, m, m, C, temporal, patch, patch).
    x = flat.reshape(gh // merge, gw // merge, merge, merge, channels, temporal, patch, patch)
    copies = x.transpose(5, 4, 0, 2, 6, 1, 3, 7).reshape(temporal, channels, gh * patch, gw * patch)
    assert all(np.array_equal(copies[0], c) for c in copies[1:]), "the temporal copies differ"
    return copies[0]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", required=True, help=".npz of HxWx3 uint8 frames")
    parser.add_argument("--out", required=True, help=".npz of float32 [3, T, T] images, same names")
    parser.add_argument("--crop-fraction", type=float, default=None, help="default: image_crop_size 230 / T")
    parser.add_argument("--edge", type=int, default=None, help="shortest_image_edge (default: T)")
    parser.add_argument("--target", type=int, default=256, help="image_target_size (T, T)")
    args = parser.parse_args(argv)

    import torch
    from lerobot.policies.groot import processor_groot
    from transformers import Qwen2VLImageProcessor

    torch.set_num_threads(2)
    processor = Qwen2VLImageProcessor(**QWEN_IMAGE_PROCESSOR)
    cfg = QWEN_IMAGE_PROCESSOR
    out, grids = {}, {}
    with np.load(args.inputs, allow_pickle=False) as frames:
        for name in frames.files:
            frame = frames[name]
            assert frame.dtype == np.uint8 and frame.ndim == 3 and frame.shape[2] == 3, (name, frame.shape)
            chw = torch.from_numpy(np.ascontiguousarray(frame)).permute(2, 0, 1).contiguous()
            image = processor_groot._transform_n1_7_image_for_vlm_torch(
                chw, image_crop_size=[230, 230], image_target_size=[args.target, args.target],
                shortest_image_edge=args.edge, crop_fraction=args.crop_fraction)
            assert image.dtype == torch.uint8, image.dtype
            encoded = processor(images=[image], return_tensors="pt")
            grid = tuple(int(v) for v in encoded["image_grid_thw"][0])
            flat = encoded["pixel_values"].numpy()
            assert flat.dtype == np.float32, flat.dtype
            out[name] = unpatchify(flat, grid, cfg["patch_size"], cfg["temporal_patch_size"], cfg["merge_size"])
            grids[name] = grid
    np.savez(args.out, **out)
    print(json.dumps({"names": sorted(out), "grids": grids,
                      "shapes": {k: list(v.shape) for k, v in out.items()}}))


if __name__ == "__main__":
    main()
