"""Weight-row products: dot products of weight rows (float32, bfloat16 bits, int8 blocks) with
activations, one row at a time (weight_dot_chunks, row_dot), four rows side by side (rows_dot4),
and 4 x 4 register tiles of rows against tokens for prefill (tile_dot_4x4 and its bfloat16 and
int8 forms). Every form sums a row in the same fixed order, so decode, batched decode and prefill
give the same bits.

bfloat16 rows meet activations rounded to bfloat16 (nearest-even, as llama.cpp's BF16 does) in
vdpbf16ps, 32 products per instruction, in BF16_CHUNK = 32 element chunks: lane i accumulates
products 2i and 2i+1 of every chunk, in two accumulators, even chunks and odd chunks, added lane by
lane before the same tree. One chain of vdpbf16ps waits on its latency: a core streamed a row of
2048 at 22 GB/s with one accumulator, 30 with two; several rows side by side did worse (15-19),
their 4 KiB rows sharing L1 sets. Without vdpbf16ps the same products are plain vectors, and
with AVX2's 16 registers a tile takes them half a chunk at a time against activations stored for
it (bf16_vectors.bf16_tile_halves, TOKEN_ORDER): one matrix 3-4x as fast as pair by pair. int8 rows
meet activations quantized to int16 per block of 32 (activation_operands.quantize_blocks), a block
at a time (vector_ir.int8_block_term).
"""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from .activation_operands import activation, chunk_operand
from .bf16_vectors import (
    BF16_ACCS,
    BF16_CHUNK,
    bf16_tile_halves,
    dpbf16,
    load_bf16_chunk,
    load_bf16_tokens,
    native_bf16,
    round_bf16_chunk,
    split_bf16,
)
from .jit import EXACT_MATH
from .quantize import chunked_len, weight_at
from .vector_ir import (
    F32,
    I16,
    I32,
    I64,
    LANES,
    LINE_BYTES,
    PREFETCH_BYTES,
    QBLOCK,
    VEC,
    as_i64,
    data_ptr,
    fma_acc,
    half_to_f32,
    int8_acc_type,
    int8_block_term,
    int8_lanes,
    int8_pairs_term,
    int8_values,
    int16_values,
    load_f32,
    load_int8_block,
    load_int16_block,
    loop,
    prefetch,
    reduce_tree,
    splat,
    store_sums,
    tile_sums,
    widen_int8_sums,
)


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
        self.chunk, x_chunk, term = LANES, load_f32, fma_acc
        self.accs = 1  # accumulators per row: chunk c goes to accumulator c % accs
        # bfloat16 rows: vdpbf16ps streams faster unprefetched; without it (AVX2, the products in
        # plain vectors) prefetching 4 KiB ahead pays (docs/performance.md)
        self.prefetched = wty.dtype != types.uint16 or not native_bf16()
        self.x_elem = F32
        self.quantized = wty.dtype == types.int8  # activations come as int16 blocks + scales
        if wty.dtype == types.float32:
            self.load = lambda i: load_f32(builder, self.ptr, i)
        elif wty.dtype == types.uint16:
            self.chunk, term, self.accs = BF16_CHUNK, dpbf16, BF16_ACCS
            x_chunk = load_bf16_tokens if xty.dtype == types.uint16 else round_bf16_chunk
            self.x_elem = I16 if xty.dtype == types.uint16 else F32
            self.load = lambda i: load_bf16_chunk(builder, self.ptr, i)
        else:
            self.chunk, x_chunk, term, self.x_elem = QBLOCK, load_int16_block, int8_block_term, I16
            sarr = context.make_array(sty)(context, builder, s)
            ps = builder.gep(sarr.data, [builder.mul(n, builder.extract_value(sarr.shape, 1))], source_etype=I16)
            self.load = lambda i: load_int8_block(builder, self.ptr, ps, i)
        self.x_chunk = lambda px, i: x_chunk(builder, px, i)
        self.term = lambda acc, w, xv: term(builder, acc, w, xv)

    def operand(self, context, xty, x, xsty, xs):
        """What x_chunk reads: x's data, or for int8 rows (quantized data, block scales)."""
        px = data_ptr(context, self.builder, xty, x, I64(0), self.x_elem)
        if self.quantized:
            return px, data_ptr(context, self.builder, xsty, xs, I64(0), F32)
        return px

    def prefetch(self, i, rows_below=0):
        """Prefetch PREFETCH_BYTES ahead, or with rows_below, element i of the row that many rows
        down (where a stream of rows_below rows side by side reads next)."""
        if rows_below:
            ahead = self.builder.add(i, self.builder.mul(self.K, I64(rows_below)))
        else:
            ahead = self.builder.add(i, I64(PREFETCH_BYTES // self.width))
        prefetch(self.builder, self.builder.gep(self.ptr, [ahead], source_etype=self.elem))


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
    acc_type = int8_acc_type() if rows[0].quantized else VEC
    zero = ir.Constant(acc_type, [0.0] * acc_type.count)

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
    flat = loop(builder, I64(0), groups_end, chunk * group, [zero] * (A * len(rows)), steps(group, True))
    # the rest: whole rounds of accumulators, then (A = 2) at most one chunk, which is even
    rounds_end = builder.sub(full, builder.srem(builder.sub(full, groups_end), I64(chunk * A)))
    flat = loop(builder, groups_end, rounds_end, chunk * A, flat, steps(A, False))
    flat = loop(builder, rounds_end, full, chunk, flat, steps(1, False))
    out = flat[: len(rows)]
    for a in range(1, A):
        out = [builder.fadd(o, f) for o, f in zip(out, flat[a * len(rows) : (a + 1) * len(rows)])]
    if rows[0].quantized:
        out = [widen_int8_sums(builder, o) for o in out]
    return out


def _operand_types_ok(w, x, xs):
    """The activations a weight row accepts (see _WeightRow)."""
    if w.dtype == types.int8:
        return x.dtype == types.int16 and xs.dtype == types.float32
    return x.dtype == types.float32 or (x.dtype == types.uint16 and w.dtype == types.uint16)


@intrinsic
def weight_dot_chunks(typingctx, w, s, n, x, xs):
    """Fixed-order dot of weight row n (f32 / bf16 bits / int8 + scales) with the activations x,
    over the row's full chunks (kernels.quantize.chunked_len). x: float32; against bfloat16 rows
    also pre-rounded bfloat16 bits (kernels.quantize.prepare_operand: the same products, fewer
    instructions); against int8 rows int16 quantized per block, with xs their float32 block
    scales (ignored otherwise)."""
    if not _operand_types_ok(w, x, xs):
        return None
    sig = types.float32(w, s, n, x, xs)

    def codegen(context, builder, signature, args):
        wty, sty, _, xty, xsty = signature.args
        row = _WeightRow(context, builder, wty, sty, args[0], args[1], as_i64(builder, args[2], None), xty)
        px = row.operand(context, xty, args[3], xsty, args[4])
        (acc,) = _weight_loop(builder, [row], lambda i, accs: [row.term(accs[0], row.load(i), row.x_chunk(px, i))])
        return reduce_tree(builder, acc)

    return sig, codegen


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
        n = as_i64(builder, args[4], None)
        rows = [_WeightRow(context, builder, wty, sty, args[2], args[3], builder.add(n, I64(r)), xty) for r in range(4)]
        px = rows[0].operand(context, xty, args[5], xsty, args[6])
        po = data_ptr(context, builder, oty, args[0], as_i64(builder, args[1], None), F32)

        def body(i, accs):
            xv = rows[0].x_chunk(px, i)
            return [row.term(acc, row.load(i), xv) for row, acc in zip(rows, accs)]

        # PREFETCH_BYTES ahead would land inside these four rows (4096 elements and up), already
        # being read; the row four below is the one this stream reads next.
        accs = _weight_loop(builder, rows, body, rows_below=4)
        for r, acc in enumerate(accs):
            builder.store(reduce_tree(builder, acc), builder.gep(po, [I64(r)], source_etype=F32))
        return context.get_dummy_value()

    return sig, codegen


TILES_AHEAD = 2


def _dense_tile(bf16, prefetch=False):
    """An intrinsic tile(out, t_out, c_out, w, n, x, t, R, G) for rows n..n+R-1 of float32 (or
    bfloat16 bits, against bfloat16 tokens) and rows t..t+G-1 of x, over the full chunks: R x G
    sums, each equal to weight_dot_chunks of the pair (the same steps and tree), stored into
    out[t_out + g, c_out + r]. R, G: compile-time constants (vector_ir.tile_shape).
    prefetch: ask for the rows TILES_AHEAD tiles below (rows that stream from memory: decode)."""

    def typer(typingctx, out, t_out, c_out, w, n, x, t, R, G):
        nr, ng = getattr(R, "literal_value", None), getattr(G, "literal_value", None)
        if not nr or not ng:
            return None
        sig = types.void(out, t_out, c_out, w, n, x, t, R, G)

        def codegen(context, builder, signature, args):
            warr = context.make_array(signature.args[3])(context, builder, args[3])
            xarr = context.make_array(signature.args[5])(context, builder, args[5])
            wK, K = builder.extract_value(warr.shape, 1), builder.extract_value(xarr.shape, 1)
            n0, t0 = as_i64(builder, args[4], None), as_i64(builder, args[6], None)
            elem = I16 if bf16 else F32
            rows = [builder.gep(warr.data, [builder.mul(builder.add(n0, I64(r)), wK)], source_etype=elem) for r in range(nr)]
            toks = [builder.gep(xarr.data, [builder.mul(builder.add(t0, I64(g)), K)], source_etype=elem) for g in range(ng)]
            # the same place in the rows TILES_AHEAD tiles below, where this stream of tiles reads
            # next: PREFETCH_BYTES ahead lands inside the tile's own rows when they are short
            ahead = builder.mul(wK, I64(nr * TILES_AHEAD)) if prefetch else None
            if bf16:
                sums = tile_sums(builder, rows, toks, wK, load=load_bf16_chunk, col_load=load_bf16_tokens, term=dpbf16, chunk=BF16_CHUNK,
                                 accs=BF16_ACCS, prefetch_ahead=ahead, pairs=bf16_tile_halves if split_bf16() else None)
            else:
                sums = tile_sums(builder, rows, toks, K, prefetch_ahead=ahead)
            store_sums(context, builder, signature.args[0], args[0], as_i64(builder, args[1], None), as_i64(builder, args[2], None),
                       sums, nr, ng)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(prefer_literal=True)(typer)


tile_dot = _dense_tile(bf16=False)  # float32 rows x float32 tokens
bf16_tile_dot = _dense_tile(bf16=True)  # bfloat16 rows x tokens rounded to bfloat16 (round_bf16_chunks)
streamed_tile_dot = _dense_tile(bf16=False, prefetch=True)  # decode's batches
streamed_bf16_tile_dot = _dense_tile(bf16=True, prefetch=True)


def _int8_tile(prefetch=False):
    """An intrinsic tile(out, t_out, c_out, w, s, n, xq, xs, t, table, R, G): int8 weight rows
    n..n+R-1 (scales s) against rows t..t+G-1 of xq, quantized per block with scales xs
    (quantize_blocks), over the full blocks: R x G sums, each equal to weight_dot_chunks of the
    pair, stored as _dense_tile's. prefetch: as _dense_tile's (decode's batches of 2-15 rows).

    The R x G scale products of a block (weight scale * token scale, as int8_block_term forms
    them) are made first into `table` (float32, R x G per block); the main loop then broadcasts
    them from memory. Formed inside it, they took a quarter of the loop's arithmetic.
    """

    def typer(typingctx, out, t_out, c_out, w, s, n, xq, xs, t, table, R, G):
        nr, ng = getattr(R, "literal_value", None), getattr(G, "literal_value", None)
        if not nr or not ng:
            return None
        sig = types.void(out, t_out, c_out, w, s, n, xq, xs, t, table, R, G)

        def codegen(context, builder, signature, args):
            wty, sty, _, xty, xsty, _, tty = signature.args[3:10]
            warr, sarr = context.make_array(wty)(context, builder, args[3]), context.make_array(sty)(context, builder, args[4])
            xarr, xsarr = context.make_array(xty)(context, builder, args[6]), context.make_array(xsty)(context, builder, args[7])
            ptab = data_ptr(context, builder, tty, args[9], I64(0), F32)
            K, KB = builder.extract_value(warr.shape, 1), builder.extract_value(sarr.shape, 1)
            XB = builder.extract_value(xsarr.shape, 1)
            n0, t0 = as_i64(builder, args[5], None), as_i64(builder, args[8], None)
            wrows = [builder.gep(warr.data, [builder.mul(builder.add(n0, I64(r)), K)], source_etype=ir.IntType(8)) for r in range(nr)]
            srows = [builder.gep(sarr.data, [builder.mul(builder.add(n0, I64(r)), KB)], source_etype=I16) for r in range(nr)]
            xrows = [builder.gep(xarr.data, [builder.mul(builder.add(t0, I64(j)), K)], source_etype=I16) for j in range(ng)]
            xsrows = [builder.gep(xsarr.data, [builder.mul(builder.add(t0, I64(j)), XB)], source_etype=F32) for j in range(ng)]
            per_block = nr * ng

            lanes = lambda ix: ir.Constant(ir.VectorType(I32, per_block), ix)

            def products(blk, _):  # table[R G blk + R j + r] = scale of row r * scale of token j
                # as one vector of R G lanes: the R row scales and G token scales gathered, spread by
                # shuffles, widened and multiplied at once (one at a time cost int8 prefill ~35%)
                ws = ir.Constant(ir.VectorType(I16, nr), [0] * nr)
                for r in range(nr):
                    ws = builder.insert_element(ws, builder.load(builder.gep(srows[r], [blk], source_etype=I16), typ=I16, align=2), I32(r))
                xsv = ir.Constant(ir.VectorType(F32, ng), [0.0] * ng)
                for j in range(ng):
                    xsv = builder.insert_element(xsv, builder.load(builder.gep(xsrows[j], [blk], source_etype=F32), typ=F32, align=4), I32(j))
                ws_all = builder.shuffle_vector(ws, ws, lanes([r for _ in range(ng) for r in range(nr)]))
                xs_all = builder.shuffle_vector(xsv, xsv, lanes([j for j in range(ng) for _ in range(nr)]))
                dst = builder.gep(ptab, [builder.mul(blk, I64(per_block))], source_etype=F32)
                builder.store(builder.fmul(half_to_f32(builder, ws_all), xs_all), builder.bitcast(dst, ir.VectorType(F32, per_block).as_pointer()), align=4)
                return []

            loop(builder, I64(0), builder.sdiv(K, I64(QBLOCK)), 1, [], products)

            def load_row(b, r, i):  # the row's index and position ride along to find the scale
                return int8_values(b, wrows[r], i), r, i

            def load_token(b, j, i):
                return int16_values(b, xrows[j], i), j

            def term(b, acc, wv, xv):
                (w_values, r, i), (x_values, j) = wv, xv
                at = b.add(b.mul(b.sdiv(i, I64(QBLOCK)), I64(per_block)), I64(nr * j + r))
                scale = splat(b, b.load(b.gep(ptab, [at], source_etype=F32), typ=F32, align=4), int8_lanes())
                return int8_pairs_term(b, acc, w_values, x_values, scale)

            ahead = builder.mul(K, I64(nr * TILES_AHEAD)) if prefetch else None
            sums = tile_sums(builder, list(range(nr)), list(range(ng)), K, load=load_row, col_load=load_token, term=term, chunk=QBLOCK,
                             acc_type=int8_acc_type(), prefetch_ahead=ahead, prefetch_rows=wrows)
            store_sums(context, builder, signature.args[0], args[0], as_i64(builder, args[1], None), as_i64(builder, args[2], None), sums, nr, ng)
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(prefer_literal=True)(typer)


int8_tile_dot = _int8_tile()  # prefill's sweep (rows in L1)
streamed_int8_tile_dot = _int8_tile(prefetch=True)  # decode's batches (rows from memory)


def row_dot(w, s, n, x, xo, xs):
    """dot(w[n, :], x) in float32 for any weight precision, in the fixed order of kernels.vector_ir:
    the full chunks from chunk_operand(w, x, xo) (xo, xs: row b of prepare_operand's buffers),
    then the tail of x in sequence."""
    raise NotImplementedError


@overload(row_dot, jit_options={"fastmath": EXACT_MATH})
def _row_dot(w, s, n, x, xo, xs):
    def dot(w, s, n, x, xo, xs):
        K = w.shape[1]
        total = weight_dot_chunks(w, s, n, chunk_operand(w, x, xo), xs)
        for k in range(chunked_len(w, K), K):
            total += weight_at(w, s, n, k) * activation(w, x[k])
        return total

    return dot
