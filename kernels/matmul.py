"""Linear layers with weights in HF's (out, in) layout: y = x @ W.T, a dot product per output row.

Weights come at any precision of kernels.quant (float32, bfloat16 bits, int8 + scales);
accumulation is always float32, and every output equals row_dot of its row and token (the
decode path) to the last bit.
"""

import numpy as np
from numba import njit, prange

from ._jit import kernel
from .lanes import EXACT_MATH
from .quant import activation, chunked_len, row_dot, row_get, weight_at
from .simd import LANES, bf16_tile_dot_4x4, dot_chunks, round_bf16_chunks, tile_dot_4x4

# Weight rows per task (widened into a float32 tile, except bfloat16): with 4 token rows they stay
# in L1 at K = 576 (16 rows measured 5-10% slower).
ROWS_PER_TASK = 8


@kernel(fastmath=EXACT_MATH)
def matvec(out, x, w, s):
    """One token: W (N, K) @ x (K,) -> out (N,). Parallel over blocks of output rows."""
    N = w.shape[0]
    for task in prange((N + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        for n in range(task * ROWS_PER_TASK, min(N, (task + 1) * ROWS_PER_TASK)):
            out[n] = row_dot(w, s, n, x)


def matmul(out, x, w, s):
    """Many tokens: x (T, K) @ W (N, K).T -> out (T, N)."""
    if w.dtype == np.uint16:
        _matmul_bf16(out, x, w, s)
    else:
        _matmul_widened(out, x, w, s)


@kernel(fastmath=EXACT_MATH)
def _matmul_widened(out, x, w, s):
    """float32 and int8 weights.

    Each task widens 8 weight rows to a float32 tile (cache-resident), then runs a register tile
    of 4 tokens x 4 rows over it (kernels.simd.tile_dot_4x4): 16 accumulators share 8 loads, so
    the loop is bound by FMAs, not loads. Sums follow row_dot's fixed order, so every output equals
    the decode path's dot product to the last bit.
    """
    T, K = x.shape
    N = w.shape[0]
    RB = ROWS_PER_TASK
    full = K - K % LANES
    for task in prange((N + RB - 1) // RB):
        n0 = task * RB
        n1 = min(N, n0 + RB)
        tile = np.empty((RB, K), np.float32)
        for n in range(n0, n1):
            row_get(w, s, n, tile[n - n0])
        t = 0
        while t + 4 <= T:
            r = 0
            while n0 + r + 4 <= n1:
                d = tile_dot_4x4(tile, r, x, t)  # literal indices: a tuple indexed at run time is slow
                _store4(out, t, n0 + r, d[0], d[1], d[2], d[3], tile, s, r, x, full)
                _store4(out, t + 1, n0 + r, d[4], d[5], d[6], d[7], tile, s, r, x, full)
                _store4(out, t + 2, n0 + r, d[8], d[9], d[10], d[11], tile, s, r, x, full)
                _store4(out, t + 3, n0 + r, d[12], d[13], d[14], d[15], tile, s, r, x, full)
                r += 4
            for n in range(n0 + r, n1):  # the last rows of a partial block
                for tt in range(t, t + 4):
                    out[tt, n] = _tile_dot(tile, n - n0, x, tt)
            t += 4
        for tt in range(t, T):  # the last T % 4 tokens
            for n in range(n0, n1):
                out[tt, n] = _tile_dot(tile, n - n0, x, tt)


@kernel(fastmath=EXACT_MATH)
def _matmul_bf16(out, x, w, s):
    """bfloat16 weights: x is rounded to bfloat16 once (kernels.quant.activation), then 4 x 4
    register tiles of vdpbf16ps run straight over the weight rows, which need no widening."""
    T, K = x.shape
    N = w.shape[0]
    RB = ROWS_PER_TASK
    full = chunked_len(w, K)
    xb = np.empty((T, K), np.uint16)
    for t in prange(T):
        round_bf16_chunks(xb, x, t)
    for task in prange((N + RB - 1) // RB):
        n0 = task * RB
        n1 = min(N, n0 + RB)
        t = 0
        while t + 4 <= T:
            n = n0
            while n + 4 <= n1:
                d = bf16_tile_dot_4x4(w, n, xb, t)
                _store4(out, t, n, d[0], d[1], d[2], d[3], w, s, n, x, full)
                _store4(out, t + 1, n, d[4], d[5], d[6], d[7], w, s, n, x, full)
                _store4(out, t + 2, n, d[8], d[9], d[10], d[11], w, s, n, x, full)
                _store4(out, t + 3, n, d[12], d[13], d[14], d[15], w, s, n, x, full)
                n += 4
            for n in range(n, n1):  # the last rows of a partial block
                for tt in range(t, t + 4):
                    out[tt, n] = row_dot(w, s, n, x[tt])
            t += 4
        for tt in range(t, T):  # the last T % 4 tokens
            for n in range(n0, n1):
                out[tt, n] = row_dot(w, s, n, x[tt])


@njit(fastmath=EXACT_MATH, cache=True, inline="always")  # 16 calls per register tile: no call overhead
def _store4(out, t, n, s0, s1, s2, s3, w, s, r, x, full):
    """out[t, n..n+3] = the four sums of token t against rows r..r+3 of w, tails added."""
    out[t, n] = _finish(s0, w, s, r, x, t, full)
    out[t, n + 1] = _finish(s1, w, s, r + 1, x, t, full)
    out[t, n + 2] = _finish(s2, w, s, r + 2, x, t, full)
    out[t, n + 3] = _finish(s3, w, s, r + 3, x, t, full)


@njit(fastmath=EXACT_MATH, cache=True, inline="always")
def _finish(total, w, s, r, x, t, full):
    """Add the tail past the full chunks in sequence, as row_dot does."""
    for k in range(full, x.shape[1]):
        total += weight_at(w, s, r, k) * activation(w, x[t, k])
    return total


@njit(fastmath=EXACT_MATH, cache=True, inline="always")
def _tile_dot(tile, r, x, t):
    """One widened row against one token, in row_dot's order."""
    K = x.shape[1]
    # the tile is float32, so weight_at never reads its `s` argument: the tile stands in for it
    return _finish(dot_chunks(tile, r * K, x, t * K, K), tile, tile, r, x, t, K - K % LANES)


@kernel(parallel=False)
def add_bias(out, b):
    """out[t] += b.  out: (T, N); b: (N,)."""
    T, N = out.shape
    for t in range(T):
        for n in range(N):
            out[t, n] += b[n]
