"""One whole decode step (one token through every layer and the LM head) in a single Numba call.

At 135M parameters a step takes a few milliseconds, so hundreds of Python-to-Numba calls per
token would cost a large share of it. Here Python calls once per token; inside, each layer runs
five parallel loops (QKV, attention, o-proj, gate/up, down) with the small serial pieces (norms,
RoPE, the cache write) between them, on the same row helpers as the prefill kernels.

Per-layer weights come as numba.typed.List (one array per layer, so memory-mapped checkpoint
tensors are used in place); biases stacked (L, N), with N = 0 when the model has none.
"""

import numpy as np
from numba import prange

from ._jit import kernel
from .lanes import EXACT_MATH
from .attention import attend
from .quant import row_dot, row_get
from .rmsnorm import rmsnorm_row
from .rope import rope_row
from .swiglu import silu_mul

ROWS_PER_TASK = 16


@kernel(fastmath=EXACT_MATH)
def decode_step(
    logits,  # (V,) out
    token,
    pos,  # the token's position; the cache holds 0..pos-1
    ws,  # workspace: (x (H,), xn (H,), qkv (q_dim + 2 kv_dim,), att (q_dim,), hidden (I,), scores (nh, ctx))
    norms,  # (input (L, H), post-attention (L, H), final (H,))
    embed,  # (w, s) of the embedding (V, H)
    lm_head,  # (w, s) of the LM head (V, H)
    layers,  # typed lists: (wq, sq, wk, sk, wv, sv, wo, so, wg, sg, wu, su, wd, sd)
    biases,  # (qkv (L, q_dim + 2 kv_dim), o (L, H), gate_up (L, 2I), down (L, H))
    k_cache,  # (L, nkv, ctx, hd)
    v_cache,
    cos,
    sin,
    eps,
):
    x, xn, qkv, att, hidden, scores = ws
    in_norm, post_norm, final_norm = norms
    wq, sq, wk, sk, wv, sv, wo, so, wg, sg, wu, su, wd, sd = layers
    b_qkv, b_o, b_gu, b_d = biases
    L = in_norm.shape[0]
    H = x.shape[0]
    nkv, _, hd = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    q_dim = att.shape[0]
    kv_dim = nkv * hd
    I = hidden.shape[0]
    nh = q_dim // hd
    n_rep = nh // nkv
    R = ROWS_PER_TASK

    row_get(embed[0], embed[1], token, x)
    for l in range(L):
        # h = x + attn(rmsnorm(x))
        # This layer's arrays, taken out of the lists once: indexing a typed list inside a
        # parallel loop would touch a shared reference count on every row.
        wq_l, sq_l, wk_l, sk_l, wv_l, sv_l = wq[l], sq[l], wk[l], sk[l], wv[l], sv[l]
        wo_l, so_l, wg_l, sg_l, wu_l, su_l, wd_l, sd_l = wo[l], so[l], wg[l], sg[l], wu[l], su[l], wd[l], sd[l]
        k_l, v_l = k_cache[l], v_cache[l]
        rmsnorm_row(xn, x, in_norm[l], eps)
        n_qkv = q_dim + 2 * kv_dim
        for task in prange((n_qkv + R - 1) // R):
            for r in range(task * R, min(n_qkv, task * R + R)):
                if r < q_dim:
                    y = row_dot(wq_l, sq_l, r, xn)
                elif r < q_dim + kv_dim:
                    y = row_dot(wk_l, sk_l, r - q_dim, xn)
                else:
                    y = row_dot(wv_l, sv_l, r - q_dim - kv_dim, xn)
                if b_qkv.shape[1] > 0:
                    y += b_qkv[l, r]
                qkv[r] = y
        q = qkv[:q_dim]
        k = qkv[q_dim : q_dim + kv_dim]
        v = qkv[q_dim + kv_dim :]
        rope_row(q, cos, sin, pos, hd)
        rope_row(k, cos, sin, pos, hd)
        for h in range(nkv):
            for d in range(hd):
                k_l[h, pos, d] = k[h * hd + d]
                v_l[h, pos, d] = v[h * hd + d]
        for h in prange(nh):
            lo = h * hd
            attend(att[lo : lo + hd], q[lo : lo + hd], k_l[h // n_rep], v_l[h // n_rep], pos + 1, scores[h])
        for task in prange((H + R - 1) // R):
            for n in range(task * R, min(H, task * R + R)):
                y = row_dot(wo_l, so_l, n, att)
                if b_o.shape[1] > 0:
                    y += b_o[l, n]
                x[n] += y

        # x = h + mlp(rmsnorm(h))
        rmsnorm_row(xn, x, post_norm[l], eps)
        for task in prange((I + R - 1) // R):
            for n in range(task * R, min(I, task * R + R)):
                g = row_dot(wg_l, sg_l, n, xn)
                u = row_dot(wu_l, su_l, n, xn)
                if b_gu.shape[1] > 0:
                    g += b_gu[l, n]
                    u += b_gu[l, I + n]
                hidden[n] = silu_mul(g, u)
        for task in prange((H + R - 1) // R):
            for n in range(task * R, min(H, task * R + R)):
                y = row_dot(wd_l, sd_l, n, hidden)
                if b_d.shape[1] > 0:
                    y += b_d[l, n]
                x[n] += y

    rmsnorm_row(xn, x, final_norm, eps)
    V = logits.shape[0]
    head_w, head_s = lm_head
    for task in prange((V + R - 1) // R):
        for n in range(task * R, min(V, task * R + R)):
            logits[n] = row_dot(head_w, head_s, n, xn)
