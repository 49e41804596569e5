"""Causal grouped-query attention over a KV cache (one layer's slice)."""

import numpy as np
from numba import get_thread_id, njit, prange

from .float_sums import (
    LANES,
    VALUE_HEADS,
    dot_4x4_into,
    dot_chunks,
    dot_rows16,
    max_chunks,
    total,
    weighted_rows_1,
    weighted_rows_2,
    weighted_rows_3,
)
from .jit import EXACT_MATH, kernel
from .kv_rows import head_dim_of, kv_at, kv_store
from .vector_math import divide, exp_f32, tanh_f32


@kernel(parallel=False, refcounts=False)
def kv_write(k_cache, v_cache, k, v, pos0):
    """Store T new keys/values at positions pos0.. in the caches' KV format (kernels.kv_rows).
    caches: (nkv, ctx, stored row); k, v: (T, nkv * hd) float32."""
    nkv = k_cache.shape[0]
    hd = head_dim_of(k_cache[0])
    for t in range(k.shape[0]):
        for h in range(nkv):
            kv_store(k_cache[h, pos0 + t], k[t, h * hd : (h + 1) * hd])
            kv_store(v_cache[h, pos0 + t], v[t, h * hd : (h + 1) * hd])


@kernel(parallel=False, fastmath=EXACT_MATH, refcounts=False)
def attend(out, q, keys, values, n_keys, s, scale, softcap, sinks):
    """R query heads that share one KV head (GQA), one query each: out, q (R * hd,) the heads side
    by side; per head, softmax(cap(keys[:n] q * scale)) values[:n], cap(z) = softcap * tanh(z /
    softcap) when softcap > 0 (Gemma 2), z otherwise. sinks: (R,) each head's sink logit, a term
    of the softmax's denominator that weighs no value (gpt-oss), or None (compiled without them).

    keys, values: (>= n_keys, stored row) of the KV head in its KV format (kernels.kv_rows), from
    the first key the queries see; s (R, >= n_keys) scratch, a row per head. Scores come 16 keys at a time (one shared reduction). Each
    head's output is the same, bit for bit, whatever R is, and each key and value row is read
    once for all R heads. A head at a time, the first read them from memory and the others from
    L2 while memory waited (docs/performance.md, "The measurements behind the kernels").
    """
    R = s.shape[0]
    hd = q.shape[0] // R
    stride = keys.shape[1]
    j = 0
    while j + LANES <= n_keys:  # 16 keys, then every head's scores for them (the keys in L1)
        for r in range(R):
            dot_rows16(s[r], j, q, r * hd, keys, j * stride, stride, hd)
        j += LANES
    for r in range(R):
        for jj in range(j, n_keys):
            s[r, jj] = dot_chunks(q, r * hd, keys, jj * stride, hd)
        _probabilities(s[r], q[r * hd : (r + 1) * hd], keys, n_keys, scale, softcap, sinks, r)
    p_stride = s.strides[0] // s.itemsize
    r = 0
    while r < R:  # VALUE_HEADS heads per pass over the values
        left = R - r
        if left >= 3:
            weighted_rows_3(out, r * hd, hd, s, r * p_stride, p_stride, values, 0, n_keys, stride, hd)
        elif left == 2:
            weighted_rows_2(out, r * hd, hd, s, r * p_stride, p_stride, values, 0, n_keys, stride, hd)
        else:
            weighted_rows_1(out, r * hd, hd, s, r * p_stride, p_stride, values, 0, n_keys, stride, hd)
        r += min(left, VALUE_HEADS)
    for r in range(R):
        _tail_columns(out[r * hd : (r + 1) * hd], s[r], values, n_keys)


@kernel(parallel=False, fastmath=EXACT_MATH, refcounts=False)
def _softmax_values(out, s, q, keys, values, n_keys, scale, softcap, sinks, h):
    """The rest of one head's attend once s[:n_keys] holds the scores' full-chunk sums: the
    probabilities (_probabilities), then the weighted values."""
    _probabilities(s, q, keys, n_keys, scale, softcap, sinks, h)
    weighted_rows_1(out, 0, 0, s, 0, 0, values, 0, n_keys, values.shape[1], q.shape[0])  # values: (ctx, row) contiguous
    _tail_columns(out, s, values, n_keys)


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _probabilities(s, q, keys, n_keys, scale, softcap, sinks, h):
    """s[:n_keys], the scores' full-chunk sums, into probabilities: their hd % 16 tails, the scale
    (and soft cap), softmax in float32 (exp(s - max) / sum, as torch does), with sinks[h] as one
    more logit when there are sinks (gpt-oss: in the max and the sum, weighing no value). The
    exp is plain arithmetic (kernels.vector_math), so those loops vectorise."""
    hd = q.shape[0]
    full = hd - hd % LANES
    if full < hd:
        for j in range(n_keys):
            for d in range(full, hd):
                s[j] += q[d] * kv_at(keys, j * keys.shape[1], d)
    scale32, cap32 = np.float32(scale), np.float32(softcap)  # float32 products, as torch's
    for j in range(n_keys):
        s[j] = s[j] * scale32
    if cap32 > 0:
        for j in range(n_keys):
            s[j] = tanh_f32(divide(s[j], cap32)) * cap32
    m = max_chunks(s, n_keys)  # in vectors: a running max is a serial chain
    for j in range(n_keys - n_keys % LANES, n_keys):
        m = max(m, s[j])
    if sinks is not None:
        m = max(m, sinks[h])
    for j in range(n_keys):
        s[j] = exp_f32(s[j] - m)
    norm = total(s, n_keys)
    if sinks is not None:
        norm += exp_f32(sinks[h] - m)
    for j in range(n_keys):
        s[j] = divide(s[j], norm)  # norm >= 1: the max's own term is exp(0)


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _tail_columns(out, p, values, n_keys):
    """out[d] for the hd % 16 columns the weighted rows leave, in their order: even keys, odd
    keys, then their sum."""
    hd = out.shape[0]
    for d in range(hd - hd % LANES, hd):
        even = np.float32(0.0)
        odd = np.float32(0.0)
        for j in range(0, n_keys - 1, 2):
            even += p[j] * kv_at(values, j * values.shape[1], d)
            odd += p[j + 1] * kv_at(values, (j + 1) * values.shape[1], d)
        if n_keys % 2 == 1:
            even += p[n_keys - 1] * kv_at(values, (n_keys - 1) * values.shape[1], d)
        out[d] = even + odd


QUERIES_PER_TASK = 4


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def attend_queries(out, q, r0, nq, h, keys, values, pos0, window, scores, row0, scale, softcap, sinks):
    """Up to 4 consecutive queries of head h, rows r0..r0+nq-1 of q (their head h at columns
    h hd..(h + 1) hd), at positions pos0.., into the same rows and columns of out: a prefill
    attention task. Their scores come from 4 x 4 register tiles, so each key is loaded once for
    four queries; scores rows row0.. are this task's scratch. Every score, and so every output,
    equals what attend gives one query alone (the decode path), bit for bit. sinks: (nh,) or None."""
    hd = head_dim_of(keys)
    row = keys.shape[1]
    ctx = scores.shape[1]
    stride = q.shape[1]
    lo = h * hd
    j = first_key(pos0, window) // 4 * 4  # scores before a query's first key go unused
    if nq == QUERIES_PER_TASK:
        while j + 4 <= pos0 + QUERIES_PER_TASK:
            dot_4x4_into(scores, row0 * ctx + j, ctx, q, r0 * stride + lo, stride, keys, j * row, row, hd)
            j += 4
    for i in range(nq):
        for jj in range(j, pos0 + i + 1):
            scores[row0 + i, jj] = dot_chunks(q, (r0 + i) * stride + lo, keys, jj * row, hd)
    for i in range(nq):
        j0 = first_key(pos0 + i, window)
        _softmax_values(out[r0 + i, lo : lo + hd], scores[row0 + i, j0:], q[r0 + i, lo : lo + hd], keys[j0:], values[j0:],
                        pos0 + i + 1 - j0, scale, softcap, sinks, h)


@kernel(fastmath=EXACT_MATH)
def attention(out, q, k_cache, v_cache, pos0, scores, window, scale, softcap, sinks):
    """out (T, nh * hd) = causal softmax attention of q (T, nh * hd) over one sequence's cache,
    the forward pass's prefill tasks (attend_queries) on their own.

    Query t sits at position p = pos0 + t and sees cache positions 0..p, or with a sliding
    window (window > 0) the last `window` of them, p - window + 1..p. Query head h reads
    KV head h // n_rep (GQA without copying KV heads). scores: (4 * threads, ctx) scratch, four
    rows per thread. sinks: (nh,) each head's sink logit (gpt-oss), or None.
    """
    nkv = k_cache.shape[0]
    hd = head_dim_of(k_cache[0])
    T = q.shape[0]
    nh = q.shape[1] // hd
    n_rep = nh // nkv
    n_blocks = (T + QUERIES_PER_TASK - 1) // QUERIES_PER_TASK
    for task in prange(nh * n_blocks):
        h = task // n_blocks
        t0 = (task % n_blocks) * QUERIES_PER_TASK
        attend_queries(out, q, t0, min(QUERIES_PER_TASK, T - t0), h, k_cache[h // n_rep], v_cache[h // n_rep], pos0 + t0, window,
                       scores, get_thread_id() * QUERIES_PER_TASK, scale, softcap, sinks)


@njit(cache=True, _nrt=False)
def first_key(position, window):
    """The first cache position a query at `position` attends to: 0, or with a sliding window
    the oldest of its last `window` positions (transformers: key > query - window); a negative
    window is chunked attention (Llama 4): the first position of its chunk of -window."""
    if window > 0:
        return max(0, position - window + 1)
    if window < 0:
        return position // -window * -window
    return 0
