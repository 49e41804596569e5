"""Linear layers with weights in HF's (out, in) layout: y = x @ W.T, a dot product per output row.

Weights come at any precision of kernels.quant (float32, bfloat16 bits, int8 + scales, GGUF
block formats);
accumulation is always float32, and every output equals row_dot of its row and token (the
decode path) to the last bit.
"""

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from .activation_prep import activation, chunk_operand, operand_buffers, prepare_operand
from .blocks import block_product, block_row_get
from .ir_blocks import QBLOCK
from .jit import EXACT_MATH, kernel
from .row_groups import GROUPED, grouped_matmul
from .quant import block_format, chunked_len, weight_at
from .weight_products import (
    bf16_tile_dot_4x4, int8_tile_dot_4x4, row_dot, streamed_bf16_tile_dot_4x4, streamed_tile_dot_4x4, tile_dot_4x4,
)

# Weight rows per task: with 4 token rows they stay in L1 at K = 576 (16 rows measured 5-10%
# slower).
ROWS_PER_TASK = 8


def matvec(out, x, w, s):
    """One token: W (N, K) @ x (K,) -> out (N,), at any weight precision."""
    if w.dtype == np.uint8:
        matmul(out.reshape(1, -1), x.reshape(1, -1), w, s)
    else:
        dense_matvec(out, x, w, s)


# From this many tokens on, block-format rows are dequantized once into a float32 panel and the
# float32 tiles run over it (prefill); below, block tiles dequantize per tile (batched decode).
PANEL_TOKENS = 16


def matmul(out, x, w, s):
    """Many tokens: x (T, K) @ W (N, K).T -> out (T, N), at any weight precision."""
    if w.dtype == np.uint8:
        if s[0, 0] in GROUPED.values():
            grouped_matmul(out, x, w, np.int64(s[0, 0]))
        elif x.shape[0] >= PANEL_TOKENS:
            panel_matmul(out, x, w, s)
        else:
            block_matmul(out, x, w, s)
    else:
        dense_matmul(out, x, w, s)


@kernel(fastmath=EXACT_MATH)
def block_matmul(out, x, w, s):
    """x (T, K) @ W (N, K).T for block-format weights (kernels.blocks): tasks of rows, each in
    tiles of 4 rows x 4 tokens that dequantize a row's chunk once for four tokens."""
    N = w.shape[0]
    fmt = block_format(s)
    for task in prange((N + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        n0 = task * ROWS_PER_TASK
        block_product(fmt, out, 0, w, n0, min(N, n0 + ROWS_PER_TASK), x)


@kernel(fastmath=EXACT_MATH)
def panel_matmul(out, x, w, s):
    """x (T, K) @ W (N, K).T for block-format weights, many tokens: each task's rows dequantized
    once into a float32 panel (as gguf-py does, kernels.blocks), then dense_matmul's float32 tiles
    run over it for every token. A weight is unpacked once per prefill chunk instead of once per
    tile of tokens, and the sums are the float32 path's, equal bit for bit to the block tiles'."""
    K = x.shape[1]
    N = w.shape[0]
    RB = ROWS_PER_TASK
    fmt = block_format(s)
    none = np.zeros((1, 1), np.float32)  # float32 rows have no scales
    full, xo, xs, xc = operands(np.empty((1, K), np.float32), x)
    for task in prange((N + RB - 1) // RB):
        n0 = task * RB
        rows = min(N, n0 + RB) - n0
        panel = np.empty((RB, K), np.float32)
        for r in range(rows):
            block_row_get(fmt, w, n0 + r, panel[r])
        sweep_rows(out, n0, panel, none, 0, rows, x, xo, xs, xc, none[0, :0], full)


@kernel(fastmath=EXACT_MATH)
def dense_matvec(out, x, w, s):
    """One token: W (N, K) @ x (K,) -> out (N,). Parallel over blocks of output rows."""
    N, K = w.shape
    x2 = x.reshape((1, K))
    xo, xs = operand_buffers(w, 1, K)
    prepare_operand(w, xo, xs, x2, 0)
    for task in prange((N + ROWS_PER_TASK - 1) // ROWS_PER_TASK):
        for n in range(task * ROWS_PER_TASK, min(N, (task + 1) * ROWS_PER_TASK)):
            out[n] = row_dot(w, s, n, x, xo[0], xs[0])


def prepared_tile_4x4(w, s, n, xo, xs, t, table):
    """Rows n..n+3 of w against tokens t..t+3 of xo, chunk_operand's activations (xs: their int8
    block scales): 16 sums over the full chunks, row-major by token, each equal to the decode's
    dot product. table: float32 scratch of 16 per block of 32 (int8's scale products)."""
    raise NotImplementedError


@overload(prepared_tile_4x4, inline="always")
def _prepared_tile_4x4(w, s, n, xo, xs, t, table):
    if w.dtype == types.float32:
        return lambda w, s, n, xo, xs, t, table: tile_dot_4x4(w, n, xo, t)
    if w.dtype == types.uint16:
        return lambda w, s, n, xo, xs, t, table: bf16_tile_dot_4x4(w, n, xo, t)
    if w.dtype == types.int8:
        return lambda w, s, n, xo, xs, t, table: int8_tile_dot_4x4(w, s, n, xo, xs, t, table)


def streamed_tile(w, s, n, xo, t):
    """Rows n..n+3 of float32 or bfloat16 weights against tokens t..t+3 of xo (as
    prepared_tile_4x4): 16 sums token-major, each equal to the decode's dot product; the rows below
    prefetched into L2 (weight_products.TILES_AHEAD), as decode's batches read them from memory."""
    raise NotImplementedError


@overload(streamed_tile, inline="always")
def _streamed_tile(w, s, n, xo, t):
    if w.dtype == types.float32:
        return lambda w, s, n, xo, t: streamed_tile_dot_4x4(w, n, xo, t)
    if w.dtype == types.uint16:
        return lambda w, s, n, xo, t: streamed_bf16_tile_dot_4x4(w, n, xo, t)
    return None


def tile_scratch(w, K):
    """The `table` prepared_tile_4x4 needs for rows of K: 16 floats per int8 block, else none."""
    raise NotImplementedError


@overload(tile_scratch, inline="always")
def _tile_scratch(w, K):
    per_block = 16 if w.dtype == types.int8 else 0
    return lambda w, K: np.empty(per_block * (K // QBLOCK), np.float32)


@kernel(fastmath=EXACT_MATH)
def dense_matmul(out, x, w, s):
    """Many tokens: x (T, K) @ W (N, K).T -> out (T, N) for float32, bfloat16 or int8 weights.

    x is prepared once (kernels.quant.prepare_operand: rounded to bfloat16 against bfloat16
    weights, quantized to int16 per block against int8, used as it is against float32). Then
    register tiles of 4 tokens x 4 rows run straight over the weight rows (FMAs, vdpbf16ps or
    vpmaddwd): 16 accumulators share 8 loads, so the loop is bound by arithmetic, not loads. Sums
    follow row_dot's fixed order, so every output equals the decode path's dot product to the
    last bit.
    """
    K = x.shape[1]
    N = w.shape[0]
    RB = ROWS_PER_TASK
    full, xo, xs, xc = operands(w, x)
    for task in prange((N + RB - 1) // RB):
        n0 = task * RB
        n1 = min(N, n0 + RB)
        sweep_rows(out, 0, w, s, n0, n1, x, xo, xs, xc, tile_scratch(w, K), full)


@njit(fastmath=EXACT_MATH, cache=True, inline="always")
def operands(w, x):
    """x (T, K) prepared once for rows like w's (kernels.activation_prep): the length of the full
    chunks, the prepared rows and their scales, and the chunked view the tiles read."""
    T, K = x.shape
    xo, xs = operand_buffers(w, T, K)
    for t in prange(T):
        prepare_operand(w, xo, xs, x, t)
    return chunked_len(w, K), xo, xs, chunk_operand(w, x, xo)


@njit(fastmath=EXACT_MATH, cache=True, inline="always")
def sweep_rows(out, col, w, s, r0, r1, x, xo, xs, xc, table, full):
    """out[t, col + r] = row r of w . x[t] for rows r0 <= r < r1 and every token: register tiles
    of 4 tokens x 4 rows (prepared_tile_4x4), then the rows and tokens left over, a row_dot each."""
    T = x.shape[0]
    t = 0
    while t + 4 <= T:
        r = r0
        while r + 4 <= r1:
            # literal indices below: a tuple indexed at run time is slow
            d = prepared_tile_4x4(w, s, r, xc, xs, t, table)
            store4(out, t, col + r, d[0], d[1], d[2], d[3], w, s, r, x, full)
            store4(out, t + 1, col + r, d[4], d[5], d[6], d[7], w, s, r, x, full)
            store4(out, t + 2, col + r, d[8], d[9], d[10], d[11], w, s, r, x, full)
            store4(out, t + 3, col + r, d[12], d[13], d[14], d[15], w, s, r, x, full)
            r += 4
        for r in range(r, r1):  # the last rows of a partial block
            for tt in range(t, t + 4):
                out[tt, col + r] = row_dot(w, s, r, x[tt], xo[tt], xs[tt])
        t += 4
    for tt in range(t, T):  # the last T % 4 tokens
        for r in range(r0, r1):
            out[tt, col + r] = row_dot(w, s, r, x[tt], xo[tt], xs[tt])


@njit(fastmath=EXACT_MATH, cache=True, inline="always")  # 16 calls per register tile: no call overhead
def store4(out, t, n, s0, s1, s2, s3, w, s, r, x, full):
    """out[t, n..n+3] = the four sums of token t against rows r..r+3 of w, tails added (x[t, k]
    past `full`, in sequence, as row_dot adds them)."""
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


@kernel(parallel=False)
def add_bias(out, b):
    """out[t] += b.  out: (T, N); b: (N,)."""
    T, N = out.shape
    for t in range(T):
        for n in range(N):
            out[t, n] += b[n]
