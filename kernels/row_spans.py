"""The work of a step on a span of rows (kernels.steps hands each thread its span): the norms,
q/k/v's biases, norms, RoPE and KV writes, the residual add, the MLP's gate; and attention's tasks,
dealt from the rows of a step.
"""

import numpy as np
from numba import njit

from .attention import QUERIES_PER_TASK
from .jit import EXACT_MATH
from .kv_rows import kv_store
from .rmsnorm import norm_row, rmsnorm_row
from .rope import rope_row
from .swiglu import gated_row


@njit(cache=True, _nrt=False)
def attention_tasks(tasks, positions, slots, T, nh, nkv, threads):
    """The attention tasks of the rows into tasks[:n] (first row, end row, first head, end head);
    returns n. A run of rows of one slot at consecutive positions (a prefill chunk) is tasks of
    4 queries of one head, scores in 4 x 4 tiles (each key loaded once for 4 queries); a lone row
    (decode) is tasks of one KV head with its query heads (attend: each key and value read once
    for all of them), split in parts until the tasks divide evenly among the threads (one
    sequence of the default model is 3 KV heads: in 2 parts, 6 tasks of 1 or 2 heads go 4 + 5
    heads on two threads rather than 2 + 1)."""
    n_rep = nh // nkv
    lone = 0
    r = 0
    while r < T:
        e = _run_end(positions, slots, T, r)
        lone += e - r == 1
        r = e
    parts = 1
    while parts < n_rep and (lone * nkv * parts) % threads != 0:
        parts += 1
    n = 0
    r = 0
    while r < T:
        e = _run_end(positions, slots, T, r)
        if e - r == 1:
            for kv in range(nkv):
                for p in range(parts):
                    tasks[n, 0], tasks[n, 1] = r, r + 1
                    tasks[n, 2], tasks[n, 3] = kv * n_rep + n_rep * p // parts, kv * n_rep + n_rep * (p + 1) // parts
                    n += 1
        else:
            for h in range(nh):
                for q0 in range(r, e, QUERIES_PER_TASK):
                    tasks[n, 0], tasks[n, 1], tasks[n, 2], tasks[n, 3] = q0, min(e, q0 + QUERIES_PER_TASK), h, h + 1
                    n += 1
        r = e
    return n


@njit(cache=True, _nrt=False)
def _run_end(positions, slots, T, r):
    """The end of the run of rows from r: one slot, consecutive positions."""
    e = r + 1
    while e < T and slots[e] == slots[r] and positions[e] == positions[e - 1] + 1:
        e += 1
    return e


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def norm_span(r0, r1, out, x, norm, l, eps, centered):
    """out[t] = rmsnorm(x[t]) (layernorm when centered) with layer l's weights, or a copy of x[t]
    where the layer has no norm at that place (norm is (L, 0))."""
    for t in range(r0, r1):
        if norm.shape[1] > 0:
            norm_row(out[t], x[t], norm[l], eps, centered)
        else:
            for n in range(x.shape[1]):
                out[t, n] = x[t, n]


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def qkv_span(r0, r1, qkv, bias, q_norm, k_norm, l, eps, table, cos, sin, positions, slots, k_pool, v_pool, q_dim, hd, w):
    """Each row's q | k | v: + bias, q/k norm (per head or over the projection; with
    w.qk_norm_rope_only on RoPE layers only), RoPE at its position (table -1: none), Llama 4's
    temperature on the queries of layers without RoPE (w.temperature_floor > 0); then its key and
    value into its slot of layer l's cache, in the pools' KV format."""
    normed = not w.qk_norm_rope_only or table >= 0
    tuned = w.temperature_floor > 0 and table < 0
    nkv = k_pool.shape[2]
    kv_dim = nkv * hd
    for t in range(r0, r1):
        if bias.shape[1] > 0:
            for r in range(q_dim + 2 * kv_dim):
                qkv[t, r] += bias[l, r]
        q = qkv[t, :q_dim]
        k = qkv[t, q_dim : q_dim + kv_dim]
        v = qkv[t, q_dim + kv_dim :]
        if normed:  # (Llama 4's norm follows RoPE: a norm without weights over a head commutes with it)
            _norm_groups(q, q_norm, l, eps)
            _norm_groups(k, k_norm, l, eps)
        pos = positions[t]
        if table >= 0:
            rope_row(q, cos[table], sin[table], pos, hd)
            rope_row(k, cos[table], sin[table], pos, hd)
        if tuned:  # transformers' float32 log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1
            scale = np.float32(np.log1p(np.floor((np.float32(pos) + np.float32(1)) / w.temperature_floor))) * w.temperature_scale + np.float32(1)
            for i in range(q_dim):
                q[i] *= scale
        for h in range(nkv):
            kv_store(k_pool[slots[t], l, h, pos], k[h * hd : (h + 1) * hd])
            kv_store(v_pool[slots[t], l, h, pos], v[h * hd : (h + 1) * hd])


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _norm_groups(x, norm, l, eps):
    """RMSNorm of x in place, group by group of norm's width (a head, or the whole projection:
    the q/k norm of Qwen3, Gemma 3 and OLMo 2); nothing when norm is (L, 0)."""
    n = norm.shape[1]
    if n > 0:
        for g in range(x.shape[0] // n):
            rmsnorm_row(x[g * n : (g + 1) * n], x[g * n : (g + 1) * n], norm[l], eps)


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def residual_span(r0, r1, x, proj, bias, norm, l, eps, scale):
    """x[t] += norm(proj[t] + bias) * scale: layer l's bias row and output norm, each where the
    model has one ((L, 0) otherwise); scale 1 but in Granite."""
    for t in range(r0, r1):
        if bias.shape[1] > 0:
            for n in range(x.shape[1]):
                proj[t, n] += bias[l, n]
        if norm.shape[1] > 0:
            rmsnorm_row(proj[t], proj[t], norm[l], eps)
        if scale != 1:
            for n in range(x.shape[1]):
                proj[t, n] *= scale
        for n in range(x.shape[1]):
            x[t, n] += proj[t, n]


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def gate_span(r0, r1, gate, up, bias, l, gelu):
    """gate[t] = act(gate[t] + bias) * (up[t] + bias), bias being layer l's (gate | up) row when
    the model has biases, act SiLU or (gelu) GELU-tanh. The loop vectorises (vector_math.divide):
    as a scalar loop SiLU took ~4% of an int8 step."""
    I = gate.shape[1]
    for t in range(r0, r1):
        if bias.shape[1] > 0:
            for n in range(I):
                gate[t, n] += bias[l, n]
                up[t, n] += bias[l, I + n]
        gated_row(gate[t], up[t], gelu)
