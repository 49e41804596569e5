"""The steps of the forward pass: each does thread t's share of one operation, step(t, threads,
state), compiled once as its own kernel and called by address (step_kernels); the row spans they
run; attention's tasks.
"""

import numpy as np
from numba import njit, prange, types

from .activation_operands import call_prepare
from .attention import attend, attend_queries, first_key
from .experts import moe_layer
from .forward_types import (
    ATTENTION_PART, FROM_ATT, FROM_GATE, FROM_KV_LATENT, FROM_Q_LATENT, FROM_VALUES, FROM_XE, JOB_GATE, JOB_XE, P_COUNT, P_LAYER, P_MATRIX,
    P_OUTPUT, P_ROWS, P_WHICH, P_WIDTH, PARALLEL_REGION, PARALLEL_ROWS, TO_GATE_UP, TO_KV, TO_LATENT, TO_LOGITS, TO_QKV, TO_ROUTER, mlp_rows,
    state_at,
)
from .jit import EXACT_MATH, array_at, call_at, native_address, rows_view
from .vector_ir import LANES
from .latent import latent_step
from .lora import LORA_A, LORA_B, LORA_BF16, LORA_COL, LORA_F16, LORA_KIND, LORA_NEXT, LORA_OUT, LORA_RANK, ROW_GROUP, lora_rows
from .matmul import call_linear
from .row_spans import gate_span, norm_span, qkv_span, residual_span
from .swiglu import CLAMPED_SWIGLU, GELU_TANH, SILU, XIELU, clamped_gated_row, xielu_row
from .work_sharing import claim

@njit(inline="always", _nrt=False)
def _source_rows(ws, source, T):
    """The T rows a linear step reads."""
    if source == FROM_ATT:
        return ws.att[:T]
    if source == FROM_GATE:
        return mlp_rows(ws.gate, T, ws.params[P_WIDTH])
    if source == FROM_XE:
        return ws.xe[:T]
    if source == FROM_Q_LATENT:
        return ws.q_latent[:T]
    if source == FROM_KV_LATENT:
        return ws.kv_latent[:T]
    if source == FROM_VALUES:  # att's rows with each head's value packed (kernels.forward), P_WIDTH wide
        return rows_view(ws.att[0], T, ws.params[P_WIDTH])
    return ws.xn[:T]


# ---------------------------------------------------------------- the steps
#
# Each step's kernel does thread t's share of it: step(t, threads, state), state the address of
# (rows, w, ws, k_pool, v_pool, cos, sin) (state_at), its own arguments in ws.params.


def prepare_step(t, threads, state):
    """Thread t's share of the rows of a linear step's input, prepared as the Operand in
    ws.params[P_COUNT] by that Operand's kernel."""
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    T, op, source = ws.params[P_ROWS], ws.params[P_COUNT], ws.params[P_WHICH]
    x = _source_rows(ws, source, T)
    K = x.shape[1]
    xo, xs = rows_view(ws.operands[op], T, K), rows_view(ws.operand_scales[op], T, 3 * (K // 32) + 1)
    call_prepare(w.prepare[op], xo, xs, x, np.int64(T * t // threads), np.int64(T * (t + 1) // threads))


def linear_step(t, threads, state):
    """Thread t's tasks of up to three matrices read from one input (ws.params), each by its
    format's linear kernel (kernels.matmul), its tasks shared from claims[2j:2j + 2]."""
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    p = ws.params
    T, n, target, source = p[P_ROWS], p[P_COUNT], p[P_OUTPUT], p[P_WHICH]
    x = _source_rows(ws, source, T)
    K = x.shape[1]
    q_dim = ws.att.shape[1]
    kv_dim = (ws.qkv.shape[1] - q_dim) // 2
    for j in range(n):
        m = p[P_MATRIX + j]
        op = w.operand[m]  # x as this matrix reads it, prepared by prepare_step
        xo, xs = rows_view(ws.operands[op], T, K), rows_view(ws.operand_scales[op], T, 3 * (K // 32) + 1)
        if target == TO_QKV:
            out, col = ws.qkv[:T], (0, q_dim, q_dim + kv_dim)[j]
        elif target == TO_KV:
            out, col = ws.qkv[:T], (q_dim, q_dim + kv_dim)[j]
        elif target == TO_LATENT:
            out, col = ws.latent[:T], (0, ws.q_latent.shape[1])[j]
        elif target == TO_GATE_UP:
            out, col = mlp_rows(ws.gate if j == 0 else ws.up, T, p[P_WIDTH]), 0
        elif target == TO_LOGITS:
            out, col = rows.logits, 0
        elif target == TO_ROUTER:
            out, col = ws.route[:T], 0
        else:
            out, col = ws.proj[:T], 0
        call_linear(w.linear[m], out, np.int64(col), array_at(w.matrices, m, np.uint8), array_at(w.scales, m, np.uint16), x, xo, xs, ws.scratch[t], ws.claims[2 * j : 2 * j + 2],
                    np.int64(t))


def lora_step(t, threads, state):
    """Thread t's share of the LoRA updates on the matrices the linear step before it ran (the
    same ws.params): each row adds its adapter's updates (rows.adapters) to what the base matrix
    wrote; a row of the base model (-1) adds nothing. The updates are tasks dealt to the threads
    in turn: one matrix's updates for a group of consecutive rows of one adapter, and for a few
    rows (a decode) one part of its columns per thread, so the adapter's matrices are read at both
    cores' bandwidth. Several adapters' updates on one matrix (a chain) are one task: one thread
    adds them in order, so no two threads write the same outputs and every step sums alike."""
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    p = ws.params
    T, n, target = p[P_ROWS], p[P_COUNT], p[P_OUTPUT]
    x = _source_rows(ws, p[P_WHICH], T)
    q_dim = ws.att.shape[1]
    kv_dim = (ws.qkv.shape[1] - q_dim) // 2
    parts = threads if T < PARALLEL_ROWS else 1
    task = 0
    r0 = 0
    while r0 < T:
        a = _row_adapter(rows, target, r0)
        r1 = r0 + 1
        while r1 < T and r1 - r0 < ROW_GROUP and _row_adapter(rows, target, r1) == a:
            r1 += 1
        if a >= 0:
            for j in range(n):
                head = w.lora_map[a, p[P_MATRIX + j]]
                if head < 0:
                    continue
                if target == TO_QKV:
                    out, col = ws.qkv[r0:r1], (0, q_dim, q_dim + kv_dim)[j]
                elif target == TO_GATE_UP:
                    out, col = mlp_rows(ws.gate if j == 0 else ws.up, T, p[P_WIDTH])[r0:r1], 0
                elif target == TO_LOGITS:
                    out, col = rows.logits[r0:r1], 0
                elif target == TO_ROUTER:
                    out, col = ws.route[r0:r1], 0
                else:
                    out, col = ws.proj[r0:r1], 0
                for part in range(parts):
                    if task % threads == t:
                        e = head
                        while e >= 0:
                            c = col + w.lora_entries[e, LORA_COL]
                            _lora_update(out[:, c : c + w.lora_entries[e, LORA_OUT]], x[r0:r1], w, e, part, parts, ws.scratch[t])
                            e = w.lora_entries[e, LORA_NEXT]
                    task += 1
        r0 = r1


def expert_lora_step(t, threads, state):
    """Thread t's share of the LoRA updates on the expert jobs just run (ws.jobs, P_COUNT of
    them): each gathered row of a job adds its row's adapter's update (ws.xe_adapter) on that
    expert's matrix, as lora_step does for the other matrices."""
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    p = ws.params
    n, source, width = p[P_COUNT], p[P_WHICH], p[P_WIDTH]
    parts = threads if p[P_ROWS] < PARALLEL_ROWS else 1
    task = 0
    for j in range(n):
        m, first, count, target = ws.jobs[j, 0], ws.jobs[j, 1], ws.jobs[j, 2], ws.jobs[j, 3]
        x = ws.xe[first : first + count] if source == FROM_XE else rows_view(ws.gate[0][first * width :], count, width)
        if target == JOB_XE:
            out = ws.xe[first : first + count]
        else:
            out = rows_view((ws.gate if target == JOB_GATE else ws.up)[0][first * width :], count, width)
        r0 = 0
        while r0 < count:
            a = ws.xe_adapter[first + r0]
            r1 = r0 + 1
            while r1 < count and r1 - r0 < ROW_GROUP and ws.xe_adapter[first + r1] == a:
                r1 += 1
            head = w.lora_map[a, m] if a >= 0 else -1
            if head >= 0:
                for part in range(parts):  # a chain of updates on one output is one thread's, as in lora_step
                    if task % threads == t:
                        e = head
                        while e >= 0:
                            _lora_update(out[r0:r1], x[r0:r1], w, e, part, parts, ws.scratch[t])
                            e = w.lora_entries[e, LORA_NEXT]
                    task += 1
            r0 = r1


@njit(inline="always", _nrt=False)
def _row_adapter(rows, target, r):
    """Row r's adapter; the LM head's rows are the logit rows."""
    return rows.adapters[rows.logit_rows[r] if target == TO_LOGITS else r]


@njit(inline="always", _nrt=False)
def _part_start(N, part, parts):
    """Where part `part` of N columns starts: on a 16-column boundary, so each column is summed
    as a full vector's lane or as the tail's whatever the parts (kernels.lora)."""
    return N if part == parts else N * part // parts // LANES * LANES


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _lora_update(out, x, w, e, part, parts, scratch):
    """Update e on the rows of x into out (its columns of the base output): part `part` of its
    columns, in groups of rows that fit the scratch."""
    entries = w.lora_entries
    N, rank = entries[e, LORA_OUT], entries[e, LORA_RANK]
    group = max(1, scratch.shape[0] // (rank + 64))  # rows whose A x and a chunk of B (A x) fit the scratch
    c0, c1 = _part_start(N, part, parts), _part_start(N, part + 1, parts)
    a0, b0 = entries[e, LORA_A], entries[e, LORA_B] + c0
    for g0 in range(0, x.shape[0], group):
        g1 = min(x.shape[0], g0 + group)
        o = out[g0:g1, c0:c1]
        if entries[e, LORA_KIND] == LORA_F16:
            lora_rows(o, x[g0:g1], w.lora_data.view(np.int16), a0, b0, rank, N, w.lora_scale[e], scratch)
        elif entries[e, LORA_KIND] == LORA_BF16:
            lora_rows(o, x[g0:g1], w.lora_data.view(np.uint16), a0, b0, rank, N, w.lora_scale[e], scratch)
        else:
            lora_rows(o, x[g0:g1], w.lora_data.view(np.float32), a0, b0, rank, N, w.lora_scale[e], scratch)


def expert_linear_step(t, threads, state):
    """Thread t's tasks of the expert jobs (ws.jobs, ws.params[P_COUNT] of them): each matrix
    over its own rows of the input (xe, or the gate rows) into its rows of gate, up or xe, by
    its format's linear kernel, its tasks shared from claims[2j:2j + 2]. A thread done with one
    matrix's tasks goes on to the next: no barrier between experts."""
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    p = ws.params
    n, source, width = p[P_COUNT], p[P_WHICH], p[P_WIDTH]
    K = ws.xe.shape[1] if source == FROM_XE else width
    S = 3 * (K // 32) + 1
    for j in range(n):
        m, r0, nr, target = ws.jobs[j, 0], ws.jobs[j, 1], ws.jobs[j, 2], ws.jobs[j, 3]
        op = w.operand[m]
        x = ws.xe[r0 : r0 + nr] if source == FROM_XE else rows_view(ws.gate[0][r0 * width :], nr, width)
        xo, xs = rows_view(ws.operands[op][r0 * K :], nr, K), rows_view(ws.operand_scales[op][r0 * S :], nr, S)
        if target == JOB_XE:
            out = ws.xe[r0 : r0 + nr]
        else:
            out = rows_view((ws.gate if target == JOB_GATE else ws.up)[0][r0 * width :], nr, width)
        call_linear(w.linear[m], out, np.int64(0), array_at(w.matrices, m, np.uint8), array_at(w.scales, m, np.uint16), x, xo, xs, ws.scratch[t],
                    ws.claims[2 * j : 2 * j + 2], np.int64(t))


def experts_step(t, threads, state):
    """Layer ws.params[P_LAYER]'s mixture of experts over the step's rows (moe_layer), run on
    this thread: its matrices run in parallel regions of their own. A step of its own, so a
    dense model's forward pass never compiles it."""
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    l, T = ws.params[P_LAYER], ws.params[P_ROWS]
    moe_layer(l, T, w, ws, rows.adapters, state)
    if rows.experts.shape[0] > 0:
        for t in range(T):
            for j in range(ws.chosen.shape[1]):
                rows.experts[l, t, j] = ws.chosen[t, j]


def norm_step(t, threads, state):
    """Thread t's rows of xn = norm(x), the attention's or the MLP's norm (ws.params[P_WHICH])."""
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    l, T = ws.params[P_LAYER], ws.params[P_ROWS]
    norm = w.attn_norm if ws.params[P_WHICH] == ATTENTION_PART else w.mlp_norm
    norm_span(T * t // threads, T * (t + 1) // threads, ws.xn, ws.x, norm, l, w.eps, w.centered_norm)


def qkv_step(t, threads, state):
    """Thread t's rows of q | k | v finished (qkv_span) and their keys and values cached, float32 KV."""
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    _qkv_share(t, threads, rows, w, ws, k_pool.view(np.float32), v_pool.view(np.float32), cos, sin)


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _qkv_share(t, threads, rows, w, ws, k_pool, v_pool, cos, sin):
    """qkv_step with the pools as their KV format's rows."""
    l, T = ws.params[P_LAYER], ws.params[P_ROWS]
    qkv_span(T * t // threads, T * (t + 1) // threads, ws.qkv, w.qkv_bias, w.q_norm, w.k_norm, l, w.eps, w.rope_table[l], cos, sin,
              rows.positions, rows.slots, k_pool, v_pool, ws.att.shape[1], ws.att.shape[1] // w.heads, w)


def residual_step(t, threads, state):
    """Thread t's rows of x += out_norm(proj + bias), after attention or the MLP (ws.params[P_WHICH])."""
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    l, T = ws.params[P_LAYER], ws.params[P_ROWS]
    if ws.params[P_WHICH] == ATTENTION_PART:
        bias, norm = w.o_bias, w.attn_out_norm
    else:
        bias, norm = w.down_bias, w.mlp_out_norm
    residual_span(T * t // threads, T * (t + 1) // threads, ws.x, ws.proj, bias, norm, l, w.eps, w.residual_scale)


def gate_step(t, threads, state):
    """Thread t's rows of gate = act(gate + bias) * (up + bias), act SiLU or GELU-tanh."""
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    l, T = ws.params[P_LAYER], ws.params[P_ROWS]
    gate, up = mlp_rows(ws.gate, T, ws.params[P_WIDTH]), mlp_rows(ws.up, T, ws.params[P_WIDTH])
    gate_span(T * t // threads, T * (t + 1) // threads, gate, up, w.gate_up_bias, l, w.activation == GELU_TANH)


def gate_step_clamped(t, threads, state):
    """gate_step with gpt-oss's clamped SwiGLU (its experts carry their biases themselves)."""
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    T, width = ws.params[P_ROWS], ws.params[P_WIDTH]
    gate, up = mlp_rows(ws.gate, T, width), mlp_rows(ws.up, T, width)
    for r in range(T * t // threads, T * (t + 1) // threads):
        clamped_gated_row(gate[r], up[r], w.swiglu_alpha, w.swiglu_limit)


def gate_step_xielu(t, threads, state):
    """Thread t's rows of gate = xIELU(gate) with layer l's parameters (Apertus: an MLP without a
    gate, whose up projection the linear step wrote into the gate rows)."""
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    l, T = ws.params[P_LAYER], ws.params[P_ROWS]
    gate = mlp_rows(ws.gate, T, ws.params[P_WIDTH])
    a = w.activation_params[l]
    for r in range(T * t // threads, T * (t + 1) // threads):
        xielu_row(gate[r], a[0], a[1], a[2], a[3])


def attention_step(t, threads, state):
    """att = causal softmax attention of each row's queries over its slot's cache, layer l: thread
    t's share of the tasks of attention_tasks. Query head h reads KV head h // n_rep (GQA without
    copying KV heads); a query at position p sees positions 0..p, or with a sliding window the
    last `window` of them. Every output equals what attend gives one query alone, bit for bit.
    float32 KV; KV_STEPS has the other formats', and those with attention sinks."""
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    _attention_share(t, rows, w, ws, k_pool.view(np.float32), v_pool.view(np.float32), None)


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _attention_share(t, rows, w, ws, k_pool, v_pool, sinks):
    """attention_step with the pools as their KV format's rows (kernels.kv_rows); sinks w.sinks
    (gpt-oss), or None: compiled without them."""
    l, T = ws.params[P_LAYER], ws.params[P_ROWS]
    att, qkv, positions, slots, tasks, scores, claims = ws.att[:T], ws.qkv[:T], rows.positions, rows.slots, ws.tasks, ws.scores, ws.claims[0:2]
    window, scale, softcap = w.window[l], w.attn_scale, w.attn_softcap
    hd = ws.att.shape[1] // w.heads
    n_rep = w.heads // k_pool.shape[2]
    row0 = t * (scores.shape[0] // claims.shape[1])  # this thread's score rows
    task = claim(claims, t, claims.shape[1])
    while task >= 0:
        r0, r1, h0, h1 = tasks[task, 0], tasks[task, 1], tasks[task, 2], tasks[task, 3]
        slot, pos0 = slots[r0], positions[r0]
        keys, values = k_pool[slot, l, h0 // n_rep], v_pool[slot, l, h0 // n_rep]
        if r1 - r0 == 1:  # a lone query: its heads of one KV head together
            j0 = first_key(pos0, window)
            out, q, s = att[r0, h0 * hd : h1 * hd], qkv[r0, h0 * hd : h1 * hd], scores[row0 : row0 + h1 - h0]
            if sinks is None:
                attend(out, q, keys[j0:], values[j0:], pos0 + 1 - j0, s, scale, softcap, None)
            else:
                attend(out, q, keys[j0:], values[j0:], pos0 + 1 - j0, s, scale, softcap, sinks[l, h0:h1])
        elif sinks is None:  # up to 4 queries of one head, consecutive positions
            attend_queries(att, qkv, r0, r1 - r0, h0, keys, values, pos0, window, scores, row0, scale, softcap, None)
        else:
            attend_queries(att, qkv, r0, r1 - r0, h0, keys, values, pos0, window, scores, row0, scale, softcap, sinks[l])
        task = claim(claims, t, claims.shape[1])


def parallel_region(step, threads, state):
    """The one parallel loop of the forward pass: every thread runs its share of a step."""
    for t in prange(threads):
        call_at(step, np.int64(t), np.int64(threads), state)


# ---------------------------------------------------------------- the steps' kernels
#
# Each step is its own compiled kernel, called by address, and the parallel loop is one kernel
# too: Numba links a called function's code into each caller and optimises it all again, so code
# called from the forward pass in a dozen places was optimised a dozen times, and each parallel
# loop (a parfor) costs seconds to compile. Here each is compiled and optimised once, in its own
# module: a first run of the default model compiled the forward pass in 15 s instead of 30
# (2-core AVX2 machine).

STEPS = (linear_step, attention_step, norm_step, qkv_step, residual_step, gate_step, prepare_step, experts_step, expert_linear_step,
         lora_step, expert_lora_step, latent_step)
MOE_STEPS = (experts_step, expert_linear_step)  # compiled only for a mixture of experts
assert len(STEPS) == PARALLEL_REGION  # in the order of forward_types' step numbers


# The steps that read or write the KV pools, per KV format (kernels.formats.KV_FORMATS): each views
# the pools' bytes as its format's rows, so only the format a model uses is compiled.


def attention_step_float16(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    _attention_share(t, rows, w, ws, k_pool.view(np.int16), v_pool.view(np.int16), None)


def qkv_step_float16(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    _qkv_share(t, threads, rows, w, ws, k_pool.view(np.int16), v_pool.view(np.int16), cos, sin)


def attention_step_bfloat16(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    _attention_share(t, rows, w, ws, k_pool.view(np.uint16), v_pool.view(np.uint16), None)


def qkv_step_bfloat16(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    _qkv_share(t, threads, rows, w, ws, k_pool.view(np.uint16), v_pool.view(np.uint16), cos, sin)


def attention_step_q8_0(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    _attention_share(t, rows, w, ws, k_pool, v_pool, None)  # Q8_0 blocks are bytes already


def qkv_step_q8_0(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    _qkv_share(t, threads, rows, w, ws, k_pool, v_pool, cos, sin)


# With attention sinks (gpt-oss): steps of their own, so other models never compile them.


def attention_step_sinks(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    _attention_share(t, rows, w, ws, k_pool.view(np.float32), v_pool.view(np.float32), w.sinks)


def attention_step_float16_sinks(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    _attention_share(t, rows, w, ws, k_pool.view(np.int16), v_pool.view(np.int16), w.sinks)


def attention_step_bfloat16_sinks(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    _attention_share(t, rows, w, ws, k_pool.view(np.uint16), v_pool.view(np.uint16), w.sinks)


def attention_step_q8_0_sinks(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = state_at(state)
    _attention_share(t, rows, w, ws, k_pool, v_pool, w.sinks)


KV_STEPS = {  # KV format -> its (attention, attention with sinks, qkv) steps
    "float32": (attention_step, attention_step_sinks, qkv_step),
    "float16": (attention_step_float16, attention_step_float16_sinks, qkv_step_float16),
    "bfloat16": (attention_step_bfloat16, attention_step_bfloat16_sinks, qkv_step_bfloat16),
    "q8_0": (attention_step_q8_0, attention_step_q8_0_sinks, qkv_step_q8_0),
}
_compiled: dict = {}
_STEP_SIGNATURE = types.void(types.int64, types.int64, types.int64)
_STEP_OPTIONS = dict(cache=True, fastmath=EXACT_MATH, nogil=True, _nrt=False)


def _compile_step(step):
    if step not in _compiled:
        if step is parallel_region:
            kernel = njit(_STEP_SIGNATURE, parallel=True, cache=True, nogil=True)(step)
        else:
            kernel = njit(_STEP_SIGNATURE, **_STEP_OPTIONS)(step)
        _compiled[step] = (kernel, native_address(kernel, _STEP_SIGNATURE))
    return _compiled[step][1]


def step_kernels(kv_format: str = "float32", experts: bool = False, sinks: bool = False, activation: int = SILU, lora: bool = False,
                 latent: bool = False) -> np.ndarray:
    """The addresses of the steps' kernels for a KV format, then of the parallel region (compiled
    the first time on a machine, then loaded from Numba's cache); the experts' steps only for a
    mixture of experts, the latent step only for latent attention and the LoRA step only with
    adapters (else 0: never called); attention
    with sinks, the clamped SwiGLU gate (gpt-oss) and xIELU (Apertus) only for a model that has them."""
    plain, with_sinks, qkv = KV_STEPS[kv_format]
    gate = {CLAMPED_SWIGLU: gate_step_clamped, XIELU: gate_step_xielu}.get(activation, gate_step)
    chosen = {attention_step: with_sinks if sinks else plain, qkv_step: qkv, gate_step: gate}
    steps = [chosen.get(step, step) for step in STEPS]
    unused = (*(MOE_STEPS if not experts else ()), *((lora_step,) if not lora else ()), *((expert_lora_step,) if not (lora and experts) else ()),
              *((latent_step,) if not latent else ()))
    return np.array([0 if step in unused else _compile_step(step) for step in (*steps, parallel_region)], np.int64)
