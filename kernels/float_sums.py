"""Fixed-order float32 sums over activations: dot products, totals and maxima of vectors (RMSNorm,
softmax), and attention's score tiles (a query against 16 keys, 4 queries against 4 keys) and
probability-weighted values. Full 16-lane chunks in LLVM IR (vector_ir), then the tail in sequence;
every tile's result equals the single dot product of the same pair.
"""

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .jit import EXACT_MATH
from .kv_rows import element_type, load_kv_chunk
from .vector_ir import (
    F32,
    I32,
    I64,
    LANES,
    VEC,
    as_i64,
    chunk_loop,
    data_ptr,
    fma_vec,
    load_f32,
    loop,
    reduce16_vector,
    reduce_tree,
    splat,
    tile_4x4,
)


@intrinsic
def dot_chunks(typingctx, a, a_off, b, b_off, n):
    """Fixed-order sum of a[a_off + k] * b[b_off + k] over the full chunks of k < n (float32 arrays)."""
    sig = types.float32(a, a_off, b, b_off, n)

    def codegen(context, builder, signature, args):
        pa = data_ptr(context, builder, signature.args[0], args[0], as_i64(builder, args[1], None), F32)
        kind = signature.args[2].dtype
        pb = data_ptr(context, builder, signature.args[2], args[2], as_i64(builder, args[3], None), element_type(kind))
        (acc,) = chunk_loop(
            builder, as_i64(builder, args[4], None), 1,
            lambda i, accs: [fma_vec(builder, load_f32(builder, pa, i), load_kv_chunk(builder, kind, pb, i), accs[0])],
        )
        return reduce_tree(builder, acc)

    return sig, codegen


@intrinsic
def sum_chunks(typingctx, a, n):
    """Fixed-order sum of a[k] over the full chunks of k < n (float32)."""
    sig = types.float32(a, n)

    def codegen(context, builder, signature, args):
        pa = data_ptr(context, builder, signature.args[0], args[0], I64(0), F32)
        (acc,) = chunk_loop(
            builder, as_i64(builder, args[1], None), 1,
            lambda i, accs: [builder.fadd(accs[0], load_f32(builder, pa, i))],
        )
        return reduce_tree(builder, acc)

    return sig, codegen


@intrinsic
def dot_4x4_into(typingctx, out, o, o_stride, a, a_off, a_stride, b, b_off, b_stride, n):
    """out[o + i * o_stride + j] = fixed-order sum of a[a_off + i * a_stride + k] *
    b[b_off + j * b_stride + k] over the full chunks of k < n, for i, j < 4 (attention scores of
    4 queries against 4 keys). Each result equals dot_chunks of the same pair.
    """
    sig = types.void(out, o, o_stride, a, a_off, a_stride, b, b_off, b_stride, n)

    def codegen(context, builder, signature, args):
        (o, o_stride, a_off, a_stride, b_off, b_stride, n) = [as_i64(builder, args[i], None) for i in (1, 2, 4, 5, 7, 8, 9)]
        po = data_ptr(context, builder, signature.args[0], args[0], o, F32)
        pa = data_ptr(context, builder, signature.args[3], args[3], a_off, F32)
        kind = signature.args[6].dtype
        pb = data_ptr(context, builder, signature.args[6], args[6], b_off, element_type(kind))
        a_rows = [builder.gep(pa, [builder.mul(a_stride, I64(i))], source_etype=F32) for i in range(4)]
        b_rows = [builder.gep(pb, [builder.mul(b_stride, I64(j))], source_etype=element_type(kind)) for j in range(4)]
        options = {} if kind == types.float32 else dict(load=lambda b, row, i: load_kv_chunk(b, kind, row, i), col_load=load_f32)
        result = tile_4x4(builder, b_rows, a_rows, n, **options)  # lane 4 i + j
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
        po = data_ptr(context, builder, signature.args[0], args[0], as_i64(builder, args[1], None), F32)
        pa = data_ptr(context, builder, signature.args[2], args[2], as_i64(builder, args[3], None), F32)
        kind = signature.args[4].dtype
        pb = data_ptr(context, builder, signature.args[4], args[4], as_i64(builder, args[5], None), element_type(kind))
        stride = as_i64(builder, args[6], None)
        rows = [builder.gep(pb, [builder.mul(stride, I64(i))], source_etype=element_type(kind)) for i in range(LANES)]

        def body(i, accs):
            av = load_f32(builder, pa, i)
            return [fma_vec(builder, av, load_kv_chunk(builder, kind, r, i), acc) for r, acc in zip(rows, accs)]

        accs = chunk_loop(builder, as_i64(builder, args[7], None), LANES, body)
        builder.store(reduce16_vector(builder, accs), builder.bitcast(po, VEC.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


# The most query heads one pass over the values serves: 8 accumulators each (4 chunks x even/odd)
# plus the row loads fit AVX-512's 32 registers for 3.
VALUE_HEADS = 3


def _weighted_rows(heads: int):
    """An intrinsic weighted_rows_<heads>(out, o_off, o_stride, p, p_off, p_stride, v, v_off, n, stride, width):
    out[o_off + h o_stride + d] = sum over j < n of p[p_off + h p_stride + j] * v[j, d], v's row j
    starting at element v_off + j stride, for h < heads and d in the full chunks of d < width
    (attention's probabilities times values, for query heads sharing one KV head: each value row
    is loaded once for all of them; v in any KV format, kernels.kv_rows).

    Each output is two sequential sums, over even and over odd j, added at the end: independent
    FMA chains in a fixed order, the same whatever `heads` is. Rows are read whole, 64 columns
    (4 chunks) at a time."""

    def typer(typingctx, out, o_off, o_stride, p, p_off, p_stride, v, v_off, n, stride, width):
        sig = types.void(out, o_off, o_stride, p, p_off, p_stride, v, v_off, n, stride, width)

        def codegen(context, builder, signature, args):
            o_off, o_stride, p_off, p_stride, v_off, n, stride, width = [as_i64(builder, args[i], None) for i in (1, 2, 4, 5, 7, 8, 9, 10)]
            po = data_ptr(context, builder, signature.args[0], args[0], o_off, F32)
            pp = data_ptr(context, builder, signature.args[3], args[3], p_off, F32)
            kind = signature.args[6].dtype
            pv = data_ptr(context, builder, signature.args[6], args[6], v_off, element_type(kind))
            outs = [builder.gep(po, [builder.mul(o_stride, I64(h))], source_etype=F32) for h in range(heads)]
            probs = [builder.gep(pp, [builder.mul(p_stride, I64(h))], source_etype=F32) for h in range(heads)]
            zero = ir.Constant(VEC, [0.0] * LANES)
            full = builder.and_(width, I64(-LANES))
            group = 4 * LANES

            def prob(h, j):
                return splat(builder, builder.load(builder.gep(probs[h], [j], source_etype=F32), typ=F32, align=4))

            def row(j, cols):
                row_start = builder.gep(pv, [builder.mul(j, stride)], source_etype=element_type(kind))
                return [load_kv_chunk(builder, kind, row_start, c) for c in cols]

            def columns(c0, width):
                """Outputs c0 .. c0 + 16 * width of every head: accumulators (even, odd) per chunk."""
                cols = [builder.add(c0, I64(LANES * i)) for i in range(width)]
                A = 2 * width  # per head

                def pair(j, accs):
                    j1 = builder.add(j, I64(1))
                    even, odd = row(j, cols), row(j1, cols)
                    new = []
                    for h in range(heads):
                        p0, p1 = prob(h, j), prob(h, j1)
                        for i in range(width):
                            new += [fma_vec(builder, p0, even[i], accs[A * h + 2 * i]), fma_vec(builder, p1, odd[i], accs[A * h + 2 * i + 1])]
                    return new

                def last(j, accs):  # n odd: the last key joins the even sums
                    even, new = row(j, cols), list(accs)
                    for h in range(heads):
                        pj = prob(h, j)
                        for i in range(width):
                            new[A * h + 2 * i] = fma_vec(builder, pj, even[i], accs[A * h + 2 * i])
                    return new

                accs = loop(builder, I64(0), builder.and_(n, I64(-2)), 2, [zero] * (A * heads), pair)
                accs = loop(builder, builder.and_(n, I64(-2)), n, 1, accs, last)
                for h in range(heads):
                    for i, c in enumerate(cols):
                        total = builder.fadd(accs[A * h + 2 * i], accs[A * h + 2 * i + 1])
                        builder.store(total, builder.bitcast(builder.gep(outs[h], [c], source_etype=F32), VEC.as_pointer()), align=4)
                return []

            loop(builder, I64(0), full, group, [], lambda c, _: columns(c, 4))
            loop(builder, builder.and_(full, I64(-group)), full, LANES, [], lambda c, _: columns(c, 1))
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = f"weighted_rows_{heads}"
    return intrinsic(typer)


weighted_rows_1, weighted_rows_2, weighted_rows_3 = (_weighted_rows(h) for h in (1, 2, 3))


@intrinsic
def max_chunks(typingctx, a, n):
    """max(a[k]) over the full chunks of k < n (-inf if none); NaNs are skipped, as by fmax."""
    sig = types.float32(a, n)

    def codegen(context, builder, signature, args):
        pa = data_ptr(context, builder, signature.args[0], args[0], I64(0), F32)
        vmax = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VEC, [VEC, VEC]), "llvm.maxnum.v16f32")
        (acc,) = chunk_loop(builder, as_i64(builder, args[1], None), 1,
                             lambda i, accs: [builder.call(vmax, [accs[0], load_f32(builder, pa, i)])], init=float("-inf"))
        smax = cgutils.get_or_insert_function(builder.module, ir.FunctionType(F32, [F32, F32]), "llvm.maxnum.f32")
        result = builder.extract_element(acc, I64(0))
        for j in range(1, LANES):
            result = builder.call(smax, [result, builder.extract_element(acc, I64(j))])
        return result

    return sig, codegen


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def dot(a, b):
    """sum(a * b) over two 1-D float32 arrays of equal length."""
    n = a.shape[0]
    result = dot_chunks(a, 0, b, 0, n)
    for k in range(n - n % LANES, n):
        result += a[k] * b[k]
    return result


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def total(a, n):
    """sum(a[:n]) of a 1-D float32 array."""
    result = sum_chunks(a, n)
    for k in range(n - n % LANES, n):
        result += a[k]
    return result
