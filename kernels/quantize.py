"""Converting weights at load, and reading dense ones back as float32.

The dense formats (kernels.formats): float32, bfloat16 (kept as uint16 bit patterns) and int8 in
symmetric blocks of 32 along the input dimension with one float16 scale each (uint16 bits, kept
beside the rows), as llama.cpp's Q8_0: 34 bytes per 32 weights. Every weight q * scale is exact
in float32 (8 + 11 significant bits).

Here: converting and quantizing weights at load (to_bf16, quantize_int8, quantize_q4_0,
quantize_q8_0, split_q8_0), reading one dense weight or row as float32 (weight_at, row_get), and
how much of a row the vector products cover (chunked_len). The products themselves are in
row_products; GGUF blocks are read by kernels.gguf_blocks.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .bf16_vectors import BF16_CHUNK
from .formats import BY_NAME
from .jit import EXACT_MATH, REDUCE_MATH, kernel
from .vector_ir import LANES, QBLOCK, bits_as_f32, f32_as_bits, half_to_f32
from .target import has


@njit(cache=True, _nrt=False)
def bf16_bits(v):
    """float32 -> bfloat16 bits, nearest-even as torch and vcvtne2ps2bf16 round; NaN stays NaN."""
    bits = f32_as_bits(v)
    if (bits & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16((bits >> 16) | 0x40)
    return np.uint16((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)


def chunked_len(w, K):
    """How many of a row's K elements weight_dot_chunks sums in whole chunks (32 for bfloat16 and
    int8, 16 for float32); the rest, the tail, is added in sequence after, in float32."""
    raise NotImplementedError


@overload(chunked_len)
def _chunked_len(w, K):
    if w.dtype == types.uint8:  # block formats: whole blocks, no tail
        return lambda w, K: K
    chunk = {types.uint16: BF16_CHUNK, types.int8: QBLOCK}.get(w.dtype, LANES)
    return lambda w, K: K - K % chunk


def f16_bits(value):
    """float32 -> float16 bits, nearest-even: vcvtps2ph where the target has F16C, else the same
    rounding in integer operations (LLVM would call compiler-rt's __truncsfhf2, which Numba's JIT
    does not link)."""
    raise NotImplementedError


@overload(f16_bits)
def _f16_bits(value):
    if has("f16c"):
        return lambda value: _f16_bits_native(value)
    return lambda value: _f16_bits_plain(value)


@intrinsic
def _f16_bits_native(typingctx, value):
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@njit(cache=True, _nrt=False)
def _f16_bits_plain(value):
    f = np.uint32(f32_as_bits(value))
    sign = np.uint32((f >> 16) & 0x8000)
    a = f & np.uint32(0x7FFFFFFF)
    if a >= 0x7F800000:  # inf, or NaN (kept quiet, as vcvtps2ph keeps it)
        return np.uint16(sign | (0x7C00 if a == 0x7F800000 else 0x7E00 | ((a >> 13) & 0x3FF)))
    if a >= 0x477FF000:  # rounds to 65520 or above: inf
        return np.uint16(sign | 0x7C00)
    e = a >> 23
    if e < 113:  # a float16 subnormal (or zero): the significand shifted into place, nearest-even
        if e < 102:
            return np.uint16(sign)
        m = (a & 0x7FFFFF) | 0x800000
        shift = np.uint32(126 - e)
        h = m >> shift
        rest = m & ((np.uint32(1) << shift) - np.uint32(1))
        half = np.uint32(1) << (shift - np.uint32(1))
        if rest > half or (rest == half and (h & 1)):
            h += 1
        return np.uint16(sign | h)
    h = ((e - 112) << 10) | ((a >> 13) & 0x3FF)
    rest = a & 0x1FFF
    if rest > 0x1000 or (rest == 0x1000 and (h & 1)):
        h += 1  # a carry into the exponent is still right, up to inf
    return np.uint16(sign | h)


@intrinsic
def f16_value(typingctx, bits):
    """float16 bits -> float32 (exact)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return half_to_f32(builder, args[0])

    return sig, codegen


def weight_at(w, s, n, k):
    """w[n, k] as float32 for any weight precision (int8: q * its block's float16 scale, exact)."""
    raise NotImplementedError


@overload(weight_at, jit_options={"fastmath": EXACT_MATH})
def _weight_at(w, s, n, k):
    if w.dtype == types.float32:
        return lambda w, s, n, k: w[n, k]
    if w.dtype == types.uint16:
        return lambda w, s, n, k: bits_as_f32(np.uint32(w[n, k]) << 16)
    if w.dtype == types.int8:
        return lambda w, s, n, k: np.float32(w[n, k]) * f16_value(s[n, k // QBLOCK])


def row_get(w, s, n, out):
    """out[:] = w[n, :] as float32 for a dense precision (an embedding row, or a row for a test)."""
    raise NotImplementedError


@overload(row_get, jit_options={"fastmath": EXACT_MATH})
def _row_get(w, s, n, out):
    def get(w, s, n, out):
        for k in range(w.shape[1]):
            out[k] = weight_at(w, s, n, k)

    return get


@kernel()
def to_bf16(out, w):
    """Round float32 (N, K) to bfloat16 bit patterns, nearest-even as torch does; NaN stays NaN."""
    N, K = w.shape
    for n in prange(N):
        for k in range(K):
            out[n, k] = bf16_bits(w[n, k])


SCALE_COARSE, SCALE_FINE = 16, 8  # candidate scales tried per block, coarse then fine


F16_TINY = np.float32(2.0**-24)  # the smallest float16 above zero
F16_MAX = 65504.0
INT8_MAX_WEIGHT = F16_MAX * 127 / 2  # so every candidate scale (up to 2 amax / 127) is finite


@njit(cache=True, _nrt=False)
def _as_f16(scale):
    """A candidate scale as the float16 it will be stored as (never 0 for a nonzero block)."""
    return max(F16_TINY, f16_value(f16_bits(scale)))


@njit(fastmath=REDUCE_MATH, cache=True, _nrt=False)  # called ~50 times per block: no call overhead
def _block_sse(w, n, k0, k1, scale):
    """Squared error of one block rounded to the int8 grid of `scale`."""
    inv = np.float32(1.0) / scale
    err = np.float32(0.0)
    for k in range(k0, k1):
        v = min(np.float32(127.0), max(np.float32(-127.0), np.rint(w[n, k] * inv)))
        d = w[n, k] - v * scale
        err += d * d
    return err


@kernel()
def quantize_int8(q, s, w):
    """Symmetric int8 per block of 32 along K, with the float16 scale that minimises the block's
    squared error. Weights must stay within F16_MAX * 127 (the caller checks).

    amax / 127 (Q8_0's choice) represents the largest weight exactly; a slightly larger scale often
    fits the other 31 far better, so scales from amax/127 to 2 amax/127 are searched, coarse then
    fine. Weights that came from a 4-bit grid (levels m + q d, as in the default model) are best
    served by a scale d / j, where every level sits at the same distance from the int8 grid: those
    candidates come from the gap between the block's lowest value and the next. Never clips.
    """
    N, K = w.shape
    for n in prange(N):
        for b in range(s.shape[1]):
            k0 = b * QBLOCK
            k1 = min(K, k0 + QBLOCK)
            amax = np.float32(0.0)
            for k in range(k0, k1):
                amax = max(amax, abs(w[n, k]))
            base = amax / np.float32(127.0)
            best = np.float32(0.0)
            if base > 0:
                best = _as_f16(base)
                if best < base:  # the next float16 up, so amax still fits in 127 steps
                    best = f16_value(f16_bits(base) + np.uint16(1))
                best_err = _block_sse(w, n, k0, k1, best)
                step = base / np.float32(SCALE_COARSE)
                centre = base
                for c in range(1, SCALE_COARSE + 1):
                    scale = _as_f16(base + step * np.float32(c))
                    err = _block_sse(w, n, k0, k1, scale)
                    if err < best_err:
                        best_err, best, centre = err, scale, scale
                fine = step / np.float32(SCALE_FINE)
                for c in range(-SCALE_FINE // 2, SCALE_FINE // 2 + 1):
                    scale = _as_f16(centre + fine * np.float32(c))
                    if scale >= base:
                        err = _block_sse(w, n, k0, k1, scale)
                        if err < best_err:
                            best_err, best = err, scale
                lowest = w[n, k0]
                for k in range(k0, k1):
                    lowest = min(lowest, w[n, k])
                gap = np.float32(np.inf)  # lowest to the next value up: d, or a multiple of it
                for k in range(k0, k1):
                    g = w[n, k] - lowest
                    if g > amax * np.float32(1e-3):  # ignore repeats and rounding noise
                        gap = min(gap, g)
                if gap < np.inf:  # inf: all values equal
                    for j in range(max(1, int(gap / (2 * base))), int(gap / base) + 1):
                        scale = _as_f16(gap / np.float32(j))
                        if base <= scale <= 2 * base:  # the range searched above
                            err = _block_sse(w, n, k0, k1, scale)
                            if err < best_err:
                                best_err, best = err, scale
            s[n, b] = f16_bits(best)
            inv = np.float32(1.0) / best if best > 0 else np.float32(0.0)
            for k in range(k0, k1):
                q[n, k] = np.int8(min(np.float32(127.0), max(np.float32(-127.0), np.rint(w[n, k] * inv))))


Q4_0_BYTES = BY_NAME["Q4_0"].block_bytes  # per block of 32: a float16 scale, 16 bytes of 4-bit levels
Q8_0_BYTES = BY_NAME["Q8_0"].block_bytes  # per block of 32: a float16 scale, 32 int8 levels


@kernel()
def quantize_q4_0(q, w):
    """float32 (N, K) -> Q4_0 blocks (N, K / 32 * 18 bytes), bit for bit as gguf-py's (and
    llama.cpp's reference) quantizer: d = the block's largest-magnitude value / -8, levels
    trunc(w / d + 8.5) clipped to 0..15, d stored as float16. K must be a multiple of 32."""
    N, K = w.shape
    for n in prange(N):
        for blk in range(K // QBLOCK):
            k0, o = blk * QBLOCK, blk * Q4_0_BYTES
            top = w[n, k0]
            for k in range(k0, k0 + QBLOCK):  # the first of the largest magnitude, sign kept
                if abs(w[n, k]) > abs(top):
                    top = w[n, k]
            d = top / np.float32(-8.0)
            inv = np.float32(0.0) if d == 0 else np.float32(1.0) / d
            bits = f16_bits(d)
            q[n, o], q[n, o + 1] = np.uint8(bits & 0xFF), np.uint8(bits >> 8)
            for j in range(16):
                lo = min(15, np.uint8(np.trunc(w[n, k0 + j] * inv + np.float32(8.5))))
                hi = min(15, np.uint8(np.trunc(w[n, k0 + 16 + j] * inv + np.float32(8.5))))
                q[n, o + 2 + j] = np.uint8(lo | (hi << 4))


@kernel()
def quantize_q8_0(q, w):
    """float32 (N, K) -> Q8_0 blocks (N, K / 32 * 34 bytes), bit for bit as gguf-py's (and
    llama.cpp's reference) quantizer: d = the block's largest magnitude / 127, levels w / d
    rounded half away from zero, d stored as float16. K must be a multiple of 32."""
    N, K = w.shape
    for n in prange(N):
        for blk in range(K // QBLOCK):
            quantize_q8_0_block(q[n], blk * Q8_0_BYTES, w[n], blk * QBLOCK)


@njit(cache=True, _nrt=False)
def quantize_q8_0_block(q, o, x, k0):
    """x[k0:k0 + 32] as one Q8_0 block at q[o:o + 34] (quantize_q8_0's rule); also the KV cache's
    q8_0 rows (kernels.kv_rows)."""
    amax = np.float32(0.0)
    for k in range(k0, k0 + QBLOCK):
        amax = max(amax, abs(x[k]))
    d = amax / np.float32(127.0)
    inv = np.float32(0.0) if d == 0 else np.float32(1.0) / d
    bits = f16_bits(d)
    q[o], q[o + 1] = np.uint8(bits & 0xFF), np.uint8(bits >> 8)
    for j in range(QBLOCK):
        v = x[k0 + j] * inv
        a = abs(v)
        whole = np.floor(a)
        level = whole + np.floor(np.float32(2.0) * (a - whole))  # half away from zero
        q[o + 2 + j] = np.uint8(np.int8(-level if v < 0 else level) & 0xFF)


@kernel()
def split_q8_0(q, s, blocks):
    """Q8_0 blocks (N, K / 32 * 34 bytes) -> int8 levels q (N, K) and float16 scales s as uint16
    bits (N, K / 32): the int8 precision's layout, the same weights (q * d, d a float16)."""
    for n in prange(blocks.shape[0]):
        for blk in range(s.shape[1]):
            o = blk * Q8_0_BYTES
            s[n, blk] = np.uint16(blocks[n, o]) | (np.uint16(blocks[n, o + 1]) << 8)
            for j in range(QBLOCK):
                q[n, blk * QBLOCK + j] = np.int8(blocks[n, o + 2 + j])
