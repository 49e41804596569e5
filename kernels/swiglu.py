import numpy as np
from numba import prange

from ._jit import kernel


@kernel()
def swiglu(out, gate, up):
    """out = silu(gate) * up, where silu(g) = g * sigmoid(g).  All (T, I); out may alias gate."""
    T, I = gate.shape
    for t in prange(T):
        for i in range(I):
            g = gate[t, i]
            out[t, i] = g / (np.float32(1.0) + np.exp(-g)) * up[t, i]
