"""The pre-norm Llama forward pass on Numba kernels.

Shapes: T tokens in this call, H hidden, I intermediate, V vocab, nh/nkv heads, hd head dim.

    x = embed[tokens]                                  (T, H)
    for each layer:
        h = x + attn(rmsnorm(x))                       GQA, RoPE, KV cache
        x = h + mlp(rmsnorm(h))                        down(silu(gate) * up)
    logits = lm_head(rmsnorm(x))                       (T, V), or last row only

Prefill runs in chunks of up to PREFILL_CHUNK tokens over workspaces sized for a chunk; decode
(T = 1) has its own preallocated workspace, so a decode step allocates nothing.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numba
import numpy as np
from numba.typed import List

import kernels as K
from kernels.jit import DirectCall, array_key, typed_list

from .cache import KVCache, aligned_zeros
from .checkpoint import Weights, load_checkpoint
from .config import ModelConfig, RopeScaling
from .errors import ConfigError, GenerationError

PREFILL_CHUNK = 256
RELEASE_STEP = 64  # sliding-window layers give back memory in steps of this many positions


def rope_inv_freq(cfg: ModelConfig, rope: tuple[float, RopeScaling] | None = None, ctx: int | None = None) -> np.ndarray:
    """Inverse frequencies (hd/2,) in float32 for RoPE base and scaling `rope` (the config's,
    by default), following transformers' rope init functions. `dynamic` and `longrope` depend on
    the sequence length: here the context size `ctx`, so every chunking of a sequence sees the
    same frequencies (transformers' for a sequence of ctx tokens)."""
    theta, s = rope if rope is not None else (cfg.rope_theta, cfg.rope_scaling)
    ctx = cfg.context_size() if ctx is None else ctx
    dim = cfg.head_dim
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
    cos, sin = K.rope_tables(rope_inv_freq(cfg, rope, ctx), ctx)
    factor = np.float32(rope_attention_factor(rope[1]))
    return cos * factor, sin * factor  # float32 products, as transformers scales them


class PrefillWorkspace:
    """Activation buffers for a chunk of up to `rows` tokens of one sequence, allocated once."""

    def __init__(self, cfg: ModelConfig, rows: int, ctx: int):
        f = np.float32
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.rows = rows
        self.x = aligned_zeros((rows, H), f)  # residual stream
        self.xn = aligned_zeros((rows, H), f)  # normalised input of a sub-block
        self.q = aligned_zeros((rows, cfg.q_dim), f)
        self.k = aligned_zeros((rows, cfg.kv_dim), f)
        self.v = aligned_zeros((rows, cfg.kv_dim), f)
        self.att = aligned_zeros((rows, cfg.q_dim), f)
        self.proj = aligned_zeros((rows, H), f)  # o_proj / down_proj output before the residual add
        self.gate = aligned_zeros((rows, I), f)
        self.up = aligned_zeros((rows, I), f)
        # score rows per thread (kernels.attention)
        self.scores = aligned_zeros((K.QUERIES_PER_TASK * numba.config.NUMBA_NUM_THREADS, ctx), f)
        self.positions = aligned_zeros((rows,), np.int64)
        self.logits = aligned_zeros((cfg.vocab_size,), f)  # the last token's


class DecodeWorkspace:
    """The buffers of one decode step for up to `rows` sequences, allocated once, handed to
    kernels.decode_batch as a DecodeBuffers of views for each batch size (made once per size)."""

    def __init__(self, cfg: ModelConfig, rows: int, ctx: int, matrix_dtypes: frozenset, grouped: bool = False):
        f = np.float32
        H, I, q_dim = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim
        # xn, att and gate as the weights' products read them (kernels.activation_prep), by the
        # matrices' dtypes (Weights.matrix_dtypes): int16 with a scale per block of 32 for int8
        # matrices (also a GGUF's Q8_0, checkpoint.runnable_blocks), bfloat16 bits for bfloat16;
        # none for float32 and the other block formats, which read xn itself. Grouped Q4_0 and
        # Q6_K (kernels.row_groups) read int16's bytes split, and a scale and two sums per block
        quantized = np.dtype(np.int8) in matrix_dtypes or grouped
        op_dtype = np.int16 if quantized else np.uint16
        op_rows = rows if quantized or np.dtype(np.uint16) in matrix_dtypes else 0
        scale_rows = rows if quantized else 0
        per_block = K.SPLIT_PER_BLOCK if grouped else 1
        self.rows = rows
        self._full = K.DecodeBuffers(
            logits=aligned_zeros((rows, cfg.vocab_size), f),
            tokens=aligned_zeros((rows,), np.int64),
            positions=aligned_zeros((rows,), np.int64),
            slots=aligned_zeros((rows,), np.int64),
            x=aligned_zeros((rows, H), f),
            xn=aligned_zeros((rows, H), f),
            qkv=aligned_zeros((rows, q_dim + 2 * cfg.kv_dim), f),
            att=aligned_zeros((rows, q_dim), f),
            proj=aligned_zeros((rows, H), f),
            gate=aligned_zeros((rows, I), f),
            up=aligned_zeros((rows, I), f),
            scores=aligned_zeros((rows * cfg.num_attention_heads, ctx), f),
            xn_op=aligned_zeros((op_rows, H), op_dtype),
            att_op=aligned_zeros((op_rows, q_dim), op_dtype),
            gate_op=aligned_zeros((op_rows, I), op_dtype),
            xn_scales=aligned_zeros((scale_rows, per_block * (H // K.QBLOCK)), f),
            att_scales=aligned_zeros((scale_rows, per_block * (q_dim // K.QBLOCK)), f),
            gate_scales=aligned_zeros((scale_rows, per_block * (I // K.QBLOCK)), f),
            claims=aligned_zeros((2, numba.config.NUMBA_NUM_THREADS), np.int64),  # kernels.schedule
        )
        self._views: dict[int, K.DecodeBuffers] = {}
        self._heads = cfg.num_attention_heads

    def buffers(self, batch: int) -> "K.DecodeBuffers":
        """The buffers for `batch` sequences: views of the first rows (score rows: batch * heads)."""
        views = self._views.get(batch)
        if views is None:
            full = self._full
            per_sequence = {name: getattr(full, name)[:batch] for name in full._fields if name not in ("scores", "claims")}
            views = full._replace(scores=full.scores[: batch * self._heads], **per_sequence)
            self._views[batch] = views
        return views


class Model:
    """Weights at one precision plus RoPE tables for a context size; run through `forward`.

    One lock serialises every kernel call: Numba's parallel regions must never be entered from
    two Python threads at once (the workqueue threading layer aborts the process).
    """

    def __init__(self, cfg: ModelConfig, weights: Weights, ctx: int | None = None):
        self.config = cfg
        self.weights = weights
        self.dtype = weights.dtype
        self.ctx = cfg.context_size(ctx)
        self.cos, self.sin, self.rope_table = rope_tables(cfg, self.ctx)
        self.windows = np.array([cfg.layer_window(i) for i in range(cfg.num_hidden_layers)], np.int64)
        self.sliding_layers = np.flatnonzero(self.windows)  # their old positions are never read again
        self.widest_window = cfg.widest_window
        self._lock = threading.Lock()
        self.matrix_dtypes = weights.matrix_dtypes
        self._grouped = weights.grouped
        self._decode_ws = DecodeWorkspace(cfg, 1, self.ctx, self.matrix_dtypes, self._grouped)
        self._prefill_ws: PrefillWorkspace | None = None
        self._decode_weights = decode_weights(cfg, weights, self.rope_table, self.windows)
        self._decode_call = DirectCall(K.decode_batch)

    @classmethod
    def load(
        cls, source: str | Path, ctx: int | None = None, dtype: str | None = None, check_finite: bool = False
    ) -> "Model":
        """From an HF checkpoint directory or a GGUF file (checkpoint.load_checkpoint); dtype None
        is float32 for a directory and the stored formats for a GGUF."""
        cfg, weights = load_checkpoint(source, dtype=dtype, check_finite=check_finite)
        return cls(cfg, weights, ctx)

    def new_cache(self) -> KVCache:
        return KVCache(self.config, self.ctx)

    # ------------------------------------------------------------------ forward

    def forward(self, tokens, cache: KVCache, all_logits: bool = False, hidden: np.ndarray | None = None) -> np.ndarray:
        """Run `tokens` after what `cache` holds; returns logits (T, V) or (V,) for the last token.

        The returned (V,) array is a workspace buffer, overwritten by the next call.
        hidden: optional (L + 2, T, H) array that receives the residual stream after the
        embedding and after every layer, then the final norm's output (for `compare --per-layer`).
        """
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        T = len(tokens)
        if T == 0:
            raise GenerationError("no tokens to run")
        V = self.config.vocab_size
        if tokens.min() < 0 or tokens.max() >= V:
            raise GenerationError(f"token id out of range [0, {V})")
        cache.reserve(T)
        with self._lock:
            if T == 1 and not all_logits and hidden is None:
                return self._decode(int(tokens[0]), cache)
            ws = self._prefill_workspace()
            out = np.empty((T, V), np.float32) if all_logits else None
            for start in range(0, T, ws.rows):
                chunk = tokens[start : start + ws.rows]
                last = start + ws.rows >= T
                capture = None if hidden is None else hidden[:, start : start + len(chunk)]
                logits = self._prefill(chunk, cache, ws, all_logits, want_logits=all_logits or last, capture=capture)
                if all_logits:
                    out[start : start + len(chunk)] = logits
            return out if all_logits else logits

    def release_outside_windows(self, cache: KVCache) -> None:
        """Give back the memory of sliding-window layers' positions no later token can attend to,
        RELEASE_STEP positions at a time: a long sequence holds about window + RELEASE_STEP of
        them per sliding layer (full layers keep every position). After this, `cache` cannot be
        truncated below its length (the engine never does; the prefix cache copies blocks first)."""
        if len(self.sliding_layers):
            cache.release_outside_window(self.sliding_layers, self.widest_window, RELEASE_STEP)

    def _prefill_workspace(self) -> PrefillWorkspace:
        if self._prefill_ws is None:
            self._prefill_ws = PrefillWorkspace(self.config, min(PREFILL_CHUNK, self.ctx), self.ctx)
        return self._prefill_ws

    def _decode(self, token: int, cache: KVCache) -> np.ndarray:
        """One token through the whole model in a single Numba call (a batch of one)."""
        buf = self._decode_ws.buffers(1)
        buf.tokens[0], buf.positions[0], buf.slots[0] = token, cache.length, 0
        self._decode_step(buf, cache.k[None], cache.v[None])
        cache.length += 1
        return buf.logits[0]

    def decode_batch(self, tokens, caches: list[KVCache], slots, pool) -> np.ndarray:
        """One token for each of B sequences in one step, weights read once: logits (B, V).

        caches[b] is slot slots[b] of `pool` (a KVPool). Each row of the result equals what a
        decode of that sequence alone would give, bit for bit. The array is a workspace buffer.
        """
        B = len(tokens)
        for c in caches:
            c.reserve(1)
        with self._lock:
            if self._decode_ws.rows < B:
                self._decode_ws = DecodeWorkspace(self.config, B, self.ctx, self.matrix_dtypes, self._grouped)
            buf = self._decode_ws.buffers(B)
            buf.tokens[:] = tokens
            buf.positions[:] = [c.length for c in caches]
            buf.slots[:] = slots
            self._decode_step(buf, pool.k, pool.v)
        for c in caches:
            c.length += 1
        return buf.logits

    def _decode_step(self, buf: "K.DecodeBuffers", k: np.ndarray, v: np.ndarray) -> None:
        """K.decode_batch on this model's weights; its argument types are fixed but for the caches'."""
        key = (array_key(k), array_key(v))
        self._decode_call(key, buf, self._decode_weights, k, v, self.cos, self.sin, self.config.rms_norm_eps)

    def _prefill(self, tokens, cache: KVCache, ws: PrefillWorkspace, all_logits: bool, want_logits: bool = True, capture=None):
        """Many tokens, one kernel call per operation, on a workspace of `ws.rows` tokens."""
        cfg, w = self.config, self.weights
        T = len(tokens)
        pos0 = cache.length
        x = ws.x[:T]
        ws.positions[:T] = np.arange(pos0, pos0 + T)
        K.gather_rows(x, w.embed.w, w.embed.s, tokens)
        x *= np.float32(cfg.embed_scale)
        if capture is not None:
            capture[0] = x
        for i, layer in enumerate(w.layers):
            self._attention_block(i, layer, x, ws, cache, pos0)  # h = x + out_norm(attn(norm(x)))
            self._mlp_block(layer, x, ws)  # x = h + out_norm(mlp(norm(h)))
            if capture is not None:
                capture[i + 1] = x
        cache.length = pos0 + T
        eps = cfg.rms_norm_eps
        if capture is not None:
            K.rmsnorm(capture[-1], x, w.norm, eps)
        if not want_logits:
            return None
        if all_logits:
            K.rmsnorm(ws.xn[:T], x, w.norm, eps)
            logits = np.empty((T, cfg.vocab_size), np.float32)
            K.matmul(logits, ws.xn[:T], w.lm_head.w, w.lm_head.s)
        else:
            K.rmsnorm(ws.xn[T - 1 : T], x[T - 1 :], w.norm, eps)
            K.matvec(ws.logits, ws.xn[T - 1], w.lm_head.w, w.lm_head.s)
            logits = ws.logits.reshape(1, -1)
        if cfg.final_logit_softcapping:
            for row in logits:
                K.softcap_row(row, cfg.final_logit_softcapping)
        return logits if all_logits else ws.logits

    def _attention_block(self, i: int, layer, x: np.ndarray, ws: PrefillWorkspace, cache: KVCache, pos0: int) -> None:
        """x += out_norm(attention(norm(x))) for layer i, the chunk's keys and values into the cache."""
        cfg, T, eps, hd = self.config, len(x), self.config.rms_norm_eps, self.config.head_dim
        xn, q, k, v, att, o = ws.xn[:T], ws.q[:T], ws.k[:T], ws.v[:T], ws.att[:T], ws.proj[:T]
        _norm_or_copy(xn, x, layer.attn_norm, eps)
        _linear(q, xn, layer.q)
        _linear(k, xn, layer.k)
        _linear(v, xn, layer.v)
        for proj, norm in ((q, layer.q_norm), (k, layer.k_norm)):
            if norm is not None:  # per head or over the projection: groups of the norm's width
                K.rmsnorm(proj.reshape(-1, len(norm)), proj.reshape(-1, len(norm)), norm, eps)
        table = self.rope_table[i]
        if table >= 0:
            K.rope(q, self.cos[table], self.sin[table], ws.positions[:T], hd)
            K.rope(k, self.cos[table], self.sin[table], ws.positions[:T], hd)
        K.kv_write(cache.k[i], cache.v[i], k, v, pos0)
        K.attention(att, q, cache.k[i], cache.v[i], pos0, ws.scores, self.windows[i], np.float32(cfg.attn_scale),
                    np.float32(cfg.attn_logit_softcapping or 0.0))
        _linear(o, att, layer.o)
        if layer.attn_out_norm is not None:
            K.rmsnorm(o, o, layer.attn_out_norm, eps)
        x += o

    def _mlp_block(self, layer, x: np.ndarray, ws: PrefillWorkspace) -> None:
        """x += out_norm(down(act(gate(norm(x))) * up(norm(x))))."""
        T, eps = len(x), self.config.rms_norm_eps
        xn, gate, up, o = ws.xn[:T], ws.gate[:T], ws.up[:T], ws.proj[:T]
        _norm_or_copy(xn, x, layer.mlp_norm, eps)
        _linear(gate, xn, layer.gate)
        _linear(up, xn, layer.up)
        K.gated(gate, gate, up, self.config.hidden_act != "silu")
        _linear(o, gate, layer.down)
        if layer.mlp_out_norm is not None:
            K.rmsnorm(o, o, layer.mlp_out_norm, eps)
        x += o


def _linear(out: np.ndarray, inp: np.ndarray, lin) -> None:
    K.matmul(out, inp, lin.w, lin.s)
    if lin.b is not None:
        K.add_bias(out, lin.b)


def _norm_or_copy(out: np.ndarray, x: np.ndarray, norm: np.ndarray | None, eps: float) -> None:
    """out = rmsnorm(x), or x itself where the architecture has no norm at that place."""
    if norm is None:
        out[:] = x
    else:
        K.rmsnorm(out, x, norm, eps)


def decode_weights(cfg: ModelConfig, w: Weights, rope_table: np.ndarray, windows: np.ndarray) -> "K.DecodeWeights":
    """The weights and architecture as kernels.decode_batch reads them, by name (built once at load)."""
    layers = w.layers
    f = np.float32

    def per_layer(get) -> List:
        return typed_list(get(layer) for layer in layers)

    def stacked_bias(*names) -> np.ndarray:
        """(L, sum of widths); (L, 0) when these projections have no bias."""
        if getattr(layers[0], names[0]).b is None:
            return np.zeros((len(layers), 0), f)
        return np.stack([np.concatenate([getattr(layer, n).b for n in names]) for layer in layers]).astype(f)

    def stacked_norm(name) -> np.ndarray:
        """(L, width); (L, 0) where the architecture has no such norm."""
        if getattr(layers[0], name) is None:
            return np.zeros((len(layers), 0), f)
        return np.stack([getattr(layer, name) for layer in layers]).astype(f)

    matrices = {}
    for name in ("q", "k", "v", "o", "gate", "up", "down"):
        matrices[name] = per_layer(lambda layer: getattr(layer, name).w)
        matrices[name + "_scales"] = per_layer(lambda layer: getattr(layer, name).s)
    norms = {name: stacked_norm(name) for name in ("attn_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm", "q_norm", "k_norm")}
    return K.DecodeWeights(
        embed=w.embed.w,
        embed_scales=w.embed.s,
        lm_head=w.lm_head.w,
        lm_head_scales=w.lm_head.s,
        final_norm=w.norm,
        qkv_bias=stacked_bias("q", "k", "v"),
        o_bias=stacked_bias("o"),
        gate_up_bias=stacked_bias("gate", "up"),
        down_bias=stacked_bias("down"),
        rope_table=rope_table,
        window=windows,
        embed_scale=f(cfg.embed_scale),
        attn_scale=f(cfg.attn_scale),
        attn_softcap=f(cfg.attn_logit_softcapping or 0.0),
        final_softcap=f(cfg.final_logit_softcapping or 0.0),
        gelu=cfg.hidden_act != "silu",
        **norms,
        **matrices,
    )
