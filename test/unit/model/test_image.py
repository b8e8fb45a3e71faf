"""Unit tests for synflux_ros.model.image (no ROS required)."""

import array
import io
import os
import subprocess
import sys

import numpy as np
import pytest

from synflux_ros.model.image import SUPPORTED_ENCODINGS, ImageError, Preprocessor, decode_compressed, decode_raw
from synflux_ros.core.config import PreprocessSpec

# 2x2 reference image in RGB: red, green / blue, white-ish.
RGB = np.array(
    [[[255, 0, 0], [0, 255, 0]],
     [[0, 0, 255], [10, 20, 30]]],
    dtype=np.uint8,
)


def _encode(image, fmt, **kwargs):
    pil = pytest.importorskip("PIL.Image")
    buf = io.BytesIO()
    pil.fromarray(image).save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _untile(out, spec):
    """Reassemble [num_tiles, 3, th, tw] back into an (H, W, 3) float image."""
    (gh, gw), (th, tw) = spec.grid, spec.tile_size
    return out.reshape(gh, gw, 3, th, tw).transpose(0, 3, 1, 4, 2).reshape(gh * th, gw * tw, 3)


# --------------------------------------------------------------------------- decode_raw


def test_supported_encodings():
    assert SUPPORTED_ENCODINGS == ("rgb8", "bgr8", "rgba8", "bgra8", "mono8")


def test_rgb8_is_zero_copy_view():
    data = bytearray(RGB.tobytes())
    out = decode_raw("rgb8", 2, 2, 6, data)
    assert out.shape == (2, 2, 3) and out.dtype == np.uint8
    np.testing.assert_array_equal(out, RGB)
    assert np.shares_memory(out, np.frombuffer(data, np.uint8))
    data[0] = 7  # writes through the shared buffer are visible
    assert out[0, 0, 0] == 7


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview, lambda b: array.array("B", b)])
def test_rgb8_accepts_buffer_types(kind):
    out = decode_raw("rgb8", 2, 2, 6, kind(RGB.tobytes()))
    np.testing.assert_array_equal(out, RGB)


def test_array_array_input_is_zero_copy():
    data = array.array("B", RGB.tobytes())
    out = decode_raw("rgb8", 2, 2, 6, data)
    assert np.shares_memory(out, np.frombuffer(data, np.uint8))
    np.testing.assert_array_equal(out, RGB)


def test_bgr8_to_rgb():
    out = decode_raw("bgr8", 2, 2, 6, RGB[:, :, ::-1].tobytes())
    np.testing.assert_array_equal(out, RGB)


def test_rgba8_to_rgb():
    rgba = np.concatenate([RGB, np.full((2, 2, 1), 99, np.uint8)], axis=2)
    out = decode_raw("rgba8", 2, 2, 8, rgba.tobytes())
    np.testing.assert_array_equal(out, RGB)


def test_bgra8_to_rgb():
    bgra = np.concatenate([RGB[:, :, ::-1], np.full((2, 2, 1), 99, np.uint8)], axis=2)
    out = decode_raw("bgra8", 2, 2, 8, array.array("B", bgra.tobytes()))
    np.testing.assert_array_equal(out, RGB)


def test_mono8_replicated():
    gray = np.array([[0, 50], [200, 255]], np.uint8)
    out = decode_raw("mono8", 2, 2, 2, gray.tobytes())
    assert out.shape == (2, 2, 3)
    for c in range(3):
        np.testing.assert_array_equal(out[:, :, c], gray)


def test_padded_rows_rgb8():
    step = 2 * 3 + 5
    rows = [RGB[r].tobytes() + b"\xee" * 5 for r in range(2)]
    data = b"".join(rows)
    out = decode_raw("rgb8", 2, 2, step, data)
    np.testing.assert_array_equal(out, RGB)
    assert np.shares_memory(out, np.frombuffer(data, np.uint8))


def test_padded_rows_bgr8_and_mono8():
    data = b"".join(RGB[r, :, ::-1].tobytes() + b"\x01\x02" for r in range(2))
    np.testing.assert_array_equal(decode_raw("bgr8", 2, 2, 8, data), RGB)
    gray = np.array([[1, 2], [3, 4]], np.uint8)
    mono = b"".join(gray[r].tobytes() + b"\xff\xff" for r in range(2))
    np.testing.assert_array_equal(decode_raw("mono8", 2, 2, 4, mono)[:, :, 1], gray)


@pytest.mark.parametrize("encoding", ["16UC1", "bayer_rggb8", "RGB8", "32FC1", ""])
def test_unsupported_encoding(encoding):
    with pytest.raises(ImageError) as err:
        decode_raw(encoding, 2, 2, 6, RGB.tobytes())
    assert repr(encoding) in str(err.value)
    assert "rgb8" in str(err.value) and "mono8" in str(err.value)


def test_data_length_mismatch():
    with pytest.raises(ImageError) as err:
        decode_raw("rgb8", 448, 448, 1344, b"\x00" * 1000)
    msg = str(err.value)
    assert "1000" in msg and "602112" in msg and "1344" in msg and "448" in msg


def test_data_longer_than_expected_is_rejected():
    with pytest.raises(ImageError, match="13"):
        decode_raw("rgb8", 2, 2, 6, RGB.tobytes() + b"\x00")


@pytest.mark.parametrize("width,height", [(0, 448), (448, 0), (0, 0)])
def test_zero_size(width, height):
    with pytest.raises(ImageError) as err:
        decode_raw("rgb8", height, width, 1344, b"")
    assert "zero-size" in str(err.value)
    assert f"width {width}" in str(err.value) and f"height {height}" in str(err.value)


def test_step_too_small():
    with pytest.raises(ImageError) as err:
        decode_raw("rgb8", 448, 448, 100, b"\x00" * 44800)
    assert "step 100" in str(err.value) and "1344" in str(err.value)


def test_non_buffer_data():
    with pytest.raises(ImageError, match="list"):
        decode_raw("rgb8", 2, 2, 6, list(RGB.tobytes()))


def test_image_error_is_value_error():
    assert issubclass(ImageError, ValueError)


# --------------------------------------------------------------------------- decode_compressed


def test_png_round_trip_exact():
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, (17, 23, 3), dtype=np.uint8)
    out = decode_compressed("png", _encode(image, "PNG"))
    assert out.dtype == np.uint8 and out.shape == (17, 23, 3)
    np.testing.assert_array_equal(out, image)


def test_png_grayscale_and_rgba_become_rgb():
    gray = np.arange(12, dtype=np.uint8).reshape(3, 4) * 20
    out = decode_compressed("png", _encode(gray, "PNG"))
    assert out.shape == (3, 4, 3)
    np.testing.assert_array_equal(out[:, :, 2], gray)
    rgba = np.dstack([np.tile(RGB, (2, 2, 1)), np.full((4, 4), 128, np.uint8)])
    out = decode_compressed("png", _encode(rgba, "PNG"))
    np.testing.assert_array_equal(out, np.tile(RGB, (2, 2, 1)))


def test_jpeg_approximate():
    image = np.zeros((32, 48, 3), np.uint8)
    image[:, :24] = (200, 40, 40)
    image[:, 24:] = (30, 90, 220)
    data = array.array("B", _encode(image, "JPEG", quality=95))
    out = decode_compressed("rgb8; jpeg compressed bgr8", data)
    assert out.shape == (32, 48, 3) and out.dtype == np.uint8
    # Away from the colour edge the JPEG should be within a few grey levels.
    diff = np.abs(out.astype(int) - image.astype(int))
    assert diff[:, :16].max() <= 8 and diff[:, 32:].max() <= 8


def test_compressed_empty():
    with pytest.raises(ImageError, match="empty.*'jpeg'"):
        decode_compressed("jpeg", b"")


def test_compressed_garbage():
    with pytest.raises(ImageError) as err:
        decode_compressed("jpeg", b"this is not an image at all")
    assert "'jpeg'" in str(err.value) and "cannot decode" in str(err.value)


def test_compressed_truncated_png():
    data = _encode(np.zeros((64, 64, 3), np.uint8) + 7, "PNG")
    with pytest.raises(ImageError, match="'png'"):
        decode_compressed("png", data[: len(data) // 2])


def test_compressed_without_pillow(monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ImageError, match=r"needs Pillow \(pip install pillow\)"):
        decode_compressed("png", b"\x89PNG\r\n")


def test_module_is_ros_free_and_imports_pillow_lazily():
    code = (
        "import sys\n"
        "for name in ('rclpy', 'sensor_msgs', 'PIL'):\n"
        "    sys.modules[name] = None\n"
        "import synflux_ros.model.image as m\n"
        "assert m.decode_raw('mono8', 1, 1, 1, b'x').shape == (1, 1, 3)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_compressed_depth_rejected():
    with pytest.raises(ImageError, match="compressedDepth"):
        decode_compressed("16UC1; compressedDepth png", b"\x00" * 20)


# --------------------------------------------------------------------------- PreprocessSpec


def test_spec_defaults_and_num_tiles():
    spec = PreprocessSpec(resolution=(448, 448), tile_size=(224, 224))
    assert spec.num_tiles == 4 and spec.grid == (2, 2)
    assert spec.resize == "letterbox" and spec.pad_value == 0
    assert PreprocessSpec((448, 672), (224, 224)).num_tiles == 6


def test_spec_normalises_sequences_to_tuples():
    spec = PreprocessSpec([448, 448], [224, 224], mean=[0.1, 0.2, 0.3], std=[1, 1, 1])
    assert spec.resolution == (448, 448) and spec.tile_size == (224, 224)
    assert spec.mean == (0.1, 0.2, 0.3) and spec.std == (1.0, 1.0, 1.0)
    hash(spec)


@pytest.mark.parametrize("tile", [(200, 224), (224, 300), (448, 100)])
def test_spec_tile_must_divide(tile):
    with pytest.raises(ValueError, match="does not divide"):
        PreprocessSpec((448, 448), tile)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"resize": "crop"}, "resize"),
        ({"interpolation": "cubic"}, "interpolation"),
        ({"pad_value": 256}, "pad_value"),
        ({"pad_value": -1}, "pad_value"),
        ({"std": (0.5, 0.0, 0.5)}, "std"),
        ({"mean": (0.5, 0.5)}, "mean"),
    ],
)
def test_spec_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PreprocessSpec((448, 448), (224, 224), **kwargs)


@pytest.mark.parametrize("res", [(0, 448), (448, -2), (448,), (448.5, 448)])
def test_spec_bad_resolution(res):
    with pytest.raises(ValueError, match="resolution"):
        PreprocessSpec(res, (224, 224))


# --------------------------------------------------------------------------- Preprocessor

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def _norm(value, c):
    return (value / 255.0 - MEAN[c]) / STD[c]


@pytest.mark.parametrize("interpolation", ["bilinear", "nearest"])
def test_output_shape_dtype_and_uniform_value(interpolation):
    spec = PreprocessSpec((448, 448), (224, 224), mean=MEAN, std=STD, interpolation=interpolation)
    pre = Preprocessor(spec)
    out = pre(np.full((448, 448, 3), 255, np.uint8))
    assert out.shape == (4, 3, 224, 224) == pre.output_shape
    assert out.dtype == np.float32 and out.flags.c_contiguous
    for c in range(3):
        np.testing.assert_allclose(out[:, c], _norm(255, c), rtol=1e-5)


def test_out_receives_the_result_and_a_wrong_one_is_refused():
    spec = PreprocessSpec((64, 64), (32, 32), mean=MEAN, std=STD, interpolation="bicubic")
    pre = Preprocessor(spec)
    image = np.random.default_rng(5).integers(0, 256, (48, 80, 3), dtype=np.uint8)
    batch = np.full((2 * 4, 3, 32, 32), np.nan, np.float32)
    assert pre(image, out=batch[4:]) is not None
    np.testing.assert_array_equal(batch[4:], pre(image))
    assert np.isnan(batch[:4]).all()  # only its own rows are written
    for bad in (np.empty((4, 3, 32, 32), np.float64), np.empty((3, 3, 32, 32), np.float32),
                np.empty((4, 3, 32, 64), np.float32)[..., ::2]):
        with pytest.raises(ValueError, match="out: expected a C-contiguous float32 array of shape"):
            pre(image, out=bad)


def test_normalisation_per_channel_values():
    spec = PreprocessSpec((4, 4), (2, 2), mean=MEAN, std=STD)
    image = np.empty((4, 4, 3), np.uint8)
    image[...] = (0, 128, 255)
    out = Preprocessor(spec)(image)
    for c, v in enumerate((0, 128, 255)):
        np.testing.assert_allclose(out[:, c], _norm(v, c), rtol=1e-5, atol=1e-6)


def test_returns_fresh_array_each_call():
    pre = Preprocessor(PreprocessSpec((4, 4), (2, 2)))
    a = pre(np.zeros((4, 4, 3), np.uint8))
    b = pre(np.full((4, 4, 3), 255, np.uint8))
    assert not np.shares_memory(a, b)
    np.testing.assert_allclose(a, -1.0)
    np.testing.assert_allclose(b, 1.0)


def test_tile_ordering_row_major():
    spec = PreprocessSpec((8, 8), (4, 4), mean=(0, 0, 0), std=(1, 1, 1))
    colours = [(10, 0, 0), (0, 20, 0), (0, 0, 30), (40, 50, 60)]  # TL, TR, BL, BR
    image = np.empty((8, 8, 3), np.uint8)
    image[:4, :4], image[:4, 4:], image[4:, :4], image[4:, 4:] = colours
    out = Preprocessor(spec)(image)
    assert out.shape == (4, 3, 4, 4)
    for k, colour in enumerate(colours):
        for c in range(3):
            np.testing.assert_allclose(out[k, c], colour[c] / 255.0, atol=1e-6)


def test_tile_content_is_channel_first_crop():
    rng = np.random.default_rng(2)
    image = rng.integers(0, 256, (6, 9, 3), dtype=np.uint8)
    spec = PreprocessSpec((6, 9), (3, 3), mean=(0, 0, 0), std=(1, 1, 1))
    out = Preprocessor(spec)(image)
    assert out.shape == (6, 3, 3, 3)
    # Tile 4 is grid row 1, grid column 1.
    np.testing.assert_allclose(out[4], image[3:6, 3:6].transpose(2, 0, 1) / 255.0, atol=1e-6)
    np.testing.assert_allclose(_untile(out, spec), image / 255.0, atol=1e-6)


@pytest.mark.parametrize("interpolation", ["bilinear", "nearest"])
def test_letterbox_wide_image_pads_top_and_bottom(interpolation):
    spec = PreprocessSpec((8, 8), (4, 4), pad_value=114, mean=MEAN, std=STD,
                          interpolation=interpolation)
    pre = Preprocessor(spec)
    assert pre.letterbox_params(2, 4) == (2.0, 2, 0, 4, 8)
    image = np.full((2, 4, 3), 255, np.uint8)
    canvas = _untile(pre(image), spec)
    for c in range(3):
        np.testing.assert_allclose(canvas[:2, :, c], _norm(114, c), rtol=1e-5)
        np.testing.assert_allclose(canvas[6:, :, c], _norm(114, c), rtol=1e-5)
        np.testing.assert_allclose(canvas[2:6, :, c], _norm(255, c), rtol=1e-5)


def test_letterbox_tall_image_pads_left_and_right():
    spec = PreprocessSpec((448, 448), (224, 224), pad_value=0, mean=(0, 0, 0), std=(1, 1, 1))
    pre = Preprocessor(spec)
    scale, top, left, new_h, new_w = pre.letterbox_params(640, 480)
    assert (top, new_h, new_w, left) == (0, 448, 336, 56) and scale == pytest.approx(0.7)
    canvas = _untile(pre(np.full((640, 480, 3), 200, np.uint8)), spec)
    np.testing.assert_allclose(canvas[:, :56], 0.0)
    np.testing.assert_allclose(canvas[:, 392:], 0.0)
    np.testing.assert_allclose(canvas[:, 56:392], 200 / 255.0, atol=1e-6)


@pytest.mark.parametrize("h,w,want", [
    (480, 640, (128, 0, 384, 512)),   # wide: padded above only
    (640, 480, (0, 128, 512, 384)),   # tall: padded on the left only
    (333, 500, (172, 0, 340, 512)),   # int(333 / (500 / 512)) = 340 (truncated, not rounded: 341)
    (512, 512, (0, 0, 512, 512)),
])
def test_letterbox_bottom_right_is_lerobot_smolvlas_resize_with_pad(h, w, want):
    """SmolVLA's ``resize_with_pad``: ratio max(w / W, h / H), sizes int(h / ratio) (truncated), the padding
    above and to the left, so the frame sits in the bottom-right corner."""
    spec = PreprocessSpec((512, 512), (512, 512), resize="letterbox_bottom_right", pad_value=0, mean=(0, 0, 0),
                          std=(1, 1, 1))
    pre = Preprocessor(spec)
    ratio = max(w / 512, h / 512)
    assert pre.letterbox_params(h, w)[1:] == want
    assert want[2:] == (int(h / ratio), int(w / ratio))
    canvas = _untile(pre(np.full((h, w, 3), 200, np.uint8)), spec)
    top, left = want[:2]
    np.testing.assert_allclose(canvas[:top], 0.0)
    np.testing.assert_allclose(canvas[:, :left], 0.0)
    np.testing.assert_allclose(canvas[top:, left:], 200 / 255.0, atol=1e-6)


def test_letterbox_params_640x480():
    pre = Preprocessor(PreprocessSpec((448, 448), (224, 224)))
    scale, top, left, new_h, new_w = pre.letterbox_params(480, 640)
    assert scale == pytest.approx(0.7) and (top, left, new_h, new_w) == (56, 0, 336, 448)


def test_border_refreshed_when_input_size_changes():
    spec = PreprocessSpec((8, 8), (4, 4), pad_value=0, mean=(0, 0, 0), std=(1, 1, 1))
    pre = Preprocessor(spec)
    pre(np.full((8, 8, 3), 255, np.uint8))  # fills the whole canvas
    canvas = _untile(pre(np.full((4, 8, 3), 255, np.uint8)), spec)
    np.testing.assert_allclose(canvas[:2], 0.0)
    np.testing.assert_allclose(canvas[6:], 0.0)
    canvas = _untile(pre(np.full((8, 8, 3), 100, np.uint8)), spec)
    np.testing.assert_allclose(canvas, 100 / 255.0, atol=1e-6)


def test_stretch_fills_whole_canvas():
    spec = PreprocessSpec((8, 8), (4, 4), resize="stretch", mean=(0, 0, 0), std=(1, 1, 1))
    image = np.zeros((2, 4, 3), np.uint8)
    image[0], image[1] = (255, 0, 0), (0, 0, 255)
    canvas = _untile(Preprocessor(spec)(image), spec)
    # No padding: top rows are pure red, bottom rows pure blue.
    np.testing.assert_allclose(canvas[0, :, 0], 1.0)
    np.testing.assert_allclose(canvas[-1, :, 2], 1.0)
    np.testing.assert_allclose(canvas[0, :, 2], 0.0)
    assert np.all(canvas.sum(axis=2) > 0.99)


def test_stretch_nearest_upscale_exact():
    spec = PreprocessSpec((4, 6), (2, 3), resize="stretch", interpolation="nearest",
                          mean=(0, 0, 0), std=(1, 1, 1))
    image = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3) * 10
    canvas = _untile(Preprocessor(spec)(image), spec)
    expected = image.repeat(2, axis=0).repeat(2, axis=1)
    np.testing.assert_allclose(canvas * 255, expected, atol=1e-3)


def test_bilinear_matches_float_reference():
    rng = np.random.default_rng(3)
    image = rng.integers(0, 256, (30, 50, 3), dtype=np.uint8)
    spec = PreprocessSpec((20, 36), (10, 12), resize="stretch", mean=(0, 0, 0), std=(1, 1, 1))
    got = _untile(Preprocessor(spec)(image), spec) * 255

    def coords(n_out, n_in):
        pos = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, n_in - 1)
        lo = np.floor(pos).astype(int)
        return lo, np.minimum(lo + 1, n_in - 1), pos - lo

    y0, y1, wy = coords(20, 30)
    x0, x1, wx = coords(36, 50)
    f = image.astype(np.float64)
    wx = wx[None, :, None]
    top = f[y0][:, x0] * (1 - wx) + f[y0][:, x1] * wx
    bottom = f[y1][:, x0] * (1 - wx) + f[y1][:, x1] * wx
    expected = top * (1 - wy[:, None, None]) + bottom * wy[:, None, None]
    assert np.abs(got - expected).max() <= 1.5


def test_same_resolution_skips_resampling():
    rng = np.random.default_rng(4)
    image = rng.integers(0, 256, (448, 448, 3), dtype=np.uint8)
    spec = PreprocessSpec((448, 448), (224, 224), mean=(0, 0, 0), std=(1, 1, 1))
    out = Preprocessor(spec)(image)
    np.testing.assert_allclose(out[3], image[224:, 224:].transpose(2, 0, 1) / 255.0, atol=1e-6)


@pytest.mark.parametrize("interpolation", ["bilinear", "nearest"])
def test_strided_input_from_decode_raw(interpolation):
    rng = np.random.default_rng(5)
    image = rng.integers(0, 256, (6, 10, 3), dtype=np.uint8)
    padded = b"".join(image[r].tobytes() + b"\x00" * 4 for r in range(6))
    view = decode_raw("rgb8", 6, 10, 34, padded)
    assert not view.flags.c_contiguous
    spec = PreprocessSpec((8, 8), (4, 4), interpolation=interpolation)
    pre = Preprocessor(spec)
    np.testing.assert_array_equal(pre(view), pre(np.ascontiguousarray(image)))


def test_planar_layout_input_from_bgr():
    rng = np.random.default_rng(6)
    image = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    rgb = decode_raw("bgr8", 8, 8, 24, image[:, :, ::-1].tobytes())
    pre = Preprocessor(PreprocessSpec((8, 8), (4, 4)))
    np.testing.assert_array_equal(pre(rgb), pre(image))


@pytest.mark.parametrize(
    "bad,match",
    [
        (np.zeros((4, 4), np.uint8), "shape"),
        (np.zeros((4, 4, 4), np.uint8), "shape"),
        (np.zeros((4, 4, 3), np.float32), "uint8"),
        (np.zeros((0, 4, 3), np.uint8), "zero-size"),
        ([[[0, 0, 0]]], "numpy array"),
    ],
)
def test_preprocessor_rejects_bad_input(bad, match):
    pre = Preprocessor(PreprocessSpec((4, 4), (2, 2)))
    with pytest.raises(ImageError, match=match):
        pre(bad)


def test_plan_cache_is_bounded():
    pre = Preprocessor(PreprocessSpec((8, 8), (4, 4)), max_cached_sizes=2)
    for size in (4, 5, 6, 7):
        assert pre(np.zeros((size, size, 3), np.uint8)).shape == (4, 3, 4, 4)
    assert len(pre._plans) == 2
