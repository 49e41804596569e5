"""bfloat16 in LLVM IR: chunks of 32 bfloat16 values, their products in vdpbf16ps where the CPU
has AVX-512 BF16 (native_bf16) and in plain integer and float vectors where it does not, the
rounding of float32 activations to bfloat16, and AVX2's form of a register tile's products
(bf16_tile_halves) with the activation layout it reads (TOKEN_ORDER).

Each product of two bfloat16 is exact in float32, so a fused multiply-add per product gives
vdpbf16ps's sums: lane i of an accumulator adds products 2i + 1, then 2i, of each chunk.
"""

from llvmlite import ir
from numba.core import cgutils

from .vector_ir import F32, I16, I32, I32_VEC, I64, LANES, VEC, fma_vec, load_f32


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
    chunk = load_bf16_chunk(builder, ptr, i)
    if not split_bf16():
        return chunk
    return builder.shuffle_vector(chunk, chunk, ir.Constant(ir.VectorType(I32, BF16_CHUNK), TOKEN_PLACE))


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


def _odd_values(builder, pairs):
    """Pairs of bfloat16 (n x i32, element 2i in the low half of lane i): elements 2i + 1 as float32."""
    n = pairs.type.count
    high = ir.Constant(pairs.type, [-65536] * n)  # 0xFFFF0000: the odd element, already in place
    return builder.bitcast(builder.and_(pairs, high), ir.VectorType(F32, n))


def _even_values(builder, pairs):
    """Pairs of bfloat16 (n x i32): elements 2i as float32."""
    n = pairs.type.count
    return builder.bitcast(builder.shl(pairs, ir.Constant(pairs.type, [16] * n)), ir.VectorType(F32, n))


def dpbf16(builder, acc, a, b):
    """acc[i] += a[2i+1] b[2i+1], then += a[2i] b[2i], in float32 (vdpbf16ps; each product of two
    bfloat16 is exact in float32, so a fused multiply-add per product gives the same sums)."""
    if native_bf16():
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VEC, [VEC, BF16_VEC, BF16_VEC]), "llvm.x86.avx512bf16.dpbf16ps.512")
        return builder.call(fn, [acc, a, b])
    pairs_a, pairs_b = builder.bitcast(a, I32_VEC), builder.bitcast(b, I32_VEC)
    acc = fma_vec(builder, _odd_values(builder, pairs_a), _odd_values(builder, pairs_b), acc)
    return fma_vec(builder, _even_values(builder, pairs_a), _even_values(builder, pairs_b), acc)


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
    zero = ir.Constant(words, [0] * (2 * half))
    vec8 = ir.VectorType(F32, half)
    parts = [[builder.shuffle_vector(acc, acc, lanes(h * half)) for h in (0, 1)] for acc in accs]

    def load(p, h, ty):  # the 16 values of half h of chunk i
        ptr = builder.bitcast(builder.gep(p, [builder.add(i, I64(h * BF16_CHUNK // 2))], source_etype=I16), ty.as_pointer())
        return builder.load(ptr, align=2)

    def widened(p, h, first):  # an activation's 4 + 4 values from words first.., first + 8.. over zeros
        pattern = [w for k in (first, first + 1, first + 2, first + 3, first + 8, first + 9, first + 10, first + 11) for w in (0, 2 * half + k)]
        return builder.bitcast(builder.shuffle_vector(zero, load(p, h, words), ir.Constant(ir.VectorType(I32, 2 * half), pattern)), vec8)

    odd_row = lambda p, h: _odd_values(builder, load(p, h, wide))
    even_row = lambda p, h: _even_values(builder, load(p, h, wide))
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
