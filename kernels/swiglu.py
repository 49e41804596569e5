import numpy as np
from numba import njit, prange

from .expf import divide, exp_f32
from .jit import EXACT_MATH, kernel


@njit(fastmath=EXACT_MATH, cache=True, inline="always")  # once per element: no call overhead
def silu_mul(g, u):
    """silu(g) * u with silu(g) = g * sigmoid(g), in float32. The divisor 1 + exp(-g) is never 0."""
    return divide(g, np.float32(1.0) + exp_f32(-g)) * u


@kernel(fastmath=EXACT_MATH)
def swiglu(out, gate, up):
    """out = silu(gate) * up.  All (T, I); out may alias gate."""
    T, I = gate.shape
    for t in prange(T):
        for i in range(I):
            out[t, i] = silu_mul(gate[t, i], up[t, i])
