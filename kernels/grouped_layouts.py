"""Block formats regrouped by 16 rows for integer dot products (kernels.integer_products): the
layouts, the regrouping done once at load, and reference readers of a row (tests, and the
dequantizing paths).

A GGUF's Q4_0 matrix (or `--dtype q4_0`'s) is regrouped at load (group_q4_0) into Q4_0_R16: for
each 16 rows and each block of 32 weights, the 16 rows' float16 scales (32 bytes), then their
4-bit levels (256 bytes) as four 64-byte words, word o holding bytes 4o..4o+3 of every row's 16
(row r at 4r). One 64-byte load, masked and shifted, gives each row's levels of weights
4o..4o+3 (low nibbles) and 16+4o..16+4o+3 (high nibbles) in the lane of that row. The same bytes
as the file, in the same number. Q5_0, Q8_0, Q4_K, Q6_K and MXFP4 are regrouped the same way, the
levels' bits and the scales' packing kept (each section below describes its layout). Each
layout's code and block size are its row in kernels.formats.
"""

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .formats import BY_GGML_TYPE, BY_NAME, GROUP_ROWS, kernel_for, kernel_of, layouts_of
from .gguf_blocks import MXFP4_LEVELS, literal_value
from .jit import EXACT_MATH, kernel
from .vector_ir import QBLOCK, as_i64, half_to_f32

GROUP = GROUP_ROWS
Q4_0_BYTES = BY_NAME["Q4_0"].block_bytes  # 18: a float16 scale, 16 bytes of levels
GROUP_BLOCK_BYTES = GROUP * Q4_0_BYTES  # 288: 16 scales, then 4 words of 64 bytes


def group_rows(out, w, ggml_type: int) -> int:
    """out (w's shape: the same bytes) = w (N, bytes per row; N % 16 == 0), rows of blocks of a
    groupable ggml format, regrouped: returns its layout's code."""
    layout = BY_NAME[BY_GGML_TYPE[ggml_type].grouped]
    kernel_for(layout, "regroup")(out, w)
    return layout.code


@kernel_of(layouts_of("Q4_0"), "regroup")
def group_q4_0(out, w):
    """out = Q4_0 rows w (N, blocks * 18) regrouped as Q4_0_R16 (same shape): N % 16 == 0."""
    group_nibbles(out, w, 2)


@kernel()
def group_nibbles(out, w, scale_bytes):
    """out = rows w (N, blocks * (scale_bytes + 16)) of blocks of 32 4-bit levels after a scale
    regrouped by 16 rows (same shape; N % 16 == 0): per block, the 16 rows' scales, then four
    64-byte words, word o holding bytes 4o..4o+3 of every row's 16 (row r at 4r)."""
    N, row_bytes = w.shape
    block_bytes = scale_bytes + 16
    blocks = row_bytes // block_bytes
    flat = out.reshape(N * row_bytes)
    for g in prange(N // GROUP):
        base = g * GROUP * row_bytes
        for k in range(blocks):  # the group's output in order, block by block
            dst = base + k * GROUP * block_bytes
            src = k * block_bytes
            for r in range(GROUP):
                row = w[g * GROUP + r]
                for i in range(scale_bytes):
                    flat[dst + scale_bytes * r + i] = row[src + i]
                for o in range(4):  # 4 bytes at a time
                    _put_u32(flat, dst + GROUP * scale_bytes + 64 * o + 4 * r, _u32_at(row, src + scale_bytes + 4 * o))


_NIBBLES, _TWO_BITS, _SIGN_BITS = np.uint32(0x0F0F0F0F), np.uint32(0x03030303), np.uint32(0x80808080)


@intrinsic
def _u32_at(typingctx, arr, i):
    """Bytes i..i+3 of a contiguous uint8 array as a little-endian uint32: one unaligned load
    (byte by byte, Numba's index wraparound keeps LLVM from merging the loads: 3x slower)."""
    sig = types.uint32(arr, i)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [as_i64(builder, args[1], None)]), ir.IntType(32).as_pointer())
        return builder.load(ptr, align=1)

    return sig, codegen


@intrinsic
def _put_u32(typingctx, arr, i, v):
    """Bytes i..i+3 of a contiguous uint8 array = the low 32 bits of v, little-endian: one store."""
    sig = types.void(arr, i, v)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [as_i64(builder, args[1], None)]), ir.IntType(32).as_pointer())
        value = args[2] if args[2].type.width == 32 else builder.trunc(args[2], ir.IntType(32))
        builder.store(value, ptr, align=1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _f16_at(typingctx, arr, i):
    """The float16 at byte i of a uint8 array, widened to float32 (exact)."""
    sig = types.float32(arr, i)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [as_i64(builder, args[1], None)]), ir.IntType(16).as_pointer())
        return half_to_f32(builder, builder.load(ptr, align=1))

    return sig, codegen


@njit(cache=True, _nrt=False)
def _row_in_group(w, n):
    """Where row n of grouped weights w (N, bytes per row) lives: (w's bytes flat, the start of
    its group of 16, its place r in the group; its bytes interleave with the 15 others')."""
    N, row_bytes = w.shape
    g, r = divmod(np.int64(n), GROUP)  # n may come unsigned (a token id)
    return w.reshape(N * row_bytes), g * GROUP * row_bytes, r


@kernel_of(layouts_of("Q4_0"), "row")
@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def q4_r16_row_get(w, n, out):
    """out[:] = row n of Q4_0_R16 weights w as float32: d * (level - 8), as gguf-py dequantizes."""
    flat, base, r = _row_in_group(w, n)
    for k in range(w.shape[1] // Q4_0_BYTES):
        at = base + k * GROUP_BLOCK_BYTES
        d = _f16_at(flat, at + 2 * r)
        for o in range(4):
            for j in range(4):
                byte = np.int32(flat[at + 32 + 64 * o + 4 * r + j])
                out[QBLOCK * k + 4 * o + j] = d * np.float32((byte & 15) - 8)
                out[QBLOCK * k + 16 + 4 * o + j] = d * np.float32((byte >> 4) - 8)


# ---------------------------------------------------------------- Q5_0
#
# Q5_0_R16, per group of 16 rows and block of 32 (352 bytes, 16 x 22): the 16 rows' float16
# scales, then a 64-byte word of fifth bits, then Q4_0_R16's four words of nibbles. In the
# fifth bits' word, byte 4r + j holds row r's fifth bit of weight 4o + j at bit o and of weight
# 16 + 4o + j at bit 4 + o (o = 0..3): the bits that nibble word o's lanes need, shifted into
# place with one shift and mask each. Levels 0..31 (weight = d * (level - 16), as gguf-py's).
# llama.cpp's Q4_K_M and Q5_K_M files store most matrices whose rows are not whole super-blocks
# of 256 (the default model's, 576 wide) as Q5_0.

Q5_0_BYTES = BY_NAME["Q5_0"].block_bytes  # 22
Q5_0_GROUP_BYTES = GROUP * Q5_0_BYTES  # 352
Q5_0_NIBBLES_AT = 32 + 64  # after the scales and the fifth bits


@kernel_of(layouts_of("Q5_0"), "regroup")
def group_q5_0(out, w):
    """out = Q5_0 rows w (N, blocks * 22) regrouped as Q5_0_R16 (same shape): N % 16 == 0."""
    N = w.shape[0]
    G = N // GROUP
    blocks = w.reshape(G, GROUP, -1, Q5_0_BYTES)
    nb = blocks.shape[2]
    d = np.ascontiguousarray(blocks[..., :2].transpose(0, 2, 1, 3)).reshape(G, nb, 32)
    qh = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")[..., 0].astype(np.uint32)  # (G, 16, nb): bit i = weight i's
    fifth = np.zeros((G, GROUP, nb, 4), np.uint8)  # byte j of row r
    for j in range(4):
        for o in range(4):
            fifth[..., j] |= (((qh >> (4 * o + j)) & 1) << o).astype(np.uint8)
            fifth[..., j] |= (((qh >> (16 + 4 * o + j)) & 1) << (4 + o)).astype(np.uint8)
    fifth = fifth.transpose(0, 2, 1, 3).reshape(G, nb, 64)
    nibbles = blocks[..., 6:].reshape(G, GROUP, nb, 4, 4).transpose(0, 2, 3, 1, 4).reshape(G, nb, 256)
    out.reshape(G, nb, Q5_0_GROUP_BYTES)[:] = np.concatenate([d, fifth, nibbles], axis=2)


@kernel_of(layouts_of("Q5_0"), "row")
@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def q5_r16_row_get(w, n, out):
    """out[:] = row n of Q5_0_R16 weights as float32: d * (level - 16), as gguf-py dequantizes."""
    flat, base, r = _row_in_group(w, n)
    for k in range(w.shape[1] // Q5_0_BYTES):
        at = base + k * Q5_0_GROUP_BYTES
        d = _f16_at(flat, at + 2 * r)
        for o in range(4):
            for j in range(4):
                byte = np.int32(flat[at + Q5_0_NIBBLES_AT + 64 * o + 4 * r + j])
                fifth = np.int32(flat[at + 32 + 4 * r + j])
                low = (byte & 15) | (((fifth >> o) & 1) << 4)
                high = (byte >> 4) | (((fifth >> (4 + o)) & 1) << 4)
                out[QBLOCK * k + 4 * o + j] = d * np.float32(low - 16)
                out[QBLOCK * k + 16 + 4 * o + j] = d * np.float32(high - 16)


# ---------------------------------------------------------------- Q8_0
#
# Q8_0_R16, per group of 16 rows and block of 32 (544 bytes, 16 x 34): the 16 rows' float16
# scales, then eight 64-byte words, word o holding every row's weights 4o..4o+3 (row r at 4r) as
# level + 128: unsigned as vpdpbusd takes them, with nothing to unpack.

Q8_0_BYTES = BY_NAME["Q8_0"].block_bytes  # 34
Q8_0_GROUP_BYTES = GROUP * Q8_0_BYTES  # 544


@kernel_of(layouts_of("Q8_0"), "regroup")
@kernel()
def group_q8_0(out, w):
    """out = Q8_0 rows w (N, blocks * 34) regrouped as Q8_0_R16 (same shape): N % 16 == 0. Compiled
    and over the groups in parallel, as the load regroups every Q8_0 matrix of a file this way."""
    N, row_bytes = w.shape
    blocks = row_bytes // Q8_0_BYTES
    flat = out.reshape(N * row_bytes)
    for g in prange(N // GROUP):
        for k in range(blocks):
            at = g * GROUP * row_bytes + k * Q8_0_GROUP_BYTES
            src = k * Q8_0_BYTES
            for r in range(GROUP):
                row = w[g * GROUP + r]
                flat[at + 2 * r] = row[src]
                flat[at + 2 * r + 1] = row[src + 1]
                for o in range(8):  # 4 levels at a time, offset to unsigned
                    _put_u32(flat, at + 32 + 64 * o + 4 * r, _u32_at(row, src + 2 + 4 * o) ^ _SIGN_BITS)


@kernel_of(layouts_of("Q8_0"), "row")
@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def q8_r16_row_get(w, n, out):
    """out[:] = row n of Q8_0_R16 weights as float32: d * level, as gguf-py dequantizes."""
    flat, base, r = _row_in_group(w, n)
    for k in range(w.shape[1] // Q8_0_BYTES):
        at = base + k * Q8_0_GROUP_BYTES
        d = _f16_at(flat, at + 2 * r)
        for o in range(8):
            for j in range(4):
                out[QBLOCK * k + 4 * o + j] = d * np.float32(np.int32(flat[at + 32 + 64 * o + 4 * r + j]) - 128)


# ---------------------------------------------------------------- Q6_K
#
# Q6_K_R16, per group of 16 rows and super-block of 256 weights (3360 bytes, 16 x 210): the 16
# rows' float16 d (32 bytes), their int8 scales of the 16 sub-blocks (256 bytes, sub-block-major),
# then per sub-block of 16 weights three 64-byte words, row r at 4r, byte j: A holds the low 4
# bits of weights j and 4 + j, B of weights 8 + j and 12 + j, C the high 2 bits of weights j,
# 4 + j, 8 + j and 12 + j. Levels 0..63 (weight = d * scale * (level - 32), as gguf-py's).

Q6_K_BYTES = BY_NAME["Q6_K"].block_bytes  # 210
Q6_K_GROUP_BYTES = GROUP * Q6_K_BYTES  # 3360
Q6_K_WORDS_AT = 32 + 256  # after d and the scales


def q6_k_parts(raw: np.ndarray):
    """Q6_K rows (N, sb * 210) -> levels (N, sb, 256) uint8 0..63, scales (N, sb, 16) int8, d
    (N, sb) float16 bits: ggml's layout unpacked (dequantize_row_q6_K)."""
    N = raw.shape[0]
    blocks = raw.reshape(N, -1, Q6_K_BYTES)
    levels = np.empty(blocks.shape[:2] + (256,), np.uint8)
    for h in range(2):
        ql, qh = blocks[..., 64 * h : 64 * h + 64], blocks[..., 128 + 32 * h : 160 + 32 * h]
        for m, (low, shift) in enumerate(((ql[..., :32] & 15, 0), (ql[..., 32:] & 15, 2), (ql[..., :32] >> 4, 4), (ql[..., 32:] >> 4, 6))):
            levels[..., 128 * h + 32 * m : 128 * h + 32 * m + 32] = low | (((qh >> shift) & 3) << 4)
    return levels, blocks[..., 192:208].view(np.int8), blocks[..., 208:210].copy().view(np.uint16)[..., 0]


@kernel_of(layouts_of("Q6_K"), "regroup")
@kernel()
def group_q6_k(out, w):
    """out = Q6_K rows w (N, sb * 210) regrouped as Q6_K_R16 (same shape): N % 16 == 0. Per
    group and super-block: the rows' d, their 16 scales as planes (plane sub: byte sub of every
    row), then per sub-block of 16 weights three words of 64 bytes (levels' low nibbles of quads
    0 | 1, of 2 | 3, their high two bits of all four); group_q6_k_reference is the same in NumPy.
    Four levels at a time, as 32-bit words (a load regroups a file's Q6_K matrices: ~1 GB at 8B)."""
    N, row_bytes = w.shape
    blocks = row_bytes // Q6_K_BYTES
    flat = out.reshape(N * row_bytes)
    for g in prange(N // GROUP):
        for k in range(blocks):  # the group's output in order, block by block
            for r in range(GROUP):
                row = w[g * GROUP + r]
                src = k * Q6_K_BYTES
                at = g * GROUP * row_bytes + k * Q6_K_GROUP_BYTES
                flat[at + 2 * r], flat[at + 2 * r + 1] = row[src + 208], row[src + 209]
                for sub in range(16):
                    flat[at + 32 + 16 * sub + r] = row[src + 192 + sub]
                # ggml's sub-block sub = 8h + 2m + s: 16 weights whose low nibbles are bytes ql..ql+15
                # (the high nibbles when m >= 2), their top two bits bits 2m, 2m+1 of bytes qh..qh+15
                for sub in range(16):
                    h, m, s = sub // 8, (sub % 8) // 2, sub % 2
                    ql = src + 64 * h + 32 * (m & 1) + 16 * s
                    qh = src + 128 + 32 * h + 16 * s
                    nibble, bits = 4 * (m // 2), 2 * m
                    lo0, lo1 = (_u32_at(row, ql) >> nibble) & _NIBBLES, (_u32_at(row, ql + 4) >> nibble) & _NIBBLES
                    lo2, lo3 = (_u32_at(row, ql + 8) >> nibble) & _NIBBLES, (_u32_at(row, ql + 12) >> nibble) & _NIBBLES
                    hi = ((_u32_at(row, qh) >> bits) & _TWO_BITS) | (((_u32_at(row, qh + 4) >> bits) & _TWO_BITS) << 2)
                    hi |= (((_u32_at(row, qh + 8) >> bits) & _TWO_BITS) << 4) | (((_u32_at(row, qh + 12) >> bits) & _TWO_BITS) << 6)
                    wb = at + Q6_K_WORDS_AT + 192 * sub + 4 * r
                    _put_u32(flat, wb, lo0 | (lo1 << 4))
                    _put_u32(flat, wb + 64, lo2 | (lo3 << 4))
                    _put_u32(flat, wb + 128, hi)


def group_q6_k_reference(out, w):
    """group_q6_k in NumPy (tests)."""
    N = w.shape[0]
    G = N // GROUP
    levels, scales, d = q6_k_parts(w)
    sb = levels.shape[1]
    y = levels.reshape(G, GROUP, sb, 16, 4, 4)  # group, row, super-block, sub-block, quad, j
    lo, hi = y & 15, y >> 4
    words = np.stack([lo[..., 0, :] | (lo[..., 1, :] << 4), lo[..., 2, :] | (lo[..., 3, :] << 4),
                      hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)], axis=4)
    words = words.transpose(0, 2, 3, 4, 1, 5).reshape(G, sb, 16 * 3 * 64)  # super-block, sub-block, word, row, j
    ds = d.reshape(G, GROUP, sb).transpose(0, 2, 1).copy().view(np.uint8)  # (G, sb, 32)
    sc = scales.reshape(G, GROUP, sb, 16).transpose(0, 2, 3, 1).reshape(G, sb, 256).view(np.uint8)
    out.reshape(G, sb, Q6_K_GROUP_BYTES)[:] = np.concatenate([ds, sc, words], axis=2)


@kernel_of(layouts_of("Q6_K"), "row")
@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def q6_r16_row_get(w, n, out):
    """out[:] = row n of Q6_K_R16 weights w as float32: (d * scale) * (level - 32), as gguf-py."""
    flat, base, r = _row_in_group(w, n)
    for sb in range(w.shape[1] // Q6_K_BYTES):
        at = base + sb * Q6_K_GROUP_BYTES
        d = _f16_at(flat, at + 2 * r)
        for sub in range(16):
            scale = d * np.float32(np.int8(flat[at + 32 + 16 * sub + r]))
            wb = at + Q6_K_WORDS_AT + 192 * sub + 4 * r
            for j in range(4):
                a, b, c = np.int32(flat[wb + j]), np.int32(flat[wb + 64 + j]), np.int32(flat[wb + 128 + j])
                low = (a & 15, a >> 4, b & 15, b >> 4)
                for i in range(4):
                    level = low[i] | (((c >> (2 * i)) & 3) << 4)
                    out[256 * sb + 16 * sub + 4 * i + j] = scale * np.float32(level - 32)


# ---------------------------------------------------------------- Q4_K
#
# Q4_K_R16, per group of 16 rows and super-block of 256 weights (2304 bytes, 16 x 144): the 16
# rows' float16 d, then dmin (64 bytes), their 12 bytes of packed 6-bit scales and minimums
# (ggml's get_scale_min_k4 packing) as 12 planes of 16 bytes, plane j holding byte j of every row
# (192 bytes), then per sub-block of 32 weights Q4_0_R16's four words. Weight = (d * scale) *
# level - dmin * minimum, as gguf-py's.

Q4_K_BYTES = BY_NAME["Q4_K"].block_bytes  # 144
Q4_K_GROUP_BYTES = GROUP * Q4_K_BYTES  # 2304
Q4_K_PLANES_AT = 64  # after d and dmin
Q4_K_WORDS_AT = 64 + 192


def q4_k_parts(raw: np.ndarray):
    """Q4_K rows (N, sb * 144) -> levels (N, sb, 256) uint8 0..15, scales and minimums (N, sb, 8)
    uint8 (get_scale_min_k4), d and dmin (N, sb) float16 bits."""
    N = raw.shape[0]
    blocks = raw.reshape(N, -1, Q4_K_BYTES)
    q = blocks[..., 4:16]
    sc = np.empty(blocks.shape[:2] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = q[..., :4] & 63, q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 15) | ((q[..., :4] >> 6) << 4)
    mn[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    qs = blocks[..., 16:144].reshape(N, -1, 4, 32)
    levels = np.stack([qs & 15, qs >> 4], axis=3).reshape(N, -1, 256)
    d = blocks[..., 0:2].copy().view(np.uint16)[..., 0]
    dmin = blocks[..., 2:4].copy().view(np.uint16)[..., 0]
    return levels, sc, mn, d, dmin


@kernel_of(layouts_of("Q4_K"), "regroup")
@kernel()
def group_q4_k(out, w):
    """out = Q4_K rows w (N, sb * 144) regrouped as Q4_K_R16 (same shape): N % 16 == 0. Per group
    and super-block: the rows' d and dmin, their 12 bytes of scales as planes, then per sub-block
    of 32 weights 256 bytes, byte (o, row, j) holding levels 4o + j and 16 + 4o + j; see
    group_q4_k_reference, the same in NumPy."""
    N, row_bytes = w.shape
    blocks = row_bytes // Q4_K_BYTES
    flat = out.reshape(N * row_bytes)
    for g in prange(N // GROUP):
        for k in range(blocks):  # the group's output in order, block by block
            for r in range(GROUP):
                row = w[g * GROUP + r]
                src = k * Q4_K_BYTES
                at = g * GROUP * row_bytes + k * Q4_K_GROUP_BYTES
                flat[at + 2 * r], flat[at + 2 * r + 1] = row[src], row[src + 1]
                flat[at + 32 + 2 * r], flat[at + 33 + 2 * r] = row[src + 2], row[src + 3]
                for j in range(12):
                    flat[at + Q4_K_PLANES_AT + 16 * j + r] = row[src + 4 + j]
                for sub in range(8):  # levels 32 sub.. are nibble sub % 2 of bytes 32 (sub // 2)..
                    q, shift = src + 16 + 32 * (sub // 2), 4 * (sub % 2)
                    wb = at + Q4_K_WORDS_AT + 256 * sub + 4 * r
                    for o in range(4):  # bytes j = 0..3 at once: levels 4o + j | 16 + 4o + j
                        lo = (_u32_at(row, q + 4 * o) >> shift) & _NIBBLES
                        hi = (_u32_at(row, q + 16 + 4 * o) >> shift) & _NIBBLES
                        _put_u32(flat, wb + 64 * o, lo | (hi << 4))


def group_q4_k_reference(out, w):
    """group_q4_k in NumPy (tests)."""
    N = w.shape[0]
    G = N // GROUP
    levels, _, _, d, dmin = q4_k_parts(w)
    sb = levels.shape[1]
    y = levels.reshape(G, GROUP, sb, 8, 2, 4, 4)  # group, row, super-block, sub-block, half, o, j
    words = (y[..., 0, :, :] | (y[..., 1, :, :] << 4)).transpose(0, 2, 3, 4, 1, 5).reshape(G, sb, 8 * 256)
    packed = w.reshape(G, GROUP, sb, Q4_K_BYTES)[..., 4:16]  # the 12 bytes of scales and minimums
    planes = packed.transpose(0, 2, 3, 1).reshape(G, sb, 12 * GROUP)
    halves = [np.ascontiguousarray(v.reshape(G, GROUP, sb).transpose(0, 2, 1)).view(np.uint8) for v in (d, dmin)]  # (G, sb, 32)
    heads = np.concatenate([*halves, planes], axis=2)
    out.reshape(G, sb, Q4_K_GROUP_BYTES)[:] = np.concatenate([heads, words], axis=2)


@kernel_of(layouts_of("Q4_K"), "row")
@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def qk_r16_row_get(w, n, out):
    """out[:] = row n of Q4_K_R16 weights as float32: (d * scale) * level - dmin * minimum."""
    flat, base, r = _row_in_group(w, n)
    for sb in range(w.shape[1] // Q4_K_BYTES):
        at = base + sb * Q4_K_GROUP_BYTES
        d, dmin = _f16_at(flat, at + 2 * r), _f16_at(flat, at + 32 + 2 * r)
        for sub in range(8):
            q = at + Q4_K_PLANES_AT + r  # byte j of this row's packed scales at q + 16 j
            if sub < 4:
                sc, mn = flat[q + 16 * sub] & 63, flat[q + 16 * (sub + 4)] & 63
            else:
                i = sub - 4
                sc = (flat[q + 16 * (8 + i)] & 15) | ((flat[q + 16 * i] >> 6) << 4)
                mn = (flat[q + 16 * (8 + i)] >> 4) | ((flat[q + 16 * (4 + i)] >> 6) << 4)
            ds = d * np.float32(sc)
            dm = dmin * np.float32(mn)
            wb = at + Q4_K_WORDS_AT + 256 * sub + 4 * r
            for o in range(4):
                for j in range(4):
                    byte = np.int32(flat[wb + 64 * o + j])
                    out[256 * sb + 32 * sub + 4 * o + j] = ds * np.float32(byte & 15) - dm
                    out[256 * sb + 32 * sub + 16 + 4 * o + j] = ds * np.float32(byte >> 4) - dm


# ---------------------------------------------------------------- MXFP4
#
# MXFP4_R16, per group of 16 rows and block of 32 (272 bytes, 16 x 17): the 16 rows' exponent
# bytes, then Q4_0_R16's four words of 4-bit codes. A step looks each code up as its level + 12
# (0..24: unsigned, as vpdpbusd takes levels; the sums subtract 12 sum(x16)) with vpshufb, and
# each exponent as the power of two 2^(e - 128), so weight = level * 2^(e - 128) exactly as
# gguf-py's dequantize forms it (levels being FP4 values doubled).

MXFP4_BYTES = BY_NAME["MXFP4"].block_bytes  # 17
MXFP4_GROUP_BYTES = GROUP * MXFP4_BYTES  # 272
MXFP4_OFFSET = -min(MXFP4_LEVELS)  # 12


@kernel_of(layouts_of("MXFP4"), "regroup")
def group_mxfp4(out, w):
    """out = MXFP4 rows w (N, blocks * 17) regrouped as MXFP4_R16 (same shape): N % 16 == 0."""
    group_nibbles(out, w, 1)


_MXFP4_VALUES = np.array(MXFP4_LEVELS, np.float32)


@kernel_of(layouts_of("MXFP4"), "row")
@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def mxfp4_r16_row_get(w, n, out):
    """out[:] = row n of MXFP4_R16 weights as float32: 2^(e - 128) * level, as gguf-py dequantizes."""
    flat, base, r = _row_in_group(w, n)
    for k in range(w.shape[1] // MXFP4_BYTES):
        at = base + k * MXFP4_GROUP_BYTES
        d = np.float32(math.ldexp(1.0, np.int64(flat[at + r]) - 128))  # exact, subnormal below e = 2
        for o in range(4):
            for j in range(4):
                byte = np.int64(flat[at + 16 + 64 * o + 4 * r + j])
                out[QBLOCK * k + 4 * o + j] = d * _MXFP4_VALUES[byte & 15]
                out[QBLOCK * k + 16 + 4 * o + j] = d * _MXFP4_VALUES[byte >> 4]


# ---------------------------------------------------------------- reading a grouped row, by the layout's code


def grouped_row_get(fmt, w, n, out):
    """out[:] = row n of grouped weights as float32, as gguf-py dequantizes the file's row (fmt:
    the layout's code, a compile-time constant)."""
    raise NotImplementedError


@overload(grouped_row_get, prefer_literal=True, jit_options={"fastmath": EXACT_MATH})
def _grouped_row_get(fmt, w, n, out):
    getter = kernel_for(literal_value(fmt), "row")
    if getter is None:
        return None
    return lambda fmt, w, n, out: getter(w, n, out)
