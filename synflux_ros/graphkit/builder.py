"""What a backend's build step gives ``synflux-build``: its command-line flags (an option group of their own),
the options they make, and the compile that follows the portable ONNX graph set.

A backend registers its builder in the ``BUILDERS`` table of :mod:`synflux_ros.backends` (or, from another
package, under the entry-point group ``synflux_ros.builders``); a backend without one builds the portable set
alone, which onnxruntime, openvino and qnn load as it is.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field


class BuildError(RuntimeError):
    """The graph set cannot be built: unknown backend, bad options, a graph without a module, or an exported
    graph that does not match its contract."""


@dataclass
class GraphCheck:
    """One row of ``synflux-build --check``: does a graph compile on a backend, and which of its nodes the
    backend cannot run."""
    graph: str
    compiles: bool
    error: str = ""
    unsupported: list[tuple[str, str]] = field(default_factory=list)  # (node name, op type)

    @property
    def ok(self) -> bool:
        return self.compiles and not self.unsupported


class Builder:
    """A backend's build step. Subclasses set ``name`` and ``options_type`` and override what they need."""

    name: str = ""
    options_type: type | None = None
    """The dataclass of the options this step takes (``None``: it takes none)."""
    description: str = ""
    weight_dtypes: tuple[str, ...] = ("float32",)
    """The ``synflux-build --weights`` formats this step compiles (a quantized portable set is for a backend
    that loads it as it is)."""

    def add_arguments(self, group: argparse._ArgumentGroup) -> None:
        """Add this backend's flags to its option group of ``synflux-build``."""

    def options_from_args(self, args: argparse.Namespace):
        """The options the parsed flags give (raise :class:`BuildError` naming the flag that is wrong)."""
        return None

    def prepare(self, options, weights: str) -> None:
        """Check the options and the toolchain before anything is exported (fail early, not after minutes)."""

    def check_config(self, cfg) -> None:
        """Refuse (:class:`BuildError`), before anything is exported, a config whose graphs this step cannot
        compile, naming the setting to change."""

    def compile(self, cfg, out: str, manifest: dict, options, *, hf_dir: str | None, seed: int, force: bool,
                progress) -> None:
        """Compile the portable graph set in ``out`` (its ``manifest``) into this backend's form, beside it."""

    def check(self, out: str, metas, options) -> list | None:
        """``synflux-build --check``: rows as :class:`GraphCheck` for this backend's own
        compiled form, or ``None`` to load the graphs on the backend's executor instead."""
        return None


PORTABLE_WEIGHT_DTYPES = ("float32", "int8", "int4")
"""The ``--weights`` formats of a backend without a build step, which loads the portable set as it is."""


def flags_given(group: argparse._ArgumentGroup, args: argparse.Namespace) -> list[str]:
    """The flags of ``group`` whose value differs from their default in ``args``."""
    given = []
    for action in group._group_actions:
        if getattr(args, action.dest, action.default) != action.default:
            given.append(action.option_strings[0])
    return given
