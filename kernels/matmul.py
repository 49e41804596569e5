"""Linear layers with weights in HF's (out, in) layout: y = x @ W.T, a dot product per output row."""

import numpy as np
from numba import prange

from ._jit import REDUCE_MATH, kernel

ROWS_PER_BLOCK = 16  # weight rows a thread keeps hot in cache while it walks all tokens


@kernel(fastmath=REDUCE_MATH)
def matvec(out, x, w):
    """One token: W (N, K) @ x (K,) -> out (N,). Parallel over output rows."""
    N, K = w.shape
    for n in prange(N):
        acc = np.float32(0.0)
        for k in range(K):
            acc += w[n, k] * x[k]
        out[n] = acc


@kernel(fastmath=REDUCE_MATH)
def matmul(out, x, w):
    """Many tokens: x (T, K) @ W (N, K).T -> out (T, N).

    Blocks of weight rows are spread over threads; each block is reused for every token while it
    sits in cache, so the weights are streamed from memory once per call.
    """
    T, K = x.shape
    N = w.shape[0]
    n_blocks = (N + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK
    for b in prange(n_blocks):
        n0 = b * ROWS_PER_BLOCK
        n1 = min(N, n0 + ROWS_PER_BLOCK)
        for t in range(T):
            for n in range(n0, n1):
                acc = np.float32(0.0)
                for k in range(K):
                    acc += w[n, k] * x[t, k]
                out[t, n] = acc


@kernel(parallel=False)
def add_bias(out, b):
    """out[t] += b.  out: (T, N); b: (N,)."""
    T, N = out.shape
    for t in range(T):
        for n in range(N):
            out[t, n] += b[n]
