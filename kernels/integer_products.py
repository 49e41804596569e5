"""Q4_0 weights in groups of 16 rows, met by activations quantized per block: integer dot products.

A GGUF's Q4_0 matrix (or `--dtype q4_0`'s) is regrouped at load (group_q4_0) into Q4_0_R16: for
each 16 rows and each block of 32 weights, the 16 rows' float16 scales (32 bytes), then their
4-bit levels (256 bytes) as four 64-byte words, word o holding bytes 4o..4o+3 of every row's 16
(row r at 4r). One 64-byte load, masked and shifted, gives each row's levels of weights
4o..4o+3 (low nibbles) and 16+4o..16+4o+3 (high nibbles) in the lane of that row: vpdpbusd then
multiplies them with 4 activations broadcast to every lane, 64 products in one instruction,
one lane per row. The same bytes as the file, in the same number.

Activations meet them as int16 levels per block of 32 (quantize_split: scale = the block's
largest magnitude / 32639), each split into a signed high and low byte, x = 256 hi + lo, so two
vpdpbusd chains give the exact integer sum of a block's 32 products q * x (q = level - 8 by
subtracting 8 * sum(x), prepared per block). Per row and token, blocks are then added in order
in float32: total = fma(float(int sum), weight scale * activation scale, total). Integer sums
have no order, and that float chain is the same in every tile, so decode, batched decode and
prefill agree bit for bit. Against the file dequantized and run at float32, a product's error is
that of 16-bit activations (about 1/65000 of a block's largest value): llama.cpp meets Q4_0 with
8-bit ones.

Q5_0, Q8_0, Q4_K, Q6_K and MXFP4 are regrouped the same way (the levels' bits and the scales'
packing kept; a Q5_0 step shifts each lane's fifth bits into place, a Q4_K step unpacks its 6-bit
scales and minimums for the 16 rows at once, an MXFP4 step looks its FP4 codes up as integer
levels and its exponents up as powers of two). A group's blocks are
one sequential stream, left to the hardware prefetcher, but for Q6_K: its step (53 lines) asks
for one line a page ahead, which keeps the next page's stream started (weights streamed from
memory, one token, alternating: +5-12%). A prefetch of every line a page ahead cost ~20% at
Q4_K and Q6_K; one line per step measured level at Q4_K and 15% slower at Q4_0 (9 lines a step).
"""

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .gguf_blocks import FORMATS, MXFP4, MXFP4_LEVELS, Q4_0, Q4_K, Q5_0, Q6_K, Q8_0, e8m0_half, literal_value, mxfp4_levels, prefetch_offsets
from .jit import EXACT_MATH, kernel
from .target import has
from .vector_ir import (
    F32,
    I32,
    I32_VEC,
    I64,
    INTO_L2,
    LANES,
    QBLOCK,
    VEC,
    as_i64,
    fma_vec,
    half_to_f32,
    loop,
    prefetch,
    quantized_block,
    splat,
)

Q4_0_R16 = 1002  # not ggml types: block formats in groups of 16 rows (the matrix's `s`)
Q5_0_R16 = 1006
Q8_0_R16 = 1008
Q4_K_R16 = 1012
Q6_K_R16 = 1014
MXFP4_R16 = 1039
GROUPED = {Q4_0: Q4_0_R16, Q5_0: Q5_0_R16, Q8_0: Q8_0_R16, Q4_K: Q4_K_R16, Q6_K: Q6_K_R16, MXFP4: MXFP4_R16}  # ggml type -> its grouped layout
GROUP = 16
Q4_0_BYTES = FORMATS[Q4_0][1]  # 18: a float16 scale, 16 bytes of levels
GROUP_BLOCK_BYTES = GROUP * Q4_0_BYTES  # 288: 16 scales, then 4 words of 64 bytes
PER_BLOCK = 3  # quantize_split's float32 words per block of 32: the scale, two sums of 16
SPLIT_LEVELS = 32639.0  # 127 * 256 + 127: the largest int16 whose high byte, rounded, is int8

I8 = ir.IntType(8)
BYTES64 = ir.VectorType(I8, 64)


def can_group(w: np.ndarray, ggml_type: int = Q4_0) -> bool:
    """Whether a matrix of a groupable block format (GROUPED: uint8 rows of blocks) can be regrouped:
    whole groups of 16 rows."""
    return ggml_type in GROUPED and w.shape[0] % GROUP == 0 and w.shape[1] % FORMATS[ggml_type][1] == 0


@njit(cache=True, _nrt=False)
def is_grouped(fmt):
    """Whether a block matrix's `s` names a grouped layout."""
    return fmt == Q4_0_R16 or fmt == Q5_0_R16 or fmt == Q8_0_R16 or fmt == Q4_K_R16 or fmt == Q6_K_R16 or fmt == MXFP4_R16


def group_rows(out, w, ggml_type: int) -> int:
    """out (w's shape: the same bytes) = w (N, bytes per row; N % 16 == 0) regrouped: its layout."""
    {Q4_0: group_q4_0, Q5_0: group_q5_0, Q8_0: group_q8_0, Q4_K: group_q4_k, Q6_K: group_q6_k, MXFP4: group_mxfp4}[ggml_type](out, w)
    return GROUPED[ggml_type]


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
        for r in range(GROUP):
            n = g * GROUP + r
            for k in range(blocks):
                dst = base + k * GROUP * block_bytes
                src = k * block_bytes
                for i in range(scale_bytes):
                    flat[dst + scale_bytes * r + i] = w[n, src + i]
                for o in range(4):
                    for j in range(4):
                        flat[dst + GROUP * scale_bytes + 64 * o + 4 * r + j] = w[n, src + scale_bytes + 4 * o + j]


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


# ---------------------------------------------------------------- activations


@intrinsic
def quantize_split(typingctx, xo, xs, x, b):
    """Row b of float32 x (T, K) as Q4_0_R16 products read it, per block j of 32: int16 levels x16
    (quantized_block, levels +-32639) split as hi = (x16 + 128) >> 8 and lo = x16 - 256 hi, both
    int8; xo[b] (2K bytes: int16 (T, K) reused) holds the K lo bytes, then the K hi bytes;
    xs[b, 3j] the block's float32 scale, xs[b, 3j + 1] and xs[b, 3j + 2] the int32 bits of
    sum(x16) over its first and its second 16 (for the weights' level offsets)."""
    sig = types.void(xo, xs, x, b)

    def codegen(context, builder, signature, args):
        b = builder
        oty, sty, xty, _ = signature.args
        xarr = context.make_array(xty)(context, b, args[2])
        K = b.extract_value(xarr.shape, 1)
        row = as_i64(b, args[3], None)
        px = b.gep(xarr.data, [b.mul(row, K)], source_etype=F32)
        oarr = context.make_array(oty)(context, b, args[0])
        plo = b.gep(b.bitcast(oarr.data, I8.as_pointer()), [b.mul(row, b.mul(K, I64(2)))], source_etype=I8)
        phi = b.gep(plo, [K], source_etype=I8)
        sarr = context.make_array(sty)(context, b, args[1])
        ps = b.gep(sarr.data, [b.mul(row, b.extract_value(sarr.shape, 1))], source_etype=F32)
        sum_fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(I32, [I32_VEC]), "llvm.vector.reduce.add.v16i32")
        ivec = lambda v: ir.Constant(I32_VEC, [v] * LANES)
        bytes16 = ir.VectorType(I8, LANES)

        def block(i, _):
            scale, halves = quantized_block(b, px, i, SPLIT_LEVELS)
            j3 = b.mul(b.sdiv(i, I64(QBLOCK)), I64(PER_BLOCK))
            b.store(scale, b.gep(ps, [j3], source_etype=F32))
            for h, q in enumerate(halves):
                x16 = b.fptosi(q, I32_VEC)
                hi = b.ashr(b.add(x16, ivec(128)), ivec(8))
                lo = b.sub(x16, b.shl(hi, ivec(8)))
                at = b.add(i, I64(h * LANES))
                for p, v in ((plo, lo), (phi, hi)):
                    b.store(b.trunc(v, bytes16), b.bitcast(b.gep(p, [at], source_etype=I8), bytes16.as_pointer()), align=1)
                total = b.call(sum_fn, [x16])
                b.store(total, b.bitcast(b.gep(ps, [b.add(j3, I64(1 + h))], source_etype=F32), I32.as_pointer()))
            return []

        loop(b, I64(0), b.and_(K, I64(-QBLOCK)), QBLOCK, [], block)
        return context.get_dummy_value()

    return sig, codegen


def operand_shapes(T: int, K: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of quantize_split's (xo int16, xs float32) for T vectors of K."""
    return (T, K), (T, PER_BLOCK * (K // QBLOCK))


# ---------------------------------------------------------------- products


def summing_way() -> str:
    """How this target sums bytes: "vnni" (vpdpbusd, AVX-512 VNNI), "avx2" (vpmaddubsw then
    vpmaddwd) or "plain" (widened vectors, any CPU). Every way gives the same exact integer sums."""
    return "vnni" if has("avx512vnni") else "avx2" if has("avx2") else "plain"


def _dpbusd(b, acc, u, s, way=None, wide_levels=False):
    """acc (16 x i32) + the sums of 4 products u * s (64 x i8: u unsigned, s signed) per lane.

    vpdpbusd with AVX-512 VNNI. With AVX2, vpmaddubsw sums pairs into int16 and vpmaddwd pairs of
    those into int32, per 32-byte half: exact while a pair stays within int16, which levels below
    128 guarantee (2 * 127 * 128 < 32768; Q4's are below 16, Q6_K's below 64). Levels up to 255
    (Q8_0 stored + 128, wide_levels) are summed as their low 7 bits plus 128 times their top bit.
    Otherwise the products in widened plain vectors."""
    way = way or summing_way()
    if way == "vnni":
        fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(I32_VEC, [I32_VEC, BYTES64, BYTES64]), "llvm.x86.avx512.vpdpbusd.512")
        return b.call(fn, [acc, u, s])
    if way == "avx2":
        return b.add(acc, _pair_sums_avx2(b, u, s, wide_levels))
    wide = ir.VectorType(I32, 64)
    p = b.mul(b.zext(u, wide), b.sext(s, wide))
    quarter = lambda k: b.shuffle_vector(p, p, ir.Constant(I32_VEC, list(range(k, 64, 4))))
    return b.add(acc, b.add(b.add(quarter(0), quarter(1)), b.add(quarter(2), quarter(3))))


BYTES32 = ir.VectorType(I8, 32)
I16x16 = ir.VectorType(ir.IntType(16), 16)
I32x8 = ir.VectorType(I32, 8)


def _avx2_pair_sums(b):
    """AVX2's vpmaddubsw (bytes to int16 pair sums) and vpmaddwd (int16 to int32 pair sums), and
    vpmaddwd's all-ones operand."""
    maddubs = cgutils.get_or_insert_function(b.module, ir.FunctionType(I16x16, [BYTES32, BYTES32]), "llvm.x86.avx2.pmadd.ub.sw")
    maddwd = cgutils.get_or_insert_function(b.module, ir.FunctionType(I32x8, [I16x16, I16x16]), "llvm.x86.avx2.pmadd.wd")
    return maddubs, maddwd, ir.Constant(I16x16, [1] * 16)


def _byte_half(b, v, h):
    """Bytes 32 h .. 32 h + 31 of 64: AVX2's register of them."""
    return b.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, 32), list(range(32 * h, 32 * h + 32))))


def _pair_sums_avx2(b, u, s, wide_levels):
    """vpdpbusd's 16 lanes of 4-product sums (without an accumulator), from AVX2's byte and word
    pair sums, half by half."""
    maddubs, maddwd, ones = _avx2_pair_sums(b)
    halves = []
    for h in (0, 1):
        uh, sh = _byte_half(b, u, h), _byte_half(b, s, h)
        if wide_levels:
            low = b.and_(uh, ir.Constant(BYTES32, [127] * 32))
            top = b.lshr(uh, ir.Constant(BYTES32, [7] * 32))
            sums = b.add(b.call(maddwd, [b.call(maddubs, [low, sh]), ones]),
                         b.call(maddwd, [b.call(maddubs, [top, sh]), ir.Constant(I16x16, [128] * 16)]))
        else:
            sums = b.call(maddwd, [b.call(maddubs, [uh, sh]), ones])
        halves.append(sums)
    return b.shuffle_vector(halves[0], halves[1], ir.Constant(I32_VEC, list(range(16))))


def _word_at(b, p, i):
    """The int32 stored in float32 slot i of p."""
    return b.load(b.bitcast(b.gep(p, [I64(i)], source_etype=F32), I32.as_pointer()), align=4)


def _broadcast4(b, p, off):
    """The 4 bytes at p + off in every 32-bit lane, as 64 x i8."""
    word = b.load(b.bitcast(b.gep(p, [off], source_etype=I8), I32.as_pointer()), align=1)
    v = b.insert_element(ir.Constant(I32_VEC, ir.Undefined), word, I32(0))
    return b.bitcast(b.shuffle_vector(v, v, ir.Constant(I32_VEC, [0] * LANES)), BYTES64)


# A group's first tile of this many tokens and more asks for every line of each step a page
# ahead, into L2. Such a tile spends G times a lone token's arithmetic on each line, and the
# hardware prefetcher alone fell behind: the weight loads stalled (17% of a step's samples on
# them). A decode step of 8 sequences on the default model's Q4_0 file 14.7 -> 12.4 ms, Q8_0
# 17.8 -> 14.1, Q4_K_M 19.3 -> 17.7 (3 alternating rounds; 8 or 16 KB ahead, or into L1, the
# same). Two tokens already outrun it: with tiles of 2 (grouped_rows) a step of 2 rows on the
# 1.2B shape's Q4_0 file took 1.5x a lone token's unprefetched, 1.05x prefetched (Zen 4, 3
# alternating rounds). Later tiles of a prefill find the group in cache: asking there too cost
# prefill 512 ~7%; asking in the first only gained 5% (Q4_0 990 -> 1046 tok/s, 4 rounds). Lone
# tokens keep the prefetcher's pace (module docstring).
STREAMED_TILE = 2


def _group_tile(step_bytes: int, step_weights: int, step, doc: str):
    """An intrinsic tile(out, col, w, g, xo, xs, t, G) over a grouped layout: out[t + j, col +
    16 g + r] = row 16 g + r of w . token t + j, for the 16 rows of group g and G tokens (G a
    compile-time constant) of quantize_split's xo, xs. The group is read in steps of step_bytes
    (step_weights weights of each row); step(b, bp, k, tokens, totals) adds step k (at bp) to
    each token's 16 totals. tokens: per token, (its lo bytes, its hi bytes, its xs row)."""

    def typer(typingctx, out, col, w, g, xo, xs, t, G):
        ng = literal_value(G)
        if not ng or out.dtype != types.float32 or out.layout != "C":
            return None
        sig = types.void(out, col, w, g, xo, xs, t, G)

        def codegen(context, builder, signature, args):
            b = builder
            oty, _, wty, _, xoty, xsty, _, _ = signature.args
            oarr = context.make_array(oty)(context, b, args[0])
            warr = context.make_array(wty)(context, b, args[2])
            xoarr = context.make_array(xoty)(context, b, args[4])
            xsarr = context.make_array(xsty)(context, b, args[5])
            row_bytes = b.extract_value(warr.shape, 1)
            steps = b.sdiv(row_bytes, I64(step_bytes // GROUP))
            K = b.mul(steps, I64(step_weights))
            gi, t0 = as_i64(b, args[3], None), as_i64(b, args[6], None)
            group = b.gep(b.bitcast(warr.data, I8.as_pointer()), [b.mul(gi, b.mul(row_bytes, I64(GROUP)))], source_etype=I8)
            act = b.bitcast(xoarr.data, I8.as_pointer())
            xs_width = b.extract_value(xsarr.shape, 1)
            tokens = []
            for j in range(ng):
                lo = b.gep(act, [b.mul(b.add(t0, I64(j)), b.mul(K, I64(2)))], source_etype=I8)
                tokens.append((lo, b.gep(lo, [K], source_etype=I8), b.gep(xsarr.data, [b.mul(b.add(t0, I64(j)), xs_width)], source_etype=F32)))

            first_tile = b.icmp_signed("==", t0, I64(0))  # later tiles find the group in cache

            def body(k, totals):
                bp = b.gep(group, [b.mul(k, I64(step_bytes))], source_etype=I8)
                if ng >= STREAMED_TILE:  # every line of the step, a page ahead (STREAMED_TILE)
                    with b.if_then(first_tile, likely=True):
                        for ahead in prefetch_offsets(step_bytes):
                            prefetch(b, b.gep(bp, [I64(ahead)], source_etype=I8), INTO_L2)
                return step(b, bp, k, tokens, list(totals))

            totals = loop(b, I64(0), steps, 1, [ir.Constant(VEC, [0.0] * LANES)] * ng, body)
            width = b.extract_value(oarr.shape, 1)
            first = b.add(as_i64(b, args[1], None), b.mul(gi, I64(GROUP)))
            for j, total in enumerate(totals):
                dst = b.gep(oarr.data, [b.add(b.mul(b.add(t0, I64(j)), width), first)], source_etype=F32)
                b.store(total, b.bitcast(dst, VEC.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    typer.__doc__ = doc
    return intrinsic(prefer_literal=True)(typer)


# vpdpbusd chains per byte half of a token: part i goes to chain i % CHAINS, added at the end.
# Integer sums are exact in any order, so this only shortens the dependent chain (8 parts of a
# Q4_0 block: 8 x vpdpbusd's latency): a decode step of 8 sequences on the default model's Q4_0
# file 15.6 -> 15.2 ms with 4 chains, 14.85 -> 14.4 with 2 on top of tiles of 8 (4 rounds,
# alternating; Intel Xeon, 2 cores); one sequence level.
CHAINS = 2


def _exact_sums(b, token, e, parts, level_max, corr=None):
    """The exact integer sums, per row lane, of levels times a token's int16 activations: parts
    are (64 x u8 levels, offset from e of their first weight), each level lane meeting the 4
    activations from there; the high bytes' sums shifted by 8 onto the low bytes' (which start
    at corr, an i32, or 0). level_max: the largest level; above 127 _dpbusd's wide levels, up to
    AVX2_INT16_LEVELS AVX2 adds the parts' pair sums as int16 (_avx2_sums)."""
    if summing_way() == "avx2" and level_max <= AVX2_INT16_LEVELS:
        return _avx2_sums(b, token, e, parts, corr, level_max)
    plo, phi, _ = token
    zero = ir.Constant(I32_VEC, [0] * LANES)
    sums = []
    for p in (phi, plo):
        chains = [zero] * CHAINS
        if p is plo and corr is not None:
            chains[0] = splat(b, corr)
        for i, (levels, off) in enumerate(parts):
            chains[i % CHAINS] = _dpbusd(b, chains[i % CHAINS], levels, _broadcast4(b, p, b.add(e, I64(off))), wide_levels=level_max >= 128)
        total = chains[0]
        for chain in chains[1:]:
            total = b.add(total, chain)
        sums.append(total)
    return b.add(b.shl(sums[0], ir.Constant(I32_VEC, [8] * LANES)), sums[1])


# Levels for which AVX2 sums a step's parts as int16 (_avx2_sums): Q4's, whose 8 parts of a block
# fit one int16 sum. Default model, haswell target, decode of 128 after 16, 4 alternating rounds:
# the Q4_0 file 126 -> 143 tok/s and prefill 512 455 -> 518; on the Q4_K_M file Q4_K's level,
# Q5_0's and both gave 172, 174, 147 and 166 tok/s: Q5_0's (4 parts per sum) lost, whatever a
# lone matrix of it measured, so larger levels keep a vpmaddwd per part.
AVX2_INT16_LEVELS = 15


def _avx2_sums(b, token, e, parts, corr, level_max):
    """_exact_sums on AVX2 for levels of at most level_max (< 128): vpmaddubsw's int16 pair sums
    (each at most 2 * level_max * 128 in magnitude: the activation bytes are within +-128) of up
    to 32767 // (256 level_max) parts are added as int16, which cannot wrap, before one vpmaddwd
    widens them to int32; per 32-byte half, as _pair_sums_avx2. For Q4 levels that is one
    vpmaddwd per 8 parts (a block) instead of one per part."""
    maddubs, maddwd, ones = _avx2_pair_sums(b)
    per = max(1, 32767 // (256 * level_max))
    plo, phi, _ = token
    sums = []
    for p in (phi, plo):
        words = [None, None]  # int32 sums of each 32-byte half
        for g in range(0, len(parts), per):
            pairs = [None, None]
            for levels, off in parts[g : g + per]:
                s = _broadcast4(b, p, b.add(e, I64(off)))
                for h in (0, 1):
                    v = b.call(maddubs, [_byte_half(b, levels, h), _byte_half(b, s, h)])
                    pairs[h] = v if pairs[h] is None else b.add(pairs[h], v)
            for h in (0, 1):
                v = b.call(maddwd, [pairs[h], ones])
                words[h] = v if words[h] is None else b.add(words[h], v)
        sums.append(b.shuffle_vector(words[0], words[1], ir.Constant(I32_VEC, list(range(LANES)))))
    hi, lo = sums
    if corr is not None:
        lo = b.add(lo, splat(b, corr))
    return b.add(b.shl(hi, ir.Constant(I32_VEC, [8] * LANES)), lo)


def _row_halves(b, bp, off):
    """The 16 float16 at bp + off (one per row), as float32."""
    return half_to_f32(b, b.load(b.bitcast(b.gep(bp, [I64(off)], source_etype=I8), ir.VectorType(ir.IntType(16), LANES).as_pointer()), align=1))


def _word64(b, bp, off):
    return b.load(b.bitcast(b.gep(bp, [I64(off)], source_etype=I8), BYTES64.as_pointer()), align=1)


def _nibbles(b, words):
    """A word's low and high nibbles, each as 64 x u8."""
    mask = ir.Constant(BYTES64, [15] * 64)
    return b.and_(words, mask), b.and_(b.lshr(words, ir.Constant(BYTES64, [4] * 64)), mask)


def _block_words(b, ps, block):
    """Pointer to quantize_split's words of a block (scale, then the two sums of 16)."""
    return b.gep(ps, [b.mul(block, I64(PER_BLOCK))], source_etype=F32)


def _block_step(offset, level_max, parts_of, scales_of=lambda b, bp: _row_halves(b, bp, 0)):
    """A step over one block of 32 for the 16 rows whose levels are q + offset (the sums
    subtract offset sum(x16)), at most level_max; parts_of(b, bp) gives the block's (levels,
    first weight) parts, scales_of(b, bp) its 16 rows' scales (float16 at the block's start)."""

    def step(b, bp, k, tokens, totals):
        dw = scales_of(b, bp)
        parts = parts_of(b, bp)
        e = b.mul(k, I64(QBLOCK))
        for j, token in enumerate(tokens):
            pw = _block_words(b, token[2], k)
            corr = b.mul(b.add(_word_at(b, pw, 1), _word_at(b, pw, 2)), I32(-offset))
            exact = _exact_sums(b, token, e, parts, level_max, corr)
            totals[j] = fma_vec(b, b.sitofp(exact, VEC), b.fmul(dw, splat(b, b.load(pw, align=4))), totals[j])
        return totals

    return step


def _q4_parts(b, bp, words_at=32):
    """Q4_0_R16's four words (from words_at) as eight nibble vectors: weights 4o.. (low) and
    16 + 4o.. (high)."""
    parts = []
    for o in range(4):
        low, high = _nibbles(b, _word64(b, bp, words_at + 64 * o))
        parts += [(low, 4 * o), (high, 16 + 4 * o)]
    return parts


_q4_step = _block_step(8, 15, _q4_parts)
q4_r16_tile = _group_tile(GROUP_BLOCK_BYTES, QBLOCK, _q4_step, "Q4_0_R16 rows of group g . G tokens (_group_tile).")


# ---------------------------------------------------------------- Q5_0
#
# Q5_0_R16, per group of 16 rows and block of 32 (352 bytes, 16 x 22): the 16 rows' float16
# scales, then a 64-byte word of fifth bits, then Q4_0_R16's four words of nibbles. In the
# fifth bits' word, byte 4r + j holds row r's fifth bit of weight 4o + j at bit o and of weight
# 16 + 4o + j at bit 4 + o (o = 0..3): the bits that nibble word o's lanes need, shifted into
# place with one shift and mask each. Levels 0..31 (weight = d * (level - 16), as gguf-py's).
# llama.cpp's Q4_K_M and Q5_K_M files store most matrices whose rows are not whole super-blocks
# of 256 (the default model's, 576 wide) as Q5_0.

Q5_0_BYTES = FORMATS[Q5_0][1]  # 22
Q5_0_GROUP_BYTES = GROUP * Q5_0_BYTES  # 352
Q5_0_NIBBLES_AT = 32 + 64  # after the scales and the fifth bits


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


def _q5_parts(b, bp):
    """Q5_0_R16's words as eight level vectors (0..31): each nibble vector of _q4_parts with its
    fifth bits (bit o for word o's low nibbles, 4 + o for its high ones) shifted to bit 4."""
    fifth = _word64(b, bp, 32)
    bytes_of = lambda v: ir.Constant(BYTES64, [v] * 64)
    parts = []
    for i, (nibbles, first) in enumerate(_q4_parts(b, bp, Q5_0_NIBBLES_AT)):
        o = i // 2
        to_bit4 = b.shl(fifth, bytes_of(4 - o)) if i % 2 == 0 else b.lshr(fifth, bytes_of(o))
        parts.append((b.or_(nibbles, b.and_(to_bit4, bytes_of(16))), first))
    return parts


_q5_step = _block_step(16, 31, _q5_parts)
q5_r16_tile = _group_tile(Q5_0_GROUP_BYTES, QBLOCK, _q5_step, "Q5_0_R16 rows of group g . G tokens (_group_tile).")


# ---------------------------------------------------------------- Q8_0
#
# Q8_0_R16, per group of 16 rows and block of 32 (544 bytes, 16 x 34): the 16 rows' float16
# scales, then eight 64-byte words, word o holding every row's weights 4o..4o+3 (row r at 4r) as
# level + 128: unsigned as vpdpbusd takes them, with nothing to unpack.

Q8_0_BYTES = FORMATS[Q8_0][1]  # 34
Q8_0_GROUP_BYTES = GROUP * Q8_0_BYTES  # 544


def group_q8_0(out, w):
    """out = Q8_0 rows w (N, blocks * 34) regrouped as Q8_0_R16 (same shape): N % 16 == 0."""
    N = w.shape[0]
    G = N // GROUP
    blocks = w.reshape(G, GROUP, -1, Q8_0_BYTES)
    nb = blocks.shape[2]
    d = np.ascontiguousarray(blocks[..., :2].transpose(0, 2, 1, 3)).reshape(G, nb, 32)
    levels = (blocks[..., 2:] ^ 0x80).reshape(G, GROUP, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(G, nb, 512)
    out.reshape(G, nb, Q8_0_GROUP_BYTES)[:] = np.concatenate([d, levels], axis=2)


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


_q8_step = _block_step(128, 255, lambda b, bp: [(_word64(b, bp, 32 + 64 * o), 4 * o) for o in range(8)])  # levels as they are stored


q8_r16_tile = _group_tile(Q8_0_GROUP_BYTES, QBLOCK, _q8_step, "Q8_0_R16 rows of group g . G tokens (_group_tile).")


# ---------------------------------------------------------------- Q6_K
#
# Q6_K_R16, per group of 16 rows and super-block of 256 weights (3360 bytes, 16 x 210): the 16
# rows' float16 d (32 bytes), their int8 scales of the 16 sub-blocks (256 bytes, sub-block-major),
# then per sub-block of 16 weights three 64-byte words, row r at 4r, byte j: A holds the low 4
# bits of weights j and 4 + j, B of weights 8 + j and 12 + j, C the high 2 bits of weights j,
# 4 + j, 8 + j and 12 + j. Levels 0..63 (weight = d * scale * (level - 32), as gguf-py's).

Q6_K_BYTES = FORMATS[Q6_K][1]  # 210
Q6_K_GROUP_BYTES = GROUP * Q6_K_BYTES  # 3360
Q6_K_WORDS_AT = 32 + 256  # after d and the scales
Q6_K_PREFETCH = 4096  # bytes ahead of a step that it asks for, one line (module docstring)


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


@kernel()
def group_q6_k(out, w):
    """out = Q6_K rows w (N, sb * 210) regrouped as Q6_K_R16 (same shape): N % 16 == 0. Per
    group and super-block: the rows' d, their 16 scales as planes (plane sub: byte sub of every
    row), then per sub-block of 16 weights three words of 64 bytes (levels' low nibbles of quads
    0 | 1, of 2 | 3, their high two bits of all four); group_q6_k_reference is the same in NumPy."""
    N, row_bytes = w.shape
    blocks = row_bytes // Q6_K_BYTES
    flat = out.reshape(N * row_bytes)
    for g in prange(N // GROUP):
        for r in range(GROUP):
            n = g * GROUP + r
            for k in range(blocks):
                src = k * Q6_K_BYTES
                at = g * GROUP * row_bytes + k * Q6_K_GROUP_BYTES
                flat[at + 2 * r], flat[at + 2 * r + 1] = w[n, src + 208], w[n, src + 209]
                for sub in range(16):
                    flat[at + 32 + 16 * sub + r] = w[n, src + 192 + sub]
                for sub in range(16):
                    wb = at + Q6_K_WORDS_AT + 192 * sub + 4 * r
                    for j in range(4):
                        e = 16 * sub + j
                        l0, l1 = _q6_level(w, n, src, e), _q6_level(w, n, src, e + 4)
                        l2, l3 = _q6_level(w, n, src, e + 8), _q6_level(w, n, src, e + 12)
                        flat[wb + j] = (l0 & 15) | ((l1 & 15) << 4)
                        flat[wb + 64 + j] = (l2 & 15) | ((l3 & 15) << 4)
                        flat[wb + 128 + j] = (l0 >> 4) | ((l1 >> 4) << 2) | ((l2 >> 4) << 4) | ((l3 >> 4) << 6)


@njit(cache=True)
def _q6_level(w, n, src, e):
    """Level e (0..255, 0..63) of the Q6_K super-block at w[n, src:] (ggml's dequantize_row_q6_K)."""
    h, m, i = e // 128, (e % 128) // 32, e % 32
    low = np.int64(w[n, src + 64 * h + 32 * (m & 1) + i])
    low = (low >> 4) if m >= 2 else (low & 15)
    return low | (((np.int64(w[n, src + 128 + 32 * h + i]) >> (2 * m)) & 3) << 4)


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


def _q6_step(b, bp, k, tokens, totals):
    """One super-block of 256 for the 16 rows: per sub-block of 16, levels q + 32 (the sums
    subtract 32 sum(x16)), scaled by d * its scale * the activations' block scale. The sub-blocks
    are a loop, not 16 copies: the same instructions each, and a sixteenth of the code for LLVM
    to compile (a first run's Q6_K kernels 13 -> .. s on AVX2)."""
    if len(tokens) < STREAMED_TILE:  # wider tiles ask for every line (_group_tile)
        prefetch(b, b.gep(bp, [I64(Q6_K_PREFETCH)], source_etype=I8))
    d = _row_halves(b, bp, 0)
    c = lambda v: ir.Constant(BYTES64, [v] * 64)

    def sub_block(sub, totals):
        sc = b.load(b.bitcast(b.gep(bp, [b.add(I64(32), b.mul(sub, I64(16)))], source_etype=I8), ir.VectorType(I8, LANES).as_pointer()), align=1)
        row_scale = b.fmul(d, b.sitofp(b.sext(sc, I32_VEC), VEC))  # exact: 11 x 8 bits
        words = b.gep(bp, [b.add(I64(Q6_K_WORDS_AT), b.mul(sub, I64(192)))], source_etype=I8)
        wa, wb, wc = (_word64(b, words, 64 * x) for x in range(3))
        low = [b.and_(wa, c(15)), b.lshr(wa, c(4)), b.and_(wb, c(15)), b.lshr(wb, c(4))]
        high = [b.and_(b.shl(wc, c(4)), c(0x30)), b.and_(b.shl(wc, c(2)), c(0x30)), b.and_(wc, c(0x30)), b.and_(b.lshr(wc, c(2)), c(0x30))]
        parts = [(b.or_(lv, hv), 4 * i) for i, (lv, hv) in enumerate(zip(low, high))]
        e = b.add(b.mul(k, I64(256)), b.mul(sub, I64(16)))
        block = b.add(b.mul(k, I64(8)), b.lshr(sub, I64(1)))
        half = b.trunc(b.and_(sub, I64(1)), I32)  # which sum of 16 of the activations' block
        totals = list(totals)
        for j, token in enumerate(tokens):
            pw = _block_words(b, token[2], block)
            x_sum = b.load(b.bitcast(b.gep(pw, [b.zext(b.add(half, I32(1)), I64)], source_etype=F32), I32.as_pointer()), align=4)
            exact = _exact_sums(b, token, e, parts, 63, b.mul(x_sum, I32(-32)))
            totals[j] = fma_vec(b, b.sitofp(exact, VEC), b.fmul(row_scale, splat(b, b.load(pw, align=4))), totals[j])
        return totals

    return loop(b, I64(0), I64(16), 1, totals, sub_block)


q6_r16_tile = _group_tile(Q6_K_GROUP_BYTES, 256, _q6_step, "Q6_K_R16 rows of group g . G tokens (_group_tile).")


# ---------------------------------------------------------------- Q4_K
#
# Q4_K_R16, per group of 16 rows and super-block of 256 weights (2304 bytes, 16 x 144): the 16
# rows' float16 d, then dmin (64 bytes), their 12 bytes of packed 6-bit scales and minimums
# (ggml's get_scale_min_k4 packing) as 12 planes of 16 bytes, plane j holding byte j of every row
# (192 bytes), then per sub-block of 32 weights Q4_0_R16's four words. Weight = (d * scale) *
# level - dmin * minimum, as gguf-py's.

Q4_K_BYTES = FORMATS[Q4_K][1]  # 144
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
        for r in range(GROUP):
            n = g * GROUP + r
            for k in range(blocks):
                src = k * Q4_K_BYTES
                at = g * GROUP * row_bytes + k * Q4_K_GROUP_BYTES
                flat[at + 2 * r], flat[at + 2 * r + 1] = w[n, src], w[n, src + 1]
                flat[at + 32 + 2 * r], flat[at + 33 + 2 * r] = w[n, src + 2], w[n, src + 3]
                for j in range(12):
                    flat[at + Q4_K_PLANES_AT + 16 * j + r] = w[n, src + 4 + j]
                for sub in range(8):  # levels 32 sub.. are nibble sub % 2 of bytes 32 (sub // 2)..
                    q, shift = src + 16 + 32 * (sub // 2), 4 * (sub % 2)
                    wb = at + Q4_K_WORDS_AT + 256 * sub + 4 * r
                    for o in range(4):
                        for j in range(4):
                            lo = (w[n, q + 4 * o + j] >> shift) & 15
                            hi = (w[n, q + 16 + 4 * o + j] >> shift) & 15
                            flat[wb + 64 * o + j] = lo | (hi << 4)


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


def _qk_step(b, bp, k, tokens, totals):
    """One super-block of 256 for the 16 rows: per sub-block of 32, total = fma(float(sum of
    level x16), d * scale * activation scale, total), then fma(float(sum of x16), -(dmin *
    minimum * activation scale), total). The sub-blocks are a loop, not 8 copies (see _q6_step)."""
    d, dmin = _row_halves(b, bp, 0), _row_halves(b, bp, 32)
    u8x16 = ir.VectorType(I8, LANES)
    plane = lambda j: b.load(b.bitcast(b.gep(bp, [b.add(I64(Q4_K_PLANES_AT), b.mul(j, I64(16)))], source_etype=I8), u8x16.as_pointer()), align=1)
    c = lambda v: ir.Constant(u8x16, [v] * LANES)
    high2 = lambda v: b.shl(b.lshr(v, c(6)), c(4))  # a scale's top two bits, in place
    as_f32 = lambda v: b.uitofp(b.zext(v, I32_VEC), VEC)

    def sub_block(sub, totals):
        # get_scale_min_k4, 16 rows at once: sub < 4 reads planes sub and 4 + sub; the others
        # plane 4 + sub's halves with two bits from planes sub - 4 and sub
        first = b.icmp_signed("<", sub, I64(4))
        top = plane(b.add(sub, I64(4)))
        below = plane(b.select(first, sub, b.sub(sub, I64(4))))
        own = plane(sub)
        sc = b.select(first, b.and_(below, c(63)), b.or_(b.and_(top, c(15)), high2(below)))
        mn = b.select(first, b.and_(top, c(63)), b.or_(b.lshr(top, c(4)), high2(own)))
        ds, dm = b.fmul(d, as_f32(sc)), b.fmul(dmin, as_f32(mn))  # exact: 11 x 6 bits
        words = b.gep(bp, [b.add(I64(Q4_K_WORDS_AT), b.mul(sub, I64(256)))], source_etype=I8)
        parts = []
        for o in range(4):
            low, high = _nibbles(b, _word64(b, words, 64 * o))
            parts += [(low, 4 * o), (high, 16 + 4 * o)]
        e = b.add(b.mul(k, I64(256)), b.mul(sub, I64(32)))
        block = b.add(b.mul(k, I64(8)), sub)
        totals = list(totals)
        for j, token in enumerate(tokens):
            pw = _block_words(b, token[2], block)
            exact = _exact_sums(b, token, e, parts, 15)
            da = splat(b, b.load(pw, align=4))
            x_sum = b.sitofp(b.add(_word_at(b, pw, 1), _word_at(b, pw, 2)), F32)
            total = fma_vec(b, b.sitofp(exact, VEC), b.fmul(ds, da), totals[j])
            totals[j] = fma_vec(b, splat(b, x_sum), b.fneg(b.fmul(dm, da)), total)
        return totals

    return loop(b, I64(0), I64(8), 1, totals, sub_block)


qk_r16_tile = _group_tile(Q4_K_GROUP_BYTES, 256, _qk_step, "Q4_K_R16 rows of group g . G tokens (_group_tile).")


# ---------------------------------------------------------------- MXFP4
#
# MXFP4_R16, per group of 16 rows and block of 32 (272 bytes, 16 x 17): the 16 rows' exponent
# bytes, then Q4_0_R16's four words of 4-bit codes. A step looks each code up as its level + 12
# (0..24: unsigned, as vpdpbusd takes levels; the sums subtract 12 sum(x16)) with vpshufb, and
# each exponent as the power of two 2^(e - 128), so weight = level * 2^(e - 128) exactly as
# gguf-py's dequantize forms it (levels being FP4 values doubled).

MXFP4_BYTES = FORMATS[MXFP4][1]  # 17
MXFP4_GROUP_BYTES = GROUP * MXFP4_BYTES  # 272
MXFP4_OFFSET = -min(MXFP4_LEVELS)  # 12


def group_mxfp4(out, w):
    """out = MXFP4 rows w (N, blocks * 17) regrouped as MXFP4_R16 (same shape): N % 16 == 0."""
    group_nibbles(out, w, 1)


_MXFP4_VALUES = np.array(MXFP4_LEVELS, np.float32)


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


def _powers_of_two(b, bp):
    """The 16 rows' exponent bytes at bp as float32 2^(e - 128) (ggml's e8m0_to_fp32_half)."""
    return e8m0_half(b, b.zext(b.load(b.bitcast(bp, ir.VectorType(I8, LANES).as_pointer()), align=1), I32_VEC))


def _mxfp4_levels(b, codes):
    """64 4-bit codes (64 x i8) as their levels + 12: a byte table lookup (vpshufb: AVX-512 BW,
    or AVX2 half by half), or computed lane by lane elsewhere."""
    table = [v + MXFP4_OFFSET for v in MXFP4_LEVELS]
    if has("avx512bw"):
        fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(BYTES64, [BYTES64, BYTES64]), "llvm.x86.avx512.pshuf.b.512")
        return b.call(fn, [ir.Constant(BYTES64, table * 4), codes])
    if has("avx2"):
        fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(BYTES32, [BYTES32, BYTES32]), "llvm.x86.avx2.pshuf.b")
        halves = [b.call(fn, [ir.Constant(BYTES32, table * 2), b.shuffle_vector(codes, codes, ir.Constant(ir.VectorType(I32, 32), list(range(h, h + 32))))])
                  for h in (0, 32)]
        return b.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(I32, 64), list(range(64))))
    return b.add(ir.Constant(BYTES64, [MXFP4_OFFSET] * 64), mxfp4_levels(b, codes))


_mxfp4_step = _block_step(MXFP4_OFFSET, MXFP4_OFFSET + max(MXFP4_LEVELS), lambda b, bp: [(_mxfp4_levels(b, codes), first) for codes, first in _q4_parts(b, bp, words_at=16)],
                          _powers_of_two)
mxfp4_r16_tile = _group_tile(MXFP4_GROUP_BYTES, QBLOCK, _mxfp4_step, "MXFP4_R16 rows of group g . G tokens (_group_tile).")


# ---------------------------------------------------------------- each layout, by its code

TILES = {Q4_0_R16: q4_r16_tile, Q5_0_R16: q5_r16_tile, Q8_0_R16: q8_r16_tile, Q4_K_R16: qk_r16_tile, Q6_K_R16: q6_r16_tile,
         MXFP4_R16: mxfp4_r16_tile}
ROW_GETTERS = {Q4_0_R16: q4_r16_row_get, Q5_0_R16: q5_r16_row_get, Q8_0_R16: q8_r16_row_get, Q4_K_R16: qk_r16_row_get, Q6_K_R16: q6_r16_row_get,
               MXFP4_R16: mxfp4_r16_row_get}


def grouped_rows(fmt, out, col, w, g, xo, xs):
    """out[t, col + 16 g ..] for group g of grouped weights (fmt: a grouped layout's code, a
    compile-time constant) and every token of xo: tiles of 8 tokens, then 4, then 3 or 2 (each
    step's levels unpacked once for them), then one at a time. Eight over two fours: a decode step
    of 8 sequences on the default model's Q4_0 file 15.6 -> 14.85 ms (4 rounds, alternating); prefill
    512 level within noise (946 vs 931 tok/s, medians of 4). A tile of 2 for steps of 2, 3, 6 and
    7 rows (a few sequences, or one checking a short draft): on the 1.2B shape's Q4_0 file a step
    of 2 rows went from 1.5-1.8x a lone token's time to 1.0-1.1x, of 3 rows from 2.0-2.2x to
    1.2-1.4x (3 alternating rounds, with STREAMED_TILE 2). A tile of 3 for steps of 3 and 7
    rows: that step of 3 rows 31.0-36.0 -> 27.7-29.5 ms (3 alternating rounds), below a step of 4."""
    raise NotImplementedError


@overload(grouped_rows, prefer_literal=True, jit_options={"fastmath": EXACT_MATH})
def _grouped_rows(fmt, out, col, w, g, xo, xs):
    tile = TILES.get(literal_value(fmt))
    if tile is None:
        return None

    def rows(fmt, out, col, w, g, xo, xs):
        T = xo.shape[0]
        t = 0
        # three loops, not literal_unroll over gguf_blocks.TOKEN_GROUPS as block_rows does: here
        # that made a parallel loop around it serial (NumbaPerformanceWarning, several exits)
        while t + 8 <= T:
            tile(out, col, w, g, xo, xs, t, 8)
            t += 8
        while t + 4 <= T:
            tile(out, col, w, g, xo, xs, t, 4)
            t += 4
        if t + 3 <= T:
            tile(out, col, w, g, xo, xs, t, 3)
            t += 3
        if t + 2 <= T:
            tile(out, col, w, g, xo, xs, t, 2)
            t += 2
        while t < T:
            tile(out, col, w, g, xo, xs, t, 1)
            t += 1

    return rows


def grouped_row_get(fmt, w, n, out):
    """out[:] = row n of grouped weights as float32, as gguf-py dequantizes the file's row (fmt:
    the layout's code, a compile-time constant)."""
    raise NotImplementedError


@overload(grouped_row_get, prefer_literal=True, jit_options={"fastmath": EXACT_MATH})
def _grouped_row_get(fmt, w, n, out):
    getter = ROW_GETTERS.get(literal_value(fmt))
    if getter is None:
        return None
    return lambda fmt, w, n, out: getter(w, n, out)
