"""Property-based tests of the image decoders over the fields of sensor_msgs/Image and CompressedImage.

For any field values the decoders either return an HxWx3 uint8 RGB array with the right pixels or raise
ImageError whose message names the field at fault; nothing else escapes, and no input allocates more
than its own data (sizes beyond the pixel limit are refused from the fields alone).
"""
from __future__ import annotations

import array
import io

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from synflux_ros.core.config import DEFAULT_MAX_INPUT_PIXELS
from synflux_ros.model.image import SUPPORTED_ENCODINGS, ImageError, decode_compressed, decode_raw
from images import encode, jpeg_with_size, png_header_only  # noqa: E402

Image = pytest.importorskip("PIL.Image")
# Forged headers announce frames beyond Pillow's own warning threshold; the refusal is what is tested.
pytestmark = pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])

CHANNELS = {"rgb8": 3, "bgr8": 3, "rgba8": 4, "bgra8": 4, "mono8": 1}
# Byte offset of R, G, B inside one pixel of each encoding.
RGB_OFFSETS = {"rgb8": (0, 1, 2), "bgr8": (2, 1, 0), "rgba8": (0, 1, 2), "bgra8": (2, 1, 0), "mono8": (0, 0, 0)}
U32 = 2**32 - 1

# ------------------------------------------------------------------------------------------ raw images

encodings = st.one_of(
    st.sampled_from(SUPPORTED_ENCODINGS),
    st.sampled_from(["RGB8", "rgb8 ", "", "16UC1", "32FC1", "bayer_rggb8", "yuv422", "8UC3", "mono16"]),
    st.text(max_size=12),
)
sizes = st.one_of(st.integers(0, 24), st.sampled_from([0, 1, 4096, 4097, 2**16, 2**31, U32]), st.integers(0, U32))


@st.composite
def raw_images(draw):
    """Fields of a sensor_msgs/Image: a consistent small image with a few fields replaced by anything."""
    wild = set(draw(st.lists(st.sampled_from(["encoding", "height", "width", "step", "data", "max_pixels"]),
                             max_size=3)))
    encoding = draw(encodings if "encoding" in wild else st.sampled_from(SUPPORTED_ENCODINGS))
    height = draw(sizes if "height" in wild else st.integers(1, 16))
    width = draw(sizes if "width" in wild else st.integers(1, 16))
    row = width * CHANNELS.get(encoding, 3)
    step = draw(st.one_of(st.integers(0, U32), st.sampled_from([0, 1, max(0, row - 1)]))) if "step" in wild \
        else row + draw(st.integers(0, 3))
    exact = step * height
    if "data" in wild or exact > 4096:
        data = draw(st.one_of(st.binary(max_size=64),
                              st.builds(lambda d: b"\x00" * max(0, min(exact + d, 8192)), st.integers(-3, 3))))
    else:
        data = draw(st.binary(min_size=exact, max_size=exact))
    container = draw(st.sampled_from([bytes, bytearray, memoryview, "array", "numpy"]))
    if container == "array":
        data = array.array("B", data)
    elif container == "numpy":
        data = np.frombuffer(data, np.uint8)
    else:
        data = container(data)
    max_pixels = draw(st.integers(1, 300)) if "max_pixels" in wild else DEFAULT_MAX_INPUT_PIXELS
    return dict(encoding=encoding, height=height, width=width, step=step, data=data,
                is_bigendian=draw(st.integers(0, 255)), max_pixels=max_pixels)


def expected_fault(f) -> tuple[str, ...] | None:
    """The words the error must contain, or None when the fields are valid (the documented check order)."""
    ch = CHANNELS.get(f["encoding"])
    if ch is None:
        return ("encoding", repr(f["encoding"]))
    h, w = f["height"], f["width"]
    if h <= 0 or w <= 0:
        return ("width", "height", "zero-size")
    if h * w > f["max_pixels"]:
        return ("width", "height", "pixels", str(f["max_pixels"]), "vision.max_input_pixels")
    if f["step"] < w * ch:
        return ("step", str(f["step"]))
    if len(memoryview(f["data"]).cast("B")) != f["step"] * h:
        return ("data", "step*height")
    return None


def reference_rgb(f) -> np.ndarray:
    """The RGB image the fields describe, read pixel by pixel from the byte offsets."""
    raw = np.frombuffer(bytes(f["data"]), np.uint8)
    ch, step = CHANNELS[f["encoding"]], f["step"]
    ys, xs = np.mgrid[:f["height"], :f["width"]]
    return np.stack([raw[ys * step + xs * ch + off] for off in RGB_OFFSETS[f["encoding"]]], axis=-1)


@FUZZ
@given(raw_images())
@example(dict(encoding="rgb8", height=U32, width=U32, step=U32, data=b"", is_bigendian=0,
              max_pixels=DEFAULT_MAX_INPUT_PIXELS))
@example(dict(encoding="mono8", height=4097, width=4096, step=4096, data=b"\x00", is_bigendian=1,
              max_pixels=DEFAULT_MAX_INPUT_PIXELS))
@example(dict(encoding="bgra8", height=2, width=3, step=13, data=bytes(range(26)), is_bigendian=1,
              max_pixels=6))
def test_decode_raw_returns_rgb_or_names_the_bad_field(fields):
    fault = expected_fault(fields)
    try:
        out = decode_raw(**fields)
    except ImageError as exc:
        assert fault is not None, f"valid fields refused: {exc}"
        message = str(exc)
        for word in fault:
            assert word in message, f"{word!r} missing from {message!r}"
        return
    assert fault is None, f"accepted although {fault[0]} is bad"
    assert out.shape == (fields["height"], fields["width"], 3) and out.dtype == np.uint8
    np.testing.assert_array_equal(out, reference_rgb(fields))


@FUZZ
@given(encoding=st.sampled_from(SUPPORTED_ENCODINGS),
       field=st.sampled_from(["height", "width", "step"]),
       value=st.one_of(st.floats(allow_nan=True, allow_infinity=True).filter(lambda v: not float(v).is_integer()),
                       st.sampled_from([None, "3", b"3", [3], float("nan"), float("inf"), True])))
def test_non_integer_sizes_name_the_field(encoding, field, value):
    fields = dict(encoding=encoding, height=2, width=2, step=2 * CHANNELS[encoding], data=b"\x00" * 64)
    fields[field] = value
    with pytest.raises(ImageError, match=field):
        decode_raw(**fields)


@FUZZ
@given(data=st.one_of(st.none(), st.text(max_size=12), st.lists(st.integers(0, 255), max_size=12),
                      st.integers(), st.just(np.zeros((4, 4), np.uint8)[:, ::2])))
def test_data_that_is_not_a_byte_buffer_names_data(data):
    with pytest.raises(ImageError, match="data"):
        decode_raw("mono8", 2, 2, 2, data)


# ------------------------------------------------------------------------------------ compressed images

PNG_MODES = ["1", "L", "LA", "P", "RGB", "RGBA", "I;16"]
JPEG_MODES = ["L", "RGB", "CMYK"]


@st.composite
def valid_images(draw):
    fmt = draw(st.sampled_from(["PNG", "JPEG"]))
    mode = draw(st.sampled_from(PNG_MODES if fmt == "PNG" else JPEG_MODES))
    w, h = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    img = Image.new(mode, (w, h))
    bands = len(img.getbands())
    top = 65535 if mode == "I;16" else (1 if mode == "1" else 255)
    values = draw(st.lists(st.integers(0, top), min_size=w * h * bands, max_size=w * h * bands))
    if bands == 1:
        img.putdata(values)
    else:
        img.putdata([tuple(values[i:i + bands]) for i in range(0, len(values), bands)])
    return fmt, img, encode(img, fmt)


formats = st.one_of(st.sampled_from(["jpeg", "png", "rgb8; jpeg compressed bgr8", "bgr8; png compressed bgr8",
                                     "", "16UC1; compressedDepth png", "gif"]), st.text(max_size=16))


@FUZZ
@given(fmt=formats, image=valid_images(), max_pixels=st.one_of(st.just(DEFAULT_MAX_INPUT_PIXELS),
                                                                 st.integers(1, 600)))
def test_valid_jpeg_and_png_decode_to_rgb(fmt, image, max_pixels):
    codec, img, data = image
    w, h = img.size
    try:
        out = decode_compressed(fmt, data, max_pixels=max_pixels)
    except ImageError as exc:
        if "compresseddepth" in fmt.lower():
            assert "compressedDepth" in str(exc)
        else:
            assert w * h > max_pixels, f"valid {codec} refused: {exc}"
            assert "pixels" in str(exc) and str(max_pixels) in str(exc) and "data" in str(exc)
        return
    assert "compresseddepth" not in fmt.lower() and w * h <= max_pixels
    assert out.shape == (h, w, 3) and out.dtype == np.uint8
    if codec == "PNG":  # lossless: the very pixels, as Pillow converts the mode to RGB
        np.testing.assert_array_equal(out, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


@st.composite
def damaged_images(draw):
    """Truncated or corrupted JPEG/PNG, other formats, forged headers and random bytes."""
    kind = draw(st.sampled_from(["truncated", "corrupted", "other_format", "forged", "random"]))
    if kind == "random":
        return kind, draw(st.binary(max_size=512))
    if kind == "forged":
        w, h = draw(st.integers(1, 65535)), draw(st.integers(1, 65535))
        return kind, (png_header_only if draw(st.booleans()) else jpeg_with_size)(w, h)
    if kind == "other_format":
        fmt = draw(st.sampled_from(["GIF", "BMP", "TIFF", "WEBP", "PPM"]))
        return kind, encode(Image.new("RGB", (draw(st.integers(1, 16)), draw(st.integers(1, 16)))), fmt)
    _, _, data = draw(valid_images())
    if kind == "truncated":
        return kind, data[:draw(st.integers(0, len(data) - 1))]
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 8))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return kind, bytes(data)


@FUZZ
@given(fmt=formats, damaged=damaged_images(), max_pixels=st.one_of(st.just(DEFAULT_MAX_INPUT_PIXELS),
                                                                     st.integers(1, 600)))
@example(fmt="png", damaged=("forged", png_header_only(40000, 40000)), max_pixels=DEFAULT_MAX_INPUT_PIXELS)
@example(fmt="jpeg", damaged=("forged", jpeg_with_size(5000, 5000)), max_pixels=DEFAULT_MAX_INPUT_PIXELS)
def test_damaged_compressed_data_is_refused_or_decoded_within_the_limit(fmt, damaged, max_pixels):
    kind, data = damaged
    try:
        out = decode_compressed(fmt, data, max_pixels=max_pixels)
    except ImageError as exc:
        message = str(exc)
        assert "data" in message or "format" in message, message
        if kind == "other_format" and "compresseddepth" not in fmt.lower():
            assert "not a JPEG or PNG image" in message
        return
    assert kind in ("truncated", "corrupted", "forged", "random"), f"{kind} accepted"
    assert out.ndim == 3 and out.shape[2] == 3 and out.dtype == np.uint8
    assert 0 < out.shape[0] * out.shape[1] <= max_pixels
