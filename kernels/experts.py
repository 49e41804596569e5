"""A mixture of experts' layer, run from the forward pass's experts step: the router's top k
per row (its kinds: softmax or sigmoid scores then the top k, renormalised or not, chosen by the
scores or by the scores plus a selection bias, among the best groups of experts; gpt-oss's top k
logits under their own softmax), the rows gathered expert by expert so each chosen expert's
matrices run once over all its rows in one parallel region, each row's experts summed in
ascending expert order whatever else is in the step, then the shared expert where the layer has
one (under the sigmoid of its gate, or as it is).
"""

import numpy as np
from numba import njit

from .forward_types import (
    EXPERT_LINEAR, EXPERT_LORA, FROM_GATE, FROM_XE, FROM_XN, GATE, GATE_ROWS, JOB_GATE, JOB_UP, JOB_XE, MATRIX_KINDS, MLP_PART, ONE,
    P_COUNT, P_LORA, P_ROWS, P_WHICH, P_WIDTH, PARALLEL_ROWS, SIGMOID_ROUTER, TO_ROUTER, TOPK_SIGMOID_INPUT_ROUTER, TOPK_SOFTMAX_ROUTER, ALWAYS,
)
from .jit import EXACT_MATH, rows_view
from .step_calls import prepare_and_claim, row_step, run_linear, run_mlp, run_step

@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def moe_layer(l, T, w, ws, adapters, state):
    """proj[:T] = layer l's mixture of experts of xn[:T]: the router's top k per row (_route);
    the rows gathered expert by expert (_gather), so that every chosen expert's gate and up run
    in one parallel region, each over its own rows, and then every down; each row adds its
    experts' outputs times their weights in ascending expert order; then the shared expert where
    the layer has one, scaled by the sigmoid of its gate when the router has a row for it.
    adapters: each row's LoRA adapter (rows.adapters), whose updates on the experts follow each
    expert matrix."""
    E, r, k = w.experts, w.router[l], w.experts_per_token
    ws.params[P_ROWS] = T
    run_linear(FROM_XN, ONE, r, r, r, TO_ROUTER, w, ws, state)
    if w.router_bias.shape[1] > 0:
        for t in range(T):
            for e in range(E):
                ws.route[t, e] += w.router_bias[l, e]
    _route(ws.route[:T], E, ws.chosen[:T], ws.chosen_weight[:T], w, w.selection_bias[l])  # (0,) without one
    n, R = _gather(ws, T, E, r, adapters)
    scaled_inputs = w.router_kind == TOPK_SIGMOID_INPUT_ROUTER
    if scaled_inputs:  # Llama 4: each gathered row times its weight, the experts' outputs then summed as they are
        for t in range(T):
            for j in range(k):
                for c in range(ws.xe.shape[1]):
                    ws.xe[ws.place[t, j], c] *= ws.chosen_weight[t, j]
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
            weight, src = np.float32(1) if scaled_inputs else ws.chosen_weight[t, j], ws.place[t, j]
            for c in range(moe.shape[1]):
                moe[t, c] += ws.xe[src, c] * weight
    proj = ws.proj[:T]
    shared = MATRIX_KINDS * l + GATE
    if w.matrices[shared, 1] > 0:
        run_mlp(FROM_XN, shared, T, w, ws, state)
        gated = w.matrices[r, 1] > E  # Qwen2-MoE: the shared expert's gate is the router's last row
        for t in range(T):
            g = np.float32(1) / (np.float32(1) + np.exp(-ws.route[t, E])) if gated else np.float32(1)
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
def _route(route, E, chosen, chosen_weight, w, selection):
    """Each row's top k experts (ties to the lower index) and their weights, held in ascending
    expert order, the order a row sums them in. route[t, :E] holds the logits and becomes the
    scores: a softmax over them, or each one's sigmoid (SIGMOID_ROUTER); experts are chosen by
    score, or by score + selection (the selection bias) in route[t, E + 1:], among the
    w.router_group_topk best of w.router_groups groups; each chosen expert weighs its score,
    renormalised when w.norm_topk (the sum at least w.norm_min; a sigmoid router's sum + 1e-20, as
    transformers writes both), times w.routed_scale. TOPK_SOFTMAX_ROUTER (gpt-oss): the top k
    logits, weighted by their own softmax (route[t, :E] stays the logits)."""
    k = chosen.shape[1]
    for t in range(route.shape[0]):
        p = route[t, :E]
        if w.router_kind == TOPK_SOFTMAX_ROUTER:
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
        if w.router_kind == TOPK_SIGMOID_INPUT_ROUTER:  # the top k logits' sigmoids (moe_layer scales the inputs by them)
            _top_k(p, chosen[t], chosen_weight[t], E)
            for j in range(k):
                chosen_weight[t, j] = np.float32(1) / (np.float32(1) + np.exp(-chosen_weight[t, j]))
            _ascending(chosen[t], chosen_weight[t])
            continue
        if w.router_kind == SIGMOID_ROUTER:
            for e in range(E):
                p[e] = np.float32(1) / (np.float32(1) + np.exp(-p[e]))
        else:
            _softmax(p)
        by = p
        if selection.shape[0] > 0 or w.router_groups > 1:
            by = route[t, E + 1 : 2 * E + 1]
            for e in range(E):
                by[e] = p[e] + selection[e] if selection.shape[0] > 0 else p[e]
            if w.router_groups > 1:
                _keep_best_groups(by, w.router_groups, w.router_group_topk, w.router_group_best)
        _top_k(by, chosen[t], chosen_weight[t], E)
        for j in range(k):
            chosen_weight[t, j] = p[chosen[t, j]]
        if w.norm_topk:
            kept = np.float32(0)
            for j in range(k):
                kept += chosen_weight[t, j]
            if w.router_kind == SIGMOID_ROUTER:
                kept += np.float32(1e-20)
            kept = max(kept, w.norm_min)
            for j in range(k):
                chosen_weight[t, j] /= kept
        if w.routed_scale != 1:
            for j in range(k):
                chosen_weight[t, j] *= w.routed_scale
        _ascending(chosen[t], chosen_weight[t])


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _softmax(p):
    top = p[0]
    for e in range(1, p.shape[0]):
        top = max(top, p[e])
    total = np.float32(0)
    for e in range(p.shape[0]):
        p[e] = np.exp(p[e] - top)
        total += p[e]
    for e in range(p.shape[0]):
        p[e] /= total


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _keep_best_groups(by, groups, keep, summed):
    """by (E,): -inf outside the `keep` groups of E / groups consecutive experts whose `summed` best
    scores sum highest (ties to the lower group), as DeepSeek-V3's and GLM-4.5's routers mask them
    (two best), and DeepSeek-V2's group_limited_greedy (the best).
    The keep-th best group is found first; a group's score reads only its own experts, so masking
    one group after that leaves the others' scores as they were."""
    size = by.shape[0] // groups
    last_score, last = np.float32(np.inf), -1
    for _ in range(keep):  # the next group in (score descending, group ascending) order
        best_score, best = np.float32(-np.inf), -1
        for g in range(groups):
            score = _group_score(by, g, size, summed)
            after_last = score < last_score or (score == last_score and g > last)
            if after_last and (best < 0 or score > best_score):
                best_score, best = score, g
        last_score, last = best_score, best
    for g in range(groups):
        score = _group_score(by, g, size, summed)
        if score < last_score or (score == last_score and g > last):
            for e in range(g * size, (g + 1) * size):
                by[e] = -np.inf


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _group_score(by, g, size, summed):
    """The sum of group g's two best scores, or its best alone (summed 1)."""
    first, second = np.float32(-np.inf), np.float32(-np.inf)
    for e in range(g * size, (g + 1) * size):
        if by[e] > first:
            first, second = by[e], first
        elif by[e] > second:
            second = by[e]
    return first if summed == 1 else first + second


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
