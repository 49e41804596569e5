"""GGUF block formats run as stored: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and MXFP4 (blocks of 32 weights)
and Q4_K, Q5_K and Q6_K (super-blocks of 256), laid out as ggml and gguf-py define them, and F32,
F16 and BF16 rows beside them (read 32 weights at a time). A weight
matrix is its rows of raw blocks, uint8 (N, bytes per row), straight from the memory-mapped file;
its format (kernels.formats) names its code, which the kernels here take as a compile-time
constant, and each format's block reader is its "chunks" kernel in the format table.

Each block is read once and dequantized in registers, 16 weights at a time, with exactly the
roundings of gguf-py's `dequantize` (d * q, then + m or - dmin * m as separate operations, never
fused), and meets float32 activations in the float32 path's fixed-order sum: one accumulator of
16 lanes, a fused multiply-add per chunk of 16, the one reduction tree (vector_ir). So these
matrices give, bit for bit, the sums of the same file dequantized to float32 and run at float32;
and decode, batched decode and prefill agree to the bit, whatever the tile. (Q4_0, Q8_0, Q4_K and
Q6_K matrices in whole groups of 16 rows are regrouped at load and run on integer products
instead: kernels.integer_products.)

A tile of R rows x G tokens dequantizes each row's chunk once for its G tokens: batched decode
and prefill pay for the unpacking once per row, not once per sequence.
"""

from llvmlite import ir
from numba import literal_unroll, types
from numba.extending import intrinsic, overload

from .formats import BY_CODE, BY_NAME, FORMATS, kernel_for, kernel_of
from .jit import EXACT_MATH
from .vector_ir import (
    F32,
    I32,
    I32_VEC,
    I64,
    LANES,
    LINE_BYTES,
    PREFETCH_BYTES,
    VEC,
    as_i64,
    fma_vec,
    half_to_f32,
    load_f32,
    loop,
    prefetch,
    reduce_tree,
    splat,
    store_sums,
)

# What a step here reads of a row, by format code (the table's ggml formats): (weights, bytes) of
# its whole blocks, at least 32 weights (float rows are read 32 weights at a time)
READ = 32
READ_UNITS = {f.code: (max(f.block, READ), max(f.block, READ) // f.block * f.block_bytes) for f in FORMATS if f.ggml_type is not None}
# MXFP4's 16 levels: FP4 (E2M1) values, doubled (the block's scale is halved to match, as ggml's)
MXFP4_LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

I8 = ir.IntType(8)
I16 = ir.IntType(16)


# ---------------------------------------------------------------- reading a block in IR


def _bytes(b, bp, off, n):
    """n bytes from bp + off as <n x i8>."""
    ptr = b.bitcast(b.gep(bp, [I64(off)], source_etype=I8), ir.VectorType(I8, n).as_pointer())
    return b.load(ptr, align=1)


def _byte(b, bp, off):
    return b.load(b.gep(bp, [I64(off)], source_etype=I8), typ=I8, align=1)


def _f16(b, bp, off):
    """The float16 at bp + off, widened to float32 (exact)."""
    bits = b.load(b.bitcast(b.gep(bp, [I64(off)], source_etype=I8), I16.as_pointer()), align=1)
    return half_to_f32(b, bits)


def _word(b, bp, off):
    return b.load(b.bitcast(b.gep(bp, [I64(off)], source_etype=I8), I32.as_pointer()), align=1)


def _k4_scale_min(b, bp, s):
    """Sub-block s's 6-bit scale and minimum of a Q4_K / Q5_K super-block (12 bytes at bp + 4),
    as float32 (ggml's get_scale_min_k4)."""
    q = lambda k: b.zext(_byte(b, bp, 4 + k), I32)
    c = lambda v: ir.Constant(I32, v)
    if s < 4:
        sc, m = b.and_(q(s), c(63)), b.and_(q(s + 4), c(63))
    else:
        sc = b.or_(b.and_(q(s + 4), c(15)), b.shl(b.lshr(q(s - 4), c(6)), c(4)))
        m = b.or_(b.lshr(q(s + 4), c(4)), b.shl(b.lshr(q(s), c(6)), c(4)))
    return b.uitofp(sc, F32), b.uitofp(m, F32)


def _lane(b, v, i):
    """Lane i of a float vector in all 16 lanes."""
    return b.shuffle_vector(v, v, ir.Constant(I32_VEC, [i] * LANES))


def _ivec(b, v, value):
    return ir.Constant(ir.VectorType(I32, v.type.count), [value] * v.type.count)


def _as_f32(b, ints):
    return b.sitofp(ints, VEC)


def _nibble_halves(b, q16):
    """16 bytes -> (low nibbles, high nibbles) as <16 x i32>: weights 0..15 and 16..31."""
    z = b.zext(q16, I32_VEC)
    return b.and_(z, _ivec(b, z, 15)), b.lshr(z, _ivec(b, z, 4))


def _high_bit_halves(b, word):
    """Bits 0..15 and 16..31 of a 32-bit word as <16 x i32> of 0 or 16.

    With AVX-512 each half of the word is read as a mask register (kmovw), and the caller's OR
    becomes a masked vpord: 4 instructions a block instead of 10; a Q5_0 or Q5_1 tile 7-9% faster
    in cache, bit for bit the same. Otherwise each lane shifts and masks its bit."""
    if _permute_ready():
        bits = b.bitcast(word, ir.VectorType(ir.IntType(1), 32))
        sixteen, zero = ir.Constant(I32_VEC, [16] * LANES), ir.Constant(I32_VEC, [0] * LANES)
        halves = [b.shuffle_vector(bits, bits, ir.Constant(I32_VEC, list(range(base, base + LANES)))) for base in (0, 16)]
        return [b.select(h, sixteen, zero) for h in halves]
    v = b.insert_element(ir.Constant(I32_VEC, [0] * LANES), word, I32(0))
    v = b.shuffle_vector(v, v, ir.Constant(I32_VEC, [0] * LANES))
    out = []
    for base in (0, 16):
        bits = b.and_(b.lshr(v, ir.Constant(I32_VEC, list(range(base, base + 16)))), _ivec(b, v, 1))
        out.append(b.shl(bits, _ivec(b, v, 4)))
    return out


def _permute_ready() -> bool:
    """Whether this CPU has AVX-512's variable permutes (vpermps, vpermt2ps). Without them each
    level is converted and scaled instead: the same values, two more float operations a chunk."""
    from .target import has

    return has("avx512f")


def _level_values(b, levels, scale, offset=None, sub=0):
    """The float32 value of every level q in `levels` (a list of ints): scale * (q - sub), then
    + offset (or - offset when given negated), each rounded as gguf-py rounds it (no fusing).
    As 16-lane vectors: one table per 16 levels."""
    tables = []
    for first in range(0, len(levels), LANES):
        q = ir.Constant(VEC, [float(v - sub) for v in levels[first : first + LANES]])
        t = b.fmul(splat(b, scale), q)
        if offset is not None:
            t = b.fadd(t, splat(b, offset[0])) if offset[1] > 0 else b.fsub(t, splat(b, offset[0]))
        tables.append(t)
    return tables


def _pick(b, tables, idx, scale, offset=None, sub=0):
    """The chunk of weights whose levels are idx (<16 x i32>): looked up in the block's value
    tables (vpermps for 16 levels, vpermt2ps for 32), or computed level by level."""
    if _permute_ready():
        if len(tables) == 1:
            fn = _intrinsic_fn(b, "llvm.x86.avx512.permvar.sf.512", VEC, [VEC, I32_VEC])
            return b.call(fn, [tables[0], idx])
        fn = _intrinsic_fn(b, "llvm.x86.avx512.vpermi2var.ps.512", VEC, [VEC, I32_VEC, VEC])
        return b.call(fn, [tables[0], idx, tables[1]])
    value = b.fmul(splat(b, scale), _as_f32(b, b.sub(idx, _ivec(b, idx, sub)) if sub else idx))
    if offset is not None:
        value = b.fadd(value, splat(b, offset[0])) if offset[1] > 0 else b.fsub(value, splat(b, offset[0]))
    return value


def mxfp4_levels(b, idx):
    """MXFP4_LEVELS[idx] computed lane by lane (no permutes), in idx's own integer vector type:
    magnitude m = idx & 7 below 4, else (2 + (m & 1)) << ((m >> 1) - 1); negative for idx >= 8."""
    c = lambda v: ir.Constant(idx.type, [v] * idx.type.count)
    m = b.and_(idx, c(7))
    shift = b.and_(b.sub(b.lshr(m, c(1)), c(1)), c(3))  # 1 or 2 where used; in range elsewhere
    big = b.shl(b.add(c(2), b.and_(m, c(1))), shift)
    mag = b.select(b.icmp_unsigned("<", m, c(4)), m, big)
    return b.select(b.icmp_unsigned(">=", idx, c(8)), b.sub(c(0), mag), mag)


def e8m0_half(b, e):
    """MXFP4's scale: the exponent byte(s) e, zero-extended to i32 (a scalar or a vector), as float32
    2^(e - 128), ggml's e8m0_to_fp32_half: the bits (e - 1) << 23, subnormal 0x200000 << e for e < 2."""
    vector = isinstance(e.type, ir.VectorType)
    c = (lambda v: ir.Constant(e.type, [v] * e.type.count)) if vector else (lambda v: ir.Constant(I32, v))
    bits = b.select(b.icmp_unsigned("<", e, c(2)), b.shl(c(0x00200000), e), b.shl(b.sub(e, c(1)), c(23)))
    return b.bitcast(bits, ir.VectorType(F32, e.type.count) if vector else F32)


def _intrinsic_fn(b, name, ret, args):
    from numba.core import cgutils

    return cgutils.get_or_insert_function(b.module, ir.FunctionType(ret, args), name)


def dequant_chunks(b, fmt, bp):
    """The block at bp (fmt: its format's code) as float32 chunks of 16 weights, in order, each
    weight computed as gguf-py's dequantize computes it (the same roundings, no fused
    multiply-add): the format's "chunks" kernel. The 4- and 5-bit formats form each block's (or
    sub-block's) 16 or 32 possible values once and look the levels up in them: the same products,
    a permute instead of a conversion and a multiply per chunk (Q4_0 decode in cache ~1.5x)."""
    chunks = kernel_for(fmt, "chunks")
    if chunks is None:
        raise ValueError(f"no block format {fmt}")
    return chunks(b, BY_CODE[fmt], bp)


@kernel_of("F32", "chunks")
def _float32_chunks(b, fmt, bp):
    return [load_f32(b, b.bitcast(bp, F32.as_pointer()), I64(h)) for h in (0, 16)]


@kernel_of("F16", "chunks")
def _float16_chunks(b, fmt, bp):
    wide = half_to_f32(b, b.load(b.bitcast(bp, ir.VectorType(I16, 32).as_pointer()), align=1))
    return [b.shuffle_vector(wide, wide, ir.Constant(I32_VEC, list(range(h, h + 16)))) for h in (0, 16)]


@kernel_of("BF16", "chunks")
def _bfloat16_chunks(b, fmt, bp):
    bits = b.zext(b.load(b.bitcast(bp, ir.VectorType(I16, 32).as_pointer()), align=1), ir.VectorType(I32, 32))
    wide = b.shl(bits, ir.Constant(ir.VectorType(I32, 32), [16] * 32))
    return [b.bitcast(b.shuffle_vector(wide, wide, ir.Constant(I32_VEC, list(range(h, h + 16)))), VEC) for h in (0, 16)]


@kernel_of("Q8_0", "chunks")
def _q8_0_chunks(b, fmt, bp):
    q = b.sext(_bytes(b, bp, 2, 32), ir.VectorType(I32, 32))
    d = splat(b, _f16(b, bp, 0))
    halves = [b.shuffle_vector(q, q, ir.Constant(I32_VEC, list(range(h, h + 16)))) for h in (0, 16)]
    return [b.fmul(_as_f32(b, h), d) for h in halves]


@kernel_of(("Q4_0", "Q4_1", "Q5_0", "Q5_1"), "chunks")
def _q4_q5_chunks(b, fmt, bp):
    """A float16 scale d, a float16 minimum m for Q4_1/Q5_1 (after d), 5-bit formats' high bits
    (a 32-bit word after those), then 16 bytes of low nibbles."""
    with_min, five_bit = fmt.name.endswith("_1"), fmt.name.startswith("Q5")
    head = 4 if with_min else 2
    lo, hi = _nibble_halves(b, _bytes(b, bp, head + 4 * five_bit, 16))
    n = 16
    if five_bit:
        hb = _high_bit_halves(b, _word(b, bp, head))
        lo, hi, n = b.or_(lo, hb[0]), b.or_(hi, hb[1]), 32
    d = _f16(b, bp, 0)
    # Q4_0, Q5_0: d * (q - 8 or 16); Q4_1, Q5_1: d * q + m
    sub = 0 if with_min else n // 2
    offset = (_f16(b, bp, 2), 1) if with_min else None
    tables = _level_values(b, list(range(n)), d, offset, sub) if _permute_ready() else None
    return [_pick(b, tables, h, d, offset, sub) for h in (lo, hi)]


@kernel_of("MXFP4", "chunks")
def _mxfp4_chunks(b, fmt, bp):
    d = e8m0_half(b, b.zext(_byte(b, bp, 0), I32))  # weight = 2^(e - 128) * level
    lo, hi = _nibble_halves(b, _bytes(b, bp, 1, 16))
    if _permute_ready():
        tables = _level_values(b, list(MXFP4_LEVELS), d)
        return [_pick(b, tables, h, d) for h in (lo, hi)]
    return [b.fmul(splat(b, d), _as_f32(b, mxfp4_levels(b, h))) for h in (lo, hi)]


@kernel_of(("Q4_K", "Q5_K"), "chunks")
def _q4_k_q5_k_chunks(b, fmt, bp):
    five_bit = fmt.name == "Q5_K"
    d, dmin = _f16(b, bp, 0), _f16(b, bp, 2)
    qs_at = 48 if five_bit else 16
    n = 32 if five_bit else 16
    out = []
    for s in range(8):
        sc, m = _k4_scale_min(b, bp, s)
        # scalar: all 8 at once in vectors, broadcast per sub-block, measured 4% slower in cache
        ds, dm = b.fmul(d, sc), b.fmul(dmin, m)  # each weight: ds * q - dm
        tables = _level_values(b, list(range(n)), ds, (dm, -1)) if _permute_ready() else None
        for h in (0, 16):
            raw = b.zext(_bytes(b, bp, qs_at + 32 * (s // 2) + h, 16), I32_VEC)
            q = b.and_(raw, _ivec(b, raw, 15)) if s % 2 == 0 else b.lshr(raw, _ivec(b, raw, 4))
            if five_bit:
                high = b.and_(b.lshr(b.zext(_bytes(b, bp, 16 + h, 16), I32_VEC), _ivec(b, raw, s)), _ivec(b, raw, 1))
                q = b.or_(q, b.shl(high, _ivec(b, raw, 4)))
            out.append(_pick(b, tables, q, ds, (dm, -1)))
    return out


@kernel_of("Q6_K", "chunks")
def _q6_k_chunks(b, fmt, bp):
    # every chunk of 16's d * scale at once (int8 scales at bp + 192), one lane each
    scales = b.fmul(splat(b, _f16(b, bp, 208)), b.sitofp(b.sext(_bytes(b, bp, 192, LANES), I32_VEC), VEC))
    out = []
    for s in range(8):
        half, k = divmod(s, 4)
        for h in (0, 16):
            raw = b.zext(_bytes(b, bp, 64 * half + 32 * (k & 1) + h, 16), I32_VEC)
            low = b.lshr(raw, _ivec(b, raw, 4)) if k >= 2 else b.and_(raw, _ivec(b, raw, 15))
            high = b.and_(b.lshr(b.zext(_bytes(b, bp, 128 + 32 * half + h, 16), I32_VEC), _ivec(b, raw, 2 * k)), _ivec(b, raw, 3))
            q = b.sub(b.or_(low, b.shl(high, _ivec(b, raw, 4))), _ivec(b, raw, 32))
            out.append(b.fmul(_lane(b, scales, 8 * half + 2 * k + h // 16), _as_f32(b, q)))
    return out


# ---------------------------------------------------------------- tiles

BLOCKS_PER_STEP = 2  # blocks of 32 weights per step of a tile's loop (block_tile)


def literal_value(v):
    return v.literal_value if isinstance(v, types.IntegerLiteral) else None


def _row_pointers(context, b, warr_ty, w, n0, count):
    warr = context.make_array(warr_ty)(context, b, w)
    row_bytes = b.extract_value(warr.shape, 1)
    data = b.bitcast(warr.data, I8.as_pointer())
    return [b.gep(data, [b.mul(b.add(n0, I64(r)), row_bytes)], source_etype=I8) for r in range(count)]


def prefetch_offsets(step_bytes: int) -> list[int]:
    """Offsets from a row's step start to prefetch, PREFETCH_BYTES ahead: one when a step is at
    most a cache line (consecutive steps' prefetches then touch every line), else enough to
    touch every line the step spans, however the step is aligned."""
    if step_bytes <= LINE_BYTES:
        return [PREFETCH_BYTES]
    return [PREFETCH_BYTES + off for off in sorted(set(range(0, step_bytes, LINE_BYTES)) | {step_bytes - 1})]


def _block_at(b, row, i, fmt):
    """Pointer to the block of `row` holding weight i (a multiple of the block size)."""
    block, size = READ_UNITS[fmt]
    return b.gep(row, [b.mul(b.sdiv(i, I64(block)), I64(size))], source_etype=I8)


@intrinsic(prefer_literal=True)
def block_tile(typingctx, fmt, R, G, out, col, w, n, x, t):
    """out[t + g, col + n + r] = row n + r of block-format weights w (ggml type fmt) . token t + g
    of float32 x (T, K), for R rows by G tokens (fmt, R and G compile-time constants), each the
    float32 path's dot product of the dequantized row."""
    F, nr, ng = literal_value(fmt), literal_value(R), literal_value(G)
    if F not in READ_UNITS or not nr or not ng or x.dtype != types.float32:
        return None
    block, size = READ_UNITS[F]
    sig = types.void(fmt, R, G, out, col, w, n, x, t)

    def codegen(context, builder, signature, args):
        b = builder
        xarr = context.make_array(signature.args[7])(context, b, args[7])
        K = b.extract_value(xarr.shape, 1)
        n0 = as_i64(b, args[6], None)
        rows = _row_pointers(context, b, signature.args[5], args[5], n0, nr)
        t0 = as_i64(b, args[8], None)
        toks = [b.gep(xarr.data, [b.mul(b.add(t0, I64(g)), K)], source_etype=F32) for g in range(ng)]

        def steps(count):
            def body(i, accs):
                first = [_block_at(b, row, i, F) for row in rows]
                # ask for the rows' data a page ahead: several rows side by side defeat the
                # hardware prefetcher (Q4_0 decode from memory 3x faster with it). Every line a
                # step reads: one prefetch per step left two of every three lines of a K-quant
                # super-block (144-210 bytes) to chance (Q4_K/Q6_K down_proj from memory 0.57x
                # the time with all of them)
                for bp in first:
                    for ahead in prefetch_offsets(size * count):
                        prefetch(b, b.gep(bp, [I64(ahead)], source_etype=I8))
                accs = list(accs)
                for u in range(count):
                    chunks = [dequant_chunks(b, F, b.gep(bp, [I64(u * size)], source_etype=I8)) for bp in first]
                    for c in range(block // LANES):
                        e = b.add(i, I64(u * block + LANES * c))
                        xv = [load_f32(b, toks[g], e) for g in range(ng)]
                        for g in range(ng):
                            for r in range(nr):
                                accs[g * nr + r] = fma_vec(b, chunks[r][c], xv[g], accs[g * nr + r])
                return accs

            return body

        # blocks of 32 go BLOCKS_PER_STEP to a loop step: one prefetch per row and one round of
        # address arithmetic for all of them (a Q4_0 block is 18 bytes, a quarter of a line);
        # the same fused multiply-adds in the same order, so the same sums
        per_step = BLOCKS_PER_STEP if block == 32 else 1
        zero = ir.Constant(VEC, [0.0] * LANES)
        steps_end = b.and_(K, I64(-block * per_step))
        accs = loop(b, I64(0), steps_end, block * per_step, [zero] * (nr * ng), steps(per_step))
        accs = loop(b, steps_end, K, block, accs, steps(1))
        sums = [reduce_tree(b, acc) for acc in accs]
        store_sums(context, b, signature.args[3], args[3], t0, b.add(as_i64(b, args[4], None), n0), sums, nr, ng)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic(prefer_literal=True)
def dequantize_block_row(typingctx, fmt, w, n, out):
    """out[:] = row n of block-format weights w (ggml type fmt, a compile-time constant) as
    float32, bit for bit what gguf-py's dequantize gives (an embedding row)."""
    F = literal_value(fmt)
    if F not in READ_UNITS:
        return None
    block = READ_UNITS[F][0]
    sig = types.void(fmt, w, n, out)

    def codegen(context, builder, signature, args):
        b = builder
        (row,) = _row_pointers(context, b, signature.args[1], args[1], as_i64(b, args[2], None), 1)
        oarr = context.make_array(signature.args[3])(context, b, args[3])
        K = b.extract_value(oarr.shape, 0)

        def body(i, _):
            for c, chunk in enumerate(dequant_chunks(b, F, _block_at(b, row, i, F))):
                dst = b.gep(oarr.data, [b.add(i, I64(LANES * c))], source_etype=F32)
                b.store(chunk, b.bitcast(dst, VEC.as_pointer()), align=4)
            return []

        loop(b, I64(0), K, block, [], body)
        return context.get_dummy_value()

    return sig, codegen


# ---------------------------------------------------------------- rows x tokens


def block_rows(fmt, out, col, w, n0, n1, x):
    """out[t, col + n] = row n of w . x[t], for rows n0 <= n < n1 and every token of x."""
    raise NotImplementedError


@overload(block_rows, prefer_literal=True, jit_options={"fastmath": EXACT_MATH})
def _block_rows(fmt, out, col, w, n0, n1, x):
    F = literal_value(fmt)
    if F not in READ_UNITS:
        return None
    # rows side by side below 8 tokens: four, but two for Q8_0, whose 34-byte blocks stream from
    # memory ~45% faster that way (1.2B-shaped matvec on two threads, 30 against 20 GB/s)
    R_DECODE = 2 if F == BY_NAME["Q8_0"].code else 4

    def rows(fmt, out, col, w, n0, n1, x):
        T = x.shape[0]
        if T >= 8:  # prefill and batches of 8: two rows by eight tokens (~10% over 4 x 4 here)
            n = n0
            while n + 2 <= n1:
                _row_tokens(F, 2, out, col, w, n, x)
                n += 2
            if n < n1:
                _row_tokens(F, 1, out, col, w, n, x)
            return
        # below 8 tokens the loops stay here, not in _row_tokens: as a call of its own per group
        # of rows, a step of 2 tokens took 1.2-1.5x as long (one Q4_1 matrix of 6144 x 2048)
        n = n0
        while n + R_DECODE <= n1:  # R_DECODE rows at a time: that many FMA chains in flight
            t = 0
            while t + 4 <= T:  # and four tokens: each row's chunk dequantized once for them
                block_tile(F, R_DECODE, 4, out, col, w, n, x, t)
                t += 4
            # then three or two tokens at a time: the shipped Q4_1 file's step of 2 rows took 1.5x
            # a lone token's time as two tiles of 1, 1.04-1.15x as one of 2; of 3 rows 1.59-1.71x
            # as tiles of 2 and 1, 1.30-1.58x as one of 3 (then below a step of 4)
            if t + 3 <= T:
                block_tile(F, R_DECODE, 3, out, col, w, n, x, t)
                t += 3
            if t + 2 <= T:
                block_tile(F, R_DECODE, 2, out, col, w, n, x, t)
                t += 2
            while t < T:
                block_tile(F, R_DECODE, 1, out, col, w, n, x, t)
                t += 1
            n += R_DECODE
        while n < n1:
            t = 0
            while t + 4 <= T:
                block_tile(F, 1, 4, out, col, w, n, x, t)
                t += 4
            if t + 3 <= T:
                block_tile(F, 1, 3, out, col, w, n, x, t)
                t += 3
            if t + 2 <= T:
                block_tile(F, 1, 2, out, col, w, n, x, t)
                t += 2
            while t < T:
                block_tile(F, 1, 1, out, col, w, n, x, t)
                t += 1
            n += 1

    return rows


# tiles of 3 and 2 tokens for the last ones, not 1 token after another: each tile unpacks the
# rows' blocks again (the shipped Q4_1 file, a step of 15 rows as 8 + 4 + 1 + 1 + 1 took 1.2x one of 16)
TOKEN_GROUPS = (8, 4, 3, 2, 1)


def _row_tokens(fmt, R, out, col, w, n, x):
    """out[t, col + n + r] for R (1 or 2) rows from n and every token: tiles of 8 tokens, then 4,
    then one of 3, 2 or 1."""
    raise NotImplementedError


@overload(_row_tokens, prefer_literal=True, jit_options={"fastmath": EXACT_MATH})
def _row_tokens_impl(fmt, R, out, col, w, n, x):
    F, nr = literal_value(fmt), literal_value(R)
    if F not in READ_UNITS or nr not in (1, 2):
        return None

    def tokens(fmt, R, out, col, w, n, x):
        T = x.shape[0]
        t = 0
        for G in literal_unroll(TOKEN_GROUPS):
            while t + G <= T:
                block_tile(F, nr, G, out, col, w, n, x, t)
                t += G

    return tokens
