"""Integer dot products of block formats regrouped by 16 rows (kernels.grouped_layouts) with
activations quantized per block (kernels.activation_operands.quantize_split).

Activations meet the weights as int16 levels per block of 32 (scale = the block's largest
magnitude / 32639), each split into a signed high and low byte, x = 256 hi + lo, so two
vpdpbusd chains give the exact integer sum of a block's 32 products q * x (q = level - 8 for Q4_0,
by subtracting 8 * sum(x), prepared per block). One 64-byte load of a group's word, masked and
shifted, gives each of 16 rows' levels in its own lane: vpdpbusd multiplies them with 4
activations broadcast to every lane, 64 products in one instruction, one lane per row. Per row and
token, blocks are then added in order in float32: total = fma(float(int sum), weight scale *
activation scale, total). Integer sums have no order, and that float chain is the same in every
tile, so decode, batched decode and prefill agree bit for bit. Against the file dequantized and
run at float32, a product's error is that of 16-bit activations (about 1/65000 of a block's
largest value). Each layout has a second tile for 8-bit activations (Operand.BYTES, the `_R16_A8`
rows; `--activations 8`): int8 levels per block (largest / 127, llama.cpp's Q8_0 activations) in
the hi bytes' place and no lo bytes, so one chain of products instead of two, llama.cpp's
numerics (its Q8_K activations for K-quants are blocks of 256; these stay blocks of 32).

A Q5_0 step shifts each lane's fifth bits into place, a Q4_K step unpacks its 6-bit scales and
minimums for the 16 rows at once, an MXFP4 step looks its FP4 codes up as integer levels and its
exponents up as powers of two. A group's blocks are one sequential stream, left to the hardware
prefetcher, but for Q6_K, whose step asks for one line a page ahead (docs/performance.md has the
measurements behind these choices).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .activation_operands import PER_BLOCK
from .formats import BY_NAME, kernel_for, kernel_of, layouts_of
from .gguf_blocks import MXFP4_LEVELS, e8m0_half, literal_value, mxfp4_levels, prefetch_offsets
from .grouped_layouts import (
    GROUP, GROUP_BLOCK_BYTES, MXFP4_GROUP_BYTES, MXFP4_OFFSET, Q4_K_GROUP_BYTES, Q4_K_PLANES_AT, Q4_K_WORDS_AT, Q5_0_GROUP_BYTES,
    Q5_0_NIBBLES_AT, Q6_K_GROUP_BYTES, Q6_K_WORDS_AT, Q8_0_GROUP_BYTES,
)
from .jit import EXACT_MATH
from .target import has
from .vector_ir import F32, I32, I32_VEC, I64, INTO_L2, LANES, QBLOCK, VEC, as_i64, fma_vec, half_to_f32, loop, prefetch, splat

I8 = ir.IntType(8)
BYTES64 = ir.VectorType(I8, 64)


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
# ahead, into L2: such a tile spends G times a lone token's arithmetic on each line, and the
# hardware prefetcher alone falls behind. Later tiles of a prefill find the group in cache. Lone
# tokens keep the prefetcher's pace. (docs/performance.md, "Integer products": the measurements.)
STREAMED_TILE = 2


def _tiles(source: str, step_bytes: int, step_weights: int, step) -> None:
    """The tiles of source's grouped layouts (_group_tile), one per activation width, each
    registered as its layout's "tile" kernel."""
    for name in layouts_of(source):
        kernel_of(name, "tile")(_group_tile(step_bytes, step_weights, step, BY_NAME[name].activation_bits, f"{name} rows of group g . G tokens (_group_tile)."))


def _group_tile(step_bytes: int, step_weights: int, step, bits: int, doc: str):
    """An intrinsic tile(out, col, w, g, xo, xs, t, G) over a grouped layout: out[t + j, col +
    16 g + r] = row 16 g + r of w . token t + j, for the 16 rows of group g and G tokens (G a
    compile-time constant) of quantize_split's xo, xs (bits 16; quantize_bytes's for 8). The group
    is read in steps of step_bytes (step_weights weights of each row); step(b, bp, k, tokens,
    totals) adds step k (at bp) to each token's 16 totals. tokens: per token, (its lo bytes or
    None for 8-bit activations, its hi bytes (the int8 levels), its xs row)."""

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
                tokens.append((lo if bits == 16 else None, b.gep(lo, [K], source_etype=I8),
                               b.gep(xsarr.data, [b.mul(b.add(t0, I64(j)), xs_width)], source_etype=F32)))

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
# Q4_0 block: 8 x vpdpbusd's latency).
CHAINS = 2


def _exact_sums(b, token, e, parts, level_max, corr=None):
    """The exact integer sums, per row lane, of levels times a token's int16 activations: parts
    are (64 x u8 levels, offset from e of their first weight), each level lane meeting the 4
    activations from there; the high bytes' sums shifted by 8 onto the low bytes' (which start
    at corr, an i32, or 0). level_max: the largest level; above 127 _dpbusd's wide levels, up to
    AVX2_INT16_LEVELS (AVX2_INT16_LEVELS_A8 against 8-bit activations) AVX2 adds the parts' pair
    sums as int16 (_avx2_sums)."""
    if summing_way() == "avx2" and level_max <= (AVX2_INT16_LEVELS if token[0] is not None else AVX2_INT16_LEVELS_A8):
        return _avx2_sums(b, token, e, parts, corr, level_max)
    plo, phi, _ = token
    zero = ir.Constant(I32_VEC, [0] * LANES)
    sums = []
    byte_planes = (phi, plo) if plo is not None else (phi,)
    for p in byte_planes:
        chains = [zero] * CHAINS
        if p is byte_planes[-1] and corr is not None:  # the offset's correction joins the unshifted sum
            chains[0] = splat(b, corr)
        for i, (levels, off) in enumerate(parts):
            chains[i % CHAINS] = _dpbusd(b, chains[i % CHAINS], levels, _broadcast4(b, p, b.add(e, I64(off))), wide_levels=level_max >= 128)
        total = chains[0]
        for chain in chains[1:]:
            total = b.add(total, chain)
        sums.append(total)
    if plo is None:  # 8-bit activations: the levels' sums themselves
        return sums[0]
    return b.add(b.shl(sums[0], ir.Constant(I32_VEC, [8] * LANES)), sums[1])


# Levels for which AVX2 sums a step's parts as int16 (_avx2_sums): against 16-bit activations Q4's,
# whose 8 parts of a block fit one int16 sum; larger levels keep a vpmaddwd per part (Q5_0's 4
# parts per sum lost). Against 8-bit activations Q5_0's and Q6_K's too (4 and 2 parts a sum): a
# Q6_K matrix at 1 thread, in cache, 0.44-0.46 ms instead of 0.52-0.72 (4096 x 4096, best of 60).
AVX2_INT16_LEVELS = 15
AVX2_INT16_LEVELS_A8 = 63


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
    for p in (phi, plo) if plo is not None else (phi,):
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
    if plo is None:  # 8-bit activations: the levels' sums themselves
        return sums[0] if corr is None else b.add(sums[0], splat(b, corr))
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
_tiles("Q4_0", GROUP_BLOCK_BYTES, QBLOCK, _q4_step)


# ---------------------------------------------------------------- Q5_0, Q8_0, Q6_K, Q4_K, MXFP4 (their layouts: kernels.grouped_layouts)


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
_tiles("Q5_0", Q5_0_GROUP_BYTES, QBLOCK, _q5_step)


_q8_step = _block_step(128, 255, lambda b, bp: [(_word64(b, bp, 32 + 64 * o), 4 * o) for o in range(8)])  # levels as they are stored
_tiles("Q8_0", Q8_0_GROUP_BYTES, QBLOCK, _q8_step)

Q6_K_PREFETCH = 4096  # bytes ahead of a step that it asks for, one line (docs/performance.md, "Integer products")


def _q6_step(b, bp, k, tokens, totals):
    """One super-block of 256 for the 16 rows: per sub-block of 16, levels q + 32 (the sums
    subtract 32 sum(x16)), scaled by d * its scale * the activations' block scale. The sub-blocks
    are a loop, not 16 copies: the same instructions each, and a sixteenth of the code for LLVM
    to compile on a first run."""
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


_tiles("Q6_K", Q6_K_GROUP_BYTES, 256, _q6_step)


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


_tiles("Q4_K", Q4_K_GROUP_BYTES, 256, _qk_step)


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
_tiles("MXFP4", MXFP4_GROUP_BYTES, QBLOCK, _mxfp4_step)


# ---------------------------------------------------------------- a grouped matrix's rows, by the layout's code


def grouped_rows(fmt, out, col, w, g, xo, xs):
    """out[t, col + 16 g ..] for group g of grouped weights (fmt: a grouped layout's code, a
    compile-time constant) and every token of xo: tiles of 8 tokens, then 4, then 3 or 2 (each
    step's levels unpacked once for them), then one at a time: eight over two fours, and small
    tiles so that steps of a few rows (a few sequences, or one checking a short draft) cost little
    more than one (docs/performance.md, "Integer products")."""
    raise NotImplementedError


@overload(grouped_rows, prefer_literal=True, jit_options={"fastmath": EXACT_MATH})
def _grouped_rows(fmt, out, col, w, g, xo, xs):
    tile = kernel_for(literal_value(fmt), "tile")
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
