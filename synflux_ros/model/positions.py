"""Qwen3-VL's multimodal rotary positions (t, h, w) of a rendered conversation."""
from __future__ import annotations

import numpy as np


def mrope_positions(tokens, grid: tuple[int, int] | None, start: int = 0) -> tuple[np.ndarray, int]:
    """Rotary positions [3, n] (t, h, w) of a rendered conversation, Qwen3-VL's rule for still images, and
    the position the next token takes.

    ``tokens`` holds a token id or ``(image key, row)`` per position, an image's rows consecutive and in
    row-major order over its merged token grid ``grid`` (rows, cols). A text token at next position s takes
    (s, s, s); an image whose first token comes at s takes (s, s + row, s + col), and the text after it
    continues at s + max(rows, cols). ``start`` is the position of ``tokens[0]``.
    """
    out = np.empty((3, len(tokens)), np.int64)
    nxt, i, n = start, 0, len(tokens)
    while i < n:
        t = tokens[i]
        if isinstance(t, (int, np.integer)):
            out[:, i] = nxt
            nxt += 1
            i += 1
            continue
        if grid is None:
            raise ValueError("image rows in a conversation of a model without an image grid")
        rows, cols = grid
        if t[1] != 0:
            raise ValueError(f"image {t[0]!r} starts at row {t[1]}, not 0")
        for j in range(rows * cols):
            if i + j >= n or isinstance(tokens[i + j], (int, np.integer)) or tuple(tokens[i + j]) != (t[0], j):
                raise ValueError(f"image {t[0]!r}: expected its {rows * cols} rows in order")
            out[0, i + j] = nxt
            out[1, i + j] = nxt + j // cols
            out[2, i + j] = nxt + j % cols
        nxt += max(rows, cols)
        i += rows * cols
    return out, nxt
