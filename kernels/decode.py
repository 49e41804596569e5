"""One decode step for a batch of sequences (one token each) through every layer and the LM head,
in a single Numba call.

At 135M parameters a step takes a few milliseconds, so hundreds of Python-to-Numba calls per
token would cost a large share of it. Here Python calls once per step; inside, each layer runs
five parallel loops (QKV, attention, o-proj, gate/up, down) with the small serial pieces (norms,
RoPE, the cache writes) between them, in the same fixed-order sums as the prefill kernels.

Batching: each weight row is read once per step and applied to every sequence while it sits in
L1 (decode is bound by reading weights, so B sequences cost little more than one). Each sequence
has its own cache slot and position. Every sum is in row_dot's fixed order, so a sequence's
logits do not depend on what else is in the batch, nor on the path (prefill or decode).

Per-layer weights come as numba.typed.List (one array per layer, so memory-mapped checkpoint
tensors are used in place); biases stacked (L, N), with N = 0 when the model has none.
"""

from numba import njit, prange, types
from numba.extending import overload

from .activation_prep import activation, chunk_operand, prepare_operand
from .attention import attend
from .jit import EXACT_MATH, kernel
from .quant import chunked_len, row_get, weight_at
from .rmsnorm import rmsnorm_row
from .rope import rope_row
from .schedule import claim, start_claims
from .weight_products import rows_dot4, weight_dot_chunks
from .swiglu import silu_mul

ROWS_PER_TASK = 16

# From this row length on, float32 weight rows are streamed four at a time. One row's sum is one
# chain of dependent FMAs (the fixed order); short rows overlap in the out-of-order window, long
# ones do not and leave the loop waiting on FMA latency. Below it one row at a time is as fast or
# faster: one stream, prefetched 4 KiB ahead (default model float32 decode +4-10% over four rows,
# 8 of 8 alternating runs). bfloat16 and int8 rows never are: a bfloat16 row has two
# accumulators (kernels.weight_products) and goes alone, unprefetched (1B shape decode +6%, default model
# +13%, 6 of 6 alternating runs each, against four rows from K = 4096 and prefetch); an int8
# block is one vpmaddwd and one FMA for 32 weights, so one row's chain keeps up with memory.
LONG_ROW = 4096
NEVER = 1 << 62


def long_row(w):
    """The row length from which rows of w's precision are streamed four at a time."""
    raise NotImplementedError


@overload(long_row)
def _long_row(w):
    threshold = LONG_ROW if w.dtype == types.float32 else NEVER
    return lambda w: threshold


@njit(fastmath=EXACT_MATH, cache=True, inline="always")
def _prepare_rows(w, xo, xs, x):
    """Each sequence's activations prepared once for w's rows (kernels.quant.prepare_operand)."""
    for b in range(x.shape[0]):
        prepare_operand(w, xo, xs, x, b)


@njit(fastmath=EXACT_MATH, cache=True, inline="always")
def _linear_rows(out, col, w, s, task, xs, xos, xss):
    """out[b, col + n] = dot(w[n], xs[b]) for the 16 rows n of `task` and every sequence b.

    The dot product is inlined (kernels.weight_products intrinsics, not a call per row, which cost ~15%)
    and summed in row_dot's order: the chunks, then the tail in sequence. Long rows are streamed
    four at a time (see long_row), shorter ones one at a time, as one contiguous stream. While
    rows sit in L1, every sequence uses them. Against bfloat16 and int8 rows the chunks read
    xos (and the block scales xss), xs as _prepare_rows left it.
    """
    N, K = w.shape
    n0 = task * ROWS_PER_TASK
    n1 = min(N, n0 + ROWS_PER_TASK)
    full = chunked_len(w, K)
    xc = chunk_operand(w, xs, xos)
    n = n0
    if K >= long_row(w):
        while n + 4 <= n1:
            for b in range(xs.shape[0]):
                rows_dot4(out, b * out.shape[1] + col + n, w, s, n, xc[b], xss[b])
                for i in range(n, n + 4):
                    for k in range(full, K):
                        out[b, col + i] += weight_at(w, s, i, k) * activation(w, xs[b, k])
            n += 4
    for i in range(n, n1):
        for b in range(xs.shape[0]):
            total = weight_dot_chunks(w, s, i, xc[b], xss[b])
            for k in range(full, K):
                total += weight_at(w, s, i, k) * activation(w, xs[b, k])
            out[b, col + i] = total


@njit(fastmath=EXACT_MATH, cache=True, inline="always")
def _linear_share(out, w, s, xs, xos, xss, claims, t, threads):
    """Thread t's part of out = xs @ w.T: the tasks it claims (kernels.schedule), run by
    _linear_rows. The body of a parallel loop over threads; holds no parallel loop itself."""
    task = claim(claims, t, threads)
    while task >= 0:
        _linear_rows(out, 0, w, s, task, xs, xos, xss)
        task = claim(claims, t, threads)


@njit(fastmath=EXACT_MATH, cache=True, inline="always")
def _silu_mul_rows(gate, up, bias, l):
    """gate = silu(gate + bias) * (up + bias), bias being layer l's (gate | up) row when the model has
    biases. The SiLU loop vectorises (kernels.expf.divide): as a scalar loop it took ~4% of an
    int8 step."""
    I = gate.shape[0]
    if bias.shape[1] > 0:
        for n in range(I):
            gate[n] += bias[l, n]
            up[n] += bias[l, I + n]
    for n in range(I):
        gate[n] = silu_mul(gate[n], up[n])


@njit(fastmath=EXACT_MATH, cache=True, inline="always")
def _add_residual(x, proj, bias, l):
    """x += proj (+ layer l's bias row, when the model has biases: bias is (L, 0) otherwise)."""
    for b in range(x.shape[0]):
        for n in range(x.shape[1]):
            y = proj[b, n]
            if bias.shape[1] > 0:
                y += bias[l, n]
            x[b, n] += y


@kernel(fastmath=EXACT_MATH)
def decode_batch(
    logits,  # (B, V) out
    tokens,  # (B,) the new token of each sequence
    positions,  # (B,) each token's position; slot b's cache holds 0..positions[b]-1
    slots,  # (B,) each sequence's cache slot
    ws,  # workspace: (x (B, H), xn (B, H), qkv (B, q_dim + 2 kv_dim), att (B, q_dim), proj (B, H), gate (B, I), up (B, I), scores (B * nh, ctx))
    ws_ops,  # xn, att and gate as the weights' dot products read them (kernels.quant.prepare_operand):
    # bfloat16 bits (uint16) or int16 values, same shapes; width 0 for float32 weights
    ws_scales,  # their int16 block scales (float32 (B, dim // 32); width 0 unless int8)
    claims,  # (2, threads) int64: the task shares of each parallel loop (kernels.schedule), one per thread
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
    x, xn, qkv, att, proj, gate, up, scores = ws
    xn_o, att_o, gate_o = ws_ops
    xn_s, att_s, gate_s = ws_scales
    in_norm, post_norm, final_norm = norms
    wq, sq, wk, sk, wv, sv, wo, so, wg, sg, wu, su, wd, sd = layers
    b_qkv, b_o, b_gu, b_d = biases
    B = tokens.shape[0]
    L = in_norm.shape[0]
    H = x.shape[1]
    nkv, hd = k_pool.shape[2], k_pool.shape[4]
    q_dim = att.shape[1]
    kv_dim = nkv * hd
    I = gate.shape[1]
    nh = q_dim // hd
    n_rep = nh // nkv
    R = ROWS_PER_TASK
    threads = claims.shape[1]
    tq, tkv, th, ti = (q_dim + R - 1) // R, (kv_dim + R - 1) // R, (H + R - 1) // R, (I + R - 1) // R

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
        _prepare_rows(wq_l, xn_o, xn_s, xn)
        start_claims(claims, tq + 2 * tkv, threads)
        for t in prange(threads):
            task = claim(claims, t, threads)
            while task >= 0:  # q | k | v, each task within one matrix
                if task < tq:
                    _linear_rows(qkv, 0, wq_l, sq_l, task, xn, xn_o, xn_s)
                elif task < tq + tkv:
                    _linear_rows(qkv, q_dim, wk_l, sk_l, task - tq, xn, xn_o, xn_s)
                else:
                    _linear_rows(qkv, q_dim + kv_dim, wv_l, sv_l, task - tq - tkv, xn, xn_o, xn_s)
                task = claim(claims, t, threads)
        for b in range(B):
            if b_qkv.shape[1] > 0:
                for r in range(q_dim + 2 * kv_dim):
                    qkv[b, r] += b_qkv[l, r]
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
        _prepare_rows(wo_l, att_o, att_s, att)
        start_claims(claims, th, threads)
        for t in prange(threads):
            _linear_share(proj, wo_l, so_l, att, att_o, att_s, claims, t, threads)
        _add_residual(x, proj, b_o, l)

        # x = h + mlp(rmsnorm(h))
        for b in range(B):
            rmsnorm_row(xn[b], x[b], post_norm[l], eps)
        _prepare_rows(wg_l, xn_o, xn_s, xn)
        start_claims(claims, 2 * ti, threads)
        for t in prange(threads):
            task = claim(claims, t, threads)
            while task >= 0:  # gate | up
                if task < ti:
                    _linear_rows(gate, 0, wg_l, sg_l, task, xn, xn_o, xn_s)
                else:
                    _linear_rows(up, 0, wu_l, su_l, task - ti, xn, xn_o, xn_s)
                task = claim(claims, t, threads)
        for b in range(B):
            _silu_mul_rows(gate[b], up[b], b_gu, l)
        _prepare_rows(wd_l, gate_o, gate_s, gate)
        start_claims(claims, th, threads)
        for t in prange(threads):
            _linear_share(proj, wd_l, sd_l, gate, gate_o, gate_s, claims, t, threads)
        _add_residual(x, proj, b_d, l)

    for b in range(B):
        rmsnorm_row(xn[b], x[b], final_norm, eps)
    head_w, head_s = lm_head
    _prepare_rows(head_w, xn_o, xn_s, xn)
    start_claims(claims, (logits.shape[1] + R - 1) // R, threads)
    for t in prange(threads):
        _linear_share(logits, head_w, head_s, xn, xn_o, xn_s, claims, t, threads)
