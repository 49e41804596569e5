"""Activations prepared for the weights they meet, once per vector rather than once per row:
rounded to bfloat16 bits against bfloat16 weights (round_bf16_chunks), quantized to int16 per block
of 32 against int8 weights (quantize_blocks), split into bytes against blocks regrouped by 16 rows
(quantize_split, for kernels.integer_products), used as they are against float32 (prepare_operand
picks, at compile time, by the weights' dtype).
"""

from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import cfunc, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .bf16_vectors import BF16_CHUNK, round_bf16_chunk, store_bf16_tokens
from .formats import PREPARE_SIGNATURE, Operand
from .jit import EXACT_MATH, address_call, kernel
from .quantize import bf16_bits
from .vector_ir import F32, I16, I32, I32_VEC, I64, LANES, QBLOCK, as_i64, bits_as_f32, data_ptr, loop, quantized_block

ACT_MAX = 32767.0  # int16 activation levels: -ACT_MAX .. ACT_MAX
I8 = ir.IntType(8)
PER_BLOCK = 3  # quantize_split's float32 words per block of 32: the scale, two sums of 16
SPLIT_LEVELS = 32639.0  # 127 * 256 + 127: the largest int16 whose high byte, rounded, is int8
BYTE_LEVELS = 127.0  # int8 activations (Operand.BYTES), as llama.cpp's Q8_0


@intrinsic
def quantize_blocks(typingctx, xq, xs, x, b):
    """Row b of float32 x quantized to int16 per block of QBLOCK, over its full blocks (int8 weights
    meet these in int8_block_term): xs[b, j] = the block's largest magnitude / 32767, xq[b, k] =
    x[b, k] * (32767 / that magnitude), rounded to nearest even (vector_ir.quantized_block). A
    product's error is then at most about 1/65534 of the block's largest value."""
    sig = types.void(xq, xs, x, b)

    def codegen(context, builder, signature, args):
        qty, sty, xty, _ = signature.args
        xarr = context.make_array(xty)(context, builder, args[2])
        K = builder.extract_value(xarr.shape, 1)
        row = as_i64(builder, args[3], None)
        px = builder.gep(xarr.data, [builder.mul(row, K)], source_etype=F32)
        pq = data_ptr(context, builder, qty, args[0], builder.mul(row, K), I16)
        sarr = context.make_array(sty)(context, builder, args[1])
        ps = builder.gep(sarr.data, [builder.mul(row, builder.extract_value(sarr.shape, 1))], source_etype=F32)
        levels = ir.VectorType(I16, LANES)

        def block(i, _):
            scale, halves = quantized_block(builder, px, i, ACT_MAX)
            builder.store(scale, builder.gep(ps, [builder.sdiv(i, I64(QBLOCK))], source_etype=F32))
            for h, q in enumerate(halves):
                dst = builder.gep(pq, [builder.add(i, I64(h * LANES))], source_etype=I16)
                builder.store(builder.fptosi(q, levels), builder.bitcast(dst, levels.as_pointer()), align=2)
            return []

        loop(builder, I64(0), builder.and_(K, I64(-QBLOCK)), QBLOCK, [], block)
        return context.get_dummy_value()

    return sig, codegen


def _quantized_bytes(levels: float):
    """The codegen of an intrinsic (xo, xs, x, b) quantizing row b of x per block of 32 to
    -levels..levels: split into two bytes for SPLIT_LEVELS, one byte for BYTE_LEVELS."""
    split = levels > BYTE_LEVELS

    def codegen(context, b, signature, args):

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
            scale, halves = quantized_block(b, px, i, levels)
            j3 = b.mul(b.sdiv(i, I64(QBLOCK)), I64(PER_BLOCK))
            b.store(scale, b.gep(ps, [j3], source_etype=F32))
            for h, q in enumerate(halves):
                xq = b.fptosi(q, I32_VEC)
                at = b.add(i, I64(h * LANES))
                if split:
                    hi = b.ashr(b.add(xq, ivec(128)), ivec(8))
                    parts = ((plo, b.sub(xq, b.shl(hi, ivec(8)))), (phi, hi))
                else:
                    parts = ((phi, xq),)
                for p, v in parts:
                    b.store(b.trunc(v, bytes16), b.bitcast(b.gep(p, [at], source_etype=I8), bytes16.as_pointer()), align=1)
                total = b.call(sum_fn, [xq])
                b.store(total, b.bitcast(b.gep(ps, [b.add(j3, I64(1 + h))], source_etype=F32), I32.as_pointer()))
            return []

        loop(b, I64(0), b.and_(K, I64(-QBLOCK)), QBLOCK, [], block)
        return context.get_dummy_value()

    return codegen


@intrinsic
def quantize_split(typingctx, xo, xs, x, b):
    """Row b of float32 x (T, K) as grouped layouts' products read it (Operand.SPLIT_BYTES), per
    block j of 32: int16 levels x16 (quantized_block, levels +-32639) split as hi = (x16 + 128) >> 8
    and lo = x16 - 256 hi, both int8; xo[b] (2K bytes: int16 (T, K) reused) holds the K lo bytes,
    then the K hi bytes; xs[b, 3j] the block's float32 scale, xs[b, 3j + 1] and xs[b, 3j + 2] the
    int32 bits of sum(x16) over its first and its second 16 (for the weights' level offsets)."""
    return types.void(xo, xs, x, b), _quantized_bytes(SPLIT_LEVELS)


@intrinsic
def quantize_bytes(typingctx, xo, xs, x, b):
    """Row b of x as quantize_split lays it out, but int8 levels (-127..127, scale = the block's
    largest magnitude / 127, nearest even: llama.cpp's Q8_0 activations) in the hi bytes' place
    and no lo bytes (Operand.BYTES); xs's sums are of those levels."""
    return types.void(xo, xs, x, b), _quantized_bytes(BYTE_LEVELS)


def operand_shapes(T: int, K: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of quantize_split's (xo int16, xs float32) for T vectors of K."""
    return (T, K), (T, PER_BLOCK * (K // QBLOCK))


@intrinsic
def round_bf16_chunks(typingctx, out, x, t):
    """out[t, k] = x[t, k] rounded to bfloat16 bits, over the full 32-element chunks of the row
    (the same rounding as weight_dot_chunks applies to its x on the fly); where split_bf16 holds,
    each chunk in bf16_vectors.TOKEN_ORDER (load_bf16_tokens reads it back)."""
    sig = types.void(out, x, t)

    def codegen(context, builder, signature, args):
        oarr = context.make_array(signature.args[0])(context, builder, args[0])
        xarr = context.make_array(signature.args[1])(context, builder, args[1])
        K = builder.extract_value(xarr.shape, 1)
        row = builder.mul(as_i64(builder, args[2], None), K)
        po = builder.gep(oarr.data, [row], source_etype=I16)
        px = builder.gep(xarr.data, [row], source_etype=F32)

        def body(i, _):
            store_bf16_tokens(builder, round_bf16_chunk(builder, px, i), po, i)
            return []

        loop(builder, I64(0), builder.and_(K, I64(-BF16_CHUNK)), BF16_CHUNK, [], body)
        return context.get_dummy_value()

    return sig, codegen


def activation(w, v):
    """Activation v as products with weights of w's precision see it: rounded to bfloat16 against
    bfloat16 weights, unchanged otherwise."""
    raise NotImplementedError


@overload(activation, jit_options={"fastmath": EXACT_MATH})
def _activation(w, v):
    if w.dtype == types.uint16:
        return lambda w, v: bits_as_f32(np.uint32(bf16_bits(v)) << 16)
    return lambda w, v: v


@kernel()
def quantize_activations(xq, xs, x):
    """Every row of x (T, K) quantized to int16 per block, as int8 weights meet it
    (quantize_blocks): xq (T, K), xs (T, K // QBLOCK)."""
    for b in prange(x.shape[0]):
        quantize_blocks(xq, xs, x, b)


def chunk_operand(w, x, xo):
    """The activations weight_dot_chunks reads against w's rows: xo (prepare_operand's) for
    bfloat16 and int8 weights, x itself for float32 and block formats."""
    raise NotImplementedError


@overload(chunk_operand)
def _chunk_operand(w, x, xo):
    if w.dtype in (types.float32, types.uint8):  # float32 weights and block formats read x itself
        return lambda w, x, xo: x
    return lambda w, x, xo: xo


# ---------------------------------------------------------------- each operand's compiled kernel


@lru_cache(maxsize=None)
def prepare_for(operand: Operand):
    """The compiled kernel preparing activations as `operand` (None for FLOAT32: nothing to do)."""
    return None if operand == Operand.FLOAT32 else make_prepare(operand)


def make_prepare(operand):
    """The compiled kernel (kernels.formats.PREPARE_SIGNATURE) preparing rows r0..r1-1 of x as
    `operand` into xo (16-bit) and xs (block scales)."""
    if operand == Operand.BFLOAT16:

        def prepare(xo, xs, x, r0, r1):
            for r in range(r0, r1):
                round_bf16_chunks(xo, x, r)

    elif operand == Operand.INT16:

        def prepare(xo, xs, x, r0, r1):
            q = xo.view(np.int16)
            for r in range(r0, r1):
                quantize_blocks(q, xs, x, r)

    elif operand == Operand.SPLIT_BYTES:

        def prepare(xo, xs, x, r0, r1):
            for r in range(r0, r1):
                quantize_split(xo, xs, x, r)

    elif operand == Operand.BYTES:

        def prepare(xo, xs, x, r0, r1):
            for r in range(r0, r1):
                quantize_bytes(xo, xs, x, r)

    else:
        raise ValueError(f"nothing to prepare for {operand!r}")
    prepare.__qualname__ = prepare.__name__ = f"prepare_{operand.name.lower()}"
    return cfunc(PREPARE_SIGNATURE, cache=True, fastmath=EXACT_MATH, _nrt=False)(prepare)


call_prepare = address_call(PREPARE_SIGNATURE, "call_prepare")
