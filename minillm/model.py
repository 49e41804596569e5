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

import numpy as np

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


class Workspace:
    """Activation buffers for up to `rows` tokens, allocated once."""

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
        self.scores = np.zeros((cfg.num_attention_heads, ctx), f)
        self.positions = np.zeros(rows, np.int64)
        self.logits = np.zeros((1, cfg.vocab_size), f)


class Model:
    """Weights plus RoPE tables for a context size; run through `forward`.

    One lock serialises every kernel call: Numba's parallel regions must never be entered from
    two Python threads at once (the workqueue threading layer aborts the process).
    """

    def __init__(self, cfg: ModelConfig, weights: Weights, ctx: int | None = None):
        self.config = cfg
        self.weights = weights
        self.ctx = cfg.context_size(ctx)
        self.cos, self.sin = K.rope_tables(rope_inv_freq(cfg), self.ctx)
        self._lock = threading.Lock()
        self._decode_ws = Workspace(cfg, 1, self.ctx)
        self._prefill_ws: Workspace | None = None

    @classmethod
    def load(cls, model_dir: str | Path, ctx: int | None = None, check_finite: bool = False) -> "Model":
        cfg, weights = load_checkpoint(model_dir, check_finite=check_finite)
        return cls(cfg, weights, ctx)

    def new_cache(self) -> KVCache:
        return KVCache(self.config, self.ctx)

    # ------------------------------------------------------------------ forward

    def forward(self, tokens, cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """Run `tokens` after what `cache` holds; returns logits (T, V) or (V,) for the last token.

        The returned (V,) array is a workspace buffer, overwritten by the next call.
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
            if T == 1:
                return self._run(tokens, cache, self._decode_ws, all_logits)
            ws = self._prefill_workspace()
            out = np.empty((T, V), np.float32) if all_logits else None
            for start in range(0, T, ws.rows):
                chunk = tokens[start : start + ws.rows]
                last = start + ws.rows >= T
                logits = self._run(chunk, cache, ws, all_logits, want_logits=all_logits or last)
                if all_logits:
                    out[start : start + len(chunk)] = logits
            return out if all_logits else logits

    def _prefill_workspace(self) -> Workspace:
        if self._prefill_ws is None:
            self._prefill_ws = Workspace(self.config, min(PREFILL_CHUNK, self.ctx), self.ctx)
        return self._prefill_ws

    def _run(self, tokens, cache: KVCache, ws: Workspace, all_logits: bool, want_logits: bool = True):
        cfg, w = self.config, self.weights
        T = len(tokens)
        pos0 = cache.length
        eps = cfg.rms_norm_eps
        hd = cfg.head_dim

        def proj(out, inp, weight, bias):
            if T == 1:
                K.matvec(out[0], inp[0], weight)
            else:
                K.matmul(out, inp, weight)
            if bias is not None:
                K.add_bias(out, bias)

        x, xn = ws.x[:T], ws.xn[:T]
        q, k, v, att = ws.q[:T], ws.k[:T], ws.v[:T], ws.att[:T]
        o, gate, up = ws.proj[:T], ws.gate[:T], ws.up[:T]
        positions = ws.positions[:T]
        positions[:] = np.arange(pos0, pos0 + T)
        np.take(w.embed, tokens, axis=0, out=x)

        for i, L in enumerate(w.layers):
            # h = x + attn(rmsnorm(x))
            K.rmsnorm(xn, x, L.input_norm, eps)
            proj(q, xn, L.wq, L.bq)
            proj(k, xn, L.wk, L.bk)
            proj(v, xn, L.wv, L.bv)
            K.rope(q, self.cos, self.sin, positions, hd)
            K.rope(k, self.cos, self.sin, positions, hd)
            K.kv_write(cache.k[i], cache.v[i], k, v, pos0)
            K.attention(att, q, cache.k[i], cache.v[i], pos0, ws.scores)
            proj(o, att, L.wo, L.bo)
            x += o
            # x = h + mlp(rmsnorm(h))
            K.rmsnorm(xn, x, L.post_norm, eps)
            proj(gate, xn, L.w_gate, L.b_gate)
            proj(up, xn, L.w_up, L.b_up)
            K.swiglu(gate, gate, up)
            proj(o, gate, L.w_down, L.b_down)
            x += o
        cache.length = pos0 + T

        if not want_logits:
            return None
        if all_logits:
            K.rmsnorm(xn, x, w.norm, eps)
            logits = np.empty((T, cfg.vocab_size), np.float32)
            K.matmul(logits, xn, w.lm_head)
            return logits
        K.rmsnorm(xn[T - 1 :], x[T - 1 :], w.norm, eps)
        K.matvec(ws.logits[0], xn[T - 1], w.lm_head)
        return ws.logits[0]
