"""Causal grouped-query attention over a KV cache (one layer's slice)."""

import numpy as np
from numba import prange

from ._jit import kernel
from .lanes import EXACT_MATH, total
from .simd import LANES, dot_chunks


@kernel(parallel=False)
def kv_write(k_cache, v_cache, k, v, pos0):
    """Store T new keys/values at positions pos0.. .  caches: (nkv, ctx, hd); k, v: (T, nkv * hd)."""
    nkv, _, hd = k_cache.shape
    for t in range(k.shape[0]):
        for h in range(nkv):
            for d in range(hd):
                k_cache[h, pos0 + t, d] = k[t, h * hd + d]
                v_cache[h, pos0 + t, d] = v[t, h * hd + d]


@kernel(parallel=False, fastmath=EXACT_MATH)
def attend(out, q, keys, values, n_keys, s):
    """One query head: out (hd,) = softmax(keys[:n] q * hd**-0.5) values[:n].

    keys, values: (ctx, hd) of the query's KV head; s: (>= n_keys,) scratch.
    Softmax in float32: exp(s - max) / sum, as torch does.
    """
    hd = q.shape[0]
    scale = np.float32(hd**-0.5)
    m = np.float32(-np.inf)
    full = hd - hd % LANES
    for j in range(n_keys):
        score = dot_chunks(q, 0, keys, j * hd, hd)  # keys: (ctx, hd) contiguous, row j at j * hd
        for d in range(full, hd):
            score += q[d] * keys[j, d]
        score = score * scale
        s[j] = score
        m = max(m, score)
    for j in range(n_keys):
        s[j] = np.exp(s[j] - m)
    norm = total(s, n_keys)
    for d in range(hd):
        out[d] = 0.0
    for j in range(n_keys):
        p = s[j] / norm
        for d in range(hd):
            out[d] += p * values[j, d]


@kernel(fastmath=EXACT_MATH)
def attention(out, q, k_cache, v_cache, pos0, scores):
    """out (T, nh * hd) = causal softmax attention of q (T, nh * hd) over the cache.

    Query t sits at position pos0 + t and sees cache positions 0..pos0 + t. Query head h reads
    KV head h // n_rep (GQA without copying KV heads). scores: (nh, ctx) scratch.
    """
    nkv, _, hd = k_cache.shape
    nh = q.shape[1] // hd
    n_rep = nh // nkv
    for h in prange(nh):
        lo = h * hd
        for t in range(q.shape[0]):
            attend(out[t, lo : lo + hd], q[t, lo : lo + hd], k_cache[h // n_rep], v_cache[h // n_rep], pos0 + t + 1, scores[h])
