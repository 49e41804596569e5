"""Fixed-order float32 sums over 1-D arrays: the full 16-lane chunks in LLVM IR (kernels.simd),
then the tail in sequence. Used by RMSNorm and attention; weight rows use quant.row_dot, which
follows the same order."""

from numba import njit

from .simd import LANES, dot_chunks, sum_chunks

EXACT_MATH = {"contract"}  # fused multiply-add allowed, reordering not


@njit(fastmath=EXACT_MATH, cache=True, inline="always")
def dot(a, b):
    """sum(a * b) over two 1-D float32 arrays of equal length."""
    n = a.shape[0]
    result = dot_chunks(a, 0, b, 0, n)
    for k in range(n - n % LANES, n):
        result += a[k] * b[k]
    return result


@njit(fastmath=EXACT_MATH, cache=True, inline="always")
def total(a, n):
    """sum(a[:n]) of a 1-D float32 array."""
    result = sum_chunks(a, n)
    for k in range(n - n % LANES, n):
        result += a[k]
    return result
