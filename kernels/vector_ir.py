"""LLVM IR building blocks for the kernels' fixed-order sums, written with 16-wide vectors.

Every sum in minillm's forward pass is LANES partial sums (one AVX-512 register) accumulated with
fused multiply-adds over aligned chunks, then added in one fixed tree (reduce_tree); the caller
adds the remaining n % LANES terms in sequence. No reassociation is possible, so the fused decode
step, the prefill matmul and batched decode give bit-identical results for the same row, whatever
else is computed alongside. Numba leaves float reductions scalar unless allowed to reorder them
(and then the order depends on how LLVM vectorises each call site), hence explicit vectors.

Here: vector types, loads, the loop and reduction skeletons, the 4 x 4 register tile, and the
int8 pieces the weight products use (blocks and their pair sums; bfloat16's are in bf16_vectors).
The intrinsics built from them live in row_products, float_sums and activation_operands.
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
                      prefetch_rows=None, pairs=None):
    """The R x G fixed-order dot products rows[c] . cols[j] over the full chunks of n, each in its
    own 16-lane accumulator, unreduced: a list, accumulator R j + c (R rows). With R x G = 4 x 4,
    8 loads feed 16 multiply-adds (AVX-512's 32 registers hold them); with AVX2's 16 half-width
    registers a tile of 6 sums is as large as fits (tile_shape).
float32 by default; bfloat16 rows and columns with load=load_bf16_chunk, term=dpbf16,
    chunk=BF16_CHUNK, accs=BF16_ACCS: one pass over the even chunks, one over the odd, added
    lane by lane (a weight row's order, _weight_loop). Columns are read with col_load when the
    two sides differ (int8 rows, int16 tokens; their accumulators acc_type=int8_acc_type()); with
    pairs(builder, rows, cols, i, accs), which returns the accumulators, every pair's term at chunk
    i at once (bf16_vectors.bf16_tile_halves). With prefetch_ahead (an i64 count of row
    elements), each step asks for the rows' data that far ahead (rows streamed from memory:
    decode's batch tiles), into L2 only; from prefetch_rows, the rows' pointers, where rows are
    not themselves pointers (int8's custom loads). A tile spends ~16 FMAs on each line it reads, so
    the prefetches stay in flight far longer than a lone row's: into L1 they held the core's few L1
    miss buffers. Into L2 a batched decode step took 0.7x the time (docs/performance.md, "The
    measurements behind the kernels")."""
    col_load = col_load or load
    R = len(rows)
    prefetch_rows = rows if prefetch_rows is None else prefetch_rows

    def body(i, accs):
        if prefetch_ahead is not None:  # a float32 chunk is one line, a bfloat16 chunk too (32 x 2 bytes), an int8 block half of one
            for p in prefetch_rows:
                prefetch(builder, builder.gep(p, [builder.add(i, prefetch_ahead)], source_etype=p.type.pointee), INTO_L2)
        if pairs is not None:
            return pairs(builder, rows, cols, i, accs)
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
