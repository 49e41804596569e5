"""Rotary position embeddings in HF's split-half (`rotate_half`) layout."""

import numpy as np
from numba import prange

from ._jit import kernel


def rope_tables(inv_freq: np.ndarray, ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables (ctx, hd/2) in float32, computed as HF does: float32 angle = pos * inv_freq."""
    positions = np.arange(ctx, dtype=np.float32)[:, None]
    angles = positions * inv_freq.astype(np.float32)[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@kernel()
def rope(x, cos, sin, positions, head_dim):
    """Rotate x (T, n_heads * hd) in place; token t sits at positions[t].

    Split-half: with a = x[:hd/2], b = x[hd/2:], the result is (a*cos - b*sin, b*cos + a*sin),
    which is HF's `x * cos + rotate_half(x) * sin` with cos/sin repeated over both halves.
    """
    T, width = x.shape
    half = head_dim // 2
    for t in prange(T):
        p = positions[t]
        for base in range(0, width, head_dim):
            for i in range(half):
                a = x[t, base + i]
                b = x[t, base + half + i]
                c = cos[p, i]
                s = sin[p, i]
                x[t, base + i] = a * c - b * s
                x[t, base + half + i] = b * c + a * s
