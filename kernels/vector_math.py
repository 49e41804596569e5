"""float32 exp as plain arithmetic, so loops over it vectorise (softmax, SiLU).

Numba lowers np.exp to a libm call per element, which LLVM cannot vectorise without a vector
math library; at 512 tokens softmax alone made that a third of prefill. This is Cephes' expf
(range reduction by ln 2 split in two, a degree-6 polynomial, scaling by 2^n), within 2 ulp of
the exact value (tests/test_kernels.py), as torch's own vectorised exp is within 1. Every step
is an explicit fused multiply-add, so a vector lane and a scalar call give the same bits and
prefill, decode and batched decode stay bit-identical.
"""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .jit import EXACT_MATH
from .vector_ir import bits_as_f32

_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)  # ln 2 = hi + lo; hi has few bits, so n * hi is exact
_LN2_LO = np.float32(-2.12194440e-4)
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)
_MAX = np.float32(88.72283935546875)  # above: +inf
_MIN = np.float32(-103.97208404541016)  # below: 0 (the subnormals end here)


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c rounded once (llvm.fma.f32; vectorises)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = context.get_value_type(types.float32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, f32, f32]), "llvm.fma.f32")
        return builder.call(fn, args)

    return sig, codegen


@intrinsic
def divide(typingctx, a, b):
    """a / b in float32, IEEE (the same bits as `/`) but without Numba's zero-divisor check, whose
    branch keeps a loop scalar: SiLU over 1536 elements took 6.6 us, 0.45 vectorised. For divisors
    that are never 0."""
    sig = types.float32(types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.fdiv(args[0], args[1])

    return sig, codegen


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _pow2(n):
    """2.0**n as float32 for integer n in [-126, 127], by building the exponent bits."""
    return bits_as_f32(np.uint32(n + 127) << np.uint32(23))


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def exp_f32(x):
    """e**x in float32; +inf above 88.72, 0 below -103.97, NaN stays NaN."""
    xc = min(max(x, _MIN), _MAX)  # keeps the integer conversion defined; results fixed below
    n = np.rint(xc * _LOG2E)
    r = fma(n, -_LN2_HI, xc)
    r = fma(n, -_LN2_LO, r)
    p = fma(_P0, r, _P1)
    p = fma(p, r, _P2)
    p = fma(p, r, _P3)
    p = fma(p, r, _P4)
    p = fma(p, r, _P5)
    y = fma(p, r * r, r) + np.float32(1.0)
    # 2^n as two factors, so that n = 128 (overflow to inf) and n < -126 (subnormals) come out right
    k = np.int32(n)
    half = k >> 1
    y = y * _pow2(half) * _pow2(k - half)
    if x > _MAX:
        y = np.float32(np.inf)
    if x < _MIN:
        y = np.float32(0.0)
    if x != x:
        y = x
    return y


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def tanh_f32(x):
    """tanh(x) in float32 as 1 - 2 / (e^(2x) + 1), through exp_f32 so loops over it vectorise:
    -1 and 1 exactly far out, an absolute error of a few float32 ulps of 1 near 0."""
    return np.float32(1.0) - divide(np.float32(2.0), exp_f32(np.float32(2.0) * x) + np.float32(1.0))
