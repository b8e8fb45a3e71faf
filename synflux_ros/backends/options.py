"""How an executor reads ``executor.options``: into its backend's options dataclass (``options_type``), checked
as a config section is (:func:`synflux_ros.core.config.options_from_dict`), so a bad option fails at load with
its field path and "did you mean"."""
from __future__ import annotations

from ..core.config import ConfigError, options_from_dict

IGNORED = ("latency_ms",)
"""Keys the runtime passes to every executor (``executor.latency_ms``, the mock's simulated latency), which a
backend that does not simulate latency leaves alone."""


def parse_options(options_type, options: dict | None, backend: str, ignored=IGNORED):
    """``options`` (without ``ignored``) as an ``options_type`` instance; a :class:`ConfigError` names the
    backend and ``executor.options.<field>``."""
    raw = {k: v for k, v in dict(options or {}).items() if k not in ignored}
    try:
        return options_from_dict(options_type, raw)
    except ConfigError as exc:
        raise ConfigError(f"{backend} executor: {exc}") from None
