"""Activations prepared for the weights they meet, once per vector rather than once per row:
rounded to bfloat16 bits against bfloat16 weights (round_bf16_chunks), quantized to int16 per block
of 32 against int8 weights (quantize_blocks), used as they are against float32 (prepare_operand
picks, at compile time, by the weights' dtype).
"""

from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import cfunc, prange, types
from numba.extending import intrinsic, overload

from .formats import PREPARE_SIGNATURE, Operand
from .integer_products import quantize_split
from .jit import EXACT_MATH, address_call, kernel
from .quantize import bf16_bits
from .vector_ir import (
    BF16_CHUNK,
    F32,
    I16,
    I64,
    LANES,
    QBLOCK,
    as_i64,
    bits_as_f32,
    data_ptr,
    loop,
    quantized_block,
    round_bf16_chunk,
)

ACT_MAX = 32767.0  # int16 activation levels: -ACT_MAX .. ACT_MAX


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


@intrinsic
def round_bf16_chunks(typingctx, out, x, t):
    """out[t, k] = x[t, k] rounded to bfloat16 bits, over the full 32-element chunks of the row
    (the same rounding as weight_dot_chunks applies to its x on the fly)."""
    sig = types.void(out, x, t)

    def codegen(context, builder, signature, args):
        oarr = context.make_array(signature.args[0])(context, builder, args[0])
        xarr = context.make_array(signature.args[1])(context, builder, args[1])
        K = builder.extract_value(xarr.shape, 1)
        row = builder.mul(as_i64(builder, args[2], None), K)
        po = builder.gep(oarr.data, [row], source_etype=I16)
        px = builder.gep(xarr.data, [row], source_etype=F32)

        def body(i, _):
            chunk = round_bf16_chunk(builder, px, i)
            dst = builder.bitcast(builder.gep(po, [i], source_etype=I16), chunk.type.as_pointer())
            builder.store(chunk, dst, align=2)
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

    else:
        raise ValueError(f"nothing to prepare for {operand!r}")
    prepare.__qualname__ = prepare.__name__ = f"prepare_{operand.name.lower()}"
    return cfunc(PREPARE_SIGNATURE, cache=True, fastmath=EXACT_MATH, _nrt=False)(prepare)


call_prepare = address_call(PREPARE_SIGNATURE, "call_prepare")
