"""The forward pass: the layer sequence, defined once, over a batch of rows, in one Numba call.

A row is one token of one sequence at one position. Decode is one row per sequence; a prefill
chunk is many rows of one sequence at consecutive positions; a step may hold both. Every sum has
one fixed order whatever else is in the batch (kernels.vector_ir), so a row's logits are the same
bits however it arrives: decode == batched decode == prefill.

Shapes: T rows, G of them wanting logits, H hidden, I intermediate, V vocab, L layers, nh/nkv
query/KV heads, hd head dim, ctx the cache's positions.

    x = embed[tokens] * embed_scale                                   (T, H)
    for each layer l:
        h = x + out_norm(o(attention(rope(qk_norm(qkv(norm(x)))))))      GQA, KV cache, window, soft cap
        x = h + out_norm(mlp(norm(h)))                                   dense or a mixture of experts
    logits = cap(lm_head(final_norm(x[logit_rows])) / logit_scale)    (G, V)

    latent attention (w.latent): qkv(y) = q_b(norm(q_a(y))) | k_b, v_b(norm(kv_a(y))), the shared
        RoPE key written into each head's key; o reads each head's value, packed
    mlp(x) = down(act(gate(x)) * up(x))                                  SiLU or GELU-tanh
    sparse layer: mlp(x) = sum over the router's top k experts e of p_e * mlp_e(x)
                           (+ sigmoid(shared gate . x) * mlp_shared(x), Qwen2-MoE)

Each norm, bias, q/k norm, RoPE table, window and cap is where the architecture has it (an
(L, 0) norm or bias is none; rope_table -1 is no RoPE; window 0 is every earlier key; cap 0 is
none), so nine architectures are parameters of this one sequence; a mixture of experts is a
router and E more MLPs per sparse layer (w.router), so Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE are
too. Each expert runs on the rows that chose it, gathered, so its weights are read once per step
for all of them, and every chosen expert's matrices share one parallel region (EXPERT_LINEAR); a
row sums its experts in ascending expert order whatever else is in the step.

A row may carry a LoRA adapter (rows.adapters): after each linear step its adapter's updates on
those matrices are added to the base products (kernels.lora), so rows of different adapters and
of the base model share one step.

Where things are: the data it reads and the step numbers (forward_types), the steps themselves,
each thread's share of one operation (steps), running them (step_calls), a mixture of experts'
layer (experts).

Every weight matrix is multiplied by its own format's compiled kernel, called by address
(kernels.matmul.kernels_for), in parallel regions of 16-row tasks shared among the threads
(kernels.work_sharing); the other row operations run in place between them, over the rows in
parallel for a prefill chunk and serially for a few decode rows (a parallel region costs more
than their work there). Python calls once per step: at 135M parameters a decode step is a few
milliseconds.
"""

import numpy as np
from numba import njit

from .forward_types import (
    ALWAYS, ATTENTION, ATTENTION_PART, EXPERTS, FROM_ATT, FROM_XN, GATE, K, LATENT, LATENT_OUT, LATENT_QKV, MATRIX_KINDS, MLP_PART, NORM, O,
    ONE, P_LAYER, P_LORA, P_ROWS, PARALLEL_ROWS, Q, QKV, RESIDUAL, THREE, TO_LOGITS, TO_PROJ, TO_QKV, V, state_address,
)
from .jit import EXACT_MATH, array_at, kernel
from .matmul import call_row
from .rmsnorm import norm_row
from .row_spans import attention_tasks
from .step_calls import row_step, run_linear, run_mlp, run_step
from .swiglu import softcap_row
from .work_sharing import start_claims


@kernel(parallel=False, fastmath=EXACT_MATH)
def forward(rows, w, ws, k_pool, v_pool, cos, sin):
    """Every layer for the rows of `rows` (Rows), with weights w (ModelWeights) and buffers ws
    (Workspace), into rows.logits. k_pool, v_pool: (slots, L, nkv, ctx, bytes of a stored row), the
    bytes of the KV format the steps were compiled for (step_kernels); each row's key and value
    are written at its slot and position before any row attends. cos, sin: RoPE tables
    (tables, ctx, hd / 2).

    Each step below is a compiled kernel, called by address (see STEPS): over the threads, or on
    this thread alone for the row operations of a few rows."""
    state = state_address((rows, w, ws, k_pool, v_pool, cos, sin))
    T = rows.tokens.shape[0]
    L = w.rope_table.shape[0]
    x = ws.x[:T]
    wide = T >= PARALLEL_ROWS  # the row operations run over the threads
    ws.params[P_LORA] = 0
    if w.lora_map.shape[0] > 0:
        for t in range(T):
            if rows.adapters[t] >= 0:
                ws.params[P_LORA] = 1
    embed = MATRIX_KINDS * L
    for t in range(T):
        call_row(w.row[embed], x[t], array_at(w.matrices, embed, np.uint8), array_at(w.scales, embed, np.uint16), rows.tokens[t])
        for n in range(x.shape[1]):
            x[t, n] *= np.float32(w.embed_scale)
    capture = rows.hidden.shape[0] > 0
    if capture:
        _copy_rows(rows.hidden[0], x)
    for l in range(L):
        m = MATRIX_KINDS * l
        ws.params[P_LAYER], ws.params[P_ROWS] = l, T
        # h = x + out_norm(o(attention(rope(qk_norm(q, k, v(norm(x)))))))
        row_step(NORM, ATTENTION_PART, wide, w, ws, state)
        if w.latent[l] < 0:
            run_linear(FROM_XN, THREE, m + Q, m + K, m + V, TO_QKV, w, ws, state)
        else:  # latent attention (kernels.latent): a step of its own, compiled only for such a model
            row_step(LATENT, LATENT_QKV, False, w, ws, state)
        row_step(QKV, ATTENTION_PART, wide, w, ws, state)
        start_claims(ws.claims[0:2], attention_tasks(ws.tasks, rows.positions, rows.slots, T, w.heads, k_pool.shape[2], ws.claims.shape[1]),
                     ws.claims.shape[1])
        run_step(ATTENTION, ALWAYS, w, ws, state)
        if w.latent[l] < 0:
            run_linear(FROM_ATT, ONE, m + O, m + O, m + O, TO_PROJ, w, ws, state)
        else:
            row_step(LATENT, LATENT_OUT, False, w, ws, state)
        row_step(RESIDUAL, ATTENTION_PART, wide, w, ws, state)
        # x = h + out_norm(mlp(norm(h))); in a parallel block xn still holds norm(x) for the MLP
        if not w.parallel:
            row_step(NORM, MLP_PART, wide, w, ws, state)
        if w.router[l] < 0:
            run_mlp(FROM_XN, m + GATE, T, w, ws, state)
        else:
            run_step(EXPERTS, False, w, ws, state)
        ws.params[P_ROWS] = T
        row_step(RESIDUAL, MLP_PART, wide, w, ws, state)
        if capture:
            _copy_rows(rows.hidden[l + 1], x)
    if capture:
        for t in range(T):
            norm_row(rows.hidden[L + 1, t], x[t], w.final_norm, w.eps, w.centered_norm)
    # logits = cap(lm_head(final_norm(x[logit_rows]))): the logit rows' norms into xn's first rows
    G = rows.logit_rows.shape[0]
    for g in range(G):
        norm_row(ws.xn[g], x[rows.logit_rows[g]], w.final_norm, w.eps, w.centered_norm)
    ws.params[P_ROWS] = G
    run_linear(FROM_XN, ONE, embed + 1, embed + 1, embed + 1, TO_LOGITS, w, ws, state)
    if w.logit_scale != 1:
        for g in range(G):
            for v in range(rows.logits.shape[1]):
                rows.logits[g, v] /= w.logit_scale
    if w.final_softcap > 0:
        for g in range(G):
            softcap_row(rows.logits[g], w.final_softcap)


@njit(cache=True, _nrt=False)
def _copy_rows(out, x):
    """out[:len(x)] = x, element by element: a slice assignment from an array compiles Numba's
    shape-mismatch message (f-strings, str, join), ~5 s of a first run's forward pass."""
    for t in range(x.shape[0]):
        for n in range(x.shape[1]):
            out[t, n] = x[t, n]
