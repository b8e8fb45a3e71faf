"""Image files the tests craft: PNG and JPEG headers that announce a size their data does not have."""
from __future__ import annotations

import io
import struct
import zlib

from PIL import Image


def encode(image: "Image.Image", fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header announces ``width x height`` followed by a tiny, truncated image stream."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + \
        chunk(b"IEND", b"")


def jpeg_with_size(width: int, height: int) -> bytes:
    """A real 8x8 JPEG whose frame header is rewritten to announce ``width x height``."""
    data = bytearray(encode(Image.new("RGB", (8, 8), (10, 200, 30)), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)
