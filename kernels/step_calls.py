"""Running the steps of the forward pass from its sequence: a step over the threads or on this
thread (run_step), a row operation (row_step), up to three matrices read from one input
(run_linear: the input prepared once per Operand, then one parallel region), a dense MLP (run_mlp).
"""

import numpy as np
from numba import njit

from .formats import Operand
from .forward_types import (
    ALWAYS, FROM_GATE, GATE_ROWS, LINEAR, LORA, MLP_PART, ONE, P_COUNT, P_LORA, P_MATRIX, P_OUTPUT, P_ROWS, P_WHICH, P_WIDTH, PARALLEL_REGION,
    PARALLEL_ROWS, PREPARE, TO_GATE_UP, TO_PROJ, TWO,
)
from .jit import call_at
from .matmul import ROWS_PER_TASK
from .work_sharing import start_claims

@njit(cache=True, _nrt=False)
def run_step(step, parallel, w, ws, state):
    """Run step `step` (an index of STEPS): every thread's share in the parallel region, or all
    of it on this thread."""
    if parallel:
        call_at(w.steps[PARALLEL_REGION], w.steps[step], np.int64(ws.claims.shape[1]), state)
    else:
        call_at(w.steps[step], np.int64(0), np.int64(1), state)


@njit(cache=True, _nrt=False)
def row_step(step, which, parallel, w, ws, state):
    ws.params[P_WHICH] = which
    run_step(step, parallel, w, ws, state)


@njit(cache=True, _nrt=False)
def run_linear(source, n, m0, m1, m2, target, w, ws, state):
    """Up to three matrices m0.. read from one input (source), into target: the input prepared
    once per Operand they read it as, then one parallel region runs them all, each matrix by its
    format's kernel."""
    p = ws.params
    p[P_WHICH], p[P_MATRIX], p[P_MATRIX + 1], p[P_MATRIX + 2], p[P_OUTPUT] = source, m0, m1, m2, target
    prepare_and_claim(p[P_MATRIX : P_MATRIX + 3], n, w, ws, state)
    run_step(LINEAR, ALWAYS, w, ws, state)
    if p[P_LORA]:  # the rows' adapters' updates, after the base products they add to
        run_step(LORA, ALWAYS, w, ws, state)


@njit(cache=True, _nrt=False)
def prepare_and_claim(matrices, n, w, ws, state):
    """Before a parallel region runs the n matrices matrices[:n] over the step's input
    (ws.params[P_WHICH], P_ROWS rows): the input prepared once per Operand they read it as, each
    matrix's tasks made claimable from claims[2j:2j + 2]; ws.params[P_COUNT] = n."""
    p = ws.params
    done = 0  # bit op: Operand op is prepared
    for j in range(n):
        op = w.operand[matrices[j]]
        if op != Operand.FLOAT32 and not (done >> op) & 1:
            p[P_COUNT] = op  # the prepare step reads the Operand here; the count is set below
            run_step(PREPARE, p[P_ROWS] >= PARALLEL_ROWS, w, ws, state)
            done |= 1 << op
    p[P_COUNT] = n
    for j in range(n):
        start_claims(ws.claims[2 * j : 2 * j + 2], (w.matrices[matrices[j], 1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK, ws.claims.shape[1])


@njit(cache=True, _nrt=False)
def run_mlp(source, gate, T, w, ws, state):
    """proj[:T] = down(act(gate(x)) * up(x)) for the T rows of x (source), the MLP whose gate, up
    and down matrices are at gate, gate + 1, gate + 2; without a gate matrix (0 rows: Apertus)
    down(act(up(x))), up written into the gate rows the activation and down read."""
    if w.matrices[gate, 1] == 0:
        ws.params[P_ROWS], ws.params[P_WIDTH] = T, w.matrices[gate + 1, 1]
        run_linear(source, ONE, gate + 1, gate + 1, gate + 1, TO_GATE_UP, w, ws, state)
    else:
        ws.params[P_ROWS], ws.params[P_WIDTH] = T, w.matrices[gate, 1]
        run_linear(source, TWO, gate, gate + 1, gate + 1, TO_GATE_UP, w, ws, state)
    row_step(GATE_ROWS, MLP_PART, T >= PARALLEL_ROWS, w, ws, state)
    run_linear(FROM_GATE, ONE, gate + 2, gate + 2, gate + 2, TO_PROJ, w, ws, state)
