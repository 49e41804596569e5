"""LLVM IR building blocks for the kernels' fixed-order sums, written with 16-wide vectors.

Every sum in minillm's forward pass is LANES partial sums (one AVX-512 register) accumulated with
fused multiply-adds over aligned chunks, then added in one fixed tree (reduce_tree); the caller
adds the remaining n % LANES terms in sequence. No reassociation is possible, so the fused decode
step, the prefill matmul and batched decode give bit-identical results for the same row, whatever
else is computed alongside. Numba leaves float reductions scalar unless allowed to reorder them
(and then the order depends on how LLVM vectorises each call site), hence explicit vectors.

Here: vector types, loads, the loop and reduction skeletons, the 4 x 4 register tile, and the
per-precision pieces the weight products use (bfloat16 chunks and vdpbf16ps, int8 blocks and
their pair sums). The intrinsics built from them live in row_products, float_sums and
activation_operands.
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


def fma_vec(builder, a, b, c):
    ty = a.type
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty, ty]), f"llvm.fma.v{ty.count}f32")
    return builder.call(fn, [a, b, c])


def reduce_tree(builder, acc):
    """(a0+a8, .., a7+a15) -> (s0+s4, .., s3+s7) -> (t0+t2, t1+t3) -> u0+u1: the one order of every sum."""

    def half(v, width):
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, width // 2), list(range(width // 2))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, width // 2), list(range(width // 2, width))))
        return builder.fadd(lo, hi)

    v = half(half(half(acc, 16), 8), 4)
    return builder.fadd(builder.extract_element(v, I64(0)), builder.extract_element(v, I64(1)))


def reduce16_vector(builder, accs):
    """reduce_tree of 16 accumulators at once, by transposing shuffles: the same additions on the same
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


def data_ptr(context, builder, arrty, arr, offset, elem):
    """Pointer to element `offset` of an array's data."""
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.gep(data, [offset], source_etype=elem)


def store_sums(context, builder, oty, out, t_out, c_out, sums, R, G):
    """out[t_out + g, c_out + r] = sums[R g + r]."""
    oarr = context.make_array(oty)(context, builder, out)
    width = builder.extract_value(oarr.shape, 1)
    for g in range(G):
        row = builder.gep(oarr.data, [builder.add(builder.mul(builder.add(t_out, I64(g)), width), c_out)], source_etype=F32)
        for r in range(R):
            builder.store(sums[R * g + r], builder.gep(row, [I64(r)], source_etype=F32))


def load_f32(builder, ptr, i):
    return builder.load(builder.gep(ptr, [i], source_etype=F32), typ=VEC, align=4)


def splat(builder, scalar, lanes=LANES):
    """`lanes` copies of a scalar (float32, or an integer)."""
    vec = builder.insert_element(ir.Constant(ir.VectorType(scalar.type, lanes), ir.Undefined), scalar, I32(0))
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(I32, lanes), [0] * lanes))


def half_to_f32(builder, bits, native=None):
    """float16 bits (i16, or a vector of them) widened to float32, exactly: vcvtph2ps where the
    target has F16C; elsewhere in integer operations, as NumPy widens them (LLVM would call
    compiler-rt's __extendhfsf2, which Numba's JIT does not link)."""
    count = bits.type.count if isinstance(bits.type, ir.VectorType) else None
    if _has_f16c() if native is None else native:
        half = ir.VectorType(ir.HalfType(), count) if count else ir.HalfType()
        return builder.fpext(builder.bitcast(bits, half), ir.VectorType(F32, count) if count else F32)
    i32 = ir.VectorType(I32, count) if count else I32
    c = lambda v: ir.Constant(i32, [v] * count) if count else I32(v)
    h = builder.zext(bits, i32)
    sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
    exp = builder.and_(builder.lshr(h, c(10)), c(0x1F))
    mant = builder.and_(h, c(0x3FF))
    normal = builder.or_(builder.shl(builder.add(exp, c(112)), c(23)), builder.shl(mant, c(13)))
    special = builder.or_(c(0x7F800000), builder.shl(mant, c(13)))  # inf and NaN
    fty = ir.VectorType(F32, count) if count else F32
    tiny = builder.fmul(builder.uitofp(mant, fty), ir.Constant(fty, [2.0**-24] * count) if count else F32(2.0**-24))  # exact
    magnitude = builder.select(builder.icmp_unsigned("==", exp, c(0)), builder.bitcast(tiny, i32),
                               builder.select(builder.icmp_unsigned("==", exp, c(31)), special, normal))
    return builder.bitcast(builder.or_(sign, magnitude), fty)


def _has_f16c() -> bool:
    from .target import has

    return has("f16c")


def f16_splat(builder, sptr, blk, lanes=LANES):
    """`lanes` copies of float16 scale blk (uint16 bits at sptr), widened to float32 (exact)."""
    bits = builder.load(builder.gep(sptr, [blk], source_etype=I16), typ=I16, align=2)
    # Into a zeroed vector, not an undefined one: LLVM would otherwise insert into whatever register
    # is at hand, often the accumulator, and chain every scale behind the previous FMA (2x slower).
    # Widened as a vector: a scalar float16 conversion measured 35% slower in the int8 row loop.
    word = builder.insert_element(ir.Constant(ir.VectorType(I32, 4), [0] * 4), builder.zext(bits, I32), I32(0))
    halves = builder.bitcast(word, ir.VectorType(I16, 8))
    splat = builder.shuffle_vector(halves, halves, ir.Constant(ir.VectorType(I32, lanes), [0] * lanes))
    return half_to_f32(builder, splat)


def as_i64(builder, value, ty):
    return builder.sext(value, I64) if value.type.width < 64 else value


def loop(builder, start, stop, step, inits, body):
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


def chunk_loop(builder, n, n_acc, body, init=0.0):
    """for i in 0, 16, .. < n - n % 16: accs = body(i, accs), each accumulator starting as 16
    copies of `init`. Returns the final accumulators."""
    return loop(builder, I64(0), builder.and_(n, I64(-LANES)), LANES, [ir.Constant(VEC, [init] * LANES)] * n_acc, body)


F32_MAX = 3.4028234663852886e38


def quantized_block(builder, px, i, levels):
    """The 32 float32 activations at px + i quantized symmetrically to integer levels
    -levels..levels: (scale, two 16-lane float vectors of the rounded levels), scale = the block's
    largest magnitude / levels and each level x * (levels / that magnitude), rounded to nearest
    even. A block holding NaN or Inf gets a NaN scale (every output it feeds is NaN, as in float
    arithmetic) and levels clamped in range; a block whose largest magnitude is below ~1e-34
    (levels / it overflows) counts as zeros."""
    module = builder.module
    fabs = cgutils.get_or_insert_function(module, ir.FunctionType(VEC, [VEC]), "llvm.fabs.v16f32")
    vmax = cgutils.get_or_insert_function(module, ir.FunctionType(VEC, [VEC, VEC]), "llvm.maxnum.v16f32")
    vmin = cgutils.get_or_insert_function(module, ir.FunctionType(VEC, [VEC, VEC]), "llvm.minnum.v16f32")
    rint = cgutils.get_or_insert_function(module, ir.FunctionType(VEC, [VEC]), "llvm.rint.v16f32")
    any_set = cgutils.get_or_insert_function(module, ir.FunctionType(ir.IntType(1), [ir.VectorType(ir.IntType(1), LANES)]), "llvm.vector.reduce.or.v16i1")
    hmax = cgutils.get_or_insert_function(module, ir.FunctionType(F32, [VEC]), "llvm.vector.reduce.fmax.v16f32")
    top = ir.Constant(VEC, [F32_MAX] * LANES)
    halves = [load_f32(builder, px, builder.add(i, I64(h * LANES))) for h in range(2)]
    mags = [builder.call(fabs, [v]) for v in halves]
    # NaN or Inf anywhere: |v| > F32_MAX or unordered
    bad = builder.call(any_set, [builder.or_(*[builder.fcmp_unordered(">", m, top) for m in mags])])
    amax = builder.call(hmax, [builder.call(vmax, mags)])
    inv = builder.fdiv(F32(levels), amax)
    zero = builder.or_(bad, builder.not_(builder.fcmp_ordered("<=", inv, F32(F32_MAX))))  # also amax == 0
    inv = builder.select(zero, F32(0.0), inv)
    scale = builder.select(bad, F32(float("nan")), builder.select(zero, F32(0.0), builder.fdiv(amax, F32(levels))))
    inv_v = splat(builder, inv)
    top_level = ir.Constant(VEC, [levels] * LANES)
    out = []
    for v in halves:
        q = builder.call(rint, [builder.fmul(v, inv_v)])
        out.append(builder.call(vmin, [builder.call(vmax, [q, builder.fneg(top_level)]), top_level]))
    return scale, out


# float32 and int8 weight loops ask for the data this many bytes ahead (into the next rows, past a
# row's end), once per 64-byte line. The hardware prefetcher stops at each 4 KiB page and restarts
# on every row. Measured: 2 KiB ahead, bfloat16 decode ~+15% on both model shapes (with one
# accumulator per row; with two, bfloat16 rows are faster without); 4 KiB over 2 KiB,
# default-model decode int8 +10%, float32 +4% (8 KiB: the same as 4). A prefetch per 16-weight
# chunk (four per line at int8) cost more than it gained.
PREFETCH_BYTES = 4096
LINE_BYTES = 64


# llvm.prefetch's locality: 3 is prefetcht0 (into L1 and below), 2 prefetcht1 (into L2, not L1).
INTO_L1, INTO_L2 = 3, 2


def prefetch(builder, ptr, locality=INTO_L1):
    """A read prefetch of ptr's cache line; never faults, even past an array's end."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32]), "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(ptr, i8p), I32(0), I32(locality), I32(1)])


def fma_acc(builder, acc, a, b):
    """acc + a b, fused: fma_vec with the accumulator first, as dpbf16 takes it."""
    return fma_vec(builder, a, b, acc)


def tile_accumulators(builder, rows, cols, n, load=load_f32, term=fma_acc, chunk=LANES, accs=1, col_load=None, prefetch_ahead=None, acc_type=VEC,
                      prefetch_rows=None):
    """The R x G fixed-order dot products rows[c] . cols[j] over the full chunks of n, each in its
    own 16-lane accumulator, unreduced: a list, accumulator R j + c (R rows). With R x G = 4 x 4,
    8 loads feed 16 multiply-adds (AVX-512's 32 registers hold them); with AVX2's 16 half-width
    registers a tile of 6 sums is as large as fits (tile_shape).
float32 by default; bfloat16 rows and columns with load=load_bf16_chunk, term=dpbf16,
    chunk=BF16_CHUNK, accs=BF16_ACCS: one pass over the even chunks, one over the odd, added
    lane by lane (a weight row's order, _weight_loop). Columns are read with col_load when the
    two sides differ (int8 rows, int16 tokens; their accumulators acc_type=int8_acc_type()). With prefetch_ahead (an i64 count of row
    elements), each step asks for the rows' data that far ahead (rows streamed from memory:
    decode's batch tiles), into L2 only; from prefetch_rows, the rows' pointers, where rows are
    not themselves pointers (int8's custom loads). A tile spends ~16 FMAs on each line it reads, so
    the prefetches stay in flight far longer than a lone row's: into L1 they held the core's few L1
    miss buffers. Into L2 a batched decode step took 0.7x the time (docs/performance.md, "The
    measurements behind the kernels")."""
    col_load = col_load or load
    R = len(rows)
    prefetch_rows = rows if prefetch_rows is None else prefetch_rows
    split = term is dpbf16 and split_bf16()

    def body(i, accs):
        if prefetch_ahead is not None:  # a float32 chunk is one line, a bfloat16 chunk too (32 x 2 bytes), an int8 block half of one
            for p in prefetch_rows:
                prefetch(builder, builder.gep(p, [builder.add(i, prefetch_ahead)], source_etype=p.type.pointee), INTO_L2)
        if split:
            return bf16_tile_halves(builder, rows, cols, i, accs)
        rv = [load(builder, p, i) for p in rows]
        out = []
        for j, cp in enumerate(cols):
            cv = col_load(builder, cp, i)
            out += [term(builder, accs[R * j + c], rv[c], cv) for c in range(R)]
        return out

    zero = ir.Constant(acc_type, [0.0] * acc_type.count)
    full = builder.and_(n, I64(-chunk))
    # chunks a, a + accs, a + 2 accs, ..: loop steps while i + step - 1 < stop, so stop is
    # raised by the stride less one chunk to take the last chunk of each pass
    stop = builder.add(full, I64(chunk * (accs - 1)))
    zeros = [zero] * (R * len(cols))
    total = loop(builder, I64(0), stop, chunk * accs, zeros, body)
    # Each later pass runs with the sums so far parked outside the registers (_park). Tiles that
    # stream rows from memory are the exception: they wait on memory, LLVM kept their sums out
    # of the loop anyway, and parking cost them ~5% (an 8-row bfloat16 step on a 56 MB matrix).
    park = prefetch_ahead is None
    for a in range(1, accs):
        parked = _park(builder, total) if park else None
        sums = loop(builder, I64(a * chunk), stop, chunk * accs, zeros, body)
        if parked is not None:
            total = _unpark(builder, parked)
        total = [builder.fadd(t, v) for t, v in zip(total, sums)]
    return total


def _park(builder, values):
    """Store values (16-lane vectors) in a 64-byte-aligned stack slot for _unpark to read after
    the next loop. Held in registers across a tile's second pass they left LLVM one accumulator
    short: it spilled one to the stack and read it back on every step, a 64-byte store and load
    on the sum's own dependency chain. Where that slot straddled a cache line (the stack's
    alignment differs by thread and process) the store could not be forwarded: one 1536 x 576
    bfloat16 matrix against 512 rows of x, one thread, took 5.4 ms on the main thread and 7.4-9.0
    ms on another; parked, 5.1-5.4 on both (the tree before the one forward pass: 5.1), and 19-20
    ms instead of 23-27 compiled for AVX2. An empty asm statement that takes the slot keeps the
    optimiser from holding the values in registers instead or loading them early."""
    slot = cgutils.alloca_once(builder, ir.ArrayType(VEC, len(values)))
    slot.align = 64
    for k, v in enumerate(values):
        builder.store(v, builder.gep(slot, [I32(0), I32(k)]), align=64)
    _opaque_use(builder, slot)
    return slot


def _unpark(builder, slot):
    """The values _park stored in slot, read where the builder stands (after the loop)."""
    _opaque_use(builder, slot)
    return [builder.load(builder.gep(slot, [I32(0), I32(k)]), typ=VEC, align=64) for k in range(slot.allocated_type.count)]


def _opaque_use(builder, ptr):
    """An asm statement that may read and write *ptr: memory the optimiser cannot see through."""
    fnty = ir.FunctionType(ir.VoidType(), [ptr.type])
    builder.asm(fnty, "", "r,~{memory}", [ptr], side_effect=True)


def tile_4x4(builder, rows, cols, n, **options):
    """tile_accumulators of 4 rows and 4 columns, reduced together: a vector, lane 4 j + c."""
    return reduce16_vector(builder, tile_accumulators(builder, rows, cols, n, **options))


def tile_sums(builder, rows, cols, n, **options):
    """tile_accumulators reduced, each in the one tree (reduce16_vector for 16 at once: the same
    additions): a list of float32 scalars, sum R j + c."""
    accs = tile_accumulators(builder, rows, cols, n, **options)
    accs = [widen_int8_sums(builder, acc) if acc.type != VEC else acc for acc in accs]
    if len(accs) == LANES:
        v = reduce16_vector(builder, accs)
        return [builder.extract_element(v, I64(k)) for k in range(LANES)]
    return [reduce_tree(builder, acc) for acc in accs]


def tile_shape(int8: bool = False) -> tuple[int, int]:
    """(weight rows, rows of x) of a register tile on this target: 4 x 4 with AVX-512's 32 vector
    registers, 2 x 3 with 16 (AVX2: a 16-lane accumulator is two registers, 6 sums 12 of them).
    int8 tiles stay 4 x 4 everywhere: AVX2's 16 sums are 8 lanes each (int8_lanes), one register
    (the shapes measured: docs/performance.md)."""
    from .target import vector_registers

    return (4, 4) if int8 or vector_registers() >= 32 else (2, 3)


# int8 weights meet activations quantized to int16 per block of 32 (quantize_blocks):
# vpmaddwd multiplies a block's 32 pairs exactly into 16 int32 lanes (lane i: products 2i and 2i+1;
# at most 2 * 128 * 32767 < 2**24, so exact again in float32), then one FMA adds them to the row's
# float32 accumulator, times the weight scale times the activation scale. Widening every int8
# weight to float32 instead cost one core 15 GB/s of weights; this streams 26.
# Without AVX-512 (16 registers of 8 floats) lanes i and i + 8 are first added in int32 (at most
# 4 * 128 * 32767 < 2**24: still exact) into 8-lane accumulators: half the conversions and FMAs
# per product, and a tile of 4 x 4 sums fits the registers instead of spilling.
# widen_int8_sums pads them with +0.0 before the one tree, whose first level then leaves each
# unchanged. AVX-512 keeps 16 lanes: there the same 8 lanes cost int8 prefill 13%, and two tokens'
# 8 lanes in one register 18% (more shuffles than the conversions they save). So int8 logits
# differ in their last bits between AVX-512 and other CPUs; every path on one CPU agrees.
I32_VEC = ir.VectorType(I32, LANES)
I16_BLOCK = ir.VectorType(I16, QBLOCK)


def int8_lanes() -> int:
    """Lanes of an int8 product's float32 accumulator on this target: 16, or 8 without AVX-512."""
    from .target import vector_registers

    return LANES if vector_registers() >= 32 else LANES // 2


def int8_acc_type():
    return ir.VectorType(F32, int8_lanes())


def int8_values(builder, qptr, i):
    """The 32 int8 weights from element i, sign-extended to int16."""
    raw = builder.load(builder.gep(qptr, [i], source_etype=ir.IntType(8)), typ=ir.VectorType(ir.IntType(8), QBLOCK), align=1)
    return builder.sext(raw, I16_BLOCK)


def int16_values(builder, qptr, i):
    """The 32 int16 activations from element i."""
    return builder.load(builder.gep(qptr, [i], source_etype=I16), typ=I16_BLOCK, align=2)


def load_int8_block(builder, qptr, sptr, i):
    """The int8 block at element i (a multiple of QBLOCK) as int16, with its float16 scale as a
    float32 vector of int8_lanes()."""
    return int8_values(builder, qptr, i), f16_splat(builder, sptr, builder.sdiv(i, I64(QBLOCK)), int8_lanes())


def load_int16_block(builder, ptrs, i):
    """The quantized activations' block at element i: 32 int16 and the block's float32 scale."""
    qptr, sptr = ptrs
    scale = builder.load(builder.gep(sptr, [builder.sdiv(i, I64(QBLOCK))], source_etype=F32), typ=F32, align=4)
    return int16_values(builder, qptr, i), splat(builder, scale, int8_lanes())


def int8_pairs_term(builder, acc, w, x, scale):
    """acc + float(sum of a block's 32 products w x, in pairs) * scale, in int8_lanes() lanes.

    The pairs are written as plain IR (widen to int32, multiply, add neighbours), which LLVM
    emits as one vpmaddwd: the same sums as vpdpwssd into zero (no overflow: |w| <= 128 and
    |x| <= 32767), but AVX-512 BW, or two AVX2 halves, instead of AVX-512 VNNI. With 8 lanes,
    pair lanes i and i + 8 (on AVX2 the two halves' registers) are then added."""
    wide = ir.VectorType(I32, QBLOCK)
    products = builder.mul(builder.sext(w, wide), builder.sext(x, wide))
    half = lambda first: builder.shuffle_vector(products, products, ir.Constant(I32_VEC, list(range(first, QBLOCK, 2))))
    pairs = builder.add(half(0), half(1))
    n = acc.type.count
    if n < LANES:
        part = lambda first: builder.shuffle_vector(pairs, pairs, ir.Constant(ir.VectorType(I32, n), list(range(first, first + n))))
        pairs = builder.add(part(0), part(n))
    return fma_vec(builder, builder.sitofp(pairs, acc.type), scale, acc)


def int8_block_term(builder, acc, w, x):
    """acc + float(sum of the block's 32 products, in pairs) * (weight scale * activation scale);
    w and x: (32 int16, scale vector) from load_int8_block and load_int16_block."""
    return int8_pairs_term(builder, acc, w[0], x[0], builder.fmul(w[1], x[1]))


def widen_int8_sums(builder, acc):
    """An int8 accumulator as a 16-lane one for reduce_tree: 8 lanes padded with +0.0."""
    n = acc.type.count
    if n == LANES:
        return acc
    zero = ir.Constant(acc.type, [0.0] * n)
    return builder.shuffle_vector(acc, zero, ir.Constant(I32_VEC, list(range(LANES))))


class BFloatType(ir.Type):
    """LLVM's bfloat, which llvmlite's IR builder lacks (it only prints types)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, BFloatType)

    def __hash__(self):
        return hash("bfloat")


BF16_CHUNK = 32
BF16_ACCS = 2  # accumulators of a bfloat16 row: even chunks, odd chunks
BF16_VEC = ir.VectorType(BFloatType(), BF16_CHUNK)
I16_VEC = ir.VectorType(I16, BF16_CHUNK)


def native_bf16() -> bool:
    """Whether this CPU has AVX-512 BF16 (vdpbf16ps, vcvtne2ps2bf16). Without it the same products
    and roundings are written as plain integer and float vectors (kernels.target); Numba's on-disk
    cache is keyed by the CPU's features, so each machine compiles the path it can run."""
    from .target import has

    return has("avx512bf16")


def load_bf16_chunk(builder, ptr, i):
    """32 bfloat16 values (uint16 bits) from element i."""
    raw = builder.load(builder.gep(ptr, [i], source_etype=I16), typ=I16_VEC, align=2)
    return builder.bitcast(raw, BF16_VEC) if native_bf16() else raw


def split_bf16() -> bool:
    """Whether bfloat16 tiles take products half a chunk at a time (bf16_tile_halves): no
    vdpbf16ps and 16 registers of 8 lanes (AVX2). Activations rounded for them are then stored in
    TOKEN_ORDER."""
    from .target import vector_registers

    return not native_bf16() and vector_registers() < 32


# Where split_bf16 holds, each 16 values of a rounded activation are stored evens, odds per 8:
# position p holds value TOKEN_ORDER[p]. One vpunpcklwd against zero then widens a half chunk's
# even values to float32, one vpunpckhwd its odd ones, each with its load folded in.
TOKEN_ORDER = [k + base for half in (0, 16) for base in (half, half + 8) for k in (0, 2, 4, 6, 1, 3, 5, 7)]
TOKEN_PLACE = [TOKEN_ORDER.index(k) for k in range(BF16_CHUNK)]


def load_bf16_tokens(builder, ptr, i):
    """load_bf16_chunk of rounded activations (round_bf16_chunks), in their natural order."""
    if not split_bf16():
        return load_bf16_chunk(builder, ptr, i)
    raw = builder.load(builder.gep(ptr, [i], source_etype=I16), typ=I16_VEC, align=2)
    return builder.shuffle_vector(raw, raw, ir.Constant(ir.VectorType(I32, BF16_CHUNK), TOKEN_PLACE))


def store_bf16_tokens(builder, chunk, ptr, i):
    """Store 32 rounded activations (bits, natural order) at element i as load_bf16_tokens reads them."""
    if split_bf16():
        chunk = builder.bitcast(chunk, I16_VEC)
        chunk = builder.shuffle_vector(chunk, chunk, ir.Constant(ir.VectorType(I32, BF16_CHUNK), TOKEN_ORDER))
    dst = builder.bitcast(builder.gep(ptr, [i], source_etype=I16), chunk.type.as_pointer())
    builder.store(chunk, dst, align=2)


def round_bf16_chunk(builder, ptr, i):
    """32 float32 values from element i, rounded to bfloat16 (nearest-even; NaN stays NaN)."""
    lo, hi = load_f32(builder, ptr, i), load_f32(builder, ptr, builder.add(i, I64(LANES)))
    if native_bf16():
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(BF16_VEC, [VEC, VEC]), "llvm.x86.avx512bf16.cvtne2ps2bf16.512")
        return builder.call(fn, [hi, lo])  # the second operand fills the low half
    halves = [round_bf16_plain(builder, v) for v in (lo, hi)]
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(I32, BF16_CHUNK), list(range(BF16_CHUNK))))


def round_bf16_plain(builder, v):
    """16 float32 to bfloat16 bits (16 x i16), as kernels.quantize.bf16_bits rounds one."""
    i32v = lambda c: ir.Constant(I32_VEC, [c] * LANES)
    bits = builder.bitcast(v, I32_VEC)
    upper = builder.lshr(bits, i32v(16))
    rounded = builder.lshr(builder.add(bits, builder.add(i32v(0x7FFF), builder.and_(upper, i32v(1)))), i32v(16))
    quiet_nan = builder.or_(upper, i32v(0x40))
    out = builder.select(builder.fcmp_unordered("uno", v, v), quiet_nan, rounded)
    return builder.trunc(out, ir.VectorType(I16, LANES))


def dpbf16(builder, acc, a, b):
    """acc[i] += a[2i+1] b[2i+1], then += a[2i] b[2i], in float32 (vdpbf16ps; each product of two
    bfloat16 is exact in float32, so a fused multiply-add per product gives the same sums)."""
    if native_bf16():
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VEC, [VEC, BF16_VEC, BF16_VEC]), "llvm.x86.avx512bf16.dpbf16ps.512")
        return builder.call(fn, [acc, a, b])
    pairs_a, pairs_b = builder.bitcast(a, I32_VEC), builder.bitcast(b, I32_VEC)
    high = ir.Constant(I32_VEC, [-65536] * LANES)  # 0xFFFF0000: the odd element, already in place
    odd = lambda p: builder.bitcast(builder.and_(p, high), VEC)
    even = lambda p: builder.bitcast(builder.shl(p, ir.Constant(I32_VEC, [16] * LANES)), VEC)
    acc = fma_vec(builder, odd(pairs_a), odd(pairs_b), acc)
    return fma_vec(builder, even(pairs_a), even(pairs_b), acc)


def bf16_tile_halves(builder, rows, cols, i, accs):
    """dpbf16 of every pair of a tile's bfloat16 rows and columns (activations in TOKEN_ORDER) at
    chunk i, where split_bf16 holds: the same products into the same lanes in the same order (odd,
    then even), written half-chunk by half-chunk and odd products before even. Written as dpbf16
    per pair, LLVM loaded every operand's two halves up front and kept them on the stack: a 2 x 3
    tile's 12 accumulators leave 4 registers. Here a weight row's odd values are one vpblendw or
    vpand with its load folded in, its even ones a load and a shift, an activation's either one
    vpunpck; an opaque barrier between odd and even keeps LLVM from merging their loads into one
    value held across both (the stack again)."""
    R, half = len(rows), LANES // 2
    lanes = lambda start: ir.Constant(ir.VectorType(I32, half), list(range(start, start + half)))
    wide, words = ir.VectorType(I32, half), ir.VectorType(I16, 2 * half)
    high = ir.Constant(wide, [-65536] * half)  # 0xFFFF0000: the odd element, already in place
    sixteen = ir.Constant(wide, [16] * half)
    zero = ir.Constant(words, [0] * (2 * half))
    vec8 = ir.VectorType(F32, half)
    parts = [[builder.shuffle_vector(acc, acc, lanes(h * half)) for h in (0, 1)] for acc in accs]

    def load(p, h, ty):  # the 16 values of half h of chunk i
        ptr = builder.bitcast(builder.gep(p, [builder.add(i, I64(h * BF16_CHUNK // 2))], source_etype=I16), ty.as_pointer())
        return builder.load(ptr, align=2)

    def widened(p, h, first):  # an activation's 4 + 4 values from words first.., first + 8.. over zeros
        pattern = [w for k in (first, first + 1, first + 2, first + 3, first + 8, first + 9, first + 10, first + 11) for w in (0, 2 * half + k)]
        return builder.bitcast(builder.shuffle_vector(zero, load(p, h, words), ir.Constant(ir.VectorType(I32, 2 * half), pattern)), vec8)

    odd_row = lambda p, h: builder.bitcast(builder.and_(load(p, h, wide), high), vec8)
    even_row = lambda p, h: builder.bitcast(builder.shl(load(p, h, wide), sixteen), vec8)
    for h in (0, 1):
        for row_values, first in ((odd_row, 4), (even_row, 0)):
            rv = [row_values(p, h) for p in rows]
            for j, cp in enumerate(cols):
                cv = widened(cp, h, first)
                for c in range(R):
                    parts[R * j + c][h] = fma_vec(builder, rv[c], cv, parts[R * j + c][h])
            _barrier(builder)
    return [builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, LANES), list(range(LANES)))) for lo, hi in parts]


def _barrier(builder):
    """An empty asm statement that may touch any memory: loads are neither moved across it nor
    merged with loads on its other side."""
    builder.asm(ir.FunctionType(ir.VoidType(), []), "", "~{memory}", [], side_effect=True)


@intrinsic
def bits_as_f32(typingctx, bits):
    """Reinterpret a uint32 as float32 (a register move, no conversion)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return sig, codegen


@intrinsic
def f32_as_bits(typingctx, value):
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return sig, codegen
