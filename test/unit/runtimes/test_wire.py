"""openpi's msgpack-numpy layout, decoded without trusting the sender (synflux_ros.runtimes.wire)."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from synflux_ros.runtimes import wire

MB = 1 << 20


def openpi_array(arr: np.ndarray) -> dict:
    """The map openpi_client.msgpack_numpy.pack_array makes of an array."""
    return {b"__ndarray__": True, b"data": arr.tobytes(), b"dtype": arr.dtype.str, b"shape": arr.shape}


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int32", "int64", "float16", "float32", "float64", "bool"])
def test_arrays_round_trip_in_openpi_s_layout(dtype):
    arr = (np.arange(24).reshape(2, 3, 4) % 2).astype(dtype)
    packed = wire.pack({"a": arr, "s": np.float32(1.5), "nested": {"b": [1, "x"]}})
    # the same bytes openpi's packer writes (its default hook, msgpack's bin type)
    theirs = msgpack.packb({"a": openpi_array(arr), "s": {b"__npgeneric__": True, b"data": 1.5, b"dtype": "<f4"},
                            "nested": {"b": [1, "x"]}})
    assert packed == theirs
    back = wire.unpack(packed, MB)
    assert back["a"].dtype == arr.dtype and back["a"].shape == arr.shape and np.array_equal(back["a"], arr)
    assert back["s"] == np.float32(1.5) and isinstance(back["s"], np.float32)
    assert back["nested"] == {"b": [1, "x"]}


@pytest.mark.parametrize("obj,needle", [
    ({b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "|O", b"shape": [1]}, "only booleans, integers"),
    ({b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "<U2", b"shape": [1]}, "only booleans, integers"),
    ({b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "V8", b"shape": [1]}, "only booleans, integers"),
    ({b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "<M8[s]", b"shape": [1]}, "only booleans, integers"),
    ({b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "nonsense", b"shape": [1]}, "not a numpy dtype"),
    ({b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": 5, b"shape": [1]}, "expected a string"),
    ({b"__ndarray__": True, b"data": b"\0" * 7, b"dtype": "<f4", b"shape": [2]}, "needs 8 bytes"),
    ({b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "<f4", b"shape": [-2]}, "non-negative integers"),
    ({b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "<f4", b"shape": [1] * 9}, "up to 8"),
    ({b"__ndarray__": True, b"data": "text", b"dtype": "<f4", b"shape": [1]}, "expected bytes"),
    ({b"__npgeneric__": True, b"data": "1", b"dtype": "<f4"}, "expected a number"),
    ({b"__npgeneric__": True, b"data": 300, b"dtype": "|u1"}, "does not fit"),
    # numpy 1.x (Humble's) would wrap these silently instead of raising
    ({b"__npgeneric__": True, b"data": -1, b"dtype": "|u1"}, "does not fit dtype |u1 (0 to 255)"),
    ({b"__npgeneric__": True, b"data": 2**40, b"dtype": "<i4"}, "does not fit dtype <i4"),
    ({b"__npgeneric__": True, b"data": 1.5, b"dtype": "<i4"}, "does not fit dtype <i4"),
    # dimensions whose product passes int64: the size is stated, not wrapped into a negative number
    ({b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "<f4", b"shape": [2**62, 4]},
     f"needs {2**62 * 4 * 4} bytes"),
])
def test_malformed_arrays_are_refused_naming_the_fault(obj, needle):
    with pytest.raises(wire.WireError, match=needle.replace("[", r"\[")):
        wire.unpack(msgpack.packb({"x": obj}), MB)


def test_bounds_are_checked_before_anything_is_built():
    big = wire.pack({"x": np.zeros(2 * MB, np.uint8)})
    with pytest.raises(wire.WireError, match="exceeds the limit of 1048576"):
        wire.unpack(big, MB)
    # a short message whose header claims a huge list or map is refused, not allocated
    with pytest.raises(wire.WireError, match="not a msgpack message"):
        wire.unpack(b"\xdd\xff\xff\xff\xff", MB)  # array32 of 4 billion items
    with pytest.raises(wire.WireError, match="not a msgpack message"):
        wire.unpack(msgpack.packb(list(range(5000))), MB)
    with pytest.raises(wire.WireError, match="nested deeper than the decoder's limit"):
        wire.unpack(b"\x91" * 100000 + b"\x01", 10 * MB)  # nesting deeper than the decoder's stack
    with pytest.raises(wire.WireError, match="binary message"):
        wire.unpack("text", MB)
    with pytest.raises(wire.WireError, match="bytes after the end"):
        wire.unpack(wire.pack({"a": 1}) + b"\x00", MB)  # trailing bytes


def test_objects_cannot_be_sent():
    with pytest.raises(TypeError):
        wire.pack({"x": np.array([object()], dtype=object)})
    with pytest.raises(TypeError):
        wire.pack({"x": object()})


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_decode_or_are_refused(data):
    try:
        wire.unpack(data, MB)
    except wire.WireError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=8))
def test_mutations_of_a_valid_message_decode_or_are_refused(edits):
    data = bytearray(wire.pack({"observation/image": np.zeros((8, 8, 3), np.uint8), "prompt": "go",
                                "state": np.arange(4, dtype=np.float64)}))
    for pos, value in edits:
        data[pos % len(data)] = value
    try:
        out = wire.unpack(bytes(data), MB)
    except wire.WireError:
        return
    for v in (out.values() if isinstance(out, dict) else []):
        if isinstance(v, np.ndarray):
            assert v.dtype.kind in wire.ARRAY_KINDS
