"""Camera frame decoding and model-input preprocessing (ROS-free).

This module turns the fields of a ``sensor_msgs/Image`` or
``sensor_msgs/CompressedImage`` message into an ``HxWx3`` uint8 RGB array
and converts such arrays into normalised, tiled float32 model input.  It
depends only on numpy (and on Pillow, imported lazily, for compressed
images) so it can be unit-tested and reused without a ROS installation.

The :class:`Preprocessor` is built for a steady camera stream: geometry and
interpolation tables are computed once per input size and cached, scratch
buffers are allocated once, and each call performs a handful of vectorised
passes over the frame.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..core.config import DEFAULT_MAX_INPUT_PIXELS, PreprocessSpec

__all__ = [
    "ImageError",
    "SUPPORTED_ENCODINGS",
    "COMPRESSED_FORMATS",
    "DEFAULT_MAX_INPUT_PIXELS",
    "check_image_size",
    "decode_raw",
    "decode_compressed",
    "PreprocessSpec",
    "Preprocessor",
]


class ImageError(ValueError):
    """Raised when an image message or array cannot be used as model input."""


#: Raw ``sensor_msgs/Image`` encodings accepted by :func:`decode_raw`.
SUPPORTED_ENCODINGS: tuple[str, ...] = ("rgb8", "bgr8", "rgba8", "bgra8", "mono8")

#: Pillow codecs :func:`decode_compressed` opens (those of ROS ``compressed`` image transport); no other
#: decoder ever sees the data.
COMPRESSED_FORMATS: tuple[str, ...] = ("JPEG", "PNG")

# encoding -> (bytes per pixel, source channel index for R, G, B or None for identity)
_LAYOUTS: dict[str, tuple[int, Any]] = {
    "rgb8": (3, None),
    "bgr8": (3, [2, 1, 0]),
    "rgba8": (4, [0, 1, 2]),
    "bgra8": (4, [2, 1, 0]),
    "mono8": (1, [0, 0, 0]),
}


def check_image_size(width: int, height: int, max_pixels: int = DEFAULT_MAX_INPUT_PIXELS) -> None:
    """Raise :class:`ImageError` when a ``width x height`` frame has more than ``max_pixels`` pixels."""
    pixels = int(width) * int(height)
    if pixels > max_pixels:
        raise ImageError(
            f"width {width} x height {height} = {pixels} pixels exceeds the limit of {max_pixels} "
            f"pixels (vision.max_input_pixels)"
        )


def _int_field(name: str, value: Any) -> int:
    """``value`` of the integer message field ``name`` as an int, or an ImageError naming the field."""
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ImageError(f"{name} must be an integer, got {value!r}") from None
    if isinstance(value, bool) or number != value:
        raise ImageError(f"{name} must be an integer, got {value!r}")
    return number


def decode_raw(
    encoding: str,
    height: int,
    width: int,
    step: int,
    data: Any,
    is_bigendian: int = 0,
    *,
    max_pixels: int = DEFAULT_MAX_INPUT_PIXELS,
) -> np.ndarray:
    """Interpret raw ``sensor_msgs/Image`` fields as an ``HxWx3`` uint8 RGB array.

    ``data`` may be any object exposing the buffer protocol (``bytes``,
    ``bytearray``, ``memoryview``, ``array.array('B')``, a numpy array).
    ``is_bigendian`` is accepted for signature parity with the message and
    has no effect on the supported 8-bit encodings.

    For ``rgb8`` the result is a zero-copy view of ``data`` (strided when
    rows are padded, i.e. ``step > width * 3``); it is read-only when
    ``data`` is immutable and keeps ``data`` alive.  The other encodings
    return a new array owned by the caller.  Its memory may be channel-planar
    rather than packed; use ``np.ascontiguousarray`` if a packed layout is
    required.

    The fields are checked in the order encoding, size (``width * height``
    at most ``max_pixels``), ``step``, ``data``, before ``data`` is touched,
    and each error names the field at fault.

    Raises:
        ImageError: unsupported encoding, non-positive size, more than
            ``max_pixels`` pixels, ``step`` too small for the row, or a data
            length other than ``step * height``.
    """
    layout = _LAYOUTS.get(encoding) if isinstance(encoding, str) else None
    if layout is None:
        raise ImageError(
            f"unsupported encoding {encoding!r} (supported: {', '.join(SUPPORTED_ENCODINGS)})"
        )
    channels, reindex = layout
    height, width = _int_field("height", height), _int_field("width", width)
    step = _int_field("step", step)
    if height <= 0 or width <= 0:
        kind = "zero-size" if min(height, width) == 0 else "negative-size"
        raise ImageError(f"{kind} image (width {width}, height {height})")
    check_image_size(width, height, max_pixels)
    row_bytes = width * channels
    if step < row_bytes:
        raise ImageError(f"step {step} is smaller than width*channels = {row_bytes}")
    try:
        buf = np.frombuffer(data, dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        raise ImageError(
            f"image data must be a contiguous bytes-like object, got {type(data).__name__}: {exc}"
        ) from exc
    if buf.size != step * height:
        raise ImageError(
            f"data length {buf.size} does not match step*height = {step * height} "
            f"(step {step}, height {height})"
        )
    # Splitting axes is always expressible as a view, so padded rows stay zero-copy.
    pixels = buf.reshape(height, step)[:, :row_bytes].reshape(height, width, channels)
    if reindex is None:
        return pixels
    # Fancy indexing on the channel axis yields a fresh, fast (plane-wise) copy.
    return pixels[:, :, reindex]


def decode_compressed(
    format: str,  # noqa: A002 (message field)
    data: Any,
    *,
    max_pixels: int = DEFAULT_MAX_INPUT_PIXELS,
) -> np.ndarray:
    """Decode ``sensor_msgs/CompressedImage`` bytes (JPEG or PNG) to ``HxWx3`` uint8 RGB.

    ``format`` is only used for validation and error messages; the codec is
    detected from the data, and only the codecs of :data:`COMPRESSED_FORMATS`
    are tried.  Greyscale, palette and alpha images are converted to RGB.
    ``compressedDepth`` payloads are rejected.  The frame size is read from
    the header and checked against ``max_pixels`` before anything is
    decoded, so a small payload that would expand to a huge frame
    (a decompression bomb) costs nothing.

    Raises:
        ImageError: empty or undecodable data, a ``compressedDepth`` payload,
            a frame of more than ``max_pixels`` pixels, or Pillow not being
            installed.
    """
    try:
        size = memoryview(data).nbytes
    except TypeError as exc:
        raise ImageError(
            f"CompressedImage data must be bytes-like, got {type(data).__name__}"
        ) from exc
    if size == 0:
        raise ImageError(f"empty CompressedImage data (format {format!r})")
    if "compresseddepth" in str(format).lower():
        raise ImageError(f"compressedDepth images are not supported (format {format!r})")
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImageError("CompressedImage needs Pillow (pip install pillow)") from exc
    where = f"CompressedImage data (format {format!r}, {size} bytes)"
    try:
        img = Image.open(io.BytesIO(data), formats=COMPRESSED_FORMATS)
    except Image.UnidentifiedImageError:
        raise ImageError(
            f"cannot decode {where}: not a {' or '.join(COMPRESSED_FORMATS)} image"
        ) from None
    except Exception as exc:  # Pillow raises a variety of types for corrupt headers
        raise ImageError(f"cannot decode {where}: {exc}") from exc
    with img:
        width, height = img.size
        if width <= 0 or height <= 0:
            raise ImageError(f"{where}: zero-size image (width {width}, height {height})")
        try:
            check_image_size(width, height, max_pixels)
        except ImageError as exc:
            raise ImageError(f"{where}: {exc}") from None
        try:
            rgb = img if img.mode == "RGB" else img.convert("RGB")
            array = np.asarray(rgb, dtype=np.uint8)
        except Exception as exc:  # Pillow raises a variety of types for corrupt input
            raise ImageError(f"cannot decode {where}: {exc}") from exc
    if array.shape != (height, width, 3):
        raise ImageError(f"cannot decode {where}: decoded to shape {array.shape}")
    return array


def _sample_positions(n_out: int, n_in: int) -> np.ndarray:
    """Source coordinates of ``n_out`` output pixel centres spread over ``n_in`` inputs."""
    return (np.arange(n_out, dtype=np.float64) + 0.5) * (n_in / n_out) - 0.5


class _Plan:
    """Resize tables and scratch buffers for one input size (internal).

    :meth:`run` writes the resized ``rgb`` into the ``(3, new_h, new_w)``
    window of a channel-planar uint8 canvas whose corner is ``(top, left)``.
    """

    def __init__(self, h: int, w: int, top: int, left: int, new_h: int, new_w: int,
                 interpolation: str) -> None:
        self.window = (slice(None), slice(top, top + new_h), slice(left, left + new_w))
        self.shape = (new_h, new_w)
        self.identity = (h, w) == (new_h, new_w)
        self.bilinear = interpolation == "bilinear" and not self.identity
        if self.identity:
            return
        ys, xs = _sample_positions(new_h, h), _sample_positions(new_w, w)
        if not self.bilinear:
            rows = np.clip(np.floor(ys + 0.5), 0, h - 1).astype(np.intp)
            cols = np.clip(np.floor(xs + 0.5), 0, w - 1).astype(np.intp)
            # Flat indices into a packed HxWx3 frame, laid out channel-planar.
            self.index = (
                (rows[None, :, None] * w + cols[None, None, :]) * 3
                + np.arange(3, dtype=np.intp)[:, None, None]
            )
            self.gathered = np.empty((3, new_h, new_w), np.uint8)
            return
        ys, xs = np.clip(ys, 0, h - 1), np.clip(xs, 0, w - 1)
        self.y0 = np.floor(ys).astype(np.intp)
        self.y1 = np.minimum(self.y0 + 1, h - 1)
        # 8-bit fixed-point weights: 255 * 256 + 128 still fits in uint16.
        wy = np.round((ys - self.y0) * 256).astype(np.uint16)[:, None, None]
        self.wy0, self.wy1 = (256 - wy).astype(np.uint16), wy
        self.x0 = np.floor(xs).astype(np.intp)
        wx = np.round((xs - self.x0) * 256).astype(np.uint16)
        self.wx0, self.wx1 = (256 - wx).astype(np.uint16), wx
        self.rows_a = np.empty((new_h, w, 3), np.uint8)
        self.rows_b = np.empty((new_h, w, 3), np.uint8)
        self.vacc0 = np.empty((new_h, w, 3), np.uint16)
        self.vacc1 = np.empty((new_h, w, 3), np.uint16)
        # One spare pixel per row lets every column x be read together with x + 1.
        vert = np.zeros((new_h, w + 1, 3), np.uint8)
        self.vert = vert[:, :w]
        self.pairs = np.ndarray((new_h, w), dtype="V6", buffer=vert, strides=(vert.strides[0], 3))
        self.planar = np.empty((2, 3, new_h, new_w), np.uint8)
        self.acc0 = np.empty((3, new_h, new_w), np.uint16)
        self.acc1 = np.empty((3, new_h, new_w), np.uint16)

    def run(self, rgb: np.ndarray, canvas: np.ndarray) -> None:
        interior = canvas[self.window]
        if self.identity:
            np.copyto(interior, rgb.transpose(2, 0, 1))
        elif not self.bilinear:
            flat = np.ascontiguousarray(rgb).reshape(-1)
            np.take(flat, self.index, out=self.gathered, mode="clip")
            np.copyto(interior, self.gathered)
        else:
            self._bilinear(rgb, interior)

    def _bilinear(self, rgb: np.ndarray, interior: np.ndarray) -> None:
        # Vertical pass in fixed point: vert = round((a * wy0 + b * wy1) / 256).
        a = np.take(rgb, self.y0, axis=0, out=self.rows_a)
        b = np.take(rgb, self.y1, axis=0, out=self.rows_b)
        acc = np.multiply(a, self.wy0, out=self.vacc0)
        np.add(acc, np.multiply(b, self.wy1, out=self.vacc1), out=acc)
        np.add(acc, 128, out=acc)
        np.right_shift(acc, 8, out=self.vert, casting="unsafe")
        # Horizontal pass: gather each pixel with its right neighbour as one 6-byte
        # item (indexing the leading axis keeps the result contiguous), go planar, blend.
        new_h, new_w = self.shape
        pair = self.pairs.T[self.x0].view(np.uint8).reshape(new_w, new_h, 2, 3)
        np.copyto(self.planar, pair.transpose(2, 3, 1, 0))
        acc = np.multiply(self.planar[0], self.wx0, out=self.acc0)
        np.add(acc, np.multiply(self.planar[1], self.wx1, out=self.acc1), out=acc)
        np.add(acc, 128, out=acc)
        np.right_shift(acc, 8, out=interior, casting="unsafe")


def _keys_cubic(x: np.ndarray) -> np.ndarray:
    """Keys' cubic convolution kernel with a = -0.5 at the float64 offsets ``x`` (zero beyond 2)."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _cubic_taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(first, taps, precision)`` of :func:`cubic_weights`: output ``i`` reads inputs ``first[i] + k`` with the
    integer weights ``taps[i, k]`` (zero past the frame's edge)."""
    scale = n_in / n_out
    support = 2.0 * scale if scale >= 1.0 else 2.0
    size = int(np.ceil(support)) * 2 + 1
    inverse = 1.0 / scale if scale >= 1.0 else 1.0
    centre = scale * (np.arange(n_out, dtype=np.int64) + 0.5)
    first = np.maximum(np.trunc(centre - support + 0.5), 0).astype(np.int64)
    count = np.clip(np.minimum(np.trunc(centre + support + 0.5).astype(np.int64), n_in) - first, 0, size)
    k = np.arange(size, dtype=np.int64)
    inside = k[None, :] < count[:, None]
    offsets = ((k[None, :] + first[:, None]) - centre[:, None] + 0.5) * inverse
    w = np.where(inside, _keys_cubic(offsets), 0.0)
    total = np.zeros(n_out)
    for j in range(size):  # summed tap by tap, in order, as the reference does
        total += w[:, j]
    w = np.divide(w, total[:, None], out=w, where=total[:, None] != 0.0)
    largest = float(w.max())
    precision = 0
    while precision < 22 and int(0.5 + largest * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = w * float(1 << precision)
    fixed = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5))
    return first, np.where(inside, fixed, 0.0).astype(np.int64), precision


def cubic_weights(n_in: int, n_out: int) -> tuple[np.ndarray, int]:
    """Fixed-point weights of the antialiased bicubic resize of one axis from ``n_in`` to ``n_out`` pixels.

    Returns ``(weights, precision)``: ``weights`` is an ``[n_out, n_in]`` int64 matrix; each output pixel is
    ``(weights @ column + 2**(precision-1)) >> precision``, clipped to 0..255.  This follows torch's uint8
    antialiased bicubic: output ``i`` is centred on input coordinate ``c = s * (i + 0.5)`` with
    ``s = n_in / n_out``; its taps are the inputs ``j`` from ``int(c - support + 0.5)`` (at least 0) to before
    ``int(c + support + 0.5)`` (at most ``n_in``), where the support is 2, or ``2 s`` when downscaling, and tap
    ``j`` weighs ``cubic((j + 0.5 - c) / max(s, 1))`` (Keys, a = -0.5); the taps are normalised to sum 1 and
    scaled by the largest power of two that keeps the largest weight of the axis below 2**15, rounded half away
    from zero.  Every step is the same float64 operation in the same order, so the integers equal torch's.
    """
    first, taps, precision = _cubic_taps(n_in, n_out)
    weights = np.zeros((n_out, n_in), np.int64)
    for k in range(taps.shape[1]):
        used = taps[:, k] != 0
        weights[np.flatnonzero(used), first[used] + k] = taps[used, k]
    return weights, precision


class _CubicPass:
    """One axis of one bicubic resize, its outputs cut to ``start:start + size``: per tap ``k`` the input index
    and the int32 weight of every output, or a plain slice when the axis keeps its size (the identity)."""

    def __init__(self, n_in: int, n_out: int, start: int, size: int) -> None:
        self.rows = slice(start, start + size)
        self.identity = n_in == n_out
        if not self.identity:
            first, taps, precision = _cubic_taps(n_in, n_out)
            first, taps = first[self.rows], taps[self.rows]
            used = np.flatnonzero(taps.any(axis=0))
            taps = taps[:, : used[-1] + 1] if used.size else taps[:, :1]
            self.index = [np.minimum(first + k, n_in - 1).astype(np.intp) for k in range(taps.shape[1])]
            self.weights = [np.ascontiguousarray(taps[:, k], dtype=np.int32) for k in range(taps.shape[1])]
            self.half = 1 << (precision - 1)
            self.precision = precision

    def run(self, x: np.ndarray, axis: int, out: np.ndarray, scratch: np.ndarray) -> None:
        """Resample ``x`` (int32 planes) along ``axis`` (1: rows, 2: columns) into ``out`` (int32 0..255)."""
        for k, (index, weight) in enumerate(zip(self.index, self.weights)):
            w = weight if axis == 2 else weight[:, None]
            target = out if k == 0 else scratch
            np.take(x, index, axis=axis, out=target, mode="clip")
            np.multiply(target, w, out=target)
            if k:
                np.add(out, scratch, out=out)
        np.add(out, self.half, out=out)
        np.right_shift(out, self.precision, out=out)
        np.clip(out, 0, 255, out=out)


class _CubicPlan:
    """Antialiased bicubic resize tables and buffers for one input size (internal).

    The frame (``h x w``) is resized to ``first`` (rows x cols), the window ``crop`` (top, left, rows, cols) is
    kept and, when ``second`` is given, resized again to it; the result lands in the ``(3, *shape)`` window of the
    canvas at ``(top, left)``.  Each axis of each resize is a sum over its taps of gathered int32 planes times
    the weights (exact integers, as torch's), rounded to uint8 by a shift; width first, as torch.
    """

    def __init__(self, h: int, w: int, top: int, left: int, first: tuple[int, int],
                 crop: tuple[int, int, int, int] | None, second: tuple[int, int] | None) -> None:
        crop_top, crop_left, crop_h, crop_w = crop if crop else (0, 0, *first)
        self.passes = [(2, _CubicPass(w, first[1], crop_left, crop_w)),
                       (1, _CubicPass(h, first[0], crop_top, crop_h))]
        shape = (crop_h, crop_w)
        if second is not None and second != shape:
            self.passes += [(2, _CubicPass(crop_w, second[1], 0, second[1])),
                            (1, _CubicPass(crop_h, second[0], 0, second[0]))]
            shape = second
        self.shape = shape
        self.window = (slice(None), slice(top, top + shape[0]), slice(left, left + shape[1]))
        self.planes = np.empty((3, h, w), np.int32)
        self.buffers = []
        rows, cols = h, w
        for axis, step in self.passes:
            if axis == 2:
                cols = step.rows.stop - step.rows.start
            else:
                rows = step.rows.stop - step.rows.start
            # Each pass writes its own contiguous buffer (a kept slice is copied), with a scratch plane.
            self.buffers.append((np.empty((3, rows, cols), np.int32), np.empty((3, rows, cols), np.int32)))

    def run(self, rgb: np.ndarray, canvas: np.ndarray) -> None:
        np.copyto(self.planes, rgb.transpose(2, 0, 1))
        x = self.planes
        for (axis, step), (out, scratch) in zip(self.passes, self.buffers):
            if step.identity:
                if out.shape != x.shape:
                    np.copyto(out, x[:, :, step.rows] if axis == 2 else x[:, step.rows])
                    x = out
            else:
                step.run(x, axis, out, scratch)
                x = out
        np.copyto(canvas[self.window], x, casting="unsafe")


class Preprocessor:
    """Resize, tile and normalise RGB frames into float32 model input.

    ``__call__`` maps an ``HxWx3`` uint8 RGB array to a float32 array of shape
    ``[num_tiles, 3, th, tw]``: tiles in row-major order over the tile grid,
    channels first, values ``(x / 255 - mean) / std``.

    A uint8 channel-planar canvas of the target resolution is allocated once;
    border pixels are written only when the input size changes.  Resize
    tables are cached per input ``(h, w)`` (up to ``max_cached_sizes``
    sizes).  Frames already at the target resolution are copied without
    resampling.  Each call returns a *new* array from ``np.empty``, so several
    results can be in flight at once; the only other per-call allocations are
    the neighbour-gather temporary of bilinear mode and, in nearest mode, a
    packed copy of a non-contiguous input.  Instances are not thread-safe;
    use one per thread.

    In bicubic mode the frame is resampled as torchvision resamples a uint8
    tensor on the CPU (see :func:`cubic_weights`): per axis a sum over the
    taps of gathered int32 planes, rounded to uint8 after each; with a crop
    (``spec.cropped``) the frame is stretched to a square, centre-cropped and
    resized again (LeRobot GR00T N1.7), only the kept rows and columns of the
    square being computed.
    """

    def __init__(self, spec: PreprocessSpec, max_cached_sizes: int = 4) -> None:
        self._spec = spec
        height, width = spec.resolution
        th, tw = spec.tile_size
        gh, gw = spec.grid
        self._max_cached = max(1, int(max_cached_sizes))
        self._plans: OrderedDict[tuple[int, int], _Plan | _CubicPlan] = OrderedDict()
        self._active: tuple[int, int] | None = None
        self._canvas = np.full((3, height, width), spec.pad_value, np.uint8)
        # Canvas seen as (grid_row, grid_col, channel, th, tw): the output tile layout.
        self._canvas_tiles = self._canvas.reshape(3, gh, th, gw, tw).transpose(1, 3, 0, 2, 4)
        std = np.asarray(spec.std, np.float64)
        self._scale = (1.0 / (255.0 * std)).astype(np.float32).reshape(3, 1, 1)
        self._bias = (-np.asarray(spec.mean, np.float64) / std).astype(np.float32).reshape(3, 1, 1)
        self._out_shape = (spec.num_tiles, 3, th, tw)
        self._tiles_shape = (gh, gw, 3, th, tw)

    @property
    def spec(self) -> PreprocessSpec:
        """The specification this preprocessor was built from."""
        return self._spec

    @property
    def output_shape(self) -> tuple[int, int, int, int]:
        """Shape of every result: ``(num_tiles, 3, th, tw)``."""
        return self._out_shape

    def letterbox_params(self, h: int, w: int) -> tuple[float, int, int, int, int]:
        """Letterbox geometry for an ``h x w`` input.

        Returns ``(scale, pad_top, pad_left, new_h, new_w)``: the frame is
        scaled by ``scale`` to ``new_h x new_w`` and placed at
        ``(pad_top, pad_left)`` in the target canvas.
        """
        if h <= 0 or w <= 0:
            raise ImageError(f"zero-size image (width {w}, height {h})")
        height, width = self._spec.resolution
        if self._spec.resize == "letterbox_bottom_right":
            # LeRobot SmolVLA's resize_with_pad: sizes truncated, the padding above and to the left
            ratio = max(w / width, h / height)
            new_h, new_w = min(height, max(1, int(h / ratio))), min(width, max(1, int(w / ratio)))
            return 1.0 / ratio, height - new_h, width - new_w, new_h, new_w
        scale = min(height / h, width / w)
        new_h = min(height, max(1, round(h * scale)))
        new_w = min(width, max(1, round(w * scale)))
        return scale, (height - new_h) // 2, (width - new_w) // 2, new_h, new_w

    def _plan(self, h: int, w: int) -> _Plan | _CubicPlan:
        plan = self._plans.get((h, w))
        if plan is None:
            spec = self._spec
            if spec.resize in ("letterbox", "letterbox_bottom_right"):
                _, top, left, new_h, new_w = self.letterbox_params(h, w)
            else:
                (new_h, new_w), top, left = spec.resolution, 0, 0
            if spec.cropped:
                edge, offset, side = spec.crop_window()
                plan = _CubicPlan(h, w, 0, 0, (edge, edge), (offset, offset, side, side), spec.resolution)
            elif spec.interpolation == "bicubic":
                plan = _CubicPlan(h, w, top, left, (new_h, new_w), None, None)
            else:
                plan = _Plan(h, w, top, left, new_h, new_w, spec.interpolation)
            self._plans[(h, w)] = plan
            if len(self._plans) > self._max_cached:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end((h, w))
        return plan

    def __call__(self, rgb: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Preprocess one ``HxWx3`` uint8 RGB frame into ``out`` (a C-contiguous float32 array of
        :attr:`output_shape`, e.g. one image's rows of a batch), or a new array; returns it."""
        if not isinstance(rgb, np.ndarray):
            raise ImageError(f"expected a numpy array, got {type(rgb).__name__}")
        if rgb.ndim != 3 or rgb.shape[2] != 3:
            raise ImageError(f"expected an HxWx3 RGB array, got shape {rgb.shape}")
        if rgb.dtype != np.uint8:
            raise ImageError(f"expected dtype uint8, got {rgb.dtype}")
        h, w = rgb.shape[:2]
        if h == 0 or w == 0:
            raise ImageError(f"zero-size image (width {w}, height {h})")
        plan = self._plan(h, w)
        if self._active != (h, w):
            # The border depends only on the geometry; refresh it on size changes.
            self._canvas.fill(self._spec.pad_value)
            self._active = (h, w)
        if out is None:
            out = np.empty(self._out_shape, np.float32)
        elif out.shape != self._out_shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out: expected a C-contiguous float32 array of shape {self._out_shape}, got "
                             f"{out.dtype} {out.shape}")
        plan.run(rgb, self._canvas)
        tiles = out.reshape(self._tiles_shape)
        np.multiply(self._canvas_tiles, self._scale, out=tiles)
        np.add(tiles, self._bias, out=tiles)
        return out
