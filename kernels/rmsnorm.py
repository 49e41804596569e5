import numpy as np
from numba import njit, prange

from .float_sums import dot, total
from .jit import EXACT_MATH, kernel


@kernel(parallel=False, fastmath=EXACT_MATH, refcounts=False)
def rmsnorm_row(out, x, w, eps):
    """out = x / sqrt(mean(x**2) + eps) * w, in float32.  out, x, w: (H,)."""
    H = x.shape[0]
    inv = np.float32(1.0) / np.sqrt(dot(x, x) / np.float32(H) + np.float32(eps))
    for i in range(H):
        out[i] = (x[i] * inv) * w[i]


@kernel(fastmath=EXACT_MATH)
def rmsnorm(out, x, w, eps):
    """Row-wise RMSNorm.  x, out: (T, H); w: (H,)."""
    for t in prange(x.shape[0]):
        rmsnorm_row(out[t], x[t], w, eps)


@kernel(parallel=False, fastmath=EXACT_MATH, refcounts=False)
def layernorm_row(out, x, w, eps):
    """out = (x - mean(x)) / sqrt(var(x) + eps) * w, in float32, without a bias (Cohere's
    LayerNorm).  out, x, w: (H,); out may not be x."""
    H = x.shape[0]
    mean = total(x, H) / np.float32(H)
    for i in range(H):
        out[i] = x[i] - mean
    inv = np.float32(1.0) / np.sqrt(dot(out, out) / np.float32(H) + np.float32(eps))
    for i in range(H):
        out[i] = (out[i] * inv) * w[i]


@njit(inline="always", _nrt=False)
def norm_row(out, x, w, eps, centered):
    """RMSNorm, or LayerNorm without a bias where the model's norms are centered."""
    if centered:
        layernorm_row(out, x, w, eps)
    else:
        rmsnorm_row(out, x, w, eps)
