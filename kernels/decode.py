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

The weights and buffers come as NamedTuples (DecodeWeights, DecodeBuffers), filled by name;
Numba passes them as plain structs.
"""

from typing import NamedTuple

import numpy as np
from numba import njit, prange, types
from numba.extending import overload
from numba.typed import List

from .activation_prep import activation, chunk_operand, prepare_operand
from .attention import attend, first_key
from .blocks import block_product
from .jit import EXACT_MATH, kernel
from .matmul import store4, streamed_tile
from .row_groups import grouped_rows, is_grouped, quantize_split
from .quant import block_format, chunked_len, row_get, weight_at
from .rmsnorm import rmsnorm_row
from .rope import rope_row
from .schedule import claim, start_claims
from .swiglu import gated_act, softcap_row
from .weight_products import rows_dot4, weight_dot_chunks

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


def _prepare_rows(w, s, xo, xs, x):
    """Each sequence's activations prepared once for w's rows (kernels.quant.prepare_operand; for
    grouped blocks, kernels.row_groups.quantize_split)."""
    raise NotImplementedError


@overload(_prepare_rows, jit_options={"fastmath": EXACT_MATH}, inline="always")
def _prepare_rows_by_format(w, s, xo, xs, x):
    if w.dtype == types.uint8:
        def blocks(w, s, xo, xs, x):
            if is_grouped(block_format(s)):
                for b in range(x.shape[0]):
                    quantize_split(xo, xs, x, b)

        return blocks

    def rows(w, s, xo, xs, x):
        for b in range(x.shape[0]):
            prepare_operand(w, xo, xs, x, b)

    return rows


def _prepared_alike(w1, s1, w2, s2):
    """Whether activations prepared for w1's rows serve w2's: matrices reading one input (Q | K | V,
    gate | up) may come at different precisions in a GGUF file (a Q4_K_M file of the default
    model: Q and K in Q5_0, V in Q8_0, which runs grouped: kernels.row_groups)."""
    raise NotImplementedError


@overload(_prepared_alike, inline="always")
def _prepared_alike_impl(w1, s1, w2, s2):
    if w1.dtype == types.uint8 and w2.dtype == types.uint8:  # grouped blocks read prepared ones, the others x
        return lambda w1, s1, w2, s2: is_grouped(block_format(s1)) == is_grouped(block_format(s2))
    same = w1.dtype == w2.dtype
    return lambda w1, s1, w2, s2: same


def _linear_rows(out, col, w, s, task, xs, xos, xss):
    """out[b, col + n] = dot(w[n], xs[b]) for the 16 rows n of `task` and every sequence b: the
    block formats' tiles (kernels.blocks, each row dequantized once for all sequences), or the
    row products below."""
    raise NotImplementedError


@overload(_linear_rows, jit_options={"fastmath": EXACT_MATH})
def _linear_rows_by_format(out, col, w, s, task, xs, xos, xss):
    if w.dtype == types.uint8:
        def blocks(out, col, w, s, task, xs, xos, xss):
            fmt = block_format(s)
            if is_grouped(fmt):  # a task is one group of 16 rows (ROWS_PER_TASK)
                grouped_rows(fmt, out, col, w, task, xos, xss)
                return
            n0 = task * ROWS_PER_TASK
            block_product(fmt, out, col, w, n0, min(w.shape[0], n0 + ROWS_PER_TASK), xs)

        return blocks
    return _row_products.py_func


@njit(fastmath=EXACT_MATH, cache=True, inline="always")
def _row_products(out, col, w, s, task, xs, xos, xss):
    """out[b, col + n] = dot(w[n], xs[b]) for the 16 rows n of `task` and every sequence b.

    Batches of four or more go through the prefill's 4 x 4 register tiles first (_batch_tiles).
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
    n = _batch_tiles(out, col, w, s, n0, n1, xs, xc, xss, full)
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


def _batch_tiles(out, col, w, s, n0, n1, xs, xc, xss, full):
    """Rows n0.. of a task against a batch of four or more sequences in register tiles
    (kernels.matmul): the prefill's 4 x 4, four sequences at a time; each chunk of the weight rows
    is loaded once into registers for those sequences, 16 accumulators sharing 8 loads, where one
    row dot per sequence reloads the row for every sequence (default model float32, kernel alone
    at 8 sequences: 2.7x one sequence's tokens/s with row dots, 4.5x with 4 x 4 tiles). The next
    four sequences find the four rows in L1. 2 rows x 8 sequences, one pass over the rows, was
    slower once the tiles prefetch into L2 (ir_blocks.tile_4x4): a step of 8 on the default model,
    alternating, float32 ~30 -> ~27 ms (5 of 7), bfloat16 ~21 -> ~18.5 ms (2 of 3). The same sums
    as every other path, tails added in sequence.
    Returns the first row left for the row products: n0 for a smaller batch, and for int8
    weights, whose tile needs a scratch table per thread."""
    raise NotImplementedError


@overload(_batch_tiles, jit_options={"fastmath": EXACT_MATH}, inline="always")
def _batch_tiles_by_precision(out, col, w, s, n0, n1, xs, xc, xss, full):
    if w.dtype not in (types.float32, types.uint16):
        return lambda out, col, w, s, n0, n1, xs, xc, xss, full: n0

    def tiles(out, col, w, s, n0, n1, xs, xc, xss, full):
        B = xs.shape[0]
        n = n0
        if B < 4:
            return n
        while n + 4 <= n1:
            b = 0
            while b + 4 <= B:
                d = streamed_tile(w, s, n, xc, b)
                # literal indices: a tuple indexed at run time is slow
                store4(out, b, col + n, d[0], d[1], d[2], d[3], w, s, n, xs, full)
                store4(out, b + 1, col + n, d[4], d[5], d[6], d[7], w, s, n, xs, full)
                store4(out, b + 2, col + n, d[8], d[9], d[10], d[11], w, s, n, xs, full)
                store4(out, b + 3, col + n, d[12], d[13], d[14], d[15], w, s, n, xs, full)
                b += 4
            _rows_alone(out, col, w, s, n, n + 4, b, xs, xc, xss, full)
            n += 4
        return n

    return tiles


@njit(fastmath=EXACT_MATH, cache=True, inline="always")
def _rows_alone(out, col, w, s, n0, n1, b0, xs, xc, xss, full):
    """Rows n0..n1-1 against sequences b0.. one dot product at a time (the ones a tile left)."""
    for b in range(b0, xs.shape[0]):
        for i in range(n0, n1):
            total = weight_dot_chunks(w, s, i, xc[b], xss[b])
            for k in range(full, w.shape[1]):
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
def _gated_rows(gate, up, bias, l, gelu):
    """gate = act(gate + bias) * (up + bias), bias being layer l's (gate | up) row when the model
    has biases, act SiLU or (gelu) GELU-tanh. The loop vectorises (kernels.expf.divide): as a
    scalar loop SiLU took ~4% of an int8 step."""
    I = gate.shape[0]
    if bias.shape[1] > 0:
        for n in range(I):
            gate[n] += bias[l, n]
            up[n] += bias[l, I + n]
    for n in range(I):
        gate[n] = gated_act(gate[n], up[n], gelu)


@njit(fastmath=EXACT_MATH, cache=True, inline="always")
def _norm_rows(out, x, norm, l, eps):
    """out[b] = rmsnorm(x[b]) with layer l's weights, or a copy of x[b] where the layer has no
    norm at that place (norm is (L, 0))."""
    for b in range(x.shape[0]):
        if norm.shape[1] > 0:
            rmsnorm_row(out[b], x[b], norm[l], eps)
        else:
            out[b, :] = x[b]


@njit(fastmath=EXACT_MATH, cache=True, inline="always")
def _add_residual(x, proj, bias, norm, l, eps):
    """x += norm(proj + bias): layer l's bias row and output norm, each where the model has one
    ((L, 0) otherwise)."""
    for b in range(x.shape[0]):
        if bias.shape[1] > 0:
            for n in range(x.shape[1]):
                proj[b, n] += bias[l, n]
        if norm.shape[1] > 0:
            rmsnorm_row(proj[b], proj[b], norm[l], eps)
        for n in range(x.shape[1]):
            x[b, n] += proj[b, n]


@njit(fastmath=EXACT_MATH, cache=True, inline="always")
def _norm_groups(x, norm, l, eps):
    """RMSNorm of x in place, group by group of norm's width (a head, or the whole projection:
    the q/k norm of Qwen3, Gemma 3 and OLMo 2); nothing when norm is (L, 0)."""
    n = norm.shape[1]
    if n > 0:
        for g in range(x.shape[0] // n):
            rmsnorm_row(x[g * n : (g + 1) * n], x[g * n : (g + 1) * n], norm[l], eps)


class DecodeWeights(NamedTuple):
    """The model's weights and architecture as decode_batch reads them, built once at load
    (minillm.model.decode_weights).

    Matrices come at any precision of kernels.quant, each with its int8 block scales, or for
    block formats its ggml type, in a (1, 1) array (a (1, 1) array of nothing otherwise). Per-layer matrices are numba.typed.List of one array per layer, so
    memory-mapped checkpoint tensors are used in place; norms and biases are stacked (L, N),
    with N = 0 where the model has none (a norm placement or a bias it lacks).
    """

    embed: np.ndarray  # (V, H)
    embed_scales: np.ndarray
    lm_head: np.ndarray  # (V, H); the embedding itself when tied
    lm_head_scales: np.ndarray
    attn_norm: np.ndarray  # (L, H) before attention, or (L, 0)
    attn_out_norm: np.ndarray  # (L, H) on attention's output, or (L, 0)
    mlp_norm: np.ndarray  # (L, H) before the MLP, or (L, 0)
    mlp_out_norm: np.ndarray  # (L, H) on the MLP's output, or (L, 0)
    q_norm: np.ndarray  # (L, hd) per head, (L, q_dim) over the projection, or (L, 0)
    k_norm: np.ndarray  # (L, hd), (L, kv_dim) or (L, 0)
    final_norm: np.ndarray  # (H,)
    q: List  # (q_dim, H) per layer
    q_scales: List
    k: List  # (kv_dim, H)
    k_scales: List
    v: List  # (kv_dim, H)
    v_scales: List
    o: List  # (H, q_dim)
    o_scales: List
    gate: List  # (I, H)
    gate_scales: List
    up: List  # (I, H)
    up_scales: List
    down: List  # (H, I)
    down_scales: List
    qkv_bias: np.ndarray  # (L, q_dim + 2 kv_dim) or (L, 0)
    o_bias: np.ndarray  # (L, H) or (L, 0)
    gate_up_bias: np.ndarray  # (L, 2 I) or (L, 0)
    down_bias: np.ndarray  # (L, H) or (L, 0)
    rope_table: np.ndarray  # (L,) int64: layer l's RoPE table in cos/sin, or -1 (no RoPE)
    window: np.ndarray  # (L,) int64: layer l's sliding window, or 0 (every earlier key)
    embed_scale: float  # the embedding is multiplied by it (Gemma: sqrt(H); else 1)
    attn_scale: float  # attention scores are multiplied by it
    attn_softcap: float  # scores -> cap * tanh(scores / cap) when > 0
    final_softcap: float  # logits -> cap * tanh(logits / cap) when > 0
    gelu: bool  # the MLP's gate is GELU-tanh, not SiLU


class DecodeBuffers(NamedTuple):
    """Inputs, outputs and scratch of one decode step for B sequences (minillm.model.DecodeWorkspace
    keeps one set of views per batch size, so a step allocates nothing)."""

    logits: np.ndarray  # (B, V) out
    tokens: np.ndarray  # (B,) the new token of each sequence
    positions: np.ndarray  # (B,) each token's position; slot b's cache holds 0..positions[b]-1
    slots: np.ndarray  # (B,) each sequence's cache slot
    x: np.ndarray  # (B, H) residual stream
    xn: np.ndarray  # (B, H) normalised input of a sub-block
    qkv: np.ndarray  # (B, q_dim + 2 kv_dim) q | k | v
    att: np.ndarray  # (B, q_dim) attention output
    proj: np.ndarray  # (B, H) o-proj / down output before the residual add
    gate: np.ndarray  # (B, I)
    up: np.ndarray  # (B, I)
    scores: np.ndarray  # (B * nh, ctx) one row per (sequence, head)
    # xn, att and gate as the weights' products read them (kernels.activation_prep.prepare_operand):
    # bfloat16 bits (uint16) or int16 values, same shapes; width 0 for float32 weights
    xn_op: np.ndarray
    att_op: np.ndarray
    gate_op: np.ndarray
    # their int16 block scales: float32 (B, dim // 32); width 0 unless int8
    xn_scales: np.ndarray
    att_scales: np.ndarray
    gate_scales: np.ndarray
    claims: np.ndarray  # (2, threads) int64: the task shares of each parallel loop (kernels.schedule)


@kernel(fastmath=EXACT_MATH)
def decode_batch(buf, w, k_pool, v_pool, cos, sin, eps):
    """One token for each of B sequences (buf: DecodeBuffers, w: DecodeWeights) through every
    layer and the LM head into buf.logits. k_pool, v_pool: (slots, L, nkv, ctx, hd); cos, sin:
    RoPE tables (tables, ctx, hd / 2)."""
    x, xn, qkv, att, proj, gate, up, scores = buf.x, buf.xn, buf.qkv, buf.att, buf.proj, buf.gate, buf.up, buf.scores
    positions, slots, claims = buf.positions, buf.slots, buf.claims
    B = buf.tokens.shape[0]
    L = w.rope_table.shape[0]
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
    # attention's tasks: each KV head with all its query heads (kernels.attention.attend), split
    # in parts until the tasks divide evenly among the threads. One sequence of the default model is 3
    # KV heads: 2 + 1 on two threads cost float32 decode 3% (4 alternating rounds); in 2 parts,
    # 6 tasks of 1 or 2 heads go 4 + 5 heads, as one head a task did.
    parts = 1
    while parts < n_rep and (B * nkv * parts) % threads != 0:
        parts += 1
    embed_scale = np.float32(w.embed_scale)

    for b in range(B):
        row_get(w.embed, w.embed_scales, buf.tokens[b], x[b])
        for n in range(H):
            x[b, n] *= embed_scale
    for l in range(L):
        # This layer's arrays, taken out of the lists once: indexing a typed list inside a
        # parallel loop would touch a shared reference count on every row.
        wq_l, sq_l, wk_l, sk_l, wv_l, sv_l = w.q[l], w.q_scales[l], w.k[l], w.k_scales[l], w.v[l], w.v_scales[l]
        wo_l, so_l, wg_l, sg_l = w.o[l], w.o_scales[l], w.gate[l], w.gate_scales[l]
        wu_l, su_l, wd_l, sd_l = w.up[l], w.up_scales[l], w.down[l], w.down_scales[l]
        table, window = w.rope_table[l], w.window[l]

        # h = x + out_norm(attn(norm(x))), each norm where the architecture has it
        _norm_rows(xn, x, w.attn_norm, l, eps)
        _prepare_rows(wq_l, sq_l, buf.xn_op, buf.xn_scales, xn)
        if not _prepared_alike(wq_l, sq_l, wk_l, sk_l):
            _prepare_rows(wk_l, sk_l, buf.xn_op, buf.xn_scales, xn)
        if not (_prepared_alike(wq_l, sq_l, wv_l, sv_l) or _prepared_alike(wk_l, sk_l, wv_l, sv_l)):
            _prepare_rows(wv_l, sv_l, buf.xn_op, buf.xn_scales, xn)
        start_claims(claims, tq + 2 * tkv, threads)
        for t in prange(threads):
            task = claim(claims, t, threads)
            while task >= 0:  # q | k | v, each task within one matrix
                if task < tq:
                    _linear_rows(qkv, 0, wq_l, sq_l, task, xn, buf.xn_op, buf.xn_scales)
                elif task < tq + tkv:
                    _linear_rows(qkv, q_dim, wk_l, sk_l, task - tq, xn, buf.xn_op, buf.xn_scales)
                else:
                    _linear_rows(qkv, q_dim + kv_dim, wv_l, sv_l, task - tq - tkv, xn, buf.xn_op, buf.xn_scales)
                task = claim(claims, t, threads)
        for b in range(B):
            if w.qkv_bias.shape[1] > 0:
                for r in range(q_dim + 2 * kv_dim):
                    qkv[b, r] += w.qkv_bias[l, r]
            pos = positions[b]
            q = qkv[b, :q_dim]
            k = qkv[b, q_dim : q_dim + kv_dim]
            v = qkv[b, q_dim + kv_dim :]
            _norm_groups(q, w.q_norm, l, eps)
            _norm_groups(k, w.k_norm, l, eps)
            if table >= 0:
                rope_row(q, cos[table], sin[table], pos, hd)
                rope_row(k, cos[table], sin[table], pos, hd)
            for h in range(nkv):
                for d in range(hd):
                    k_pool[slots[b], l, h, pos, d] = k[h * hd + d]
                    v_pool[slots[b], l, h, pos, d] = v[h * hd + d]
        for task in prange(B * nkv * parts):  # a task: a KV head's query heads, or a part of them
            b = task // (nkv * parts)
            kv = (task // parts) % nkv
            h0 = kv * n_rep + n_rep * (task % parts) // parts
            h1 = kv * n_rep + n_rep * (task % parts + 1) // parts
            j0 = first_key(positions[b], window)
            attend(att[b, h0 * hd : h1 * hd], qkv[b, h0 * hd : h1 * hd], k_pool[slots[b], l, kv, j0:], v_pool[slots[b], l, kv, j0:],
                   positions[b] + 1 - j0, scores[b * nh + h0 : b * nh + h1], w.attn_scale, w.attn_softcap)
        _prepare_rows(wo_l, so_l, buf.att_op, buf.att_scales, att)
        start_claims(claims, th, threads)
        for t in prange(threads):
            _linear_share(proj, wo_l, so_l, att, buf.att_op, buf.att_scales, claims, t, threads)
        _add_residual(x, proj, w.o_bias, w.attn_out_norm, l, eps)

        # x = h + out_norm(mlp(norm(h)))
        _norm_rows(xn, x, w.mlp_norm, l, eps)
        _prepare_rows(wg_l, sg_l, buf.xn_op, buf.xn_scales, xn)
        if not _prepared_alike(wg_l, sg_l, wu_l, su_l):
            _prepare_rows(wu_l, su_l, buf.xn_op, buf.xn_scales, xn)
        start_claims(claims, 2 * ti, threads)
        for t in prange(threads):
            task = claim(claims, t, threads)
            while task >= 0:  # gate | up
                if task < ti:
                    _linear_rows(gate, 0, wg_l, sg_l, task, xn, buf.xn_op, buf.xn_scales)
                else:
                    _linear_rows(up, 0, wu_l, su_l, task - ti, xn, buf.xn_op, buf.xn_scales)
                task = claim(claims, t, threads)
        for b in range(B):
            _gated_rows(gate[b], up[b], w.gate_up_bias, l, w.gelu)
        _prepare_rows(wd_l, sd_l, buf.gate_op, buf.gate_scales, gate)
        start_claims(claims, th, threads)
        for t in prange(threads):
            _linear_share(proj, wd_l, sd_l, gate, buf.gate_op, buf.gate_scales, claims, t, threads)
        _add_residual(x, proj, w.down_bias, w.mlp_out_norm, l, eps)

    for b in range(B):
        rmsnorm_row(xn[b], x[b], w.final_norm, eps)
    _prepare_rows(w.lm_head, w.lm_head_scales, buf.xn_op, buf.xn_scales, xn)
    start_claims(claims, (buf.logits.shape[1] + R - 1) // R, threads)
    for t in prange(threads):
        _linear_share(buf.logits, w.lm_head, w.lm_head_scales, xn, buf.xn_op, buf.xn_scales, claims, t, threads)
    if w.final_softcap > 0:
        for b in range(B):
            softcap_row(buf.logits[b], w.final_softcap)
