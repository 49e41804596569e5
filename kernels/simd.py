"""Fixed-order float32 dot products written in LLVM IR with 16-wide vectors.

Every sum in minillm's forward pass goes through here: LANES partial sums (one AVX-512 register)
accumulated with fused multiply-adds over aligned chunks, then added in one fixed tree; the
caller adds the remaining n % LANES terms in sequence. No reassociation is possible, so the fused
decode step, the prefill matmul and batched decode produce bit-identical results for the same
row, whatever else is computed alongside.

Numba leaves float reductions scalar unless allowed to reorder them (and then the order depends
on how LLVM vectorises each call site), hence explicit vectors.

Operands are (array, element offset) pairs; the chunk loops read `n - n % LANES` elements.
Weight rows come as float32, bfloat16 bits (uint16) or int8 with one float16 scale (uint16 bits) per 32.

bfloat16 and int8 rows are the exceptions. bfloat16 rows meet activations rounded to bfloat16
(nearest-even, as llama.cpp's BF16 does) in vdpbf16ps, 32 products per instruction, twice
float32's FMA rate. Their chunks are BF16_CHUNK = 32 elements: lane i accumulates products 2i and
2i+1 of every chunk, in two accumulators, even chunks and odd chunks, added lane by lane before
the same tree. One chain of vdpbf16ps waits on its latency: a core streamed a row of 2048 at 22
GB/s with one accumulator, 30 with two; several rows side by side did worse (15-19), their 4 KiB
rows sharing L1 sets. int8 rows meet activations quantized to int16 per block of 32
(quantize_blocks), a block at a time: see _int8_block_term.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 16
QBLOCK = 32  # int8 weights per scale

F32 = ir.FloatType()
I16 = ir.IntType(16)
I32 = ir.IntType(32)
I64 = ir.IntType(64)
VEC = ir.VectorType(F32, LANES)


def _fma(builder, a, b, c):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VEC, [VEC, VEC, VEC]), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


def _reduce(builder, acc):
    """(a0+a8, .., a7+a15) -> (s0+s4, .., s3+s7) -> (t0+t2, t1+t3) -> u0+u1; kernels.lanes order."""

    def half(v, width):
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, width // 2), list(range(width // 2))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, width // 2), list(range(width // 2, width))))
        return builder.fadd(lo, hi)

    v = half(half(half(acc, 16), 8), 4)
    return builder.fadd(builder.extract_element(v, I64(0)), builder.extract_element(v, I64(1)))


def _reduce16_vector(builder, accs):
    """_reduce of 16 accumulators at once, by transposing shuffles: the same additions on the same
    pairs (so bit-identical results), 15 vector adds instead of 16 separate trees."""

    def combine(a, b, lo, hi):
        idx = lambda ix: ir.Constant(ir.VectorType(I32, LANES), ix)
        return builder.fadd(builder.shuffle_vector(a, b, idx(lo)), builder.shuffle_vector(a, b, idx(hi)))

    # level 1: [A0..7 | B0..7] + [A8..15 | B8..15] = [sA0..7 | sB0..7]
    lvl = [combine(accs[2 * p], accs[2 * p + 1], list(range(8)) + list(range(16, 24)), list(range(8, 16)) + list(range(24, 32))) for p in range(8)]
    # level 2: s_i + s_(i+4), four outputs per vector
    lo = [o + i for o in (0, 8, 16, 24) for i in range(4)]
    lvl = [combine(lvl[2 * p], lvl[2 * p + 1], lo, [i + 4 for i in lo]) for p in range(4)]
    # level 3: (t0 + t2, t1 + t3), eight outputs per vector
    lo = [o + i for o in range(0, 32, 4) for i in range(2)]
    lvl = [combine(lvl[2 * p], lvl[2 * p + 1], lo, [i + 2 for i in lo]) for p in range(2)]
    # level 4: u0 + u1, sixteen outputs
    return combine(lvl[0], lvl[1], list(range(0, 32, 2)), list(range(1, 32, 2)))


def _reduce16(builder, accs):
    """_reduce of 16 accumulators at once (see _reduce16_vector), as 16 floats."""
    result = _reduce16_vector(builder, accs)
    return [builder.extract_element(result, I64(j)) for j in range(LANES)]


def _data(context, builder, arrty, arr, offset, elem):
    """Pointer to element `offset` of an array's data."""
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.gep(data, [offset], source_etype=elem)


def _load_f32(builder, ptr, i):
    return builder.load(builder.gep(ptr, [i], source_etype=F32), typ=VEC, align=4)


def _splat(builder, scalar):
    """16 copies of a float32 scalar."""
    vec = builder.insert_element(ir.Constant(VEC, ir.Undefined), scalar, I32(0))
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(I32, LANES), [0] * LANES))


def _f16_splat(builder, sptr, blk):
    """16 copies of float16 scale blk (uint16 bits at sptr), widened to float32 (exact)."""
    bits = builder.load(builder.gep(sptr, [blk], source_etype=I16), typ=I16, align=2)
    # Into a zeroed vector, not an undefined one: LLVM would otherwise insert into whatever register
    # is at hand, often the accumulator, and chain every scale behind the previous FMA (2x slower).
    # Widened as a vector: a scalar float16 conversion measured 35% slower in the int8 row loop.
    word = builder.insert_element(ir.Constant(ir.VectorType(I32, 4), [0] * 4), builder.zext(bits, I32), I32(0))
    halves = builder.bitcast(word, ir.VectorType(ir.HalfType(), 8))
    splat = builder.shuffle_vector(halves, halves, ir.Constant(ir.VectorType(I32, LANES), [0] * LANES))
    return builder.fpext(splat, VEC)


# int8 weights meet activations quantized to int16 per block of 32 (quantize_blocks):
# vpmaddwd multiplies a block's 32 pairs exactly into 16 int32 lanes (lane i: products 2i and 2i+1;
# at most 2 * 127 * 32767 < 2**24, so exact again in float32), then one FMA adds them to the row's
# float32 accumulator, times the weight scale times the activation scale. Widening every int8
# weight to float32 instead cost one core 15 GB/s of weights; this streams 26.
I32_VEC = ir.VectorType(I32, LANES)
I16_BLOCK = ir.VectorType(I16, QBLOCK)


def _int8_values(builder, qptr, i):
    """The 32 int8 weights from element i, sign-extended to int16."""
    raw = builder.load(builder.gep(qptr, [i], source_etype=ir.IntType(8)), typ=ir.VectorType(ir.IntType(8), QBLOCK), align=1)
    return builder.sext(raw, I16_BLOCK)


def _int16_values(builder, qptr, i):
    """The 32 int16 activations from element i."""
    return builder.load(builder.gep(qptr, [i], source_etype=I16), typ=I16_BLOCK, align=2)


def _load_int8_block(builder, qptr, sptr, i):
    """The int8 block at element i (a multiple of QBLOCK) as int16, with its float16 scale as a
    float32 vector."""
    return _int8_values(builder, qptr, i), _f16_splat(builder, sptr, builder.sdiv(i, I64(QBLOCK)))


def _load_int16_block(builder, ptrs, i):
    """The quantized activations' block at element i: 32 int16 and the block's float32 scale."""
    qptr, sptr = ptrs
    scale = builder.load(builder.gep(sptr, [builder.sdiv(i, I64(QBLOCK))], source_etype=F32), typ=F32, align=4)
    return _int16_values(builder, qptr, i), _splat(builder, scale)


def _int8_pairs_term(builder, acc, w, x, scale):
    """acc + float(sum of a block's 32 products w x, in pairs) * scale.

    The pairs are written as plain IR (widen to int32, multiply, add neighbours), which LLVM
    emits as one vpmaddwd: the same sums as vpdpwssd into zero (no overflow: |w| <= 127 and
    |x| <= 32767), but AVX-512 BW, or two AVX2 halves, instead of AVX-512 VNNI."""
    wide = ir.VectorType(I32, QBLOCK)
    products = builder.mul(builder.sext(w, wide), builder.sext(x, wide))
    half = lambda first: builder.shuffle_vector(products, products, ir.Constant(I32_VEC, list(range(first, QBLOCK, 2))))
    pairs = builder.add(half(0), half(1))
    return _fma(builder, builder.sitofp(pairs, VEC), scale, acc)


def _int8_block_term(builder, acc, w, x):
    """acc + float(sum of the block's 32 products, in pairs) * (weight scale * activation scale);
    w and x: (32 int16, scale vector) from _load_int8_block and _load_int16_block."""
    return _int8_pairs_term(builder, acc, w[0], x[0], builder.fmul(w[1], x[1]))


class _BFloat(ir.Type):
    """LLVM's bfloat, which llvmlite's IR builder lacks (it only prints types)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


BF16_CHUNK = 32
BF16_ACCS = 2  # accumulators of a bfloat16 row: even chunks, odd chunks
BF16_VEC = ir.VectorType(_BFloat(), BF16_CHUNK)
I16_VEC = ir.VectorType(I16, BF16_CHUNK)


def _native_bf16() -> bool:
    """Whether this CPU has AVX-512 BF16 (vdpbf16ps, vcvtne2ps2bf16). Without it the same products
    and roundings are written as plain integer and float vectors (kernels.cpu); Numba's on-disk
    cache is keyed by the CPU's features, so each machine compiles the path it can run."""
    from .cpu import host_features

    return "avx512bf16" in host_features()


def _load_bf16_chunk(builder, ptr, i):
    """32 bfloat16 values (uint16 bits) from element i."""
    raw = builder.load(builder.gep(ptr, [i], source_etype=I16), typ=I16_VEC, align=2)
    return builder.bitcast(raw, BF16_VEC) if _native_bf16() else raw


def _round_bf16_chunk(builder, ptr, i):
    """32 float32 values from element i, rounded to bfloat16 (nearest-even; NaN stays NaN)."""
    lo, hi = _load_f32(builder, ptr, i), _load_f32(builder, ptr, builder.add(i, I64(LANES)))
    if _native_bf16():
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(BF16_VEC, [VEC, VEC]), "llvm.x86.avx512bf16.cvtne2ps2bf16.512")
        return builder.call(fn, [hi, lo])  # the second operand fills the low half
    halves = [_round_bf16_plain(builder, v) for v in (lo, hi)]
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(I32, BF16_CHUNK), list(range(BF16_CHUNK))))


def _round_bf16_plain(builder, v):
    """16 float32 to bfloat16 bits (16 x i16), as kernels.quant.bf16_bits rounds one."""
    i32v = lambda c: ir.Constant(I32_VEC, [c] * LANES)
    bits = builder.bitcast(v, I32_VEC)
    upper = builder.lshr(bits, i32v(16))
    rounded = builder.lshr(builder.add(bits, builder.add(i32v(0x7FFF), builder.and_(upper, i32v(1)))), i32v(16))
    quiet_nan = builder.or_(upper, i32v(0x40))
    out = builder.select(builder.fcmp_unordered("uno", v, v), quiet_nan, rounded)
    return builder.trunc(out, ir.VectorType(I16, LANES))


def _dpbf16(builder, acc, a, b):
    """acc[i] += a[2i+1] b[2i+1], then += a[2i] b[2i], in float32 (vdpbf16ps; each product of two
    bfloat16 is exact in float32, so a fused multiply-add per product gives the same sums)."""
    if _native_bf16():
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VEC, [VEC, BF16_VEC, BF16_VEC]), "llvm.x86.avx512bf16.dpbf16ps.512")
        return builder.call(fn, [acc, a, b])
    pairs_a, pairs_b = builder.bitcast(a, I32_VEC), builder.bitcast(b, I32_VEC)
    high = ir.Constant(I32_VEC, [-65536] * LANES)  # 0xFFFF0000: the odd element, already in place
    odd = lambda p: builder.bitcast(builder.and_(p, high), VEC)
    even = lambda p: builder.bitcast(builder.shl(p, ir.Constant(I32_VEC, [16] * LANES)), VEC)
    acc = _fma(builder, odd(pairs_a), odd(pairs_b), acc)
    return _fma(builder, even(pairs_a), even(pairs_b), acc)


def _loop(builder, start, stop, step, inits, body):
    """for i in range(start, stop, step) (i < stop checked before each step): values = body(i, values).
    Returns the final values."""
    entry = builder.block
    header = builder.append_basic_block("loop")
    loop = builder.append_basic_block("step")
    done = builder.append_basic_block("loop_done")
    builder.branch(header)
    builder.position_at_end(header)
    i = builder.phi(I64)
    i.add_incoming(start, entry)
    values = []
    for init in inits:
        phi = builder.phi(init.type)
        phi.add_incoming(init, entry)
        values.append(phi)
    builder.cbranch(builder.icmp_signed("<", builder.add(i, I64(step - 1)), stop), loop, done)
    builder.position_at_end(loop)
    new = body(i, values)
    for phi, value in zip(values, new):
        phi.add_incoming(value, builder.block)
    i.add_incoming(builder.add(i, I64(step)), builder.block)
    builder.branch(header)
    builder.position_at_end(done)
    return values


def _chunk_loop(builder, n, n_acc, body, init=0.0):
    """for i in 0, 16, .. < n - n % 16: accs = body(i, accs), each accumulator starting as 16
    copies of `init`. Returns the final accumulators."""
    return _loop(builder, I64(0), builder.and_(n, I64(-LANES)), LANES, [ir.Constant(VEC, [init] * LANES)] * n_acc, body)


def _i64(builder, value, ty):
    return builder.sext(value, I64) if value.type.width < 64 else value


@intrinsic
def dot_chunks(typingctx, a, a_off, b, b_off, n):
    """Fixed-order sum of a[a_off + k] * b[b_off + k] over the full chunks of k < n (float32 arrays)."""
    sig = types.float32(a, a_off, b, b_off, n)

    def codegen(context, builder, signature, args):
        pa = _data(context, builder, signature.args[0], args[0], _i64(builder, args[1], None), F32)
        pb = _data(context, builder, signature.args[2], args[2], _i64(builder, args[3], None), F32)
        (acc,) = _chunk_loop(
            builder, _i64(builder, args[4], None), 1,
            lambda i, accs: [_fma(builder, _load_f32(builder, pa, i), _load_f32(builder, pb, i), accs[0])],
        )
        return _reduce(builder, acc)

    return sig, codegen


@intrinsic
def sum_chunks(typingctx, a, n):
    """Fixed-order sum of a[k] over the full chunks of k < n (float32)."""
    sig = types.float32(a, n)

    def codegen(context, builder, signature, args):
        pa = _data(context, builder, signature.args[0], args[0], I64(0), F32)
        (acc,) = _chunk_loop(
            builder, _i64(builder, args[1], None), 1,
            lambda i, accs: [builder.fadd(accs[0], _load_f32(builder, pa, i))],
        )
        return _reduce(builder, acc)

    return sig, codegen


# float32 and int8 weight loops ask for the data this many bytes ahead (into the next rows, past a
# row's end), once per 64-byte line. The hardware prefetcher stops at each 4 KiB page and restarts
# on every row. Measured: 2 KiB ahead, bfloat16 decode ~+15% on both model shapes (with one
# accumulator per row; with two, bfloat16 rows are faster without); 4 KiB over 2 KiB,
# default-model decode int8 +10%, float32 +4% (8 KiB: the same as 4). A prefetch per 16-weight
# chunk (four per line at int8) cost more than it gained.
PREFETCH_BYTES = 4096
LINE_BYTES = 64


def _prefetch(builder, ptr):
    """A read prefetch of ptr's cache line into all levels; never faults, even past an array's end."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32]), "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(ptr, i8p), I32(0), I32(3), I32(1)])


class _WeightRow:
    """Weight row n (f32 / bf16 bits / int8 + scales), read `chunk` elements at a time: load(i)
    gives the weights from element i (16 float32, 32 bfloat16, or an int8 block of 32 with its
    scale), x_chunk(px, i) the matching activations (px from operand()), term(acc, w, xv) adds
    their products; prefetch(i) asks for the line PREFETCH_BYTES past element i; K is the row
    length.

    The activations (xty) are float32; against bfloat16 rows also bfloat16 bits already rounded
    (uint16, which saves the rounding per row); against int8 rows always int16 quantized per
    block (quantize_blocks) with float32 block scales (xsty)."""

    def __init__(self, context, builder, wty, sty, w, s, n, xty):
        warr = context.make_array(wty)(context, builder, w)
        self.K = K = builder.extract_value(warr.shape, 1)
        self.builder = builder
        self.elem, self.width = {types.float32: (F32, 4), types.uint16: (I16, 2), types.int8: (ir.IntType(8), 1)}[wty.dtype]
        self.ptr = builder.gep(warr.data, [builder.mul(n, K)], source_etype=self.elem)
        self.chunk, x_chunk, term = LANES, _load_f32, _fma_acc
        self.accs = 1  # accumulators per row: chunk c goes to accumulator c % accs
        self.prefetched = wty.dtype != types.uint16  # bfloat16 rows measured faster without
        self.x_elem = F32
        self.quantized = wty.dtype == types.int8  # activations come as int16 blocks + scales
        if wty.dtype == types.float32:
            self.load = lambda i: _load_f32(builder, self.ptr, i)
        elif wty.dtype == types.uint16:
            self.chunk, term, self.accs = BF16_CHUNK, _dpbf16, BF16_ACCS
            x_chunk = _load_bf16_chunk if xty.dtype == types.uint16 else _round_bf16_chunk
            self.x_elem = I16 if xty.dtype == types.uint16 else F32
            self.load = lambda i: _load_bf16_chunk(builder, self.ptr, i)
        else:
            self.chunk, x_chunk, term, self.x_elem = QBLOCK, _load_int16_block, _int8_block_term, I16
            sarr = context.make_array(sty)(context, builder, s)
            ps = builder.gep(sarr.data, [builder.mul(n, builder.extract_value(sarr.shape, 1))], source_etype=I16)
            self.load = lambda i: _load_int8_block(builder, self.ptr, ps, i)
        self.x_chunk = lambda px, i: x_chunk(builder, px, i)
        self.term = lambda acc, w, xv: term(builder, acc, w, xv)

    def operand(self, context, xty, x, xsty, xs):
        """What x_chunk reads: x's data, or for int8 rows (quantized data, block scales)."""
        px = _data(context, self.builder, xty, x, I64(0), self.x_elem)
        if self.quantized:
            return px, _data(context, self.builder, xsty, xs, I64(0), F32)
        return px

    def prefetch(self, i, rows_below=0):
        """Prefetch PREFETCH_BYTES ahead, or with rows_below, element i of the row that many rows
        down (where a stream of rows_below rows side by side reads next)."""
        if rows_below:
            ahead = self.builder.add(i, self.builder.mul(self.K, I64(rows_below)))
        else:
            ahead = self.builder.add(i, I64(PREFETCH_BYTES // self.width))
        _prefetch(self.builder, self.builder.gep(self.ptr, [ahead], source_etype=self.elem))


def _weight_loop(builder, rows, body, rows_below=0):
    """Loop over the full chunks of weight rows (all of one length and precision), with one
    prefetch per row and 64-byte line (see _WeightRow.prefetch). body(i, accs) adds the chunks at
    element i to one accumulator per row; a row has `accs` of them, chunk c going to accumulator
    c % accs. Each step takes whole lines (1 chunk for float32 and bfloat16, 4 for int8) and
    whole rounds of accumulators; the chunks after the last step go without prefetch. Returns one
    vector per row: its accumulators added lane by lane (the row's canonical order)."""
    K, chunk, A = rows[0].K, rows[0].chunk, rows[0].accs
    per_line = LINE_BYTES // (chunk * rows[0].width)
    group = max(per_line, A)  # chunks per step; a multiple of both
    zero = ir.Constant(VEC, [0.0] * LANES)

    def steps(chunks, prefetch):
        def step(i, flat):  # flat[a * R + r]: accumulator a of row r
            if prefetch and rows[0].prefetched:
                for u in range(0, chunks, per_line):
                    for row in rows:
                        row.prefetch(builder.add(i, I64(u * chunk)), rows_below)
            flat = list(flat)
            for u in range(chunks):
                a = (u % A) * len(rows)
                flat[a : a + len(rows)] = body(builder.add(i, I64(u * chunk)), flat[a : a + len(rows)])
            return flat

        return step

    full = builder.and_(K, I64(-chunk))
    groups_end = builder.and_(K, I64(-chunk * group))
    flat = _loop(builder, I64(0), groups_end, chunk * group, [zero] * (A * len(rows)), steps(group, True))
    # the rest: whole rounds of accumulators, then (A = 2) at most one chunk, which is even
    rounds_end = builder.sub(full, builder.srem(builder.sub(full, groups_end), I64(chunk * A)))
    flat = _loop(builder, groups_end, rounds_end, chunk * A, flat, steps(A, False))
    flat = _loop(builder, rounds_end, full, chunk, flat, steps(1, False))
    out = flat[: len(rows)]
    for a in range(1, A):
        out = [builder.fadd(o, f) for o, f in zip(out, flat[a * len(rows) : (a + 1) * len(rows)])]
    return out


def _operand_types_ok(w, x, xs):
    """The activations a weight row accepts (see _WeightRow)."""
    if w.dtype == types.int8:
        return x.dtype == types.int16 and xs.dtype == types.float32
    return x.dtype == types.float32 or (x.dtype == types.uint16 and w.dtype == types.uint16)


@intrinsic
def weight_dot_chunks(typingctx, w, s, n, x, xs):
    """Fixed-order dot of weight row n (f32 / bf16 bits / int8 + scales) with the activations x,
    over the row's full chunks (kernels.quant.chunked_len). x: float32; against bfloat16 rows
    also pre-rounded bfloat16 bits (kernels.quant.prepare_operand: the same products, fewer
    instructions); against int8 rows int16 quantized per block, with xs their float32 block
    scales (ignored otherwise)."""
    if not _operand_types_ok(w, x, xs):
        return None
    sig = types.float32(w, s, n, x, xs)

    def codegen(context, builder, signature, args):
        wty, sty, _, xty, xsty = signature.args
        row = _WeightRow(context, builder, wty, sty, args[0], args[1], _i64(builder, args[2], None), xty)
        px = row.operand(context, xty, args[3], xsty, args[4])
        (acc,) = _weight_loop(builder, [row], lambda i, accs: [row.term(accs[0], row.load(i), row.x_chunk(px, i))])
        return _reduce(builder, acc)

    return sig, codegen


def _fma_acc(builder, acc, a, b):
    """acc + a b, fused: _fma with the accumulator first, as _dpbf16 takes it."""
    return _fma(builder, a, b, acc)


def _tile_4x4(builder, rows, cols, n, load=_load_f32, term=_fma_acc, chunk=LANES, accs=1, col_load=None):
    """The 16 fixed-order dot products rows[c] . cols[j] over the full chunks of n, each with
    its own accumulator (8 loads feed 16 multiply-adds), reduced together: a vector, lane 4 j + c.
    float32 by default; bfloat16 rows and columns with load=_load_bf16_chunk, term=_dpbf16,
    chunk=BF16_CHUNK, accs=BF16_ACCS: one pass over the even chunks, one over the odd, added
    lane by lane (a weight row's order, _weight_loop). Columns are read with col_load when the
    two sides differ (int8 rows, int16 tokens)."""
    col_load = col_load or load

    def body(i, accs):
        rv = [load(builder, p, i) for p in rows]
        out = []
        for j, cp in enumerate(cols):
            cv = col_load(builder, cp, i)
            out += [term(builder, accs[4 * j + c], rv[c], cv) for c in range(4)]
        return out

    zero = ir.Constant(VEC, [0.0] * LANES)
    full = builder.and_(n, I64(-chunk))
    # chunks a, a + accs, a + 2 accs, ..: _loop steps while i + step - 1 < stop, so stop is
    # raised by the stride less one chunk to take the last chunk of each pass
    stop = builder.add(full, I64(chunk * (accs - 1)))
    passes = [_loop(builder, I64(a * chunk), stop, chunk * accs, [zero] * 16, body) for a in range(accs)]
    total = passes[0]
    for p in passes[1:]:
        total = [builder.fadd(t, v) for t, v in zip(total, p)]
    return _reduce16_vector(builder, total)


@intrinsic
def rows_dot4(typingctx, out, o, w, s, n, x, xs):
    """out[o + i] = weight_dot_chunks(w, s, n + i, x, xs) for i < 4: four rows streamed side by side
    (four independent FMA chains and memory streams, one load of x per chunk), each summed in
    exactly the single-row order. `out` is a C-contiguous array, `o` a flat element offset.
    Faster than one row at a time for long rows (see kernels.decode.long_row).
    """
    if not _operand_types_ok(w, x, xs):
        return None
    sig = types.void(out, o, w, s, n, x, xs)

    def codegen(context, builder, signature, args):
        oty, _, wty, sty, _, xty, xsty = signature.args
        n = _i64(builder, args[4], None)
        rows = [_WeightRow(context, builder, wty, sty, args[2], args[3], builder.add(n, I64(r)), xty) for r in range(4)]
        px = rows[0].operand(context, xty, args[5], xsty, args[6])
        po = _data(context, builder, oty, args[0], _i64(builder, args[1], None), F32)

        def body(i, accs):
            xv = rows[0].x_chunk(px, i)
            return [row.term(acc, row.load(i), xv) for row, acc in zip(rows, accs)]

        # PREFETCH_BYTES ahead would land inside these four rows (4096 elements and up), already
        # being read; the row four below is the one this stream reads next. Measured when float32
        # rows of 576 still took this path: faster in 18 of 24 alternating runs, +2% to +16%.
        accs = _weight_loop(builder, rows, body, rows_below=4)
        for r, acc in enumerate(accs):
            builder.store(_reduce(builder, acc), builder.gep(po, [I64(r)], source_etype=F32))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def tile_dot_4x4(typingctx, tile, r, x, t):
    """Rows r..r+3 of a float32 tile against tokens t..t+3 of x, full chunks: 16 sums.

    The same chunk order and tree as dot_chunks, so each result equals the single dot product;
    16 accumulators share 8 loads per chunk, so the loop is bound by FMAs rather than loads.
    Returns the sums row-major by token: (t, r), (t, r+1), .., (t+3, r+3).
    """
    sig = types.UniTuple(types.float32, 16)(tile, r, x, t)

    def codegen(context, builder, signature, args):
        tarr = context.make_array(signature.args[0])(context, builder, args[0])
        xarr = context.make_array(signature.args[2])(context, builder, args[2])
        K = builder.extract_value(xarr.shape, 1)
        tK = builder.extract_value(tarr.shape, 1)
        r0 = _i64(builder, args[1], None)
        t0 = _i64(builder, args[3], None)
        w = [builder.gep(tarr.data, [builder.mul(builder.add(r0, I64(j)), tK)], source_etype=F32) for j in range(4)]
        xs = [builder.gep(xarr.data, [builder.mul(builder.add(t0, I64(j)), K)], source_etype=F32) for j in range(4)]
        result = _tile_4x4(builder, w, xs, K)
        sums = [builder.extract_element(result, I64(j)) for j in range(LANES)]
        return context.make_tuple(builder, signature.return_type, sums)

    return sig, codegen


@intrinsic
def bf16_tile_dot_4x4(typingctx, w, n, xb, t):
    """bfloat16 weight rows n..n+3 against bfloat16 tokens t..t+3 of xb (round_bf16_chunks), over
    the full 32-element chunks: 16 sums, each equal to weight_dot_chunks of the pair (the same
    vdpbf16ps steps and tree). Returns them row-major by token, as tile_dot_4x4.
    """
    sig = types.UniTuple(types.float32, 16)(w, n, xb, t)

    def codegen(context, builder, signature, args):
        warr = context.make_array(signature.args[0])(context, builder, args[0])
        xarr = context.make_array(signature.args[2])(context, builder, args[2])
        K = builder.extract_value(warr.shape, 1)
        n0, t0 = _i64(builder, args[1], None), _i64(builder, args[3], None)
        rows = [builder.gep(warr.data, [builder.mul(builder.add(n0, I64(j)), K)], source_etype=I16) for j in range(4)]
        toks = [builder.gep(xarr.data, [builder.mul(builder.add(t0, I64(j)), K)], source_etype=I16) for j in range(4)]
        result = _tile_4x4(builder, rows, toks, K, load=_load_bf16_chunk, term=_dpbf16, chunk=BF16_CHUNK, accs=BF16_ACCS)
        sums = [builder.extract_element(result, I64(j)) for j in range(LANES)]
        return context.make_tuple(builder, signature.return_type, sums)

    return sig, codegen


@intrinsic
def int8_tile_dot_4x4(typingctx, w, s, n, xq, xs, t, table):
    """int8 weight rows n..n+3 (scales s) against tokens t..t+3 of xq, quantized per block with
    scales xs (quantize_blocks), over the full blocks: 16 sums, each equal to weight_dot_chunks of
    the pair. Returns them row-major by token, as tile_dot_4x4.

    The 16 scale products of a block (weight scale * token scale, as _int8_block_term forms them)
    are made first, 16 to a vector, into `table` (float32, 16 per block); the main loop then
    broadcasts them from memory. Formed inside it, they took a quarter of the loop's arithmetic.
    """
    sig = types.UniTuple(types.float32, 16)(w, s, n, xq, xs, t, table)

    def codegen(context, builder, signature, args):
        wty, sty, _, xty, xsty, _, tty = signature.args
        warr, sarr = context.make_array(wty)(context, builder, args[0]), context.make_array(sty)(context, builder, args[1])
        xarr, xsarr = context.make_array(xty)(context, builder, args[3]), context.make_array(xsty)(context, builder, args[4])
        ptab = _data(context, builder, tty, args[6], I64(0), F32)
        K, KB = builder.extract_value(warr.shape, 1), builder.extract_value(sarr.shape, 1)
        XB = builder.extract_value(xsarr.shape, 1)
        n0, t0 = _i64(builder, args[2], None), _i64(builder, args[5], None)
        wrows = [builder.gep(warr.data, [builder.mul(builder.add(n0, I64(r)), K)], source_etype=ir.IntType(8)) for r in range(4)]
        srows = [builder.gep(sarr.data, [builder.mul(builder.add(n0, I64(r)), KB)], source_etype=I16) for r in range(4)]
        xrows = [builder.gep(xarr.data, [builder.mul(builder.add(t0, I64(j)), K)], source_etype=I16) for j in range(4)]
        xsrows = [builder.gep(xsarr.data, [builder.mul(builder.add(t0, I64(j)), XB)], source_etype=F32) for j in range(4)]
        lane = lambda ix: ir.Constant(I32_VEC, ix)

        def products(blk, _):  # table[16 blk + 4 j + r] = scale of row r * scale of token j
            ws = ir.Constant(ir.VectorType(I16, 4), [0] * 4)
            xsv = ir.Constant(ir.VectorType(F32, 4), [0.0] * 4)
            for r in range(4):
                bits = builder.load(builder.gep(srows[r], [blk], source_etype=I16), typ=I16, align=2)
                ws = builder.insert_element(ws, bits, I32(r))
                xsv = builder.insert_element(xsv, builder.load(builder.gep(xsrows[r], [blk], source_etype=F32), typ=F32, align=4), I32(r))
            ws16 = builder.shuffle_vector(ws, ws, lane([r for _ in range(4) for r in range(4)]))
            xs16 = builder.shuffle_vector(xsv, xsv, lane([j for j in range(4) for _ in range(4)]))
            prod = builder.fmul(builder.fpext(builder.bitcast(ws16, ir.VectorType(ir.HalfType(), LANES)), VEC), xs16)
            dst = builder.gep(ptab, [builder.mul(blk, I64(LANES))], source_etype=F32)
            builder.store(prod, builder.bitcast(dst, VEC.as_pointer()), align=4)
            return []

        _loop(builder, I64(0), builder.sdiv(K, I64(QBLOCK)), 1, [], products)

        def load_row(b, r, i):  # the row's index and position ride along to find the scale
            return _int8_values(b, wrows[r], i), r, i

        def load_token(b, j, i):
            return _int16_values(b, xrows[j], i), j

        def term(b, acc, wv, xv):
            (w_values, r, i), (x_values, j) = wv, xv
            at = b.add(b.mul(b.sdiv(i, I64(QBLOCK)), I64(LANES)), I64(4 * j + r))
            scale = _splat(b, b.load(b.gep(ptab, [at], source_etype=F32), typ=F32, align=4))
            return _int8_pairs_term(b, acc, w_values, x_values, scale)

        result = _tile_4x4(builder, list(range(4)), list(range(4)), K, load=load_row, col_load=load_token, term=term, chunk=QBLOCK)
        sums = [builder.extract_element(result, I64(j)) for j in range(LANES)]
        return context.make_tuple(builder, signature.return_type, sums)

    return sig, codegen


ACT_MAX = 32767.0  # int16 activation levels: -ACT_MAX .. ACT_MAX
F32_MAX = 3.4028234663852886e38


@intrinsic
def quantize_blocks(typingctx, xq, xs, x, b):
    """Row b of float32 x quantized to int16 per block of QBLOCK, over its full blocks (int8 weights
    meet these in _int8_block_term): xs[b, j] = the block's largest magnitude / 32767, xq[b, k] =
    x[b, k] * (32767 / that magnitude), rounded to nearest even. A product's error is then at most
    about 1/65534 of the block's largest value. A block holding NaN or Inf gets a NaN scale, so
    every output it feeds is NaN, as in float arithmetic; a block whose largest magnitude is below
    ~1e-34 (32767 / it overflows) counts as zeros."""
    sig = types.void(xq, xs, x, b)

    def codegen(context, builder, signature, args):
        qty, sty, xty, _ = signature.args
        xarr = context.make_array(xty)(context, builder, args[2])
        K = builder.extract_value(xarr.shape, 1)
        row = _i64(builder, args[3], None)
        px = builder.gep(xarr.data, [builder.mul(row, K)], source_etype=F32)
        pq = _data(context, builder, qty, args[0], builder.mul(row, K), I16)
        sarr = context.make_array(sty)(context, builder, args[1])
        ps = builder.gep(sarr.data, [builder.mul(row, builder.extract_value(sarr.shape, 1))], source_etype=F32)
        module = builder.module
        fabs = cgutils.get_or_insert_function(module, ir.FunctionType(VEC, [VEC]), "llvm.fabs.v16f32")
        vmax = cgutils.get_or_insert_function(module, ir.FunctionType(VEC, [VEC, VEC]), "llvm.maxnum.v16f32")
        vmin = cgutils.get_or_insert_function(module, ir.FunctionType(VEC, [VEC, VEC]), "llvm.minnum.v16f32")
        rint = cgutils.get_or_insert_function(module, ir.FunctionType(VEC, [VEC]), "llvm.rint.v16f32")
        any_set = cgutils.get_or_insert_function(module, ir.FunctionType(ir.IntType(1), [ir.VectorType(ir.IntType(1), LANES)]), "llvm.vector.reduce.or.v16i1")
        hmax = cgutils.get_or_insert_function(module, ir.FunctionType(F32, [VEC]), "llvm.vector.reduce.fmax.v16f32")
        top = ir.Constant(VEC, [F32_MAX] * LANES)

        def block(i, _):
            halves = [_load_f32(builder, px, builder.add(i, I64(h * LANES))) for h in range(2)]
            mags = [builder.call(fabs, [v]) for v in halves]
            # NaN or Inf anywhere: |v| > F32_MAX or unordered
            bad = builder.call(any_set, [builder.or_(*[builder.fcmp_unordered(">", m, top) for m in mags])])
            amax = builder.call(hmax, [builder.call(vmax, mags)])
            inv = builder.fdiv(F32(ACT_MAX), amax)
            zero = builder.or_(bad, builder.not_(builder.fcmp_ordered("<=", inv, F32(F32_MAX))))  # also amax == 0
            inv = builder.select(zero, F32(0.0), inv)
            scale = builder.select(bad, F32(float("nan")), builder.select(zero, F32(0.0), builder.fdiv(amax, F32(ACT_MAX))))
            builder.store(scale, builder.gep(ps, [builder.sdiv(i, I64(QBLOCK))], source_etype=F32))
            inv_v = _splat(builder, inv)
            levels = ir.Constant(VEC, [ACT_MAX] * LANES)
            for h, v in enumerate(halves):
                q = builder.call(rint, [builder.fmul(v, inv_v)])
                q = builder.call(vmin, [builder.call(vmax, [q, builder.fneg(levels)]), levels])
                dst = builder.gep(pq, [builder.add(i, I64(h * LANES))], source_etype=I16)
                builder.store(builder.fptosi(q, ir.VectorType(I16, LANES)), builder.bitcast(dst, ir.VectorType(I16, LANES).as_pointer()), align=2)
            return []

        _loop(builder, I64(0), builder.and_(K, I64(-QBLOCK)), QBLOCK, [], block)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def round_bf16_chunks(typingctx, out, x, t):
    """out[t, k] = x[t, k] rounded to bfloat16 bits, over the full 32-element chunks of the row
    (the same rounding as weight_dot_chunks applies to its x on the fly)."""
    sig = types.void(out, x, t)

    def codegen(context, builder, signature, args):
        oarr = context.make_array(signature.args[0])(context, builder, args[0])
        xarr = context.make_array(signature.args[1])(context, builder, args[1])
        K = builder.extract_value(xarr.shape, 1)
        row = builder.mul(_i64(builder, args[2], None), K)
        po = builder.gep(oarr.data, [row], source_etype=I16)
        px = builder.gep(xarr.data, [row], source_etype=F32)

        def body(i, _):
            chunk = _round_bf16_chunk(builder, px, i)
            dst = builder.bitcast(builder.gep(po, [i], source_etype=I16), chunk.type.as_pointer())
            builder.store(chunk, dst, align=2)
            return []

        _loop(builder, I64(0), builder.and_(K, I64(-BF16_CHUNK)), BF16_CHUNK, [], body)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def dot_4x4_into(typingctx, out, o, o_stride, a, a_off, a_stride, b, b_off, b_stride, n):
    """out[o + i * o_stride + j] = fixed-order sum of a[a_off + i * a_stride + k] *
    b[b_off + j * b_stride + k] over the full chunks of k < n, for i, j < 4 (attention scores of
    4 queries against 4 keys). Each result equals dot_chunks of the same pair.
    """
    sig = types.void(out, o, o_stride, a, a_off, a_stride, b, b_off, b_stride, n)

    def codegen(context, builder, signature, args):
        (o, o_stride, a_off, a_stride, b_off, b_stride, n) = [_i64(builder, args[i], None) for i in (1, 2, 4, 5, 7, 8, 9)]
        po = _data(context, builder, signature.args[0], args[0], o, F32)
        pa = _data(context, builder, signature.args[3], args[3], a_off, F32)
        pb = _data(context, builder, signature.args[6], args[6], b_off, F32)
        a_rows = [builder.gep(pa, [builder.mul(a_stride, I64(i))], source_etype=F32) for i in range(4)]
        b_rows = [builder.gep(pb, [builder.mul(b_stride, I64(j))], source_etype=F32) for j in range(4)]
        result = _tile_4x4(builder, b_rows, a_rows, n)  # lane 4 i + j
        quad = ir.VectorType(F32, 4)
        for i in range(4):
            part = builder.shuffle_vector(result, result, ir.Constant(ir.VectorType(I32, 4), [4 * i + j for j in range(4)]))
            dst = builder.gep(po, [builder.mul(o_stride, I64(i))], source_etype=F32)
            builder.store(part, builder.bitcast(dst, quad.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def dot_rows16(typingctx, out, o, a, a_off, b, b_off, stride, n):
    """out[o + i] = fixed-order sum of a[a_off + k] * b[b_off + i * stride + k] over the full
    chunks of k < n, for i < 16: one vector against 16 rows (attention scores for 16 keys).

    Each result equals dot_chunks of the same pair; the 16 trees share one transposing reduction.
    """
    sig = types.void(out, o, a, a_off, b, b_off, stride, n)

    def codegen(context, builder, signature, args):
        po = _data(context, builder, signature.args[0], args[0], _i64(builder, args[1], None), F32)
        pa = _data(context, builder, signature.args[2], args[2], _i64(builder, args[3], None), F32)
        pb = _data(context, builder, signature.args[4], args[4], _i64(builder, args[5], None), F32)
        stride = _i64(builder, args[6], None)
        rows = [builder.gep(pb, [builder.mul(stride, I64(i))], source_etype=F32) for i in range(LANES)]

        def body(i, accs):
            av = _load_f32(builder, pa, i)
            return [_fma(builder, av, _load_f32(builder, r, i), acc) for r, acc in zip(rows, accs)]

        accs = _chunk_loop(builder, _i64(builder, args[7], None), LANES, body)
        builder.store(_reduce16_vector(builder, accs), builder.bitcast(po, VEC.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def weighted_rows(typingctx, out, p, v, v_off, n, stride):
    """out[d] = sum over j < n of p[j] * v[v_off + j * stride + d], for d in the full chunks of
    d < stride (attention's probabilities times values).

    Each output is two sequential sums, over even and over odd j, added at the end: independent
    FMA chains in a fixed order. Rows are read whole, 64 columns (4 chunks) at a time.
    """
    sig = types.void(out, p, v, v_off, n, stride)

    def codegen(context, builder, signature, args):
        po = _data(context, builder, signature.args[0], args[0], I64(0), F32)
        pp = _data(context, builder, signature.args[1], args[1], I64(0), F32)
        pv = _data(context, builder, signature.args[2], args[2], _i64(builder, args[3], None), F32)
        n, stride = _i64(builder, args[4], None), _i64(builder, args[5], None)
        zero = ir.Constant(VEC, [0.0] * LANES)
        full = builder.and_(stride, I64(-LANES))
        group = 4 * LANES

        def splat(j):
            pj = builder.load(builder.gep(pp, [j], source_etype=F32), typ=F32, align=4)
            vec = builder.insert_element(ir.Constant(VEC, ir.Undefined), pj, I32(0))
            return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(I32, LANES), [0] * LANES))

        def term(pj, j, c, acc):
            return _fma(builder, pj, _load_f32(builder, pv, builder.add(builder.mul(j, stride), c)), acc)

        def columns(c0, width):
            """Outputs c0 .. c0 + 16 * width: accumulators (even, odd) per chunk."""
            cols = [builder.add(c0, I64(LANES * i)) for i in range(width)]

            def pair(j, accs):
                j1 = builder.add(j, I64(1))
                p0, p1 = splat(j), splat(j1)
                new = []
                for i, c in enumerate(cols):
                    new += [term(p0, j, c, accs[2 * i]), term(p1, j1, c, accs[2 * i + 1])]
                return new

            def last(j, accs):  # n odd: the last key joins the even sum
                pj = splat(j)
                return [term(pj, j, cols[i // 2], a) if i % 2 == 0 else a for i, a in enumerate(accs)]

            accs = _loop(builder, I64(0), builder.and_(n, I64(-2)), 2, [zero] * (2 * width), pair)
            accs = _loop(builder, builder.and_(n, I64(-2)), n, 1, accs, last)
            for i, c in enumerate(cols):
                total = builder.fadd(accs[2 * i], accs[2 * i + 1])
                builder.store(total, builder.bitcast(builder.gep(po, [c], source_etype=F32), VEC.as_pointer()), align=4)
            return []

        _loop(builder, I64(0), full, group, [], lambda c, _: columns(c, 4))
        _loop(builder, builder.and_(full, I64(-group)), full, LANES, [], lambda c, _: columns(c, 1))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def max_chunks(typingctx, a, n):
    """max(a[k]) over the full chunks of k < n (-inf if none); NaNs are skipped, as by fmax."""
    sig = types.float32(a, n)

    def codegen(context, builder, signature, args):
        pa = _data(context, builder, signature.args[0], args[0], I64(0), F32)
        vmax = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VEC, [VEC, VEC]), "llvm.maxnum.v16f32")
        (acc,) = _chunk_loop(builder, _i64(builder, args[1], None), 1,
                             lambda i, accs: [builder.call(vmax, [accs[0], _load_f32(builder, pa, i)])], init=float("-inf"))
        smax = cgutils.get_or_insert_function(builder.module, ir.FunctionType(F32, [F32, F32]), "llvm.maxnum.f32")
        result = builder.extract_element(acc, I64(0))
        for j in range(1, LANES):
            result = builder.call(smax, [result, builder.extract_element(acc, I64(j))])
        return result

    return sig, codegen
