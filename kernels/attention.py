"""Causal grouped-query attention over a KV cache (one layer's slice)."""

import numpy as np
from numba import prange

from ._jit import REDUCE_MATH, kernel


@kernel(parallel=False)
def kv_write(k_cache, v_cache, k, v, pos0):
    """Store T new keys/values at positions pos0.. .  caches: (nkv, ctx, hd); k, v: (T, nkv * hd)."""
    nkv, _, hd = k_cache.shape
    T = k.shape[0]
    for t in range(T):
        for h in range(nkv):
            for d in range(hd):
                k_cache[h, pos0 + t, d] = k[t, h * hd + d]
                v_cache[h, pos0 + t, d] = v[t, h * hd + d]


@kernel(fastmath=REDUCE_MATH)
def attention(out, q, k_cache, v_cache, pos0, scores):
    """out (T, nh * hd) = softmax(q k^T * hd**-0.5 + causal mask) v, per query head.

    Query t sits at position pos0 + t and sees cache positions 0..pos0 + t. Query head h reads
    KV head h // n_rep (GQA without copying KV heads). scores: (nh, ctx) scratch.
    Softmax in float32: exp(s - max) / sum, as torch does.
    """
    nkv, ctx, hd = k_cache.shape
    T = q.shape[0]
    nh = q.shape[1] // hd
    n_rep = nh // nkv
    scale = np.float32(hd ** -0.5)
    for h in prange(nh):
        kvh = h // n_rep
        s = scores[h]
        q0 = h * hd
        for t in range(T):
            n_keys = pos0 + t + 1
            m = np.float32(-np.inf)
            for j in range(n_keys):
                acc = np.float32(0.0)
                for d in range(hd):
                    acc += q[t, q0 + d] * k_cache[kvh, j, d]
                acc = acc * scale
                s[j] = acc
                m = max(m, acc)
            total = np.float32(0.0)
            for j in range(n_keys):
                e = np.exp(s[j] - m)
                s[j] = e
                total += e
            for d in range(hd):
                out[t, q0 + d] = 0.0
            for j in range(n_keys):
                p = s[j] / total
                for d in range(hd):
                    out[t, q0 + d] += p * v_cache[kvh, j, d]
