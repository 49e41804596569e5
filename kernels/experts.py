"""A mixture of experts' layer, run from the forward pass's experts step: the router's top k
per row (its kinds: softmax then top k, renormalised or not; gpt-oss's top k logits under their own
softmax), the rows gathered expert by expert so each chosen expert's matrices run once over all
its rows in one parallel region, each row's experts summed in ascending expert order whatever
else is in the step, then the shared expert where the layer has one.
"""

import numpy as np
from numba import njit

from .forward_types import (
    EXPERT_LINEAR, EXPERT_LORA, FROM_GATE, FROM_XE, FROM_XN, GATE, GATE_ROWS, JOB_GATE, JOB_UP, JOB_XE, MATRIX_KINDS, MLP_PART, ONE,
    P_COUNT, P_LORA, P_ROWS, P_WHICH, P_WIDTH, PARALLEL_ROWS, TO_ROUTER, ALWAYS,
)
from .jit import EXACT_MATH, rows_view
from .step_calls import prepare_and_claim, row_step, run_linear, run_mlp, run_step

@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def moe_layer(l, T, w, ws, adapters, state):
    """proj[:T] = layer l's mixture of experts of xn[:T]: the router's top k per row (_route);
    the rows gathered expert by expert (_gather), so that every chosen expert's gate and up run
    in one parallel region, each over its own rows, and then every down; each row adds its
    experts' outputs times their weights in ascending expert order; then the shared expert,
    scaled by the sigmoid of its gate, where the layer has one. adapters: each row's LoRA
    adapter (rows.adapters), whose updates on the experts follow each expert matrix."""
    E, r, k = w.experts, w.router[l], w.experts_per_token
    ws.params[P_ROWS] = T
    run_linear(FROM_XN, ONE, r, r, r, TO_ROUTER, w, ws, state)
    if w.router_bias.shape[1] > 0:
        for t in range(T):
            for e in range(E):
                ws.route[t, e] += w.router_bias[l, e]
    _route(ws.route[:T], E, ws.chosen[:T], ws.chosen_weight[:T], w.norm_topk, w.topk_softmax)
    n, R = _gather(ws, T, E, r, adapters)
    width = w.matrices[r + 1, 1]
    ws.params[P_ROWS], ws.params[P_WIDTH] = R, width
    _expert_linear(FROM_XE, n, w, ws, state)
    biased = w.expert_down_bias.shape[0] > 0
    if biased:
        _add_expert_bias(ws, w.expert_gate_up_bias, l, r, n, width)
    row_step(GATE_ROWS, MLP_PART, R >= PARALLEL_ROWS, w, ws, state)
    for j in range(n // 2):  # each expert's down, from its gate rows into its rows of xe
        ws.jobs[j, 0], ws.jobs[j, 1], ws.jobs[j, 2], ws.jobs[j, 3] = ws.jobs[2 * j, 0] + 2, ws.jobs[2 * j, 1], ws.jobs[2 * j, 2], JOB_XE
    _expert_linear(FROM_GATE, n // 2, w, ws, state)
    if biased:
        _add_expert_bias(ws, w.expert_down_bias, l, r, n // 2, width)
    moe = ws.moe[:T]
    for t in range(T):
        for c in range(moe.shape[1]):
            moe[t, c] = 0
        for j in range(k):  # ascending expert order (_route)
            weight, src = ws.chosen_weight[t, j], ws.place[t, j]
            for c in range(moe.shape[1]):
                moe[t, c] += ws.xe[src, c] * weight
    proj = ws.proj[:T]
    shared = MATRIX_KINDS * l + GATE
    if w.matrices[shared, 1] > 0:
        run_mlp(FROM_XN, shared, T, w, ws, state)
        for t in range(T):
            g = np.float32(1) / (np.float32(1) + np.exp(-ws.route[t, E]))
            for c in range(proj.shape[1]):
                proj[t, c] = moe[t, c] + g * proj[t, c]
    else:
        for t in range(T):
            for c in range(proj.shape[1]):
                proj[t, c] = moe[t, c]


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _add_expert_bias(ws, bias, l, r, n, width):
    """Each of the n expert jobs' output rows += its expert's bias row (gpt-oss): bias (L, E,
    2 I) gate | up for gate and up jobs, (L, E, H) for down jobs; r the layer's router matrix."""
    for j in range(n):
        m, r0, nr, target = ws.jobs[j, 0], ws.jobs[j, 1], ws.jobs[j, 2], ws.jobs[j, 3]
        e = (m - r - 1) // 3
        first = width if target == JOB_UP else 0
        if target == JOB_XE:
            out = ws.xe[r0 : r0 + nr]
        else:
            out = rows_view((ws.gate if target == JOB_GATE else ws.up)[0][r0 * width :], nr, width)
        for i in range(nr):
            for c in range(out.shape[1]):
                out[i, c] += bias[l, e, first + c]


@njit(cache=True, _nrt=False)
def _expert_linear(source, n, w, ws, state):
    """The n expert jobs of ws.jobs in one parallel region (expert_linear_step), their input
    (source: xe, or the gate rows) prepared once for all of them per Operand; then the rows'
    LoRA updates on them (expert_lora_step) when a row of the step has an adapter."""
    ws.params[P_WHICH] = source
    prepare_and_claim(ws.jobs[:, 0], n, w, ws, state)
    run_step(EXPERT_LINEAR, ALWAYS, w, ws, state)
    if ws.params[P_LORA]:
        ws.params[P_COUNT] = n
        run_step(EXPERT_LORA, ALWAYS, w, ws, state)


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _route(route, E, chosen, chosen_weight, norm_topk, topk_softmax):
    """Each row's top k experts by softmax probability over the E logits in route[t, :E] (ties
    to the lower index), their probabilities renormalised to sum to 1 when norm_topk, as
    transformers' routers; or with topk_softmax (gpt-oss) the top k logits, weighted by their
    own softmax. Then held in ascending expert order, the order a row sums them in. route[t, :E]
    becomes the probabilities (topk_softmax: stays the logits)."""
    k = chosen.shape[1]
    for t in range(route.shape[0]):
        p = route[t, :E]
        if topk_softmax:
            _top_k(p, chosen[t], chosen_weight[t], E)
            top = chosen_weight[t, 0]  # the largest, first
            total = np.float32(0)
            for j in range(k):
                chosen_weight[t, j] = np.exp(chosen_weight[t, j] - top)
                total += chosen_weight[t, j]
            for j in range(k):
                chosen_weight[t, j] /= total
            _ascending(chosen[t], chosen_weight[t])
            continue
        top = p[0]
        for e in range(1, E):
            top = max(top, p[e])
        total = np.float32(0)
        for e in range(E):
            p[e] = np.exp(p[e] - top)
            total += p[e]
        for e in range(E):
            p[e] /= total
        _top_k(p, chosen[t], chosen_weight[t], E)
        if norm_topk:
            kept = np.float32(0)
            for j in range(k):
                kept += chosen_weight[t, j]
            for j in range(k):
                chosen_weight[t, j] /= kept
        _ascending(chosen[t], chosen_weight[t])


@njit(cache=True, _nrt=False)
def _top_k(p, chosen, value, E):
    """The k = len(chosen) largest of p[:E], largest first (ties to the lower index), and their values."""
    for j in range(chosen.shape[0]):
        best = -1
        for e in range(E):
            if (best < 0 or p[e] > p[best]) and not _taken(chosen[:j], e):
                best = e
        chosen[j], value[j] = best, p[best]


@njit(cache=True, _nrt=False)
def _ascending(chosen, weight):
    """Insertion sort of one row's choices by expert."""
    for j in range(1, chosen.shape[0]):
        e, wj, i = chosen[j], weight[j], j
        while i > 0 and chosen[i - 1] > e:
            chosen[i], weight[i] = chosen[i - 1], weight[i - 1]
            i -= 1
        chosen[i], weight[i] = e, wj


@njit(cache=True, _nrt=False)
def _taken(ids, e):
    for i in ids:
        if i == e:
            return True
    return False


@njit(cache=True, _nrt=False)
def _gather(ws, T, E, r, adapters):
    """The T rows' choices gathered expert by expert: each chosen expert's rows of xn copied to
    consecutive rows of xe (ascending), place[t, j] the row of row t's choice j (and its row's
    LoRA adapter in xe_adapter); its gate and up matrices as jobs. Returns (jobs, rows of xe)."""
    n = 0
    row = 0
    for e in range(E):
        first = row
        for t in range(T):
            for j in range(ws.chosen.shape[1]):
                if ws.chosen[t, j] == e:
                    ws.place[t, j] = row
                    if ws.params[P_LORA]:
                        ws.xe_adapter[row] = adapters[t]
                    for c in range(ws.xn.shape[1]):
                        ws.xe[row, c] = ws.xn[t, c]
                    row += 1
        if row > first:
            for kind in range(2):  # gate, up
                ws.jobs[n, 0], ws.jobs[n, 1], ws.jobs[n, 2], ws.jobs[n, 3] = r + 1 + 3 * e + kind, first, row - first, kind
                n += 1
    return n, row
