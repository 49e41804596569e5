"""The model: weights, RoPE tables and buffers for one context size, and its entry points.

The layer sequence itself is defined once, in kernels.forward, over a batch of rows. Here are the
three ways to feed it, each one Numba call per step:

    forward(tokens, cache)                 prefill: a sequence's tokens, in chunks of PREFILL_CHUNK rows
                                           (one token is a decode step of one sequence)
    decode_batch(tokens, caches, ...)      one token for each of several sequences, weights read once
    step(tokens, positions, slots, ...)    any mix of rows (prefill chunks beside decodes)

Every buffer a step uses is allocated once (Workspace), so a step allocates nothing.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numba
import numpy as np

from .. import kernels as K
from ..errors import ConfigError, GenerationError, UsageError
from ..kernels.forward import forward
from ..kernels.forward_types import LORA, MATRIX_KINDS
from ..kernels.lora import LORA_BF16, LORA_F16, LORA_F32, LORA_FIELDS, LORA_NEXT
from ..kernels.steps import STEPS, step_kernels
from ..kernels.jit import CompileNotice, DirectCall, array_key
from ..loading.checkpoint import Linear, Weights, load_checkpoint
from ..loading.config import ModelConfig, RopeScaling
from ..loading.lora import Adapter, widened
from ..memory import CACHE_LINE, aligned_zeros, lazy_zeros
from .cache import KVCache, kv_bytes_per_token, kv_format
from .threads import StepTimer, ThreadTuner

PREFILL_CHUNK = 256
RELEASE_STEP = 64  # sliding-window layers give back memory in steps of this many positions


def rope_inv_freq(cfg: ModelConfig, rope: tuple[float, RopeScaling] | None = None, ctx: int | None = None) -> np.ndarray:
    """Inverse frequencies (hd/2,) in float32 for RoPE base and scaling `rope` (the config's,
    by default), following transformers' rope init functions. `dynamic` and `longrope` depend on
    the sequence length: here the context size `ctx`, so every chunking of a sequence sees the
    same frequencies (transformers' for a sequence of ctx tokens)."""
    theta, s = rope if rope is not None else (cfg.rope_theta, cfg.rope_scaling)
    ctx = cfg.context_size() if ctx is None else ctx
    dim = cfg.rope_dim  # with partial_rotary_factor, fewer than head_dim: the rest pass (frequency 0, rope_tables)
    f32 = np.float32
    if s.rope_type == "dynamic" and ctx > cfg.max_position_embeddings:
        theta = theta * ((s.factor * ctx / cfg.max_position_embeddings) - (s.factor - 1)) ** (dim / (dim - 2))
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim
    # Correctly rounded to float32: what torch's float32 pow gives, to the last bit or one ulp.
    pos_freqs = (theta**exponents).astype(f32)
    inv_freq = (1.0 / (theta**exponents)).astype(f32)
    if s.rope_type == "linear":
        inv_freq = inv_freq / f32(s.factor)
    elif s.rope_type == "llama3":
        old_ctx = s.original_max_position_embeddings
        low_freq_wavelen = old_ctx / s.low_freq_factor
        high_freq_wavelen = old_ctx / s.high_freq_factor
        wavelen = f32(2 * np.pi) / inv_freq
        scaled = np.where(wavelen > f32(low_freq_wavelen), inv_freq / f32(s.factor), inv_freq)
        smooth = (f32(old_ctx) / wavelen - f32(s.low_freq_factor)) / f32(s.high_freq_factor - s.low_freq_factor)
        smoothed = (f32(1) - smooth) * scaled / f32(s.factor) + smooth * scaled
        medium = ~(wavelen < f32(high_freq_wavelen)) & ~(wavelen > f32(low_freq_wavelen))
        inv_freq = np.where(medium, smoothed, scaled)
    elif s.rope_type == "yarn":
        low, high = _yarn_correction_range(s, dim, theta)
        if low == high:
            high += 0.001  # transformers: no singular ramp
        ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), f32(0), f32(1))
        extrapolation = f32(1) - ramp
        inv_freq = (f32(1) / (f32(s.factor) * pos_freqs)) * (f32(1) - extrapolation) + (f32(1) / pos_freqs) * extrapolation
    elif s.rope_type == "longrope":
        factors = s.long_factor if ctx > s.original_max_position_embeddings else s.short_factor
        if len(factors) != dim // 2:
            raise ConfigError(f"config.json: longrope factors have {len(factors)} entries, head_dim / 2 is {dim // 2}")
        inv_freq = f32(1.0) / (np.array(factors, f32) * pos_freqs)
    return inv_freq.astype(f32)


def rope_attention_factor(s: RopeScaling) -> float:
    """What yarn and longrope scale cos and sin by (transformers' attention_factor); 1 otherwise."""
    if s.attention_factor is not None or s.rope_type not in ("yarn", "longrope"):
        return 1.0 if s.attention_factor is None else s.attention_factor
    if s.rope_type == "longrope":
        if s.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return float(mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim))
    return mscale(s.factor)


def _yarn_correction_range(s: RopeScaling, dim: int, theta: float) -> tuple[float, float]:
    def correction_dim(rotations):
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def rope_tables(cfg: ModelConfig, ctx: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cos, sin (tables, ctx, hd/2): one table per distinct RoPE base and scaling among the
    layers (Gemma 3's sliding and full layers differ); and each layer's table, -1 for none."""
    kinds: dict = {}
    index = []
    for i in range(cfg.num_hidden_layers):
        rope = cfg.layer_rope(i)
        if rope is not None and rope not in kinds:
            kinds[rope] = len(kinds)
        index.append(-1 if rope is None else kinds[rope])
    tables = [_scaled_tables(cfg, rope, ctx) for rope in kinds] or [K.rope_tables(np.zeros(cfg.head_dim // 2, np.float32), 1)]
    return np.stack([c for c, _ in tables]), np.stack([s for _, s in tables]), np.array(index, np.int64)


def _scaled_tables(cfg: ModelConfig, rope: tuple[float, RopeScaling], ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (ctx, hd/2): the turned pairs' first, scaled by the attention factor (float32
    products, as transformers scales them); the pairs RoPE leaves alone with frequency 0 (cos 1,
    sin 0: their values pass exactly, in the layout rope_halves_order gives q and k)."""
    turned = cfg.rope_dim // 2
    inv_freq = np.zeros(cfg.head_dim // 2, np.float32)
    inv_freq[:turned] = rope_inv_freq(cfg, rope, ctx)
    cos, sin = K.rope_tables(inv_freq, ctx)
    factor = np.float32(rope_attention_factor(rope[1]))
    cos[:, :turned] *= factor
    sin[:, :turned] *= factor
    return cos, sin


NO_SCALES = np.zeros((1, 1), np.uint16)  # the scales of a matrix that has none beside it
NO_HIDDEN = np.zeros((0, 0, 0), np.float32)
NO_EXPERTS = np.zeros((0, 0, 0), np.int64)


def step_buffer(shape: tuple[int, ...], dtype, lane: int) -> np.ndarray:
    """Zeros that take memory only where a step writes (lazy_zeros), starting `lane` cache lines
    into a page: buffers read side by side (gate and up, their output rows) at the same offset in
    their pages alias in the CPU's store buffer (4 KiB aliasing cost float32 decode ~10%)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return lazy_zeros((n + lane * CACHE_LINE,), np.uint8)[lane * CACHE_LINE :].view(dtype).reshape(shape)


def workspace(cfg: ModelConfig, rows: int, ctx: int) -> "K.Workspace":
    """Buffers for a step of up to `rows` rows (kernels.forward.Workspace)."""
    f = np.float32
    H, I, q_dim, kv_dim = cfg.hidden_size, cfg.widest_mlp, cfg.q_dim, cfg.kv_dim
    widest = max(H, I, q_dim, cfg.q_lora_rank, cfg.kv_lora_rank)
    moe_rows = rows if cfg.num_experts else 0  # a dense model's expert buffers are empty
    E, k = cfg.num_experts, cfg.experts_per_token
    routed = moe_rows * k  # rows the chosen experts run, gathered
    I = max(I, k * cfg.expert_intermediate_size)  # the gate rows of every chosen expert at once
    operand = max(rows * widest, routed * max(H, cfg.expert_intermediate_size))  # a step's input rows, prepared
    threads = numba.config.NUMBA_NUM_THREADS
    n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
    return K.Workspace(
        x=aligned_zeros((rows, H), f),
        xn=aligned_zeros((rows, H), f),
        qkv=aligned_zeros((rows, q_dim + 2 * kv_dim), f),
        att=aligned_zeros((rows, q_dim), f),
        proj=aligned_zeros((rows, H), f),
        # the largest buffers take memory only where a step writes (a decode, a few rows of them)
        gate=step_buffer((1, rows * I), f, 1),
        up=step_buffer((1, rows * I), f, 21),
        operands=step_buffer((len(K.Operand), operand), np.uint16, 41),
        operand_scales=step_buffer((len(K.Operand), operand * 3 // K.QBLOCK + max(rows, routed)), f, 51),
        scratch=aligned_zeros((threads, 8 * widest), f),
        scores=aligned_zeros((threads * max(4, n_rep), ctx), f),
        claims=aligned_zeros((2 * max(3, 2 * E), threads), np.int64),
        params=np.zeros(K.forward_params, np.int64),
        tasks=np.zeros((rows * cfg.num_attention_heads + cfg.num_attention_heads, 4), np.int64),
        moe=aligned_zeros((moe_rows, H), f),
        xe=step_buffer((routed, H), f, 11),
        route=aligned_zeros((moe_rows, 2 * E + 1), f),
        chosen=np.zeros((moe_rows, k), np.int64),
        chosen_weight=np.zeros((moe_rows, k), f),
        place=np.zeros((moe_rows, k), np.int64),
        jobs=np.zeros((2 * E, 4), np.int64),
        xe_adapter=np.zeros(routed, np.int64),
        latent=aligned_zeros((rows, cfg.q_lora_rank + cfg.kv_lora_rank + cfg.rope_dim) if cfg.latent else (0, 0), f),
        q_latent=aligned_zeros((rows if cfg.latent else 0, cfg.q_lora_rank), f),
        kv_latent=aligned_zeros((rows if cfg.latent else 0, cfg.kv_lora_rank), f),
    )


KERNEL_LOCK = threading.Lock()


class Model:
    """Weights in their formats plus RoPE tables for a context size; run through `forward`,
    `decode_batch` or `step`.

    One lock, shared by every model in the process (a server may hold several, each with its own
    engine thread), serialises every kernel call: Numba's parallel regions must never be entered
    from two Python threads at once (the workqueue threading layer aborts the process). Each step
    uses every core it is given, so two models' steps taking turns lose nothing to each other.
    """

    def __init__(self, cfg: ModelConfig, weights: Weights, ctx: int | None = None, threads: int | None = None, kv_dtype: str = "float32",
                 activations: int | dict | None = None):
        self.config = cfg
        self.activations = activations  # bits against grouped layouts, None each format's default (kernels.formats.with_activations)
        self.kv_format = kv_format(kv_dtype, cfg)
        self.kv_dtype = self.kv_format.name
        self.kv_bytes_per_token = kv_bytes_per_token(cfg, self.kv_format)
        self.weights = weights
        self.dtype = weights.dtype
        self.formats = sorted({K.with_activations(fmt, activations) for fmt in weights.formats}, key=lambda fmt: fmt.code)
        self.ctx = cfg.context_size(ctx)
        self.cos, self.sin, self.rope_table = rope_tables(cfg, self.ctx)
        self.windows = np.array([cfg.layer_window(i) for i in range(cfg.num_hidden_layers)], np.int64)
        self.sliding_layers = np.flatnonzero(self.windows > 0)  # their old positions are never read again (chunked layers' are kept)
        self.widest_window = cfg.widest_window
        self._lock = KERNEL_LOCK
        self._kernel_weights = kernel_weights(cfg, weights, self.rope_table, self.windows, activations)
        self.adapters: tuple[Adapter, ...] = ()  # a row's adapter is its index here (set_adapters)
        self._rows = 0
        self._grow(min(PREFILL_CHUNK, self.ctx))
        self._call = DirectCall(forward)
        self.threads = _thread_count(threads)
        self._steps = StepTimer(ThreadTuner(self.threads))
        self._compile()

    def _grow(self, rows: int) -> None:
        """Buffers for steps of up to `rows` rows."""
        if rows <= self._rows:
            return
        self._ws = workspace(self.config, rows, self.ctx)
        self._tokens, self._positions, self._slots, self._logit_rows, self._adapters = (np.zeros(rows, np.int64) for _ in range(5))
        self._logits = step_buffer((rows, self.config.vocab_size), np.float32, 31)
        self._rows = rows

    def _compile(self) -> None:
        """The forward pass compiled (or loaded from Numba's cache) now, not at the first token:
        its steps' kernels for this state's types, then a step of one row on a cache of one
        position that nothing reads."""
        k = np.zeros((1, self.config.num_hidden_layers, self.config.num_key_value_heads, 1, self.kv_format.row_bytes(self.config.head_dim)), np.uint8)
        rows = self._step_rows(np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64), 1)
        state = numba.typeof((rows, self._kernel_weights, self._ws, k, k, self.cos, self.sin))
        assert state == K.forward_state_type, f"the forward pass's state has type {state}, not {K.forward_state_type}"
        kv = "" if self.kv_dtype == "float32" else f" ({self.kv_dtype} KV cache)"
        with CompileNotice(f"the forward pass{kv}", jobs=2) as notice:
            self._kernel_weights.steps[:] = self._step_kernels()
            notice.step()
            self._run(rows, k, k.copy())
            notice.step()

    def _step_kernels(self) -> np.ndarray:
        cfg = self.config
        return step_kernels(self.kv_dtype, experts=cfg.num_experts > 0, sinks=cfg.attention_sinks, activation=ACTIVATIONS[cfg.hidden_act],
                            lora=bool(self.adapters), latent=cfg.latent)

    def set_adapters(self, adapters) -> None:
        """The LoRA adapters rows may use (minillm.loading.lora), adapter i for a row of adapter
        index i; the base weights stay as they are. Replaces the previous set."""
        adapters = tuple(adapters)
        tables = lora_tables(self.config, adapters, self._kernel_weights)
        with self._lock:
            self.adapters = adapters
            if adapters and not self._kernel_weights.steps[LORA]:
                with CompileNotice("the LoRA step", jobs=1):
                    self._kernel_weights.steps[:] = self._step_kernels()
            self._kernel_weights = self._kernel_weights._replace(**tables)

    @classmethod
    def load(
        cls, source: str | Path, ctx: int | None = None, dtype: str | None = None, check_finite: bool = False, threads: int | None = None,
        kv_dtype: str = "float32", activations: int | dict | None = None,
    ) -> "Model":
        """From an HF checkpoint directory or a GGUF file (checkpoint.load_checkpoint); dtype None
        is float32 for a directory and the stored formats for a GGUF. threads: the most a step
        uses (default: every CPU Numba sees). kv_dtype: how the KV cache keeps keys and values
        (kernels.formats.KV_FORMATS). activations: 16 or 8 bits against GGUF blocks run on integer
        products, None each format's default, or a dict by format name (kernels.formats.with_activations)."""
        with CompileNotice("the kernels that convert weights at load", jobs=1):  # int8's quantizer, regrouping, ..
            cfg, weights = load_checkpoint(source, dtype=dtype, check_finite=check_finite)
        return cls(cfg, weights, ctx, threads, kv_dtype, activations)

    def new_cache(self) -> KVCache:
        return KVCache(self.config, self.ctx, fmt=self.kv_format)

    # ------------------------------------------------------------------ entry points

    def forward(self, tokens, cache: KVCache, all_logits: bool = False, hidden: np.ndarray | None = None,
                experts: np.ndarray | None = None, adapter: Adapter | None = None) -> np.ndarray:
        """Run `tokens` after what `cache` holds; returns logits (T, V) or (V,) for the last token.

        The returned (V,) array is a workspace buffer, overwritten by the next call.
        hidden: optional (L + 2, T, H) array that receives the residual stream after the
        embedding and after every layer, then the final norm's output (for `compare --per-layer`).
        experts: optional (L, T, k) int64 array that receives each sparse layer's chosen experts
        per token, ascending (a mixture of experts' router, compared the same way).
        adapter: one of self.adapters to run with (set_adapters), or None.
        """
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        T = len(tokens)
        if T == 0:
            raise GenerationError("no tokens to run")
        V = self.config.vocab_size
        if tokens.min() < 0 or tokens.max() >= V:
            raise GenerationError(f"token id out of range [0, {V})")
        pos0 = cache.reserve(T)
        out = np.empty((T, V), np.float32) if all_logits else None
        chunk = min(PREFILL_CHUNK, self.ctx)
        with self._lock:
            for start in range(0, T, chunk):
                n = min(chunk, T - start)
                wanted = n if all_logits else (1 if start + n == T else 0)
                rows = self._step_rows(tokens[start : start + n], np.arange(pos0 + start, pos0 + start + n), np.zeros(n, np.int64), wanted,
                                       logits=out[start : start + n] if all_logits else None,
                                       hidden=None if hidden is None else np.empty((hidden.shape[0], n, hidden.shape[2]), np.float32),
                                       experts=None if experts is None else np.zeros((experts.shape[0], n, experts.shape[2]), np.int64),
                                       adapters=np.full(n, self.adapter_index(adapter), np.int64))
                self._run(rows, cache.k[None].view(np.uint8), cache.v[None].view(np.uint8))
                if hidden is not None:
                    hidden[:, start : start + n] = rows.hidden
                if experts is not None:
                    experts[:, start : start + n] = rows.experts
        cache.length = pos0 + T
        return out if all_logits else self._logits[0]

    def decode_batch(self, tokens, caches: list[KVCache], slots, pool) -> np.ndarray:
        """One token for each of B sequences in one step, weights read once: logits (B, V).

        caches[b] is slot slots[b] of `pool` (a KVPool). Each row of the result equals what a
        decode of that sequence alone would give, bit for bit. The array is a workspace buffer.
        """
        for c in caches:
            c.reserve(1)
        logits = self.step(tokens, [c.length for c in caches], slots, pool)
        for c in caches:
            c.length += 1
        return logits

    def step(self, tokens, positions, slots, pool, logit_rows=None, hidden: np.ndarray | None = None, adapters=None) -> np.ndarray:
        """Any rows in one step: row t is token tokens[t] at position positions[t] of the sequence
        in slot slots[t] of `pool`; a sequence's rows come together, at consecutive positions.
        Returns the logits of logit_rows (default: every row), (G, V), a workspace buffer. The
        caller advances its caches' lengths. hidden: as in `forward`, for every row. adapters: each
        row's LoRA adapter (an index of self.adapters, -1 for none; default none)."""
        T = len(tokens)
        with self._lock:
            self._grow(T)
            wanted = T if logit_rows is None else len(logit_rows)
            rows = self._step_rows(np.asarray(tokens, np.int64), np.asarray(positions, np.int64), np.asarray(slots, np.int64), wanted,
                                   logit_rows=logit_rows, hidden=hidden, adapters=adapters)
            self._run(rows, pool.k_bytes, pool.v_bytes)
            return rows.logits

    # ------------------------------------------------------------------ internals

    def adapter_index(self, adapter: Adapter | None) -> int:
        """A row's adapter number in the forward pass: -1 for the base model."""
        if adapter is None:
            return -1
        for i, held in enumerate(self.adapters):
            if held is adapter:
                return i
        raise GenerationError(f"LoRA adapter {adapter.name!r} is not loaded on this model")

    def _step_rows(self, tokens, positions, slots, wanted: int, logits=None, hidden=None, logit_rows=None, experts=None,
                   adapters=None) -> "K.Rows":
        """The Rows of a step in this model's buffers: logits for the last `wanted` rows (or for
        logit_rows), into `logits` (default: the model's buffer)."""
        T = len(tokens)
        self._tokens[:T], self._positions[:T], self._slots[:T] = tokens, positions, slots
        self._adapters[:T] = -1 if adapters is None else adapters
        self._logit_rows[:wanted] = np.arange(T - wanted, T) if logit_rows is None else logit_rows
        return K.Rows(
            tokens=self._tokens[:T], positions=self._positions[:T], slots=self._slots[:T], logit_rows=self._logit_rows[:wanted],
            logits=self._logits[:wanted] if logits is None else logits, hidden=NO_HIDDEN if hidden is None else hidden,
            experts=NO_EXPERTS if experts is None else experts, adapters=self._adapters[:T],
        )

    def _run(self, rows: "K.Rows", k: np.ndarray, v: np.ndarray) -> None:
        """kernels.forward on this model's weights, the caches as bytes of this model's KV format."""
        key = (array_key(k), array_key(v))
        with self._steps.step(len(rows.tokens)):  # on as many threads as pay (minillm.core.threads)
            self._call(key, rows, self._kernel_weights, self._ws, k, v, self.cos, self.sin)

    def release_outside_windows(self, cache: KVCache) -> None:
        """Give back the memory of sliding-window layers' positions no later token can attend to,
        RELEASE_STEP positions at a time: a long sequence holds about window + RELEASE_STEP of
        them per sliding layer (full layers keep every position). After this, `cache` cannot be
        truncated below its length (the engine never does; the prefix cache copies blocks first)."""
        if len(self.sliding_layers):
            cache.release_outside_window(self.sliding_layers, self.widest_window, RELEASE_STEP)


def _thread_count(threads: int | None) -> int:
    """The most threads a step may use: `threads`, or every CPU Numba sees (NUMBA_NUM_THREADS)."""
    most = numba.config.NUMBA_NUM_THREADS
    if threads is None:
        return most
    if not 1 <= threads <= most:
        raise UsageError(f"threads must be between 1 and {most} (the CPUs Numba sees; NUMBA_NUM_THREADS), got {threads}")
    return threads


def format_names(formats) -> str:
    """"Q4_K and Q6_K": the formats as users know them (a grouped layout by the format it regroups)."""
    names = sorted({fmt.group_of or fmt.name for fmt in formats})
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _address(a: np.ndarray, unit: int = 1) -> tuple[int, int, int]:
    """(data address, rows, row length in units of `unit` bytes) of a C-contiguous 2-D array, as
    kernels.forward.ModelWeights holds matrices (Weights keeps the arrays alive)."""
    if a.ndim != 2 or not a.flags.c_contiguous:
        raise ValueError("a weight matrix must be a C-contiguous 2-D array")
    return a.ctypes.data, a.shape[0], a.shape[1] * a.itemsize // unit


def kernel_weights(cfg: ModelConfig, w: Weights, rope_table: np.ndarray, windows: np.ndarray, activations: int | dict | None = None) -> "K.ModelWeights":
    """The weights and architecture as kernels.forward reads them, by name (built once at load):
    every matrix as its bytes, with its format's kernels (compiled now, or loaded from Numba's
    cache, for the formats this model has; a grouped layout's for its activations' bits)."""
    layers = w.layers
    f = np.float32
    no_mlp = Linear(np.zeros((0, cfg.hidden_size), f), K.BY_NAME["F32"])  # a sparse layer without a shared expert
    linears = [getattr(layer, kind) or no_mlp for layer in layers for kind in ("q", "k", "v", "o", "gate", "up", "down")] + [w.embed, w.lm_head]
    assert len(linears) == MATRIX_KINDS * len(layers) + 2
    router = np.full(len(layers), -1, np.int64)  # a sparse layer's router, then its experts (ModelWeights.router)
    for i, layer in enumerate(layers):
        if layer.router is not None:
            router[i] = len(linears)
            linears += [layer.router, *(m for expert in layer.experts for m in expert)]
    latent = _latent_matrices(layers, linears, no_mlp)
    runs_as = [K.with_activations(lin.format, activations) for lin in linears]
    formats = sorted(set(runs_as), key=lambda fmt: fmt.code)
    operands = sorted({fmt.operand for fmt in formats} - {K.Operand.FLOAT32})
    with CompileNotice(f"kernels for {format_names(formats)}", jobs=len(formats) + len(operands)) as notice:
        for fmt in formats:
            K.kernels_for(fmt)
            notice.step()
        prepare = np.zeros(len(K.Operand), np.int64)
        for op in operands:
            prepare[op] = K.prepare_for(op).address
            notice.step()

    def stacked_bias(*names) -> np.ndarray:
        """(L, sum of widths); (L, 0) when these projections have no bias."""
        if any(getattr(layer, names[0]) is None or getattr(layer, names[0]).b is None for layer in layers):
            return np.zeros((len(layers), 0), f)
        return np.stack([np.concatenate([getattr(layer, n).b for n in names]) for layer in layers]).astype(f)

    def stacked_norm(name) -> np.ndarray:
        """(L, width); (L, 0) where the architecture has no such norm."""
        if getattr(layers[0], name) is None:
            return np.zeros((len(layers), 0), f)
        return np.stack([getattr(layer, name) for layer in layers]).astype(f)

    return K.ModelWeights(
        matrices=np.array([_address(lin.w) for lin in linears], np.int64),
        scales=np.array([_address(NO_SCALES if lin.scales is None else lin.scales, unit=2) for lin in linears], np.int64),
        linear=np.array([K.kernels_for(fmt).linear.address for fmt in runs_as], np.int64),
        row=np.array([K.kernels_for(fmt).row.address for fmt in runs_as], np.int64),
        operand=np.array([int(fmt.operand) for fmt in runs_as], np.int64),
        prepare=prepare,
        steps=np.zeros(len(STEPS) + 1, np.int64),  # filled by Model once the state's type is known
        **{name: stacked_norm(name) for name in ("attn_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm", "q_norm", "k_norm")},
        final_norm=w.norm,
        qkv_bias=stacked_bias("q", "k", "v"),
        o_bias=stacked_bias("o"),
        gate_up_bias=stacked_bias("gate", "up"),
        down_bias=stacked_bias("down"),
        rope_table=rope_table,
        window=windows,
        heads=cfg.num_attention_heads,
        eps=f(cfg.rms_norm_eps),
        embed_scale=f(cfg.embed_scale),
        attn_scale=f(cfg.attn_scale),
        attn_softcap=f(cfg.attn_logit_softcapping or 0.0),
        final_softcap=f(cfg.final_logit_softcapping or 0.0),
        activation=ACTIVATIONS[cfg.hidden_act],
        activation_params=_activation_params(layers),
        router=router,
        **_router_knobs(cfg, layers),
        sinks=np.stack([layer.sinks for layer in layers]).astype(f) if layers[0].sinks is not None else np.zeros((len(layers), 0), f),
        swiglu_alpha=f(cfg.swiglu_alpha),
        swiglu_limit=f(cfg.swiglu_limit),
        residual_scale=f(cfg.residual_multiplier),
        logit_scale=f(cfg.logits_scaling),
        centered_norm=cfg.layer_norm,
        parallel=cfg.parallel_block,
        latent=latent,
        q_latent_norm=stacked_norm("q_a_norm"),
        kv_latent_norm=stacked_norm("kv_a_norm"),
        **_attention_knobs(cfg),
        **lora_tables(cfg, (), None),
    )


def _attention_knobs(cfg: ModelConfig) -> dict:
    """ModelWeights' scalar knobs of latent attention (DeepSeek) and of Llama 4's attention."""
    f = np.float32
    return dict(value_dim=cfg.value_dim, latent_eps=f(cfg.latent_norm_eps), qk_norm_rope_only=cfg.qk_norm_rope_only,
                temperature_floor=f(cfg.attn_temperature_floor), temperature_scale=f(cfg.attn_temperature_scale))


def _latent_matrices(layers, linears: list, none: Linear) -> np.ndarray:
    """Latent attention's q_a (`none` without one) and kv_a appended to `linears`: where each
    layer's are (ModelWeights.latent), -1 for a layer without them."""
    latent = np.full(len(layers), -1, np.int64)
    for i, layer in enumerate(layers):
        if layer.kv_a is not None:
            latent[i] = len(linears)
            linears += [layer.q_a or none, layer.kv_a]
    return latent


def lora_tables(cfg: ModelConfig, adapters: tuple[Adapter, ...], w: "K.ModelWeights | None") -> dict:
    """ModelWeights' LoRA fields for `adapters` on the model whose kernel weights are `w`
    (kernels.lora): each update on the matrix whose output it adds to, at the column it starts
    (a fused qkv_proj's update spans q | k | v, which are side by side in the step's rows; a fused
    gate_up_proj's is cut in two; Qwen2-MoE's shared-expert gate is the router's last column; an
    expert's on its own matrices), its A and B^T in the precision the file holds them, each on a
    cache line."""
    if not adapters:
        return dict(lora_map=np.zeros((0, 0), np.int64), lora_entries=np.zeros((0, LORA_FIELDS), np.int64), lora_scale=np.zeros(0, np.float32),
                    lora_data=np.zeros(0, np.uint8))
    lora_map = np.full((len(adapters), w.matrices.shape[0]), -1, np.int64)
    entries, scales, data = [], [], []
    size = 0  # bytes so far
    kinds = dict(zip(("q", "k", "v", "o", "gate", "up", "down"), range(MATRIX_KINDS)))

    def place(values: np.ndarray) -> int:
        """values' bytes appended on a cache line; their first element's index in their kind."""
        nonlocal size
        pad = -size % CACHE_LINE
        data.extend((np.zeros(pad, np.uint8), np.ascontiguousarray(values).view(np.uint8).ravel()))
        size += pad + values.nbytes
        return (size - values.nbytes) // values.itemsize

    def add(index: int, m: int, col: int, a: np.ndarray, b: np.ndarray, scale: float) -> None:
        if a.dtype != b.dtype:
            a, b = widened(a), widened(b)
        r, K = a.shape
        entries.append([place(a), place(b.T), r, K, b.shape[0], col, -1, LORA_KINDS[a.dtype.str]])
        scales.append(scale)
        e, last = len(entries) - 1, lora_map[index, m]
        if last < 0:
            lora_map[index, m] = e
            return
        while entries[last][LORA_NEXT] >= 0:
            last = entries[last][LORA_NEXT]
        entries[last][LORA_NEXT] = e

    for index, adapter in enumerate(adapters):
        for u in adapter.updates:
            layer = MATRIX_KINDS * u.layer
            if u.kind in kinds:
                add(index, layer + kinds[u.kind], 0, u.a, u.b, u.scale)
            elif u.kind == "qkv":
                add(index, layer + kinds["q"], 0, u.a, u.b, u.scale)
            elif u.kind == "gate_up":
                half = u.b.shape[0] // 2
                add(index, layer + kinds["gate"], 0, u.a, u.b[:half], u.scale)
                add(index, layer + kinds["up"], 0, u.a, u.b[half:], u.scale)
            elif u.kind == "shared_gate":
                add(index, int(w.router[u.layer]), cfg.num_experts, u.a, u.b, u.scale)
            elif u.kind == "router":
                add(index, int(w.router[u.layer]), 0, u.a, u.b, u.scale)
            elif u.kind.startswith("expert_"):  # expert e's gate, up, down follow the router (ModelWeights.router)
                which = ("expert_gate", "expert_up", "expert_down").index(u.kind)
                add(index, int(w.router[u.layer]) + 1 + 3 * u.expert + which, 0, u.a, u.b, u.scale)
            else:  # the LM head
                add(index, MATRIX_KINDS * cfg.num_hidden_layers + 1, 0, u.a, u.b, u.scale)
    lora_data = aligned_zeros((size + -size % CACHE_LINE,), np.uint8)  # each kind's view aligned
    lora_data[:size] = np.concatenate(data)
    return dict(lora_map=lora_map, lora_entries=np.array(entries, np.int64), lora_scale=np.array(scales, np.float32), lora_data=lora_data)


# an update's stored precision (its arrays' dtype: bfloat16 is held as its uint16 bits) -> kernels.lora's kind
LORA_KINDS = {"<f4": LORA_F32, "<f2": LORA_F16, "<u2": LORA_BF16}


# ModelConfig.router -> kernels.experts' router kinds
ROUTER_KINDS = {"softmax": K.SOFTMAX_ROUTER, "topk_softmax": K.TOPK_SOFTMAX_ROUTER, "sigmoid": K.SIGMOID_ROUTER,
                "topk_sigmoid_input": K.TOPK_SIGMOID_INPUT_ROUTER}

# config.json's hidden_act -> kernels.swiglu's gated activation
ACTIVATIONS = {"silu": K.SILU, "gelu_pytorch_tanh": K.GELU_TANH, "clamped_swiglu": K.CLAMPED_SWIGLU, "xielu": K.XIELU}


def _activation_params(layers) -> np.ndarray:
    """(L, 4): each layer's activation parameters (xIELU's alpha_p, alpha_n, beta, eps), or (L, 0)."""
    if layers[0].activation_params is None:
        return np.zeros((len(layers), 0), np.float32)
    return np.stack([layer.activation_params for layer in layers]).astype(np.float32)


def _router_knobs(cfg: ModelConfig, layers) -> dict:
    """ModelWeights' fields of a mixture of experts' routers (and their biases) beyond the matrices."""
    f = np.float32
    return dict(experts=cfg.num_experts, experts_per_token=cfg.experts_per_token, norm_topk=cfg.norm_topk_prob,
                router_kind=ROUTER_KINDS[cfg.router], **_expert_biases(cfg, layers), selection_bias=_selection_biases(cfg, layers),
                router_groups=cfg.router_groups, router_group_topk=cfg.router_group_topk, router_group_best=cfg.router_group_best, routed_scale=f(cfg.routed_scaling),
                norm_min=f(cfg.router_norm_min))


def _selection_biases(cfg: ModelConfig, layers) -> np.ndarray:
    """(L, E): each sparse layer's bias the router chooses by (zeros in dense layers), or (L, 0)."""
    if not cfg.selection_bias:
        return np.zeros((len(layers), 0), np.float32)
    return np.stack([np.zeros(cfg.num_experts, np.float32) if layer.selection_bias is None else layer.selection_bias for layer in layers])


def _expert_biases(cfg: ModelConfig, layers) -> dict:
    """ModelWeights' router and expert biases (gpt-oss), stacked by layer; empty where a model has none."""
    f = np.float32
    sparse = [layer for layer in layers if layer.router is not None]
    if not sparse or sparse[0].router.b is None:
        return dict(router_bias=np.zeros((len(layers), 0), f), expert_gate_up_bias=np.zeros((0, 0, 0), f),
                    expert_down_bias=np.zeros((0, 0, 0), f))
    E, I, H = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size
    router_bias = np.zeros((len(layers), E), f)
    gate_up, down = np.zeros((len(layers), E, 2 * I), f), np.zeros((len(layers), E, H), f)
    for i, layer in enumerate(layers):
        if layer.router is not None:
            router_bias[i] = layer.router.b
            for e, (g, u, d) in enumerate(layer.experts):
                gate_up[i, e] = np.concatenate([g.b, u.b])
                down[i, e] = d.b
    return dict(router_bias=router_bias, expert_gate_up_bias=gate_up, expert_down_bias=down)
