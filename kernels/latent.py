"""Multi-head latent attention (DeepSeek-V2/V3; minillm.architectures.deepseek): one step of the
forward pass, compiled only for a model that has it, as the experts' step is. Before attention
(ws.params[P_WHICH] LATENT_QKV) it makes q | k | v from the latents; after it (LATENT_OUT) o reads
each head's value, v_head_dim of its head_dim.
"""

from numba import njit

from .forward_types import (
    FROM_KV_LATENT, FROM_Q_LATENT, FROM_VALUES, FROM_XN, K, LATENT_QKV, MATRIX_KINDS, O, ONE, P_LAYER, P_ROWS, P_WHICH, P_WIDTH, Q, TO_KV,
    TO_LATENT, TO_PROJ, TO_QKV, TWO, V, state_at,
)
from .rmsnorm import norm_row
from .step_calls import run_linear


def latent_step(t, threads, state):
    """Layer ws.params[P_LAYER]'s latent attention before or after attention (P_WHICH), on this
    thread: its matrices run in parallel regions of their own."""
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    l, T = ws.params[P_LAYER], ws.params[P_ROWS]
    if ws.params[P_WHICH] == LATENT_QKV:
        _latent_qkv(l, T, w, ws, state)
    else:
        width = _pack_values(ws.att, T, w.heads, w.value_dim)
        ws.params[P_ROWS], ws.params[P_WIDTH] = T, width
        m = MATRIX_KINDS * l
        run_linear(FROM_VALUES, ONE, m + O, m + O, m + O, TO_PROJ, w, ws, state)


@njit(cache=True, _nrt=False)
def _latent_qkv(l, T, w, ws, state):
    """Latent attention's q | k | v rows for layer l (minillm.architectures.deepseek): q_a and kv_a
    over xn into the latents, each latent normed, then Q over the q latent (or over xn without
    one), K and V over the kv latent, and the shared RoPE key (kv_a's last columns, in the RoPE
    kernel's halves: tensor_names.latent_rows) written into every head's key, where K wrote zeros."""
    a = w.latent[l]
    m = MATRIX_KINDS * l
    q_rank, kv_rank = w.q_latent_norm.shape[1], w.kv_latent_norm.shape[1]
    if q_rank > 0:
        run_linear(FROM_XN, TWO, a, a + 1, a + 1, TO_LATENT, w, ws, state)
    else:
        run_linear(FROM_XN, ONE, a + 1, a + 1, a + 1, TO_LATENT, w, ws, state)
        run_linear(FROM_XN, ONE, m + Q, m + Q, m + Q, TO_QKV, w, ws, state)
    for t in range(T):
        if q_rank > 0:
            norm_row(ws.q_latent[t], ws.latent[t, :q_rank], w.q_latent_norm[l], w.latent_eps, False)
        norm_row(ws.kv_latent[t], ws.latent[t, q_rank : q_rank + kv_rank], w.kv_latent_norm[l], w.latent_eps, False)
    if q_rank > 0:
        run_linear(FROM_Q_LATENT, ONE, m + Q, m + Q, m + Q, TO_QKV, w, ws, state)
    run_linear(FROM_KV_LATENT, TWO, m + K, m + V, m + V, TO_KV, w, ws, state)
    q_dim = ws.att.shape[1]
    hd = q_dim // w.heads
    half = (ws.latent.shape[1] - q_rank - kv_rank) // 2
    key = q_rank + kv_rank
    for t in range(T):
        for k0 in range(q_dim, q_dim + (ws.qkv.shape[1] - q_dim) // 2, hd):
            for i in range(half):
                ws.qkv[t, k0 + i] = ws.latent[t, key + i]
                ws.qkv[t, k0 + hd // 2 + i] = ws.latent[t, key + half + i]


@njit(cache=True, _nrt=False)
def _pack_values(att, T, heads, value_dim):
    """att's first T rows with each head's first value_dim columns packed together, in place, as
    (T, heads * value_dim) rows from att's start (FROM_VALUES); returns that width. In order:
    each value moves to an earlier place or its own."""
    q_dim = att.shape[1]
    hd = q_dim // heads
    width = heads * value_dim
    for t in range(T):
        for h in range(heads):
            for i in range(value_dim):
                d = t * width + h * value_dim + i
                att[d // q_dim, d % q_dim] = att[t, h * hd + i]
    return width
