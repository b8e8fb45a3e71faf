"""``synflux-build --check``: does each graph of a set compile on a backend, and which operators does it
leave out?

Each graph is loaded on its own with the backend (as a node would load it), so a graph that fails says
so with the backend's reason, and the others are still checked. A backend that can tell which operators
it does not support on its device (OpenVINO's ``query_model``: operators it would not run on that device,
or would fall back from) lists them by node name and op type.
"""
from __future__ import annotations

from ..backends import build_executor
from ..graphkit.builder import GraphCheck
from ..graphset import reader as graphset

__all__ = ["GraphCheck", "check_graph_set", "report"]


def check_graph_set(graph_dir: str, backend: str, options: dict | None = None) -> list[GraphCheck]:
    """One row per graph of the set in ``graph_dir``."""
    manifest = graphset.read_manifest(graph_dir)
    rows = []
    for meta in graphset.graph_metas(graph_dir, manifest):
        ex = build_executor(backend, [meta], graph_dir, dict(options or {}))
        try:
            ex.load()
        except Exception as exc:  # the backend's own reason, whatever its type
            rows.append(GraphCheck(meta.name, False, f"{type(exc).__name__}: {exc}"))
            continue
        try:
            finder = getattr(ex, "unsupported_nodes", None)
            unsupported = finder(meta.name) if finder else []
            rows.append(GraphCheck(meta.name, True, unsupported=list(unsupported)))
        finally:
            ex.close()
    return rows


def report(rows: list[GraphCheck], backend: str) -> str:
    lines = [f"{'graph':<24} {backend} compiles  unsupported operators"]
    for r in rows:
        ops = ", ".join(f"{name} ({op})" for name, op in r.unsupported[:8])
        more = f" and {len(r.unsupported) - 8} more" if len(r.unsupported) > 8 else ""
        lines.append(f"{r.graph:<24} {'yes' if r.compiles else 'NO':<{len(backend) + 9}} "
                     f"{ops + more if r.unsupported else ('-' if r.compiles else r.error.splitlines()[0][:200])}")
    bad = [r for r in rows if not r.ok]
    lines.append(f"{len(rows) - len(bad)} of {len(rows)} graphs compile on {backend} with every operator supported")
    return "\n".join(lines)
