import numpy as np
from numba import prange

from ._jit import REDUCE_MATH, kernel


@kernel(fastmath=REDUCE_MATH)
def rmsnorm(out, x, w, eps):
    """out[t] = x[t] / sqrt(mean(x[t]**2) + eps) * w, in float32.  x, out: (T, H); w: (H,)."""
    T, H = x.shape
    eps32 = np.float32(eps)
    for t in prange(T):
        ss = np.float32(0.0)
        for i in range(H):
            ss += x[t, i] * x[t, i]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(H) + eps32)
        for i in range(H):
            out[t, i] = (x[t, i] * inv) * w[i]
