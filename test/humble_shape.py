"""Run a Python program with rclpy cut down to Humble's API shape: ``python humble_shape.py PROGRAM [ARGS...]``.

No Humble rclpy exists on PyPI, so the node processes of test/integration/test_humble_shape.py run on Jazzy's
rclpy with what Humble lacks taken away, as recorded from Humble's sources in test/data/ros_api:
every rclpy module Humble does not have (``rclpy.event_handler``, Iron's name for ``rclpy.qos_event``) cannot be
imported, every public module-level name Humble's module does not define is hidden from importers (rclpy's own
code keeps them), ``Executor.shutdown``
refuses arguments Humble's does not take, and ``ROS_DISTRO`` says humble (what Humble's setup script sets).
Methods Jazzy added to classes stay (rclpy itself calls them); the static check in
test/unit/test_ros_api_surface.py covers the package's own calls of them.
"""
from __future__ import annotations

import functools
import importlib
import importlib.abc
import json
import os
import runpy
import sys
import types
from pathlib import Path

API_DIR = Path(__file__).resolve().parent / "data" / "ros_api"


def _modules(distro: str) -> dict:
    with open(API_DIR / f"{distro}.json", encoding="utf-8") as fh:
        return json.load(fh)["modules"]


class _Refuse(importlib.abc.MetaPathFinder):
    """Makes the named modules unimportable, as they are on Humble."""

    def __init__(self, names):
        self.names = frozenset(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r} (not in Humble's rclpy)", name=fullname)
        return None


class _Shaped(types.ModuleType):
    """Stands for an rclpy module in ``sys.modules`` and in its package: every name but the hidden ones comes
    from the real module. rclpy's own code keeps the real module's globals, so it runs as it is."""

    def __init__(self, module, hidden):
        super().__init__(module.__name__, module.__doc__)
        object.__setattr__(self, "_real", module)
        object.__setattr__(self, "_hidden", frozenset(hidden))

    def __getattr__(self, attr):
        if attr in self._hidden:
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r} (not in Humble's rclpy)")
        return getattr(self._real, attr)

    def __dir__(self):
        return sorted(set(dir(self._real)) - self._hidden)


def _hide(name: str, module, hidden) -> None:
    shaped = _Shaped(module, hidden)
    for attr in ("__file__", "__path__", "__spec__", "__package__"):  # a package stays a package
        if hasattr(module, attr):
            object.__setattr__(shaped, attr, getattr(module, attr))
    sys.modules[name] = shaped
    parent, _, leaf = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], leaf, shaped)


def _humble_shutdown(shutdown):
    @functools.wraps(shutdown)
    def wrapper(self, timeout_sec=None, **kwargs):
        if kwargs:  # Humble: Executor.shutdown(self, timeout_sec=None)
            raise TypeError(f"shutdown() got an unexpected keyword argument {next(iter(kwargs))!r} (Humble's "
                            f"Executor.shutdown takes timeout_sec only)")
        return shutdown(self, timeout_sec)
    del wrapper.__wrapped__  # inspect.signature shows Humble's parameters, not Jazzy's
    return wrapper


def install() -> dict:
    """Cut the imported rclpy down to Humble's shape; returns what was removed (module -> names)."""
    humble, jazzy = _modules("humble"), _modules("jazzy")
    import rclpy  # noqa: F401  (Jazzy's, whole, before anything is taken away)
    for name in sorted(jazzy):
        if name.startswith("rclpy") and name in humble:
            try:
                importlib.import_module(name)
            except Exception:  # a module of the sources that the wheel does not ship
                pass
    removed: dict = {}
    gone = sorted(n for n in jazzy if n.startswith("rclpy") and n not in humble)
    for name in gone:
        sys.modules.pop(name, None)
        parent, _, leaf = name.rpartition(".")
        if parent in sys.modules and hasattr(sys.modules[parent], leaf):
            delattr(sys.modules[parent], leaf)
        removed[name] = ["(module)"]
    sys.meta_path.insert(0, _Refuse(gone))
    for name, entries in jazzy.items():
        module = sys.modules.get(name)
        if not name.startswith("rclpy") or name not in humble or module is None:
            continue
        hidden = sorted(a for a in set(entries) - set(humble[name]) if not a.startswith("_") and hasattr(module, a))
        if hidden:
            _hide(name, module, hidden)
            removed[name] = hidden
    from rclpy.executors import Executor
    Executor.shutdown = _humble_shutdown(Executor.shutdown)
    os.environ["ROS_DISTRO"] = "humble"
    return removed


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python humble_shape.py PROGRAM [ARGS...]")
    removed = install()
    print(f"humble_shape: removed {sum(len(v) for v in removed.values())} names of Jazzy's rclpy "
          f"({', '.join(sorted(removed))})", file=sys.stderr, flush=True)
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
