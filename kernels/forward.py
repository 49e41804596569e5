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

Every weight matrix is multiplied by its own format's compiled kernel, called by address
(kernels.formats), in parallel regions of 16-row tasks shared among the threads
(kernels.work_sharing); the other row operations run in place between them, over the rows in
parallel for a prefill chunk and serially for a few decode rows (a parallel region costs more
than their work there). Python calls once per step: at 135M parameters a decode step is a few
milliseconds.
"""

from typing import NamedTuple

import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic

from .activation_operands import call_prepare
from .attention import QUERIES_PER_TASK, attend, attend_queries, first_key
from .formats import Operand
from .jit import EXACT_MATH, array_at, call_at, kernel, native_address, rows_view
from .kv_rows import kv_store
from .matmul import ROWS_PER_TASK, call_linear, call_row
from .rmsnorm import layernorm_row, rmsnorm_row
from .rope import rope_row
from .swiglu import GELU_TANH, clamped_gated_row, gated_row, softcap_row
from .work_sharing import claim, start_claims

# The constants the forward pass passes to its helpers are NumPy integers: Numba types a Python
# int constant as a literal and compiles a called function again for each value.
_n = np.int64

# A layer's matrices, by kind; matrix m of layer l is at MATRIX_KINDS * l + m in ModelWeights,
# then the embedding and the LM head.
Q, K, V, O, GATE, UP, DOWN = (_n(i) for i in range(7))
MATRIX_KINDS = 7

PARALLEL_ROWS = 16  # from this many rows on, the row operations run in parallel

# ws.params while a step runs
P_LAYER, P_ROWS, P_WHICH, P_COUNT, P_MATRIX = 0, 1, 2, 3, 4  # P_MATRIX.. P_MATRIX + 2: up to three matrices
P_OUTPUT = 7
P_WIDTH = 8  # the MLP's intermediate width in this layer (its gate matrix's rows)
PARAMS = 9
ATTENTION_PART, MLP_PART = _n(0), _n(1)  # which sub-block a norm or residual step serves
# what a linear step reads (P_WHICH) and writes (P_OUTPUT)
FROM_XN, FROM_ATT, FROM_GATE, FROM_XE = _n(0), _n(1), _n(2), _n(3)
TO_QKV, TO_PROJ, TO_GATE_UP, TO_LOGITS, TO_ROUTER = _n(0), _n(1), _n(2), _n(3), _n(4)
JOB_GATE, JOB_UP, JOB_XE = 0, 1, 2  # where an expert job writes: gate, up (its rows), xe (its rows)
ONE, TWO, THREE = _n(1), _n(2), _n(3)  # matrices read from one input
ALWAYS = np.bool_(True)


class Rows(NamedTuple):
    """What one forward call runs and where its results go."""

    tokens: np.ndarray  # (T,) int64
    positions: np.ndarray  # (T,) int64: each row's position in its sequence
    slots: np.ndarray  # (T,) int64: each row's sequence's slot in the KV pool
    logit_rows: np.ndarray  # (G,) int64: the rows whose logits are wanted, in this order
    logits: np.ndarray  # (G, V) float32, out
    hidden: np.ndarray  # (L + 2, T, H) float32, out: after the embedding, each layer, the final norm; or (0, 0, 0)
    experts: np.ndarray  # (L, T, k) int64, out: each sparse layer's experts for each row, ascending; or (0, 0, 0)


class ModelWeights(NamedTuple):
    """The weights and architecture as the forward pass reads them (minillm's Model builds them
    once at load). A matrix is its stored rows as bytes, whatever its format, with the addresses
    of its format's kernels beside it."""

    matrices: np.ndarray  # (M, 3) int64: each matrix's data address, rows, bytes per row (the arrays are
    #   the loader's, kept alive by the model); layer l's kind m at MATRIX_KINDS * l + m, then embedding, LM head,
    #   then the sparse layers' routers and experts (router); a sparse layer's GATE, UP, DOWN are its
    #   shared expert, or matrices of 0 rows
    scales: np.ndarray  # (M, 3) int64: the same for its float16 scales (I8: (N, K / 32)), or a (1, 1) array
    linear: np.ndarray  # (M,) int64: the address of each matrix's linear kernel
    row: np.ndarray  # (M,) int64: of its row kernel (the embedding's is read)
    operand: np.ndarray  # (M,) int64: the Operand its activations are prepared as
    prepare: np.ndarray  # (4,) int64: the address of each Operand's prepare kernel, 0 for none
    steps: np.ndarray  # (len(STEPS) + 1,) int64: the addresses of the steps' kernels, then of the parallel region
    attn_norm: np.ndarray  # (L, H) before attention, or (L, 0)
    attn_out_norm: np.ndarray  # (L, H) on attention's output, or (L, 0)
    mlp_norm: np.ndarray  # (L, H) before the MLP, or (L, 0)
    mlp_out_norm: np.ndarray  # (L, H) on the MLP's output, or (L, 0)
    q_norm: np.ndarray  # (L, hd) per head, (L, q_dim) over the projection, or (L, 0)
    k_norm: np.ndarray  # (L, hd), (L, kv_dim) or (L, 0)
    final_norm: np.ndarray  # (H,)
    qkv_bias: np.ndarray  # (L, q_dim + 2 kv_dim) or (L, 0)
    o_bias: np.ndarray  # (L, H) or (L, 0)
    gate_up_bias: np.ndarray  # (L, 2 I) or (L, 0)
    down_bias: np.ndarray  # (L, H) or (L, 0)
    rope_table: np.ndarray  # (L,) int64: layer l's RoPE table in cos/sin, or -1 (no RoPE)
    window: np.ndarray  # (L,) int64: layer l's sliding window, or 0 (every earlier key)
    heads: int  # nh
    eps: float  # RMSNorm's epsilon
    embed_scale: float  # the embedding is multiplied by it (Gemma: sqrt(H); else 1)
    attn_scale: float  # attention scores are multiplied by it
    attn_softcap: float  # scores -> cap * tanh(scores / cap) when > 0
    final_softcap: float  # logits -> cap * tanh(logits / cap) when > 0
    activation: int  # the MLP's gated activation (kernels.swiglu): SILU, GELU_TANH or CLAMPED_SWIGLU
    router: np.ndarray  # (L,) int64: a sparse layer's router in matrices ((E, H), or (E + 1, H) with the
    #   shared expert's gate last), expert e's gate, up, down at router + 1 + 3 e + 0, 1, 2; -1: a dense layer
    experts: int  # E, experts per sparse layer (0: a dense model)
    experts_per_token: int  # the router's top k
    norm_topk: bool  # the top k weights renormalised to sum to 1
    topk_softmax: bool  # the top k by logit, their weights the softmax of those k logits (gpt-oss)
    router_bias: np.ndarray  # (L, E) added to the router's logits, or (L, 0)
    expert_gate_up_bias: np.ndarray  # (L, E, 2 I) each expert's gate | up bias (gpt-oss), or (0, 0, 0)
    expert_down_bias: np.ndarray  # (L, E, H) each expert's down bias, or (0, 0, 0)
    sinks: np.ndarray  # (L, nh) each head's attention sink logit (gpt-oss), or (L, 0)
    swiglu_alpha: float  # CLAMPED_SWIGLU's sigmoid gain
    swiglu_limit: float  # and clamp
    residual_scale: float  # each sub-block's output is multiplied by it before the residual add (Granite; else 1)
    logit_scale: float  # logits are divided by it (Granite; else 1)
    centered_norm: bool  # the layers' and the final norm subtract the mean first: LayerNorm without a bias (Cohere 2)
    parallel: bool  # the MLP reads the attention's normalised input, not h (Cohere 2: x + attn(norm(x)) + mlp(norm(x)))


class Workspace(NamedTuple):
    """Buffers for up to R rows, allocated once (minillm's Model), so a step allocates nothing."""

    x: np.ndarray  # (R, H) the residual stream
    xn: np.ndarray  # (R, H) a sub-block's normalised input; the logit rows' final norm
    qkv: np.ndarray  # (R, q_dim + 2 kv_dim) q | k | v
    att: np.ndarray  # (R, q_dim) attention's output
    proj: np.ndarray  # (R, H) o / down projection before the residual add
    gate: np.ndarray  # (1, R * widest I): the MLP's gate rows, (T, I) for the layer's I (_mlp_rows)
    up: np.ndarray  # (1, R * widest I)
    operands: np.ndarray  # (4, R * max K) uint16: activations prepared per Operand (flat; viewed (T, K))
    operand_scales: np.ndarray  # (4, R * (3 max K / 32 + 1)) float32: their block scales
    scratch: np.ndarray  # (threads, 8 max K) float32: a thread's panel or scale table (kernels.matmul)
    scores: np.ndarray  # (threads * max(4, n_rep), ctx) float32: a thread's attention score rows
    claims: np.ndarray  # (2 max(3, 2 E), threads) int64: the task shares of up to three matrices, or of the expert jobs (kernels.work_sharing)
    params: np.ndarray  # (PARAMS,) int64: the arguments of the step running (P_* below)
    tasks: np.ndarray  # (R * nh + nh, 4) int64: attention tasks (first row, end row, first head, end head)
    # a mixture of experts' buffers ((0, 0) in a dense model)
    moe: np.ndarray  # (R, H) the routed experts' weighted sum
    xe: np.ndarray  # (R k, H) the rows each chosen expert runs, gathered from xn expert by expert; then their outputs
    route: np.ndarray  # (R, E + 1) the router's logits, then probabilities; the shared expert's gate last
    chosen: np.ndarray  # (R, k) int64: each row's experts, ascending
    chosen_weight: np.ndarray  # (R, k) float32: their weights
    place: np.ndarray  # (R, k) int64: the row of xe that holds each choice
    jobs: np.ndarray  # (2 E, 4) int64: the expert matrices a step runs: matrix, first row of xe, rows, output (JOB_*)


# Their Numba types, fixed whatever the model (a format changes addresses, not types): the forward
# pass and its steps compile once per machine. minillm's Model checks its values against them.
_F1, _F2, _F3 = (types.Array(types.float32, n, "C") for n in (1, 2, 3))
_P5 = types.Array(types.uint8, 5, "C")  # a KV pool as bytes, whatever its KV format: the steps that
# read or write it (KV_STEPS) view it as their format's rows
_I1, _I2, _I3 = (types.Array(types.int64, n, "C") for n in (1, 2, 3))
ROWS_TYPE = types.NamedTuple([_I1, _I1, _I1, _I1, _F2, _F3, _I3], Rows)
MODEL_WEIGHTS_TYPE = types.NamedTuple(
    [_I2, _I2, _I1, _I1, _I1, _I1, _I1,
     *[_F2] * 6, _F1, *[_F2] * 4, _I1, _I1, types.int64, *[types.float32] * 5, types.int64,
     _I1, types.int64, types.int64, types.boolean, types.boolean, _F2, _F3, _F3, _F2, *[types.float32] * 4, types.boolean, types.boolean], ModelWeights)
WORKSPACE_TYPE = types.NamedTuple([*[_F2] * 7, types.Array(types.uint16, 2, "C"), _F2, _F2, _F2, _I2, _I1, _I2,
                                   _F2, _F2, _F2, _I2, _F2, _I2, _I2], Workspace)
STATE_TYPE = types.Tuple([ROWS_TYPE, MODEL_WEIGHTS_TYPE, WORKSPACE_TYPE, _P5, _P5, _F3, _F3])  # (rows, w, ws, k_pool, v_pool, cos, sin)


@intrinsic
def _state_address(typingctx, state):
    """The address of a copy of `state` in the caller's frame, for the steps it calls."""
    if state != STATE_TYPE:
        return None

    def codegen(context, builder, sig, args):
        return builder.ptrtoint(cgutils.alloca_once_value(builder, args[0]), context.get_value_type(types.int64))

    return types.int64(state), codegen


@intrinsic
def _state_at(typingctx, address):
    """The state at `address` (_state_address), read without reference counting: the steps are
    compiled without it (a step's share runs while the forward pass holds every array)."""

    def codegen(context, builder, sig, args):
        value = builder.load(builder.inttoptr(args[0], context.get_value_type(STATE_TYPE).as_pointer()))
        return impl_ret_borrowed(context, builder, STATE_TYPE, value)  # counted where counting is on

    return STATE_TYPE(types.int64), codegen


@kernel(parallel=False, fastmath=EXACT_MATH)
def forward(rows, w, ws, k_pool, v_pool, cos, sin):
    """Every layer for the rows of `rows` (Rows), with weights w (ModelWeights) and buffers ws
    (Workspace), into rows.logits. k_pool, v_pool: (slots, L, nkv, ctx, bytes of a stored row), the
    bytes of the KV format the steps were compiled for (step_kernels); each row's key and value
    are written at its slot and position before any row attends. cos, sin: RoPE tables
    (tables, ctx, hd / 2).

    Each step below is a compiled kernel, called by address (see STEPS): over the threads, or on
    this thread alone for the row operations of a few rows."""
    state = _state_address((rows, w, ws, k_pool, v_pool, cos, sin))
    T = rows.tokens.shape[0]
    L = w.rope_table.shape[0]
    x = ws.x[:T]
    wide = T >= PARALLEL_ROWS  # the row operations run over the threads
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
        _row_step(NORM, ATTENTION_PART, wide, w, ws, state)
        _linear_step(FROM_XN, THREE, m + Q, m + K, m + V, TO_QKV, w, ws, state)
        _row_step(QKV, ATTENTION_PART, wide, w, ws, state)
        start_claims(ws.claims[0:2], _attention_tasks(ws.tasks, rows.positions, rows.slots, T, w.heads, k_pool.shape[2], ws.claims.shape[1]),
                     ws.claims.shape[1])
        _run(ATTENTION, ALWAYS, w, ws, state)
        _linear_step(FROM_ATT, ONE, m + O, m + O, m + O, TO_PROJ, w, ws, state)
        _row_step(RESIDUAL, ATTENTION_PART, wide, w, ws, state)
        # x = h + out_norm(mlp(norm(h))); in a parallel block xn still holds norm(x) for the MLP
        if not w.parallel:
            _row_step(NORM, MLP_PART, wide, w, ws, state)
        if w.router[l] < 0:
            _mlp(FROM_XN, m + GATE, T, w, ws, state)
        else:
            _run(EXPERTS, False, w, ws, state)
        ws.params[P_ROWS] = T
        _row_step(RESIDUAL, MLP_PART, wide, w, ws, state)
        if capture:
            _copy_rows(rows.hidden[l + 1], x)
    if capture:
        for t in range(T):
            _norm_row(rows.hidden[L + 1, t], x[t], w.final_norm, w.eps, w.centered_norm)
    # logits = cap(lm_head(final_norm(x[logit_rows]))): the logit rows' norms into xn's first rows
    G = rows.logit_rows.shape[0]
    for g in range(G):
        _norm_row(ws.xn[g], x[rows.logit_rows[g]], w.final_norm, w.eps, w.centered_norm)
    ws.params[P_ROWS] = G
    _linear_step(FROM_XN, ONE, embed + 1, embed + 1, embed + 1, TO_LOGITS, w, ws, state)
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


@njit(cache=True, _nrt=False)
def _mlp(source, gate, T, w, ws, state):
    """proj[:T] = down(act(gate(x)) * up(x)) for the T rows of x (source), the MLP whose gate, up
    and down matrices are at gate, gate + 1, gate + 2."""
    ws.params[P_ROWS], ws.params[P_WIDTH] = T, w.matrices[gate, 1]
    _linear_step(source, TWO, gate, gate + 1, gate + 1, TO_GATE_UP, w, ws, state)
    _row_step(GATE_ROWS, MLP_PART, T >= PARALLEL_ROWS, w, ws, state)
    _linear_step(FROM_GATE, ONE, gate + 2, gate + 2, gate + 2, TO_PROJ, w, ws, state)


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _experts(l, T, w, ws, state):
    """proj[:T] = layer l's mixture of experts of xn[:T]: the router's top k per row (_route);
    the rows gathered expert by expert (_gather), so that every chosen expert's gate and up run
    in one parallel region, each over its own rows, and then every down; each row adds its
    experts' outputs times their weights in ascending expert order; then the shared expert,
    scaled by the sigmoid of its gate, where the layer has one."""
    E, r, k = w.experts, w.router[l], w.experts_per_token
    ws.params[P_ROWS] = T
    _linear_step(FROM_XN, ONE, r, r, r, TO_ROUTER, w, ws, state)
    if w.router_bias.shape[1] > 0:
        for t in range(T):
            for e in range(E):
                ws.route[t, e] += w.router_bias[l, e]
    _route(ws.route[:T], E, ws.chosen[:T], ws.chosen_weight[:T], w.norm_topk, w.topk_softmax)
    n, R = _gather(ws, T, E, r)
    width = w.matrices[r + 1, 1]
    ws.params[P_ROWS], ws.params[P_WIDTH] = R, width
    _expert_linear(FROM_XE, n, w, ws, state)
    biased = w.expert_down_bias.shape[0] > 0
    if biased:
        _add_expert_bias(ws, w.expert_gate_up_bias, l, r, n, width)
    _row_step(GATE_ROWS, MLP_PART, R >= PARALLEL_ROWS, w, ws, state)
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
        _mlp(FROM_XN, shared, T, w, ws, state)
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
    (source: xe, or the gate rows) prepared once for all of them per Operand."""
    ws.params[P_WHICH] = source
    _prepare_and_claim(ws.jobs[:, 0], n, w, ws, state)
    _run(EXPERT_LINEAR, ALWAYS, w, ws, state)


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
def _gather(ws, T, E, r):
    """The T rows' choices gathered expert by expert: each chosen expert's rows of xn copied to
    consecutive rows of xe (ascending), place[t, j] the row of row t's choice j; its gate and up
    matrices as jobs. Returns (jobs, rows of xe)."""
    n = 0
    row = 0
    for e in range(E):
        first = row
        for t in range(T):
            for j in range(ws.chosen.shape[1]):
                if ws.chosen[t, j] == e:
                    ws.place[t, j] = row
                    for c in range(ws.xn.shape[1]):
                        ws.xe[row, c] = ws.xn[t, c]
                    row += 1
        if row > first:
            for kind in range(2):  # gate, up
                ws.jobs[n, 0], ws.jobs[n, 1], ws.jobs[n, 2], ws.jobs[n, 3] = r + 1 + 3 * e + kind, first, row - first, kind
                n += 1
    return n, row


@njit(inline="always", _nrt=False)
def _mlp_rows(flat, T, width):
    """An MLP buffer's first T rows of the layer's width (gate, up: (1, R * widest I))."""
    return rows_view(flat[0], T, width)


@njit(inline="always", _nrt=False)
def _source_rows(ws, source, T):
    """The T rows a linear step reads."""
    if source == FROM_ATT:
        return ws.att[:T]
    if source == FROM_GATE:
        return _mlp_rows(ws.gate, T, ws.params[P_WIDTH])
    if source == FROM_XE:
        return ws.xe[:T]
    return ws.xn[:T]


@njit(cache=True, _nrt=False)
def _run(step, parallel, w, ws, state):
    """Run step `step` (an index of STEPS): every thread's share in the parallel region, or all
    of it on this thread."""
    if parallel:
        call_at(w.steps[PARALLEL_REGION], w.steps[step], np.int64(ws.claims.shape[1]), state)
    else:
        call_at(w.steps[step], np.int64(0), np.int64(1), state)


@njit(cache=True, _nrt=False)
def _row_step(step, which, parallel, w, ws, state):
    ws.params[P_WHICH] = which
    _run(step, parallel, w, ws, state)


@njit(cache=True, _nrt=False)
def _linear_step(source, n, m0, m1, m2, target, w, ws, state):
    """Up to three matrices m0.. read from one input (source), into target: the input prepared
    once per Operand they read it as, then one parallel region runs them all, each matrix by its
    format's kernel."""
    p = ws.params
    p[P_WHICH], p[P_MATRIX], p[P_MATRIX + 1], p[P_MATRIX + 2], p[P_OUTPUT] = source, m0, m1, m2, target
    _prepare_and_claim(p[P_MATRIX : P_MATRIX + 3], n, w, ws, state)
    _run(LINEAR, ALWAYS, w, ws, state)


@njit(cache=True, _nrt=False)
def _prepare_and_claim(matrices, n, w, ws, state):
    """Before a parallel region runs the n matrices matrices[:n] over the step's input
    (ws.params[P_WHICH], P_ROWS rows): the input prepared once per Operand they read it as, each
    matrix's tasks made claimable from claims[2j:2j + 2]; ws.params[P_COUNT] = n."""
    p = ws.params
    done = 0  # bit op: Operand op is prepared
    for j in range(n):
        op = w.operand[matrices[j]]
        if op != Operand.FLOAT32 and not (done >> op) & 1:
            p[P_COUNT] = op  # the prepare step reads the Operand here; the count is set below
            _run(PREPARE, p[P_ROWS] >= PARALLEL_ROWS, w, ws, state)
            done |= 1 << op
    p[P_COUNT] = n
    for j in range(n):
        start_claims(ws.claims[2 * j : 2 * j + 2], (w.matrices[matrices[j], 1] + ROWS_PER_TASK - 1) // ROWS_PER_TASK, ws.claims.shape[1])


# ---------------------------------------------------------------- the steps
#
# Each step's kernel does thread t's share of it: step(t, threads, state), state the address of
# (rows, w, ws, k_pool, v_pool, cos, sin) (_state_at), its own arguments in ws.params.


def prepare_step(t, threads, state):
    """Thread t's share of the rows of a linear step's input, prepared as the Operand in
    ws.params[P_COUNT] by that Operand's kernel."""
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
    T, op, source = ws.params[P_ROWS], ws.params[P_COUNT], ws.params[P_WHICH]
    x = _source_rows(ws, source, T)
    K = x.shape[1]
    xo, xs = rows_view(ws.operands[op], T, K), rows_view(ws.operand_scales[op], T, 3 * (K // 32) + 1)
    call_prepare(w.prepare[op], xo, xs, x, np.int64(T * t // threads), np.int64(T * (t + 1) // threads))


def linear_step(t, threads, state):
    """Thread t's tasks of up to three matrices read from one input (ws.params), each by its
    format's linear kernel (kernels.matmul), its tasks shared from claims[2j:2j + 2]."""
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
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
        elif target == TO_GATE_UP:
            out, col = _mlp_rows(ws.gate if j == 0 else ws.up, T, p[P_WIDTH]), 0
        elif target == TO_LOGITS:
            out, col = rows.logits, 0
        elif target == TO_ROUTER:
            out, col = ws.route[:T], 0
        else:
            out, col = ws.proj[:T], 0
        call_linear(w.linear[m], out, np.int64(col), array_at(w.matrices, m, np.uint8), array_at(w.scales, m, np.uint16), x, xo, xs, ws.scratch[t], ws.claims[2 * j : 2 * j + 2],
                    np.int64(t))


def expert_linear_step(t, threads, state):
    """Thread t's tasks of the expert jobs (ws.jobs, ws.params[P_COUNT] of them): each matrix
    over its own rows of the input (xe, or the gate rows) into its rows of gate, up or xe, by
    its format's linear kernel, its tasks shared from claims[2j:2j + 2]. A thread done with one
    matrix's tasks goes on to the next: no barrier between experts."""
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
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
    """Layer ws.params[P_LAYER]'s mixture of experts over the step's rows (_experts), run on
    this thread: its matrices run in parallel regions of their own. A step of its own, so a
    dense model's forward pass never compiles it."""
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
    l, T = ws.params[P_LAYER], ws.params[P_ROWS]
    _experts(l, T, w, ws, state)
    if rows.experts.shape[0] > 0:
        for t in range(T):
            for j in range(ws.chosen.shape[1]):
                rows.experts[l, t, j] = ws.chosen[t, j]


def norm_step(t, threads, state):
    """Thread t's rows of xn = norm(x), the attention's or the MLP's norm (ws.params[P_WHICH])."""
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
    l, T = ws.params[P_LAYER], ws.params[P_ROWS]
    norm = w.attn_norm if ws.params[P_WHICH] == ATTENTION_PART else w.mlp_norm
    _norm_span(T * t // threads, T * (t + 1) // threads, ws.xn, ws.x, norm, l, w.eps, w.centered_norm)


def qkv_step(t, threads, state):
    """Thread t's rows of q | k | v finished (_qkv_span) and their keys and values cached, float32 KV."""
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
    _qkv_share(t, threads, rows, w, ws, k_pool.view(np.float32), v_pool.view(np.float32), cos, sin)


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _qkv_share(t, threads, rows, w, ws, k_pool, v_pool, cos, sin):
    """qkv_step with the pools as their KV format's rows."""
    l, T = ws.params[P_LAYER], ws.params[P_ROWS]
    _qkv_span(T * t // threads, T * (t + 1) // threads, ws.qkv, w.qkv_bias, w.q_norm, w.k_norm, l, w.eps, w.rope_table[l], cos, sin,
              rows.positions, rows.slots, k_pool, v_pool, ws.att.shape[1], ws.att.shape[1] // w.heads)


def residual_step(t, threads, state):
    """Thread t's rows of x += out_norm(proj + bias), after attention or the MLP (ws.params[P_WHICH])."""
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
    l, T = ws.params[P_LAYER], ws.params[P_ROWS]
    if ws.params[P_WHICH] == ATTENTION_PART:
        bias, norm = w.o_bias, w.attn_out_norm
    else:
        bias, norm = w.down_bias, w.mlp_out_norm
    _residual_span(T * t // threads, T * (t + 1) // threads, ws.x, ws.proj, bias, norm, l, w.eps, w.residual_scale)


def gate_step(t, threads, state):
    """Thread t's rows of gate = act(gate + bias) * (up + bias), act SiLU or GELU-tanh."""
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
    l, T = ws.params[P_LAYER], ws.params[P_ROWS]
    gate, up = _mlp_rows(ws.gate, T, ws.params[P_WIDTH]), _mlp_rows(ws.up, T, ws.params[P_WIDTH])
    _gate_span(T * t // threads, T * (t + 1) // threads, gate, up, w.gate_up_bias, l, w.activation == GELU_TANH)


def gate_step_clamped(t, threads, state):
    """gate_step with gpt-oss's clamped SwiGLU (its experts carry their biases themselves)."""
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
    T, width = ws.params[P_ROWS], ws.params[P_WIDTH]
    gate, up = _mlp_rows(ws.gate, T, width), _mlp_rows(ws.up, T, width)
    for r in range(T * t // threads, T * (t + 1) // threads):
        clamped_gated_row(gate[r], up[r], w.swiglu_alpha, w.swiglu_limit)


def attention_step(t, threads, state):
    """att = causal softmax attention of each row's queries over its slot's cache, layer l: thread
    t's share of the tasks of _attention_tasks. Query head h reads KV head h // n_rep (GQA without
    copying KV heads); a query at position p sees positions 0..p, or with a sliding window the
    last `window` of them. Every output equals what attend gives one query alone, bit for bit.
    float32 KV; KV_STEPS has the other formats', and those with attention sinks."""
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
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

STEPS = (linear_step, attention_step, norm_step, qkv_step, residual_step, gate_step, prepare_step, experts_step, expert_linear_step)
LINEAR, ATTENTION, NORM, QKV, RESIDUAL, GATE_ROWS, PREPARE, EXPERTS, EXPERT_LINEAR = (_n(i) for i in range(len(STEPS)))
MOE_STEPS = (experts_step, expert_linear_step)  # compiled only for a mixture of experts
PARALLEL_REGION = len(STEPS)


# The steps that read or write the KV pools, per KV format (kernels.formats.KV_FORMATS): each views
# the pools' bytes as its format's rows, so only the format a model uses is compiled.


def attention_step_float16(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
    _attention_share(t, rows, w, ws, k_pool.view(np.int16), v_pool.view(np.int16), None)


def qkv_step_float16(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
    _qkv_share(t, threads, rows, w, ws, k_pool.view(np.int16), v_pool.view(np.int16), cos, sin)


def attention_step_bfloat16(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
    _attention_share(t, rows, w, ws, k_pool.view(np.uint16), v_pool.view(np.uint16), None)


def qkv_step_bfloat16(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
    _qkv_share(t, threads, rows, w, ws, k_pool.view(np.uint16), v_pool.view(np.uint16), cos, sin)


def attention_step_q8_0(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
    _attention_share(t, rows, w, ws, k_pool, v_pool, None)  # Q8_0 blocks are bytes already


def qkv_step_q8_0(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
    _qkv_share(t, threads, rows, w, ws, k_pool, v_pool, cos, sin)


# With attention sinks (gpt-oss): steps of their own, so other models never compile them.


def attention_step_sinks(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
    _attention_share(t, rows, w, ws, k_pool.view(np.float32), v_pool.view(np.float32), w.sinks)


def attention_step_float16_sinks(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
    _attention_share(t, rows, w, ws, k_pool.view(np.int16), v_pool.view(np.int16), w.sinks)


def attention_step_bfloat16_sinks(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
    _attention_share(t, rows, w, ws, k_pool.view(np.uint16), v_pool.view(np.uint16), w.sinks)


def attention_step_q8_0_sinks(t, threads, state):
    rows, w, ws, k_pool, v_pool, cos, sin = _state_at(state)
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


def step_kernels(kv_format: str = "float32", experts: bool = False, sinks: bool = False, clamped: bool = False) -> np.ndarray:
    """The addresses of the steps' kernels for a KV format, then of the parallel region (compiled
    the first time on a machine, then loaded from Numba's cache); the experts' steps only for a
    mixture of experts (else 0: never called); attention with sinks and the clamped SwiGLU gate
    only for a model that has them (gpt-oss)."""
    plain, with_sinks, qkv = KV_STEPS[kv_format]
    chosen = {attention_step: with_sinks if sinks else plain, qkv_step: qkv, gate_step: gate_step_clamped if clamped else gate_step}
    steps = [chosen.get(step, step) for step in STEPS]
    return np.array([0 if step in MOE_STEPS and not experts else _compile_step(step) for step in (*steps, parallel_region)], np.int64)


# ---------------------------------------------------------------- attention tasks and row spans


@njit(cache=True, _nrt=False)
def _attention_tasks(tasks, positions, slots, T, nh, nkv, threads):
    """The attention tasks of the rows into tasks[:n] (first row, end row, first head, end head);
    returns n. A run of rows of one slot at consecutive positions (a prefill chunk) is tasks of
    4 queries of one head, scores in 4 x 4 tiles (each key loaded once for 4 queries); a lone row
    (decode) is tasks of one KV head with its query heads (attend: each key and value read once
    for all of them), split in parts until the tasks divide evenly among the threads. One
    sequence of the default model is 3 KV heads: 2 + 1 on two threads cost float32 decode 3% (4
    alternating rounds); in 2 parts, 6 tasks of 1 or 2 heads go 4 + 5 heads."""
    n_rep = nh // nkv
    lone = 0
    r = 0
    while r < T:
        e = _run_end(positions, slots, T, r)
        lone += e - r == 1
        r = e
    parts = 1
    while parts < n_rep and (lone * nkv * parts) % threads != 0:
        parts += 1
    n = 0
    r = 0
    while r < T:
        e = _run_end(positions, slots, T, r)
        if e - r == 1:
            for kv in range(nkv):
                for p in range(parts):
                    tasks[n, 0], tasks[n, 1] = r, r + 1
                    tasks[n, 2], tasks[n, 3] = kv * n_rep + n_rep * p // parts, kv * n_rep + n_rep * (p + 1) // parts
                    n += 1
        else:
            for h in range(nh):
                for q0 in range(r, e, QUERIES_PER_TASK):
                    tasks[n, 0], tasks[n, 1], tasks[n, 2], tasks[n, 3] = q0, min(e, q0 + QUERIES_PER_TASK), h, h + 1
                    n += 1
        r = e
    return n


@njit(cache=True, _nrt=False)
def _run_end(positions, slots, T, r):
    """The end of the run of rows from r: one slot, consecutive positions."""
    e = r + 1
    while e < T and slots[e] == slots[r] and positions[e] == positions[e - 1] + 1:
        e += 1
    return e


@njit(inline="always", _nrt=False)
def _norm_row(out, x, w, eps, centered):
    """RMSNorm, or LayerNorm without a bias where the model's norms are centered."""
    if centered:
        layernorm_row(out, x, w, eps)
    else:
        rmsnorm_row(out, x, w, eps)


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _norm_span(r0, r1, out, x, norm, l, eps, centered):
    """out[t] = rmsnorm(x[t]) (layernorm when centered) with layer l's weights, or a copy of x[t]
    where the layer has no norm at that place (norm is (L, 0))."""
    for t in range(r0, r1):
        if norm.shape[1] > 0:
            _norm_row(out[t], x[t], norm[l], eps, centered)
        else:
            for n in range(x.shape[1]):
                out[t, n] = x[t, n]


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _qkv_span(r0, r1, qkv, bias, q_norm, k_norm, l, eps, table, cos, sin, positions, slots, k_pool, v_pool, q_dim, hd):
    """Each row's q | k | v: + bias, q/k norm (per head or over the projection), RoPE at its
    position (table -1: none); then its key and value into its slot of layer l's cache, in the
    pools' KV format."""
    nkv = k_pool.shape[2]
    kv_dim = nkv * hd
    for t in range(r0, r1):
        if bias.shape[1] > 0:
            for r in range(q_dim + 2 * kv_dim):
                qkv[t, r] += bias[l, r]
        q = qkv[t, :q_dim]
        k = qkv[t, q_dim : q_dim + kv_dim]
        v = qkv[t, q_dim + kv_dim :]
        _norm_groups(q, q_norm, l, eps)
        _norm_groups(k, k_norm, l, eps)
        pos = positions[t]
        if table >= 0:
            rope_row(q, cos[table], sin[table], pos, hd)
            rope_row(k, cos[table], sin[table], pos, hd)
        for h in range(nkv):
            kv_store(k_pool[slots[t], l, h, pos], k[h * hd : (h + 1) * hd])
            kv_store(v_pool[slots[t], l, h, pos], v[h * hd : (h + 1) * hd])


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _norm_groups(x, norm, l, eps):
    """RMSNorm of x in place, group by group of norm's width (a head, or the whole projection:
    the q/k norm of Qwen3, Gemma 3 and OLMo 2); nothing when norm is (L, 0)."""
    n = norm.shape[1]
    if n > 0:
        for g in range(x.shape[0] // n):
            rmsnorm_row(x[g * n : (g + 1) * n], x[g * n : (g + 1) * n], norm[l], eps)


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _residual_span(r0, r1, x, proj, bias, norm, l, eps, scale):
    """x[t] += norm(proj[t] + bias) * scale: layer l's bias row and output norm, each where the
    model has one ((L, 0) otherwise); scale 1 but in Granite."""
    for t in range(r0, r1):
        if bias.shape[1] > 0:
            for n in range(x.shape[1]):
                proj[t, n] += bias[l, n]
        if norm.shape[1] > 0:
            rmsnorm_row(proj[t], proj[t], norm[l], eps)
        if scale != 1:
            for n in range(x.shape[1]):
                proj[t, n] *= scale
        for n in range(x.shape[1]):
            x[t, n] += proj[t, n]


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def _gate_span(r0, r1, gate, up, bias, l, gelu):
    """gate[t] = act(gate[t] + bias) * (up[t] + bias), bias being layer l's (gate | up) row when
    the model has biases, act SiLU or (gelu) GELU-tanh. The loop vectorises (vector_math.divide):
    as a scalar loop SiLU took ~4% of an int8 step."""
    I = gate.shape[1]
    for t in range(r0, r1):
        if bias.shape[1] > 0:
            for n in range(I):
                gate[t, n] += bias[l, n]
                up[t, n] += bias[l, I + n]
        gated_row(gate[t], up[t], gelu)


