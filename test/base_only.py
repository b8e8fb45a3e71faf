"""Run a Python program as if only the base requirements were installed: ``python base_only.py PROGRAM [ARGS...]``.

The base requirements are what a robot needs to run the nodes: requirements-ros.txt and what its packages
require, the ROS packages, the standard library and synflux_ros. Every other top-level module of this
environment (torch, transformers, onnx, onnxruntime, openvino, Ray, MuJoCo, ...) raises ModuleNotFoundError
on import, as it would in a venv made from requirements-ros.txt alone (test/integration/test_base_requirements.py).
"""
from __future__ import annotations

import importlib.abc
import importlib.metadata as md
import re
import runpy
import sys
from pathlib import Path

REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements-ros.txt"
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(lines) -> list[str]:
    names = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        if ";" in line and "extra ==" in line.split(";", 1)[1]:
            continue  # an optional extra of a package, not a requirement of it
        match = _NAME.match(line)
        if match:
            names.append(_canonical(match.group(1)))
    return names


def base_distributions() -> set[str]:
    """The distributions requirements-ros.txt names, with everything they require, as installed here."""
    todo = _requirement_names(REQUIREMENTS.read_text(encoding="utf-8").splitlines())
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo.extend(_requirement_names(requires))
    return seen


def _top_levels(dist: md.Distribution) -> set[str]:
    """The top-level modules a distribution installs: its top_level.txt, else its RECORD (Python 3.10's
    packages_distributions reads only the first, which wheels built with meson, numpy's, do not have)."""
    text = dist.read_text("top_level.txt")
    if text:
        return {line.strip() for line in text.splitlines() if line.strip()}
    names = set()
    for path in dist.files or ():
        first = path.parts[0] if path.parts else ""
        if not first or first.endswith((".dist-info", ".egg-info", ".data")) or first in ("..", "__pycache__"):
            continue
        names.add(first[:-3] if first.endswith(".py") else first.split(".")[0])
    return names


def allowed_modules() -> set[str]:
    """Top-level modules a base-only environment has."""
    allowed = set(sys.stdlib_module_names) | {"synflux_ros", "__main__"}
    base = base_distributions()
    for dist in md.distributions():
        name = _canonical(dist.metadata["Name"] or "")
        if name in base or name.startswith("ros-"):
            allowed |= _top_levels(dist)
    return allowed


class BaseOnly(importlib.abc.MetaPathFinder):
    """Refuses every top-level module outside the base requirements (their own imports go on as usual)."""

    def __init__(self, allowed: set[str]):
        self.allowed = allowed
        self.refused: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top in self.allowed or top.startswith("_"):
            return None
        # a ROS package built into the prefix (generated messages) has no distribution record: it is allowed
        # when it lives under the same site-packages as rclpy's messages and ships a package.xml beside it
        if _is_ros_package(top):
            self.allowed.add(top)
            return None
        self.refused.add(top)
        raise ModuleNotFoundError(f"No module named {fullname!r} (not in the base requirements)", name=fullname)


def _is_ros_package(top: str) -> bool:
    for entry in sys.path:
        share = Path(entry).parents[2] / "share" / top / "package.xml" if entry.endswith("site-packages") else None
        if share is not None and share.is_file():
            return True
    return False


def install() -> BaseOnly:
    finder = BaseOnly(allowed_modules())
    sys.meta_path.insert(0, finder)
    return finder


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python base_only.py PROGRAM [ARGS...]")
    install()
    print("base_only: only the base requirements can be imported", file=sys.stderr, flush=True)
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
