"""What the backends' sidecars share: a sidecar is the JSON description a backend's build step writes next to
what it compiled (``rknn/<target>/rknn.json``, ``tensorrt/<device>/tensorrt.json``) and its executor reads
back. Each backend declares the schema as frozen dataclasses with ``from_json``/``to_json``; this module reads
and writes the file and checks a field's type, so a bad sidecar is refused naming the field. Standard library
only (run time)."""
from __future__ import annotations

import json
import os

_KINDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "an object",
          list: "a list"}


class SidecarError(ValueError):
    """A sidecar that cannot be read or does not follow its schema."""


def load(path: str, error: type[SidecarError] = SidecarError):
    """The JSON in ``path``: ``FileNotFoundError`` when there is none, ``error`` (a backend's subclass of
    :class:`SidecarError`) when it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise error(f"unreadable ({exc})") from None


def write(path: str, data: dict, sort_keys: bool = False) -> None:
    """Write ``data`` as JSON to ``path`` atomically (a reader sees the old file or the new one)."""
    tmp = f"{path}.partial-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=sort_keys)
    os.replace(tmp, path)


def with_optional(data: dict, **optional) -> dict:
    """``data`` with each of ``optional`` that is not None, in that order (an absent value stays out of the
    file rather than being written as null)."""
    data.update((k, v) for k, v in optional.items() if v is not None)
    return data


def field(data: dict, name: str, kind, default=..., where: str = "", optional: bool = False,
          error: type[SidecarError] = SidecarError):
    """``data[name]`` checked to be of ``kind`` (a type; an int passes for a float, a bool not for an int);
    ``default`` when absent (no default: the field is required), ``optional``: None passes too. Raises
    ``error`` naming ``where`` and the field."""
    label = f"{where}: " if where else ""
    if name not in data:
        if default is ...:
            raise error(f"{label}field {name!r} is missing")
        return default
    value = data[name]
    if value is None and optional:
        return None
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind in (int, float))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        raise error(f"{label}field {name!r} must be {_KINDS.get(kind, kind.__name__)}"
                    f"{' or null' if optional else ''}, got {value!r}")
    return value
