"""Linear layers, y = x @ W.T with W in HF's (out, in) layout: a dot product per output row, for
every weight format (kernels.formats), choosing register tiles by how many rows x has.

One task is 16 output rows against every row of x. With few rows of x (decode, batched decode,
short prompts: below SWEEP_FROM's rows for float32, bfloat16 and int8, PANEL_TOKENS for GGUF
blocks) the weights stream from memory once for all of them: row products, 4 x 4 tiles from four
rows of x (the last rows in a narrower one), block tiles that unpack each block once for every
row of x. From there on (prefill) each task works in halves of 8 weight rows that stay in L1
while 4 x 4 tiles sweep every row of x; GGUF blocks are first unpacked into a float32 panel.
Every output equals row_dot of its weight row and activation row to the last bit, whichever tile
made it, so decode, batched decode and prefill agree bit for bit.

`make_linear(fmt)` and `make_row(fmt)` compile one format's kernels (kernels.formats);
`matmul` runs one on a whole matrix (tests, load-time checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cfunc, njit, prange, types
from numba.extending import overload

from .activation_operands import activation, call_prepare, chunk_operand, prepare_for
from .formats import LINEAR_SIGNATURE, ROW_SIGNATURE, Operand, WeightFormat
from .gguf_blocks import block_rows, dequantize_block_row
from .grouped_layouts import grouped_row_get
from .integer_products import grouped_rows
from .jit import EXACT_MATH, address_call, kernel
from .quantize import chunked_len, row_get, weight_at
from .row_products import (
    bf16_tile_dot,
    int8_tile_dot,
    row_dot,
    rows_dot4,
    streamed_bf16_tile_dot,
    streamed_int8_tile_dot,
    streamed_tile_dot,
    tile_dot,
    weight_dot_chunks,
)
from .vector_ir import tile_shape
from .work_sharing import claim, start_claims

ROWS_PER_TASK = 16  # a grouped layout's 16 rows; two halves of 8 in prefill
HALF_TASK = 8  # prefill's weight rows at a time: with 4 rows of x they stay in L1 at K = 576 (16 measured 5-10% slower)
PANEL_TOKENS = 16  # from this many rows of x on, GGUF blocks are unpacked into a panel once and swept
# From this many rows of x on, float32, bfloat16 and int8 weights are swept by prefill's tiles
# rather than streamed once for every row of x. A sweep's weight rows come from memory unprefetched,
# so it pays only once enough rows of x share them, later for float32's wide rows than for int8's
# (docs/performance.md, "The measurements behind the kernels").
SWEEP_FROM = {"float32": 64, "bfloat16": 48, "int8": 32}

# From this row length on, float32 weight rows are streamed four at a time in decode. One row's
# sum is one chain of dependent FMAs (the fixed order); short rows overlap in the out-of-order
# window, long ones do not and leave the loop waiting on FMA latency. Below it one row at a time
# is as fast or faster: one stream, prefetched 4 KiB ahead. bfloat16 and int8 rows never are: a
# bfloat16 row has two accumulators (kernels.row_products) and goes alone, unprefetched; an int8
# block is one vpmaddwd and one FMA for 32 weights, so one row's chain keeps up with memory
# (docs/performance.md, "The measurements behind the kernels").
LONG_ROW = 4096
NEVER = 1 << 62


def sweep_from(w):
    """The rows of x from which weights of w's precision are swept (SWEEP_FROM)."""
    raise NotImplementedError


@overload(sweep_from)
def _sweep_from(w):
    rows = SWEEP_FROM["int8" if w.dtype == types.int8 else "bfloat16" if w.dtype == types.uint16 else "float32"]
    return lambda w: rows


def long_row(w):
    """The row length from which rows of w's precision are streamed four at a time."""
    raise NotImplementedError


@overload(long_row)
def _long_row(w):
    threshold = LONG_ROW if w.dtype == types.float32 else NEVER
    return lambda w: threshold


# ---------------------------------------------------------------- float32, bfloat16, int8 rows


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def dense_task(out, col, w, s, task, x, xo, xs, scratch):
    """out[t, col + n] = row n of w (float32, bfloat16 bits or int8 with scales s) . x[t] for the
    16 rows n of `task` and every row t of x; xo, xs: x prepared for w (activation_operands)."""
    N, K = w.shape
    n0 = task * ROWS_PER_TASK
    n1 = min(N, n0 + ROWS_PER_TASK)
    full = chunked_len(w, K)
    xc = chunk_operand(w, x, xo)
    table = scratch[: I8_ROWS * I8_TOKENS * (K // 32)]  # int8 tiles' scale products (only they read it)
    if x.shape[0] < sweep_from(w):
        _streamed_rows(out, col, w, s, n0, n1, x, xc, xs, full, table)
    else:
        for r0 in range(n0, n1, HALF_TASK):
            sweep_rows(out, col, w, s, r0, min(n1, r0 + HALF_TASK), x, xo, xs, xc, table, full)


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _streamed_rows(out, col, w, s, n0, n1, x, xc, xs, full, table):
    """Rows n0..n1-1 of w against a few rows of x, the weights streamed from memory once for all
    of them: register tiles over every row of x when it has enough (_batch_tiles), then long
    rows four at a time (rows_dot4), shorter ones one at a time; each dot product inlined and
    summed in row_dot's order (the chunks, then the tail in sequence)."""
    K = w.shape[1]
    n = _batch_tiles(out, col, w, s, n0, n1, x, xc, xs, full, table)
    if K >= long_row(w):
        while n + 4 <= n1:
            for b in range(x.shape[0]):
                rows_dot4(out, b * out.shape[1] + col + n, w, s, n, xc[b], xs[b])
                for i in range(n, n + 4):
                    for k in range(full, K):
                        out[b, col + i] += weight_at(w, s, i, k) * activation(w, x[b, k])
            n += 4
    for i in range(n, n1):
        for b in range(x.shape[0]):
            total = weight_dot_chunks(w, s, i, xc[b], xs[b])
            for k in range(full, K):
                total += weight_at(w, s, i, k) * activation(w, x[b, k])
            out[b, col + i] = total


TILE_ROWS, TILE_TOKENS = tile_shape()  # weight rows x rows of x of a register tile on this target
I8_ROWS, I8_TOKENS = tile_shape(int8=True)


def _batch_tiles(out, col, w, s, n0, n1, x, xc, xs, full, table):
    """Rows n0.. against a tile's rows of x or more in register tiles (prepared_shape: 4 x 4 with
    AVX-512, 2 x 3 with AVX2; int8's 4 x 4 everywhere), a tile's rows of x at a time: each chunk
    of the weight rows is loaded once into registers for them, the rows prefetched into L2 as they
    stream from memory (default model float32, 8 sequences: 2.7x one sequence's tokens/s with
    row dots, 4.5x with 4 x 4 tiles). The next rows of x find the weights in L1, and the last
    rows a tile leaves go in one narrower tile (_last_tile). The same sums as every other path,
    tails added in sequence. Returns the first weight row left for the row products (n0 for
    fewer rows of x than `least`)."""
    raise NotImplementedError


@overload(_batch_tiles, jit_options={"fastmath": EXACT_MATH})
def _batch_tiles_by_precision(out, col, w, s, n0, n1, x, xc, xs, full, table):
    TR, TT = _tile_of(w)  # compile-time constants: streamed_tile takes TT as a literal
    # int8 tiles from 2 rows of x (default model, a step of 2 or 3 sequences 0.73-0.83x the time of
    # row products); float32 and bfloat16 from a tile's, as before (narrower tiles: level to 1.2x)
    least = 2 if w.dtype == types.int8 else TT

    def tiles(out, col, w, s, n0, n1, x, xc, xs, full, table):
        B = x.shape[0]
        n = n0
        if B < least:
            return n
        while n + TR <= n1:
            b = 0
            while b + TT <= B:
                streamed_tile(out, b, col + n, w, s, n, xc, xs, b, table, TT)
                b += TT
            if b < B:
                _last_tile(out, b, col + n, w, s, n, xc, xs, table, B - b)
            if full < x.shape[1]:
                _add_tails(out, 0, col + n, B, TR, w, s, n, x, full)
            n += TR
        return n

    return tiles


def _last_tile(out, t, c, w, s, n, xo, xs, table, rows):
    """The last rows of x, fewer than a tile's, from row t, in one narrower tile (streamed_tile),
    rather than a dot product each (default model at float32, a step of 5-7 sequences 0.69-0.78x
    the time; at int8 0.68-0.70x)."""
    raise NotImplementedError


@overload(_last_tile, jit_options={"fastmath": EXACT_MATH})
def _last_tile_impl(out, t, c, w, s, n, xo, xs, table, rows):
    def last(out, t, c, w, s, n, xo, xs, table, rows):
        if rows == 1:
            streamed_tile(out, t, c, w, s, n, xo, xs, t, table, 1)
        elif rows == 2:
            streamed_tile(out, t, c, w, s, n, xo, xs, t, table, 2)
        else:  # 3 (AVX2's float32 tiles take 3 rows of x, so never less than a tile's there)
            streamed_tile(out, t, c, w, s, n, xo, xs, t, table, 3)

    return last


def streamed_tile(out, t_out, c_out, w, s, n, xo, xs, t, table, G):
    """Weight rows n.. against G rows t.. of xo (G a literal) in a register tile, as
    prepared_tile's, the rows below prefetched into L2 (row_products.TILES_AHEAD), as decode's
    batches read them."""
    raise NotImplementedError


@overload(streamed_tile, prefer_literal=True)
def _streamed_tile(out, t_out, c_out, w, s, n, xo, xs, t, table, G):
    g = getattr(G, "literal_value", None)
    if g is None:
        return None
    if w.dtype == types.float32:
        return lambda out, t_out, c_out, w, s, n, xo, xs, t, table, G: streamed_tile_dot(out, t_out, c_out, w, n, xo, t, TILE_ROWS, g)
    if w.dtype == types.uint16:
        return lambda out, t_out, c_out, w, s, n, xo, xs, t, table, G: streamed_bf16_tile_dot(out, t_out, c_out, w, n, xo, t, TILE_ROWS, g)
    if w.dtype == types.int8:
        return lambda out, t_out, c_out, w, s, n, xo, xs, t, table, G: streamed_int8_tile_dot(out, t_out, c_out, w, s, n, xo, xs, t, table,
                                                                                               I8_ROWS, g)
    return None


def prepared_tile(out, t_out, c_out, w, s, n, xo, xs, t, table):
    """Weight rows n.. against rows t.. of xo, chunk_operand's activations (xs: their int8 block
    scales), in a register tile over the full chunks, stored as streamed_tile's, each equal to
    the decode's dot product. table: float32 scratch of 16 per block of 32 (int8's scale
    products)."""
    raise NotImplementedError


# inlined into the sweep: bfloat16 tiles hold a 64-byte-aligned stack slot (vector_ir._park), with
# which LLVM left the tile a call of its own (~25% slower on a bfloat16 matrix of 512 rows of x)
@overload(prepared_tile, inline="always")
def _prepared_tile(out, t_out, c_out, w, s, n, xo, xs, t, table):
    if w.dtype == types.float32:
        return lambda out, t_out, c_out, w, s, n, xo, xs, t, table: tile_dot(out, t_out, c_out, w, n, xo, t, TILE_ROWS, TILE_TOKENS)
    if w.dtype == types.uint16:
        return lambda out, t_out, c_out, w, s, n, xo, xs, t, table: bf16_tile_dot(out, t_out, c_out, w, n, xo, t, TILE_ROWS, TILE_TOKENS)
    if w.dtype == types.int8:
        return lambda out, t_out, c_out, w, s, n, xo, xs, t, table: int8_tile_dot(out, t_out, c_out, w, s, n, xo, xs, t, table,
                                                                                   I8_ROWS, I8_TOKENS)


def prepared_shape(w):
    """(weight rows, rows of x) of prepared_tile's register tile for w's precision."""
    raise NotImplementedError


@overload(prepared_shape)
def _prepared_shape(w):
    shape = _tile_of(w)
    return lambda w: shape


def _tile_of(w):
    """(weight rows, rows of x) of a register tile for w's Numba type (while typing)."""
    return (I8_ROWS, I8_TOKENS) if w.dtype == types.int8 else (TILE_ROWS, TILE_TOKENS)


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def sweep_rows(out, col, w, s, r0, r1, x, xo, xs, xc, table, full):
    """out[t, col + r] = row r of w . x[t] for rows r0 <= r < r1 and every row of x: register tiles
    of rows of x by weight rows (prepared_shape), the last rows of x (fewer than a tile's) in one
    narrower tile per weight rows (_last_tile), then the weight rows left over, a row_dot each."""
    T = x.shape[0]
    TR, TT = prepared_shape(w)
    t = 0
    while t < T:
        G = min(TT, T - t)
        r = r0
        while r + TR <= r1:
            if G == TT:
                prepared_tile(out, t, col + r, w, s, r, xc, xs, t, table)
            else:  # the last rows of x: as a row_dot each (one chain of FMAs per sum, each waiting
                # on the last) a step of 15 rows of the shipped Q4_1 file swept took 1.35x one of 16
                _last_tile(out, t, col + r, w, s, r, xc, xs, table, G)
            if full < x.shape[1]:  # rows with no tail skip the call (int8 prefill of one matrix ~3% faster)
                _add_tails(out, t, col + r, G, TR, w, s, r, x, full)
            r += TR
        for r in range(r, r1):  # the last rows of a partial block
            for tt in range(t, t + G):
                out[tt, col + r] = row_dot(w, s, r, x[tt], xo[tt], xs[tt])
        t += G


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _add_tails(out, t, c, G, R, w, s, r, x, full):
    """Add each tile sum's tail past the full chunks in sequence, as row_dot does: x[t + g, k] for
    k from `full` against weight row r + j, into out[t + g, c + j]."""
    for g in range(G):
        for j in range(R):
            total = out[t + g, c + j]
            for k in range(full, x.shape[1]):
                total += weight_at(w, s, r + j, k) * activation(w, x[t + g, k])
            out[t + g, c + j] = total


# ---------------------------------------------------------------- GGUF blocks


def block_task(fmt, out, col, w, task, x, xo, xs, scratch):
    """out[t, col + n] for the 16 rows n of `task` of GGUF block rows w (ggml type fmt, a
    compile-time constant) and every row t of x: block tiles below PANEL_TOKENS rows of x;
    from there each half of 8 rows unpacked once into a float32 panel (as gguf-py dequantizes
    them) and swept by the float32 tiles, the same sums as the block tiles'."""
    raise NotImplementedError


@overload(block_task, prefer_literal=True, jit_options={"fastmath": EXACT_MATH})
def _block_task(fmt, out, col, w, task, x, xo, xs, scratch):
    F = getattr(fmt, "literal_value", None)
    if F is None:
        return None

    def run(fmt, out, col, w, task, x, xo, xs, scratch):
        N = w.shape[0]
        K = x.shape[1]
        n0 = task * ROWS_PER_TASK
        n1 = min(N, n0 + ROWS_PER_TASK)
        if x.shape[0] < PANEL_TOKENS:
            block_rows(F, out, col, w, n0, n1, x)
            return
        panel = scratch[: HALF_TASK * K].reshape((HALF_TASK, K))
        none = np.zeros((1, 1), np.uint16)  # float32 rows have no scales (not read)
        full = K - K % 16
        for r0 in range(n0, n1, HALF_TASK):
            rows = min(n1, r0 + HALF_TASK) - r0
            for r in range(rows):
                dequantize_block_row(F, w, r0 + r, panel[r])
            sweep_rows(out, col + r0, panel, none, 0, rows, x, xo, xs, x, xs[0, :0], full)

    return run


# ---------------------------------------------------------------- each format's kernels


def make_linear(fmt: WeightFormat):
    """The compiled `linear` kernel of one format (kernels.formats.LINEAR_SIGNATURE): thread t's
    tasks of 16 rows, claimed from `claims`, against every row of x."""
    code = fmt.code
    if fmt.group_of:  # a grouped layout: integer products

        def linear(out, col, w, scales, x, xo, xs, scratch, claims, t):
            xq = xo.view(np.int16)
            task = claim(claims, t, claims.shape[1])
            while task >= 0:
                grouped_rows(code, out, col, w, task, xq, xs)
                task = claim(claims, t, claims.shape[1])

    elif fmt.is_gguf_blocks:

        def linear(out, col, w, scales, x, xo, xs, scratch, claims, t):
            task = claim(claims, t, claims.shape[1])
            while task >= 0:
                block_task(code, out, col, w, task, x, xo, xs, scratch)
                task = claim(claims, t, claims.shape[1])

    else:
        element = fmt.element
        operand_element = np.int16 if fmt.operand == Operand.INT16 else np.uint16

        def linear(out, col, w, scales, x, xo, xs, scratch, claims, t):
            typed = w.view(element)
            prepared = xo.view(operand_element)
            task = claim(claims, t, claims.shape[1])
            while task >= 0:
                dense_task(out, col, typed, scales, task, x, prepared, xs, scratch)
                task = claim(claims, t, claims.shape[1])

    linear.__qualname__ = linear.__name__ = f"linear_{fmt.name}"
    # without reference counting (kernels.jit), but for the plain GGUF blocks' kernels, which allocate
    return cfunc(LINEAR_SIGNATURE, cache=True, fastmath=EXACT_MATH, _nrt=fmt.is_gguf_blocks)(linear)


def make_row(fmt: WeightFormat):
    """The compiled `row` kernel of one format: a row as float32, as gguf-py dequantizes it."""
    code = fmt.code
    if fmt.group_of:  # a grouped layout: integer products

        def row(out, w, scales, n):
            grouped_row_get(code, w, n, out)

    elif fmt.is_gguf_blocks:

        def row(out, w, scales, n):
            dequantize_block_row(code, w, n, out)

    else:
        element = fmt.element

        def row(out, w, scales, n):
            row_get(w.view(element), scales, n, out)

    row.__qualname__ = row.__name__ = f"row_{fmt.name}"
    return cfunc(ROW_SIGNATURE, cache=True, fastmath=EXACT_MATH)(row)


@dataclass(frozen=True)
class FormatKernels:
    linear: object  # numba CFunc; .address is what the forward pass calls
    row: object


@lru_cache(maxsize=None)
def kernels_for(fmt: WeightFormat) -> FormatKernels:
    """The compiled linear and row kernels of one format (compiled the first time on a machine,
    then loaded from Numba's cache): the format's row of the table, made runnable."""
    return FormatKernels(make_linear(fmt), make_row(fmt))


# ---------------------------------------------------------------- running them

call_linear = address_call(LINEAR_SIGNATURE, "call_linear")
call_row = address_call(ROW_SIGNATURE, "call_row")


def matmul(out: np.ndarray, x: np.ndarray, w: np.ndarray, fmt: WeightFormat, scales: np.ndarray | None = None) -> None:
    """out (T, N) = x (T, K) @ W.T for a whole matrix W (N, K weights) of format fmt, stored as w
    (its rows as the format stores them; int8's float16 scales beside): the forward pass's kernels
    on one matrix, for tests and checks."""
    import numba

    T, K = x.shape
    x = np.ascontiguousarray(x, np.float32)
    threads = numba.config.NUMBA_NUM_THREADS
    xo = np.zeros((T, K), np.uint16)
    xs = np.zeros((T, 3 * (K // 32) + 1), np.float32)
    prepare = prepare_for(fmt.operand)
    s = np.zeros((1, 1), np.uint16) if scales is None else np.ascontiguousarray(scales, np.uint16)
    wb = np.ascontiguousarray(w).view(np.uint8).reshape(w.shape[0], -1)
    _matmul(0 if prepare is None else prepare.address, kernels_for(fmt).linear.address, out, x, wb, s, xo, xs,
            np.zeros((threads, max(HALF_TASK * K, 16)), np.float32), np.zeros((2, threads), np.int64))


@kernel()
def _matmul(prepare, linear, out, x, w, s, xo, xs, scratch, claims):
    if prepare != 0:
        call_prepare(prepare, xo, xs, x, np.int64(0), np.int64(x.shape[0]))
    start_claims(claims, (w.shape[0] + ROWS_PER_TASK - 1) // ROWS_PER_TASK, claims.shape[1])
    for t in prange(claims.shape[1]):
        call_linear(linear, out, np.int64(0), w, s, x, xo, xs, scratch[t], claims, np.int64(t))


def dequantize(w: np.ndarray, fmt: WeightFormat, scales: np.ndarray | None = None) -> np.ndarray:
    """Every row of a matrix of format fmt as float32, (N, K), by the format's row kernel (as
    gguf-py dequantizes GGUF blocks): the reference the tests compare products with."""
    wb = np.ascontiguousarray(w).view(np.uint8).reshape(w.shape[0], -1)
    out = np.empty((w.shape[0], wb.shape[1] // fmt.block_bytes * fmt.block), np.float32)
    s = np.zeros((1, 1), np.uint16) if scales is None else np.ascontiguousarray(scales, np.uint16)
    _rows(kernels_for(fmt).row.address, out, wb, s)
    return out


@kernel()
def _rows(row, out, w, s):
    for n in prange(out.shape[0]):
        call_row(row, out[n], w, s, np.int64(n))


@njit(cache=True, _nrt=False)
def start_tasks(claims, rows):
    """Share the tasks of a matrix of `rows` rows among the threads (claims: (2, threads))."""
    start_claims(claims, (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK, claims.shape[1])


@kernel(parallel=False)
def add_bias(out, b):
    """out[t] += b.  out: (T, N); b: (N,)."""
    T, N = out.shape
    for t in range(T):
        for n in range(N):
            out[t, n] += b[n]
