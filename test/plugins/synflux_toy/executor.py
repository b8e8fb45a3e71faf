"""The toy backend's executor: the mock's computation on a graph set its build step has marked."""
from __future__ import annotations

import json
import os

from synflux_ros.backends.mock.executor import MockExecutor

from .build import MARKER


class ToyExecutor(MockExecutor):
    name = "toy"

    def load(self):
        marker = os.path.join(self.graph_dir, MARKER)
        if not os.path.isfile(marker):
            raise FileNotFoundError(f"toy backend: {marker} not found (build with synflux-build --backend toy)")
        with open(marker, encoding="utf-8") as fh:
            self.level = json.load(fh)["level"]
        return super().load()
