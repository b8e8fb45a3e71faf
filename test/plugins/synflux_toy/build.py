"""The toy backend's build step: one flag of its own, one file beside the graph set."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from synflux_ros.graphkit.builder import BuildError, Builder

MARKER = "toy.json"


@dataclass(frozen=True)
class ToyOptions:
    level: int = 1

    def __post_init__(self):
        if self.level < 1:
            raise BuildError(f"--toy-level must be >= 1, got {self.level}")


class ToyBuilder(Builder):
    name = "toy"
    options_type = ToyOptions
    description = "portable ONNX, then toy.json naming the graphs"

    def add_arguments(self, group) -> None:
        group.add_argument("--toy-level", type=int, default=1, help="a number the build step records")

    def options_from_args(self, args) -> ToyOptions:
        return ToyOptions(level=args.toy_level)

    def prepare(self, options, weights: str) -> ToyOptions:
        return options or ToyOptions()

    def compile(self, cfg, out, manifest, options, *, hf_dir, seed, force, progress) -> None:
        with open(os.path.join(out, MARKER), "w", encoding="utf-8") as fh:
            json.dump({"level": options.level, "graphs": [g["name"] for g in manifest["graphs"]]}, fh)
        progress(f"  toy: {MARKER} written (level {options.level})")
