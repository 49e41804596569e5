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

import threading
from pathlib import Path

import numba
import numpy as np
from numba.typed import List

import kernels as K

from .cache import KVCache
from .checkpoint import Weights, load_checkpoint
from .config import ModelConfig, RopeScaling
from .errors import GenerationError

PREFILL_CHUNK = 256


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies (hd/2,) in float32, following transformers' rope init functions."""
    dim = cfg.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim
    # Correctly rounded to float32: what torch's float32 pow gives, to the last bit or one ulp.
    inv_freq = (1.0 / (cfg.rope_theta**exponents)).astype(np.float32)
    s: RopeScaling = cfg.rope_scaling
    f32 = np.float32
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
    return inv_freq.astype(np.float32)


class PrefillWorkspace:
    """Activation buffers for a chunk of up to `rows` tokens of one sequence, allocated once."""

    def __init__(self, cfg: ModelConfig, rows: int, ctx: int):
        f = np.float32
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.rows = rows
        self.x = np.zeros((rows, H), f)  # residual stream
        self.xn = np.zeros((rows, H), f)  # normalised input of a sub-block
        self.q = np.zeros((rows, cfg.q_dim), f)
        self.k = np.zeros((rows, cfg.kv_dim), f)
        self.v = np.zeros((rows, cfg.kv_dim), f)
        self.att = np.zeros((rows, cfg.q_dim), f)
        self.proj = np.zeros((rows, H), f)  # o_proj / down_proj output before the residual add
        self.gate = np.zeros((rows, I), f)
        self.up = np.zeros((rows, I), f)
        # score rows per thread (kernels.attention)
        self.scores = np.zeros((K.QUERIES_PER_TASK * numba.config.NUMBA_NUM_THREADS, ctx), f)
        self.positions = np.zeros(rows, np.int64)
        self.logits = np.zeros(cfg.vocab_size, f)  # the last token's


class DecodeWorkspace:
    """The buffers of one decode step for up to `rows` sequences, allocated once, handed to
    kernels.decode_batch as a DecodeBuffers of views for each batch size (made once per size)."""

    def __init__(self, cfg: ModelConfig, rows: int, ctx: int, dtype: str):
        f = np.float32
        H, I, q_dim = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim
        # xn, att and gate as the weights' products read them (kernels.activation_prep):
        # bfloat16 bits, or int16 with a scale per block of 32; none for float32
        op_dtype = np.int16 if dtype == "int8" else np.uint16
        op_rows = rows if dtype != "float32" else 0
        scale_rows = rows if dtype == "int8" else 0
        self.rows = rows
        self._full = K.DecodeBuffers(
            logits=np.zeros((rows, cfg.vocab_size), f),
            tokens=np.zeros(rows, np.int64),
            positions=np.zeros(rows, np.int64),
            slots=np.zeros(rows, np.int64),
            x=np.zeros((rows, H), f),
            xn=np.zeros((rows, H), f),
            qkv=np.zeros((rows, q_dim + 2 * cfg.kv_dim), f),
            att=np.zeros((rows, q_dim), f),
            proj=np.zeros((rows, H), f),
            gate=np.zeros((rows, I), f),
            up=np.zeros((rows, I), f),
            scores=np.zeros((rows * cfg.num_attention_heads, ctx), f),
            xn_op=np.zeros((op_rows, H), op_dtype),
            att_op=np.zeros((op_rows, q_dim), op_dtype),
            gate_op=np.zeros((op_rows, I), op_dtype),
            xn_scales=np.zeros((scale_rows, H // K.QBLOCK), f),
            att_scales=np.zeros((scale_rows, q_dim // K.QBLOCK), f),
            gate_scales=np.zeros((scale_rows, I // K.QBLOCK), f),
            claims=np.zeros((2, numba.config.NUMBA_NUM_THREADS), np.int64),  # kernels.schedule
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
        self.cos, self.sin = K.rope_tables(rope_inv_freq(cfg), self.ctx)
        self._lock = threading.Lock()
        self._decode_ws = DecodeWorkspace(cfg, 1, self.ctx, self.dtype)
        self._prefill_ws: PrefillWorkspace | None = None
        self._decode_weights = decode_weights(weights)

    @classmethod
    def load(
        cls, model_dir: str | Path, ctx: int | None = None, dtype: str = "float32", check_finite: bool = False
    ) -> "Model":
        cfg, weights = load_checkpoint(model_dir, dtype=dtype, check_finite=check_finite)
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

    def _prefill_workspace(self) -> PrefillWorkspace:
        if self._prefill_ws is None:
            self._prefill_ws = PrefillWorkspace(self.config, min(PREFILL_CHUNK, self.ctx), self.ctx)
        return self._prefill_ws

    def _decode(self, token: int, cache: KVCache) -> np.ndarray:
        """One token through the whole model in a single Numba call (a batch of one)."""
        buf = self._decode_ws.buffers(1)
        buf.tokens[0], buf.positions[0], buf.slots[0] = token, cache.length, 0
        K.decode_batch(buf, self._decode_weights, cache.k[None], cache.v[None], self.cos, self.sin, self.config.rms_norm_eps)
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
                self._decode_ws = DecodeWorkspace(self.config, B, self.ctx, self.dtype)
            buf = self._decode_ws.buffers(B)
            buf.tokens[:] = tokens
            buf.positions[:] = [c.length for c in caches]
            buf.slots[:] = slots
            K.decode_batch(buf, self._decode_weights, pool.k, pool.v, self.cos, self.sin, self.config.rms_norm_eps)
        for c in caches:
            c.length += 1
        return buf.logits

    def _prefill(self, tokens, cache: KVCache, ws: PrefillWorkspace, all_logits: bool, want_logits: bool = True, capture=None):
        """Many tokens, one kernel call per operation, on a workspace of `ws.rows` tokens."""
        cfg, w = self.config, self.weights
        T = len(tokens)
        pos0 = cache.length
        eps = cfg.rms_norm_eps
        hd = cfg.head_dim

        def linear(out, inp, lin):
            K.matmul(out, inp, lin.w, lin.s)
            if lin.b is not None:
                K.add_bias(out, lin.b)

        x, xn, att = ws.x[:T], ws.xn[:T], ws.att[:T]
        q, k, v = ws.q[:T], ws.k[:T], ws.v[:T]
        o, gate, up = ws.proj[:T], ws.gate[:T], ws.up[:T]
        positions = ws.positions[:T]
        positions[:] = np.arange(pos0, pos0 + T)
        K.gather_rows(x, w.embed.w, w.embed.s, tokens)
        if capture is not None:
            capture[0] = x

        for i, L in enumerate(w.layers):
            # h = x + attn(rmsnorm(x))
            K.rmsnorm(xn, x, L.input_norm, eps)
            linear(q, xn, L.q)
            linear(k, xn, L.k)
            linear(v, xn, L.v)
            K.rope(q, self.cos, self.sin, positions, hd)
            K.rope(k, self.cos, self.sin, positions, hd)
            K.kv_write(cache.k[i], cache.v[i], k, v, pos0)
            K.attention(att, q, cache.k[i], cache.v[i], pos0, ws.scores)
            linear(o, att, L.o)
            x += o
            # x = h + mlp(rmsnorm(h))
            K.rmsnorm(xn, x, L.post_norm, eps)
            linear(gate, xn, L.gate)
            linear(up, xn, L.up)
            K.swiglu(gate, gate, up)
            linear(o, gate, L.down)
            x += o
            if capture is not None:
                capture[i + 1] = x
        cache.length = pos0 + T
        if capture is not None:
            K.rmsnorm(capture[-1], x, w.norm, eps)

        if not want_logits:
            return None
        if all_logits:
            K.rmsnorm(xn, x, w.norm, eps)
            logits = np.empty((T, cfg.vocab_size), np.float32)
            K.matmul(logits, xn, w.lm_head.w, w.lm_head.s)
            return logits
        K.rmsnorm(xn[T - 1 :], x[T - 1 :], w.norm, eps)
        K.matvec(ws.logits, xn[T - 1], w.lm_head.w, w.lm_head.s)
        return ws.logits


def decode_weights(w: Weights) -> "K.DecodeWeights":
    """The weights as kernels.decode_batch reads them, by name (built once at load)."""
    layers = w.layers

    def per_layer(get) -> List:
        lst = List()
        for layer in layers:
            lst.append(get(layer))
        return lst

    def stacked_bias(*names) -> np.ndarray:
        """(L, sum of widths); (L, 0) when these projections have no bias."""
        if getattr(layers[0], names[0]).b is None:
            return np.zeros((len(layers), 0), np.float32)
        return np.stack([np.concatenate([getattr(layer, n).b for n in names]) for layer in layers]).astype(np.float32)

    matrices = {}
    for name in ("q", "k", "v", "o", "gate", "up", "down"):
        matrices[name] = per_layer(lambda layer: getattr(layer, name).w)
        matrices[name + "_scales"] = per_layer(lambda layer: getattr(layer, name).s)
    return K.DecodeWeights(
        embed=w.embed.w,
        embed_scales=w.embed.s,
        lm_head=w.lm_head.w,
        lm_head_scales=w.lm_head.s,
        input_norm=np.stack([layer.input_norm for layer in layers]),
        post_norm=np.stack([layer.post_norm for layer in layers]),
        final_norm=w.norm,
        qkv_bias=stacked_bias("q", "k", "v"),
        o_bias=stacked_bias("o"),
        gate_up_bias=stacked_bias("gate", "up"),
        down_bias=stacked_bias("down"),
        **matrices,
    )
