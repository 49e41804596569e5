"""Rotary position embeddings in HF's split-half (`rotate_half`) layout."""

import numpy as np
from numba import prange

from .jit import kernel


def rope_tables(inv_freq: np.ndarray, ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables (ctx, hd/2) in float32, computed as HF does: float32 angle = pos * inv_freq."""
    positions = np.arange(ctx, dtype=np.float32)[:, None]
    angles = positions * inv_freq.astype(np.float32)[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@kernel(parallel=False, refcounts=False)
def rope_row(x, cos, sin, p, head_dim):
    """Rotate every head of one token's x (n_heads * hd,) in place for position p.

    Split-half: with a = x[:hd/2], b = x[hd/2:], the result is (a*cos - b*sin, b*cos + a*sin),
    which is HF's `x * cos + rotate_half(x) * sin` with cos/sin repeated over both halves.
    """
    half = head_dim // 2
    for base in range(0, x.shape[0], head_dim):
        for i in range(half):
            a = x[base + i]
            b = x[base + half + i]
            c = cos[p, i]
            s = sin[p, i]
            x[base + i] = a * c - b * s
            x[base + half + i] = b * c + a * s


@kernel()
def rope(x, cos, sin, positions, head_dim):
    """Rotate x (T, n_heads * hd) in place; token t sits at positions[t]."""
    for t in prange(x.shape[0]):
        rope_row(x[t], cos, sin, positions[t], head_dim)
