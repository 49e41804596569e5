"""One decode step for a batch of sequences (one token each) through every layer and the LM head,
in a single Numba call.

At 135M parameters a step takes a few milliseconds, so hundreds of Python-to-Numba calls per
token would cost a large share of it. Here Python calls once per step; inside, each layer runs
five parallel loops (QKV, attention, o-proj, gate/up, down) with the small serial pieces (norms,
RoPE, the cache writes) between them, on the same row helpers as the prefill kernels.

Batching: each weight row is read once per step and applied to every sequence while it sits in
L1 (decode is bound by reading weights, so B sequences cost little more than one). Each sequence
has its own cache slot and position. Every sum is the same fixed-order `row_dot`, so a sequence's
logits do not depend on what else is in the batch.

Per-layer weights come as numba.typed.List (one array per layer, so memory-mapped checkpoint
tensors are used in place); biases stacked (L, N), with N = 0 when the model has none.
"""

from numba import prange

from ._jit import kernel
from .attention import attend
from .lanes import EXACT_MATH
from .quant import row_dot, row_get
from .rmsnorm import rmsnorm_row
from .rope import rope_row
from .swiglu import silu_mul

ROWS_PER_TASK = 16


@kernel(fastmath=EXACT_MATH)
def decode_batch(
    logits,  # (B, V) out
    tokens,  # (B,) the new token of each sequence
    positions,  # (B,) each token's position; slot b's cache holds 0..positions[b]-1
    slots,  # (B,) each sequence's cache slot
    ws,  # workspace: (x (B, H), xn (B, H), qkv (B, q_dim + 2 kv_dim), att (B, q_dim), hidden (B, I), scores (B * nh, ctx))
    norms,  # (input (L, H), post-attention (L, H), final (H,))
    embed,  # (w, s) of the embedding (V, H)
    lm_head,  # (w, s) of the LM head (V, H)
    layers,  # typed lists: (wq, sq, wk, sk, wv, sv, wo, so, wg, sg, wu, su, wd, sd)
    biases,  # (qkv (L, q_dim + 2 kv_dim), o (L, H), gate_up (L, 2I), down (L, H))
    k_pool,  # (slots, L, nkv, ctx, hd)
    v_pool,
    cos,
    sin,
    eps,
):
    x, xn, qkv, att, hidden, scores = ws
    in_norm, post_norm, final_norm = norms
    wq, sq, wk, sk, wv, sv, wo, so, wg, sg, wu, su, wd, sd = layers
    b_qkv, b_o, b_gu, b_d = biases
    B = tokens.shape[0]
    L = in_norm.shape[0]
    H = x.shape[1]
    nkv, hd = k_pool.shape[2], k_pool.shape[4]
    q_dim = att.shape[1]
    kv_dim = nkv * hd
    I = hidden.shape[1]
    nh = q_dim // hd
    n_rep = nh // nkv
    R = ROWS_PER_TASK

    for b in range(B):
        row_get(embed[0], embed[1], tokens[b], x[b])
    for l in range(L):
        # This layer's arrays, taken out of the lists once: indexing a typed list inside a
        # parallel loop would touch a shared reference count on every row.
        wq_l, sq_l, wk_l, sk_l, wv_l, sv_l = wq[l], sq[l], wk[l], sk[l], wv[l], sv[l]
        wo_l, so_l, wg_l, sg_l, wu_l, su_l, wd_l, sd_l = wo[l], so[l], wg[l], sg[l], wu[l], su[l], wd[l], sd[l]

        # h = x + attn(rmsnorm(x))
        for b in range(B):
            rmsnorm_row(xn[b], x[b], in_norm[l], eps)
        n_qkv = q_dim + 2 * kv_dim
        for task in prange((n_qkv + R - 1) // R):
            for r in range(task * R, min(n_qkv, task * R + R)):
                for b in range(B):
                    if r < q_dim:
                        y = row_dot(wq_l, sq_l, r, xn[b])
                    elif r < q_dim + kv_dim:
                        y = row_dot(wk_l, sk_l, r - q_dim, xn[b])
                    else:
                        y = row_dot(wv_l, sv_l, r - q_dim - kv_dim, xn[b])
                    if b_qkv.shape[1] > 0:
                        y += b_qkv[l, r]
                    qkv[b, r] = y
        for b in range(B):
            pos = positions[b]
            q = qkv[b, :q_dim]
            k = qkv[b, q_dim : q_dim + kv_dim]
            v = qkv[b, q_dim + kv_dim :]
            rope_row(q, cos, sin, pos, hd)
            rope_row(k, cos, sin, pos, hd)
            for h in range(nkv):
                for d in range(hd):
                    k_pool[slots[b], l, h, pos, d] = k[h * hd + d]
                    v_pool[slots[b], l, h, pos, d] = v[h * hd + d]
        for bh in prange(B * nh):
            b = bh // nh
            h = bh % nh
            lo = h * hd
            kv = h // n_rep
            attend(att[b, lo : lo + hd], qkv[b, lo : lo + hd], k_pool[slots[b], l, kv], v_pool[slots[b], l, kv], positions[b] + 1, scores[bh])
        for task in prange((H + R - 1) // R):
            for n in range(task * R, min(H, task * R + R)):
                for b in range(B):
                    y = row_dot(wo_l, so_l, n, att[b])
                    if b_o.shape[1] > 0:
                        y += b_o[l, n]
                    x[b, n] += y

        # x = h + mlp(rmsnorm(h))
        for b in range(B):
            rmsnorm_row(xn[b], x[b], post_norm[l], eps)
        for task in prange((I + R - 1) // R):
            for n in range(task * R, min(I, task * R + R)):
                for b in range(B):
                    g = row_dot(wg_l, sg_l, n, xn[b])
                    u = row_dot(wu_l, su_l, n, xn[b])
                    if b_gu.shape[1] > 0:
                        g += b_gu[l, n]
                        u += b_gu[l, I + n]
                    hidden[b, n] = silu_mul(g, u)
        for task in prange((H + R - 1) // R):
            for n in range(task * R, min(H, task * R + R)):
                for b in range(B):
                    y = row_dot(wd_l, sd_l, n, hidden[b])
                    if b_d.shape[1] > 0:
                        y += b_d[l, n]
                    x[b, n] += y

    for b in range(B):
        rmsnorm_row(xn[b], x[b], final_norm, eps)
    V = logits.shape[1]
    head_w, head_s = lm_head
    for task in prange((V + R - 1) // R):
        for n in range(task * R, min(V, task * R + R)):
            for b in range(B):
                logits[b, n] = row_dot(head_w, head_s, n, xn[b])
