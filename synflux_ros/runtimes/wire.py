"""openpi's wire format: msgpack whose numpy arrays are maps ``{b"__ndarray__": True, b"data", b"dtype",
b"shape"}`` (scalars ``{b"__npgeneric__": True, b"data", b"dtype"}``), as ``openpi_client.msgpack_numpy`` packs
them. Decoded here without trusting the sender: numbers and booleans only (no object, void, string or
datetime arrays), the bytes must match dtype and shape, and the message, its strings, containers and arrays
are bounded before they are built."""
from __future__ import annotations

import numpy as np

# Array element kinds that carry data and nothing else: booleans, signed and unsigned integers, floats.
ARRAY_KINDS = ("b", "i", "u", "f")
MAX_NDIM = 8


class WireError(ValueError):
    """A message that is not a well-formed, bounded openpi message; the text says what was wrong."""


def _msgpack():
    """msgpack, imported when a message is packed or read: only ``executor.backend: remote`` and synflux-serve
    speak this format, so a node that does neither runs without it."""
    try:
        import msgpack
    except ImportError:
        raise ImportError("openpi's wire format needs msgpack (executor.backend remote, synflux-serve): "
                          "pip install 'msgpack>=1.0.3' or apt install python3-msgpack") from None
    return msgpack


def _pack_default(obj):
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in ARRAY_KINDS:
            raise TypeError(f"arrays of dtype {obj.dtype} are not sent (numbers and booleans only)")
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str,
                b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        if obj.dtype.kind not in ARRAY_KINDS:
            raise TypeError(f"scalars of dtype {obj.dtype} are not sent")
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send a {type(obj).__name__}")


def pack(obj) -> bytes:
    """``obj`` (dicts, lists, strings, numbers, numpy arrays and scalars) as one openpi message."""
    return _msgpack().packb(obj, default=_pack_default, use_bin_type=True)


def _dtype(value) -> np.dtype:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if not isinstance(value, str):
        raise WireError(f"array dtype: expected a string such as '<f4', got {type(value).__name__}")
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise WireError(f"array dtype {value!r} is not a numpy dtype") from None
    if dtype.kind not in ARRAY_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise WireError(f"array dtype {value!r}: only booleans, integers and floats are accepted")
    return dtype


def _array(obj: dict) -> np.ndarray:
    dtype = _dtype(obj.get(b"dtype"))
    shape, data = obj.get(b"shape"), obj.get(b"data")
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise WireError(f"array shape: expected up to {MAX_NDIM} non-negative integers, got {shape!r}")
    if not isinstance(data, bytes):
        raise WireError(f"array data: expected bytes, got {type(data).__name__}")
    count = 1
    for n in shape:  # Python integers: a product of large dimensions must not wrap around in int64
        count *= n
    if count * dtype.itemsize != len(data):
        raise WireError(f"array of shape {list(shape)} and dtype {dtype.str} needs {count * dtype.itemsize} "
                        f"bytes, the message holds {len(data)}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _scalar(obj: dict):
    dtype = _dtype(obj.get(b"dtype"))
    data = obj.get(b"data")
    if not isinstance(data, (bool, int, float)):
        raise WireError(f"scalar data: expected a number, got {type(data).__name__}")
    if dtype.kind in "iu" and not isinstance(data, bool):
        # numpy 1.x wraps an integer that does not fit (np.uint8(300) == 44, with a warning); numpy 2 raises
        info = np.iinfo(dtype)
        if not isinstance(data, int) or not info.min <= data <= info.max:
            raise WireError(f"scalar {data!r} does not fit dtype {dtype.str} ({info.min} to {info.max})")
    try:
        return dtype.type(data)
    except (OverflowError, ValueError) as exc:
        raise WireError(f"scalar {data!r} does not fit dtype {dtype.str} ({exc})") from None


def _hook(obj: dict):
    if b"__ndarray__" in obj:
        return _array(obj)
    if b"__npgeneric__" in obj:
        return _scalar(obj)
    return obj


def unpack(data: bytes, max_bytes: int, max_items: int = 4096):
    """One message back into Python objects and numpy arrays (read-only views of ``data``).

    ``max_bytes`` bounds the message and every byte string in it; ``max_items`` every list and map, so that a
    small message cannot unfold into a large structure. WireError names what was wrong."""
    if not isinstance(data, (bytes, bytearray)):
        raise WireError(f"expected a binary message, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise WireError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    msgpack = _msgpack()
    try:
        return msgpack.unpackb(bytes(data), object_hook=_hook, raw=False,
                               max_bin_len=max_bytes, max_str_len=max_bytes, max_array_len=max_items,
                               max_map_len=max_items, max_ext_len=0)
    except WireError:
        raise
    except msgpack.exceptions.StackError:
        raise WireError("not a msgpack message: nested deeper than the decoder's limit") from None
    except msgpack.exceptions.ExtraData:
        raise WireError("not a msgpack message: bytes after the end of the message") from None
    except (msgpack.exceptions.FormatError, ValueError, TypeError) as exc:
        raise WireError(f"not a msgpack message: {exc or type(exc).__name__}") from None
