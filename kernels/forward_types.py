"""What the forward pass reads and writes, and the numbers its parts agree on: the rows of a
step (Rows), the weights and architecture as knobs (ModelWeights), the buffers (Workspace), their
Numba types (fixed whatever the model: the forward pass and its steps compile once per machine),
the step numbers and their arguments in ws.params, and the state the steps are handed by address.
"""

from typing import NamedTuple

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic

from .jit import rows_view

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
P_LORA = 9  # 1 when a row of the step has a LoRA adapter (the linear steps then run the LoRA step)
PARAMS = 10
ATTENTION_PART, MLP_PART = _n(0), _n(1)  # which sub-block a norm or residual step serves
# what a linear step reads (P_WHICH) and writes (P_OUTPUT)
FROM_XN, FROM_ATT, FROM_GATE, FROM_XE = _n(0), _n(1), _n(2), _n(3)
FROM_Q_LATENT, FROM_KV_LATENT, FROM_VALUES = _n(4), _n(5), _n(6)  # latent attention's: its latents normed; att's values, packed
TO_QKV, TO_PROJ, TO_GATE_UP, TO_LOGITS, TO_ROUTER = _n(0), _n(1), _n(2), _n(3), _n(4)
TO_LATENT, TO_KV = _n(5), _n(6)  # q_a | kv_a's outputs side by side; k | v of the qkv rows
JOB_GATE, JOB_UP, JOB_XE = 0, 1, 2  # where an expert job writes: gate, up (its rows), xe (its rows)
ONE, TWO, THREE = _n(1), _n(2), _n(3)  # matrices read from one input
# a mixture of experts' router (ModelWeights.router_kind): a softmax over all experts, then the top k;
# the top k logits under their own softmax (gpt-oss); or each expert's sigmoid, then the top k (GLM-4.5)
SOFTMAX_ROUTER, TOPK_SOFTMAX_ROUTER, SIGMOID_ROUTER = 0, 1, 2
# Llama 4: the top k logits, each one's sigmoid scaling its expert's input (not its output)
TOPK_SIGMOID_INPUT_ROUTER = 3
ALWAYS = np.bool_(True)

# The steps (kernels.steps.STEPS, in this order), each a compiled kernel called by address; then
# the parallel region that runs one over the threads.
LINEAR, ATTENTION, NORM, QKV, RESIDUAL, GATE_ROWS, PREPARE, EXPERTS, EXPERT_LINEAR, LORA, EXPERT_LORA, LATENT = (_n(i) for i in range(12))
PARALLEL_REGION = 12
LATENT_QKV, LATENT_OUT = _n(0), _n(1)  # the latent step's parts (P_WHICH): before attention, after it


class Rows(NamedTuple):
    """What one forward call runs and where its results go."""

    tokens: np.ndarray  # (T,) int64
    positions: np.ndarray  # (T,) int64: each row's position in its sequence
    slots: np.ndarray  # (T,) int64: each row's sequence's slot in the KV pool
    logit_rows: np.ndarray  # (G,) int64: the rows whose logits are wanted, in this order
    logits: np.ndarray  # (G, V) float32, out
    hidden: np.ndarray  # (L + 2, T, H) float32, out: after the embedding, each layer, the final norm; or (0, 0, 0)
    experts: np.ndarray  # (L, T, k) int64, out: each sparse layer's experts for each row, ascending; or (0, 0, 0)
    adapters: np.ndarray  # (T,) int64: each row's LoRA adapter (ModelWeights.lora_map's row), -1 for the base model


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
    prepare: np.ndarray  # (len(Operand),) int64: the address of each Operand's prepare kernel, 0 for none
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
    activation: int  # the MLP's activation (kernels.swiglu): SILU, GELU_TANH, CLAMPED_SWIGLU, or XIELU (no gate matrix)
    activation_params: np.ndarray  # (L, 4) each layer's xIELU alpha_p, alpha_n, beta, eps; or (L, 0)
    router: np.ndarray  # (L,) int64: a sparse layer's router in matrices ((E, H), or (E + 1, H) with the
    #   shared expert's gate last), expert e's gate, up, down at router + 1 + 3 e + 0, 1, 2; -1: a dense layer
    experts: int  # E, experts per sparse layer (0: a dense model)
    experts_per_token: int  # the router's top k
    norm_topk: bool  # the top k weights renormalised to sum to 1
    router_kind: int  # kernels.experts: SOFTMAX_ROUTER, TOPK_SOFTMAX_ROUTER (gpt-oss), SIGMOID_ROUTER (GLM-4.5), TOPK_SIGMOID_INPUT_ROUTER (Llama 4)
    router_bias: np.ndarray  # (L, E) added to the router's logits, or (L, 0)
    selection_bias: np.ndarray  # (L, E) added to the scores for choosing experts only (e_score_correction_bias), or (L, 0)
    router_groups: int  # the experts in this many groups, of which a row chooses among the best router_group_topk
    router_group_topk: int
    router_group_best: int  # a group's score: the sum of its this many best scores (2: DeepSeek-V3, GLM-4.5; 1: DeepSeek-V2)
    routed_scale: float  # the chosen experts' weights times this (routed_scaling_factor)
    norm_min: float  # the renormalising sum is at least this (Ernie 4.5's moe_norm_min; else 0)
    expert_gate_up_bias: np.ndarray  # (L, E, 2 I) each expert's gate | up bias (gpt-oss), or (0, 0, 0)
    expert_down_bias: np.ndarray  # (L, E, H) each expert's down bias, or (0, 0, 0)
    sinks: np.ndarray  # (L, nh) each head's attention sink logit (gpt-oss), or (L, 0)
    swiglu_alpha: float  # CLAMPED_SWIGLU's sigmoid gain
    swiglu_limit: float  # and clamp
    residual_scale: float  # each sub-block's output is multiplied by it before the residual add (Granite; else 1)
    logit_scale: float  # logits are divided by it (Granite; else 1)
    centered_norm: bool  # the layers' and the final norm subtract the mean first: LayerNorm without a bias (Cohere 2)
    parallel: bool  # the MLP reads the attention's normalised input, not h (Cohere 2: x + attn(norm(x)) + mlp(norm(x)))
    # latent attention (DeepSeek-V3): layer l's q_a, kv_a at latent[l], latent[l] + 1 in matrices
    # (q_a of 0 rows: Q reads xn); q, k, v (Q, K, V) then read the normed latents
    latent: np.ndarray  # (L,) int64, or -1: attention over q, k, v projections of xn
    q_latent_norm: np.ndarray  # (L, q_lora_rank) or (L, 0)
    kv_latent_norm: np.ndarray  # (L, kv_lora_rank) or (L, 0)
    value_dim: int  # a head's value width in att (the rest of its head_dim is zeros); head_dim but under latent attention
    latent_eps: float  # the latents' RMSNorm epsilon
    qk_norm_rope_only: bool  # the q/k norms on RoPE layers only (Llama 4)
    temperature_floor: float  # Llama 4: queries of layers without RoPE times log1p(floor((pos + 1) / floor)) * scale + 1; 0: none
    temperature_scale: float
    # LoRA adapters (kernels.lora), (0, 0) without any: a row's adapter a adds the updates of
    # lora_map[a, m] (a chain through lora_entries) to matrix m's output
    lora_map: np.ndarray  # (adapters, M) int64: the first update of adapter a on matrix m, or -1
    lora_entries: np.ndarray  # (updates, LORA_FIELDS) int64: each update's place in lora_data and shape
    lora_scale: np.ndarray  # (updates,) float32: each update's scale (alpha / r, or alpha / sqrt(r), times the user's)
    lora_data: np.ndarray  # (bytes,) uint8: every update's A and B^T in its stored precision (kernels.lora)


class Workspace(NamedTuple):
    """Buffers for up to R rows, allocated once (minillm's Model), so a step allocates nothing."""

    x: np.ndarray  # (R, H) the residual stream
    xn: np.ndarray  # (R, H) a sub-block's normalised input; the logit rows' final norm
    qkv: np.ndarray  # (R, q_dim + 2 kv_dim) q | k | v
    att: np.ndarray  # (R, q_dim) attention's output
    proj: np.ndarray  # (R, H) o / down projection before the residual add
    gate: np.ndarray  # (1, R * widest I): the MLP's gate rows, (T, I) for the layer's I (mlp_rows)
    up: np.ndarray  # (1, R * widest I)
    operands: np.ndarray  # (len(Operand), R * max K) uint16: activations prepared per Operand (flat; viewed (T, K))
    operand_scales: np.ndarray  # (len(Operand), R * (3 max K / 32 + 1)) float32: their block scales
    scratch: np.ndarray  # (threads, 8 max K) float32: a thread's panel or scale table (kernels.matmul)
    scores: np.ndarray  # (threads * max(4, n_rep), ctx) float32: a thread's attention score rows
    claims: np.ndarray  # (2 max(3, 2 E), threads) int64: the task shares of up to three matrices, or of the expert jobs (kernels.work_sharing)
    params: np.ndarray  # (PARAMS,) int64: the arguments of the step running (P_* below)
    tasks: np.ndarray  # (R * nh + nh, 4) int64: attention tasks (first row, end row, first head, end head)
    # a mixture of experts' buffers ((0, 0) in a dense model)
    moe: np.ndarray  # (R, H) the routed experts' weighted sum
    xe: np.ndarray  # (R k, H) the rows each chosen expert runs, gathered from xn expert by expert; then their outputs
    route: np.ndarray  # (R, 2 E + 1) the router's logits, then scores; the shared expert's gate; the scores experts are chosen by
    chosen: np.ndarray  # (R, k) int64: each row's experts, ascending
    chosen_weight: np.ndarray  # (R, k) float32: their weights
    place: np.ndarray  # (R, k) int64: the row of xe that holds each choice
    jobs: np.ndarray  # (2 E, 4) int64: the expert matrices a step runs: matrix, first row of xe, rows, output (JOB_*)
    xe_adapter: np.ndarray  # (R k,) int64: the LoRA adapter of each row of xe (its row's), when a row of the step has one
    # latent attention's buffers ((0, 0) without it)
    latent: np.ndarray  # (R, q_lora_rank + kv_lora_rank + rope dims) what q_a and kv_a write
    q_latent: np.ndarray  # (R, q_lora_rank) the q latent normed, Q's input
    kv_latent: np.ndarray  # (R, kv_lora_rank) the kv latent normed, K's and V's input


# Their Numba types, fixed whatever the model (a format changes addresses, not types): the forward
# pass and its steps compile once per machine. minillm's Model checks its values against them.
_F1, _F2, _F3 = (types.Array(types.float32, n, "C") for n in (1, 2, 3))
_P5 = types.Array(types.uint8, 5, "C")  # a KV pool as bytes, whatever its KV format: the steps that
# read or write it (KV_STEPS) view it as their format's rows
_I1, _I2, _I3 = (types.Array(types.int64, n, "C") for n in (1, 2, 3))
ROWS_TYPE = types.NamedTuple([_I1, _I1, _I1, _I1, _F2, _F3, _I3, _I1], Rows)
MODEL_WEIGHTS_TYPE = types.NamedTuple(
    [_I2, _I2, _I1, _I1, _I1, _I1, _I1,
     *[_F2] * 6, _F1, *[_F2] * 4, _I1, _I1, types.int64, *[types.float32] * 5, types.int64, _F2,
     _I1, types.int64, types.int64, types.boolean, types.int64, _F2, _F2, types.int64, types.int64, types.int64, types.float32, types.float32, _F3, _F3, _F2, *[types.float32] * 4, types.boolean, types.boolean,
     _I1, _F2, _F2, types.int64, types.float32, types.boolean, types.float32, types.float32,
     _I2, _I2, _F1, types.Array(types.uint8, 1, "C")], ModelWeights)
WORKSPACE_TYPE = types.NamedTuple([*[_F2] * 7, types.Array(types.uint16, 2, "C"), _F2, _F2, _F2, _I2, _I1, _I2,
                                   _F2, _F2, _F2, _I2, _F2, _I2, _I2, _I1, _F2, _F2, _F2], Workspace)
STATE_TYPE = types.Tuple([ROWS_TYPE, MODEL_WEIGHTS_TYPE, WORKSPACE_TYPE, _P5, _P5, _F3, _F3])  # (rows, w, ws, k_pool, v_pool, cos, sin)


@intrinsic
def state_address(typingctx, state):
    """The address of a copy of `state` in the caller's frame, for the steps it calls."""
    if state != STATE_TYPE:
        return None

    def codegen(context, builder, sig, args):
        return builder.ptrtoint(cgutils.alloca_once_value(builder, args[0]), context.get_value_type(types.int64))

    return types.int64(state), codegen


@intrinsic
def state_at(typingctx, address):
    """The state at `address` (state_address), read without reference counting: the steps are
    compiled without it (a step's share runs while the forward pass holds every array)."""

    def codegen(context, builder, sig, args):
        value = builder.load(builder.inttoptr(args[0], context.get_value_type(STATE_TYPE).as_pointer()))
        return impl_ret_borrowed(context, builder, STATE_TYPE, value)  # counted where counting is on

    return STATE_TYPE(types.int64), codegen


@njit(inline="always", _nrt=False)
def mlp_rows(flat, T, width):
    """An MLP buffer's first T rows of the layer's width (gate, up: (1, R * widest I))."""
    return rows_view(flat[0], T, width)
