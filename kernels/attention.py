"""Causal grouped-query attention over a KV cache (one layer's slice)."""

import numpy as np
from numba import get_thread_id, prange

from ._jit import kernel
from .lanes import EXACT_MATH, total
from .expf import exp_f32
from .simd import LANES, dot_chunks, dot_rows16, weighted_rows


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
    Softmax in float32: exp(s - max) / sum, as torch does. Scores come 16 keys at a time (one
    shared reduction); the exp is plain arithmetic (kernels.expf), so those loops vectorise.
    """
    hd = q.shape[0]
    scale = np.float32(hd**-0.5)
    full = hd - hd % LANES
    j = 0
    while j + LANES <= n_keys:
        dot_rows16(s, j, q, 0, keys, j * hd, hd, hd)  # keys: (ctx, hd) contiguous, row j at j * hd
        j += LANES
    for j in range(j, n_keys):
        s[j] = dot_chunks(q, 0, keys, j * hd, hd)
    m = np.float32(-np.inf)
    for j in range(n_keys):
        score = s[j]
        for d in range(full, hd):
            score += q[d] * keys[j, d]
        score = score * scale
        s[j] = score
        m = max(m, score)
    for j in range(n_keys):
        s[j] = exp_f32(s[j] - m)
    norm = total(s, n_keys)
    for j in range(n_keys):
        s[j] = s[j] / norm
    weighted_rows(out, s, values, 0, n_keys, hd)  # values: (ctx, hd) contiguous
    for d in range(full, hd):  # the same order: even keys, odd keys, then their sum
        even = np.float32(0.0)
        odd = np.float32(0.0)
        for j in range(0, n_keys - 1, 2):
            even += s[j] * values[j, d]
            odd += s[j + 1] * values[j + 1, d]
        if n_keys % 2 == 1:
            even += s[n_keys - 1] * values[n_keys - 1, d]
        out[d] = even + odd


@kernel(fastmath=EXACT_MATH)
def attention(out, q, k_cache, v_cache, pos0, scores):
    """out (T, nh * hd) = causal softmax attention of q (T, nh * hd) over the cache.

    Query t sits at position pos0 + t and sees cache positions 0..pos0 + t. Query head h reads
    KV head h // n_rep (GQA without copying KV heads). scores: (>= threads, ctx) scratch, one row
    per thread.
    """
    nkv, _, hd = k_cache.shape
    T = q.shape[0]
    nh = q.shape[1] // hd
    n_rep = nh // nkv
    # One task per (head, query); every head costs the same, so an even split balances threads
    for task in prange(nh * T):
        h = task // T
        t = task % T
        lo = h * hd
        attend(out[t, lo : lo + hd], q[t, lo : lo + hd], k_cache[h // n_rep], v_cache[h // n_rep], pos0 + t + 1, scores[get_thread_id()])
