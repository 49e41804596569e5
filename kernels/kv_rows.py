"""Rows of the KV cache in their stored format (kernels.formats.KV_FORMATS): written from float32
as each key and value is made, widened back to float32 in registers as attention reads them.

The format is the array's dtype, so Numba compiles attention once per format in use:

    float32   float32 values
    int16     float16 bits (nearest-even)
    uint16    bfloat16 bits (nearest-even)
    uint8     Q8_0 blocks of 32 values: a float16 scale d, then 32 int8 levels q (value = d q)

Every widening is exact (a float16 or bfloat16 value, or d q, is a float32), so attention's float32
sums over the widened values are the same bits whichever path reads them: decode == prefill.
"""

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from .quantize import QBLOCK, bf16_bits, f16_bits, quantize_q8_0_block
from .vector_ir import F32, I16, I32, I32_VEC, I64, LANES, VEC, f16_splat, half_to_f32, load_f32

I8 = ir.IntType(8)
Q8_0_BLOCK_BYTES = 34


def element_type(dtype):
    """The LLVM element of a KV array of this Numba dtype (what its offsets count)."""
    return {types.float32: F32, types.int16: I16, types.uint16: I16, types.uint8: I8}[dtype]


def load_kv_chunk(builder, dtype, row, col):
    """16 stored values of a KV row as float32, from column col (a multiple of 16): row points at
    the row's first element."""
    if dtype == types.float32:
        return load_f32(builder, row, col)
    if dtype in (types.int16, types.uint16):
        bits = builder.load(builder.gep(row, [col], source_etype=I16), typ=ir.VectorType(I16, LANES), align=2)
        if dtype == types.int16:
            return half_to_f32(builder, bits)
        return builder.bitcast(builder.shl(builder.zext(bits, I32_VEC), ir.Constant(I32_VEC, [16] * LANES)), VEC)
    block, levels = _q8_0_at(builder, row, col)
    scale = f16_splat(builder, builder.bitcast(block, I16.as_pointer()), I64(0))  # rows and blocks start on even bytes
    q = builder.load(builder.bitcast(levels, ir.VectorType(I8, LANES).as_pointer()), typ=ir.VectorType(I8, LANES), align=1)
    return builder.fmul(scale, builder.sitofp(q, VEC))


def load_kv_value(builder, dtype, row, col):
    """One stored value of a KV row as float32, column col."""
    if dtype == types.float32:
        return builder.load(builder.gep(row, [col], source_etype=F32), typ=F32, align=4)
    if dtype in (types.int16, types.uint16):
        bits = builder.load(builder.gep(row, [col], source_etype=I16), typ=I16, align=2)
        if dtype == types.int16:
            return half_to_f32(builder, bits)
        return builder.bitcast(builder.shl(builder.zext(bits, I32), I32(16)), F32)
    block, levels = _q8_0_at(builder, row, col)
    scale = half_to_f32(builder, builder.load(builder.bitcast(block, I16.as_pointer()), typ=I16, align=1))
    return builder.fmul(scale, builder.sitofp(builder.load(levels, typ=I8), F32))


def _q8_0_at(builder, row, col):
    """(the Q8_0 block holding column col of a row: its float16 scale first, the level of col)."""
    block = builder.gep(row, [builder.mul(builder.lshr(col, I64(5)), I64(Q8_0_BLOCK_BYTES))], source_etype=I8)
    return block, builder.gep(block, [builder.add(builder.and_(col, I64(QBLOCK - 1)), I64(2))], source_etype=I8)


@intrinsic
def kv_at(typingctx, a, row_off, col):
    """Value col of the stored KV row starting at element row_off of array a, as float32."""
    sig = types.float32(a, row_off, col)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        dtype = signature.args[0].dtype
        row = builder.gep(data, [_i64(builder, args[1])], source_etype=element_type(dtype))
        return load_kv_value(builder, dtype, row, _i64(builder, args[2]))

    return sig, codegen


def _i64(builder, value):
    return builder.sext(value, I64) if value.type.width < 64 else value


def head_dim_of(rows):
    """The values per stored KV row of a 2-D array of rows (its columns, but for Q8_0's blocks)."""
    raise NotImplementedError


@overload(head_dim_of)
def _head_dim_of(rows):
    if rows.dtype == types.uint8:
        return lambda rows: rows.shape[1] // Q8_0_BLOCK_BYTES * QBLOCK
    return lambda rows: rows.shape[1]


def kv_store(out, x):
    """Store float32 values x (hd,) as one KV row `out` in its format (out's dtype)."""
    raise NotImplementedError


@overload(kv_store)
def _kv_store(out, x):
    if out.dtype == types.float32:
        def store(out, x):
            for d in range(x.shape[0]):
                out[d] = x[d]
    elif out.dtype == types.int16:
        def store(out, x):
            for d in range(x.shape[0]):
                out[d] = np.int16(f16_bits(x[d]))
    elif out.dtype == types.uint16:
        def store(out, x):
            for d in range(x.shape[0]):
                out[d] = bf16_bits(x[d])
    elif out.dtype == types.uint8:
        def store(out, x):
            for blk in range(x.shape[0] // QBLOCK):
                quantize_q8_0_block(out, blk * Q8_0_BLOCK_BYTES, x, blk * QBLOCK)
    else:
        return None
    return store

