"""Each Numba kernel against a plain NumPy reference, on odd shapes (not multiples of 8 or 16)."""

import subprocess
import sys
import typing

import numba
import numpy as np
import pytest
from conftest import ROOT
from minillm.kernels.vector_math import divide, exp_f32

from minillm import kernels as K

RNG = np.random.default_rng(0)
F32, BF16, I8 = K.BY_NAME["F32"], K.BY_NAME["BF16"], K.BY_NAME["I8"]


def matvec(out, x, w, fmt, s=None):
    """One row of activations: the decode path's products."""
    K.matmul(out.reshape(1, -1), x.reshape(1, -1), w, fmt, s)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------- references


def ref_rmsnorm(x, w, eps):
    x64 = x.astype(np.float64)
    return (x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps) * w).astype(np.float32)


def ref_layernorm(x, w, eps):
    x64 = x.astype(np.float64)
    centered = x64 - x64.mean(-1, keepdims=True)
    return (centered / np.sqrt((centered**2).mean(-1, keepdims=True) + eps) * w).astype(np.float32)


def ref_rope(x, cos, sin, positions, hd):
    T, width = x.shape
    xh = x.reshape(T, width // hd, hd).astype(np.float64)
    c = np.concatenate([cos[positions], cos[positions]], -1)[:, None, :]
    s = np.concatenate([sin[positions], sin[positions]], -1)[:, None, :]
    rotated = np.concatenate([-xh[..., hd // 2 :], xh[..., : hd // 2]], -1)  # HF rotate_half
    return (xh * c + rotated * s).reshape(T, width).astype(np.float32)


NO_SINKS = None  # compiled without sinks


def ref_attention(q, k_cache, v_cache, pos0, window=0, scale=None, softcap=0.0, sinks=None):
    T = q.shape[0]
    nkv, _, hd = k_cache.shape
    nh = q.shape[1] // hd
    scale = hd**-0.5 if scale is None else scale
    out = np.zeros_like(q, dtype=np.float64)
    for h in range(nh):
        kv = h // (nh // nkv)
        for t in range(T):
            n = pos0 + t + 1
            lo = max(0, n - window) if window else 0  # the last `window` keys
            s = k_cache[kv, lo:n].astype(np.float64) @ q[t, h * hd : (h + 1) * hd] * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            m = s.max() if sinks is None else max(s.max(), sinks[h])
            p = np.exp(s - m)
            p /= p.sum() + (0.0 if sinks is None else np.exp(sinks[h] - m))  # a sink weighs no value
            out[t, h * hd : (h + 1) * hd] = p @ v_cache[kv, lo:n]
    return out.astype(np.float32)


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("T,H", [(1, 1), (1, 37), (5, 53), (17, 129)])
def test_rmsnorm(T, H):
    x, w = rand(T, H), rand(H)
    out = np.empty_like(x)
    K.rmsnorm(out, x, w, 1e-5)
    np.testing.assert_allclose(out, ref_rmsnorm(x, w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("H", [1, 37, 129, 576])
def test_layernorm_row(H):
    x, w = rand(H) + np.float32(3.0), rand(H)  # an offset the mean must take out
    out = np.empty_like(x)
    K.layernorm_row(out, x, w, 1e-5)
    np.testing.assert_allclose(out, ref_layernorm(x, w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("N,Kdim", [(1, 1), (7, 13), (29, 53), (131, 67)])
def test_matvec(N, Kdim):
    x, w = rand(Kdim), rand(N, Kdim)
    out = np.empty(N, np.float32)
    matvec(out, x, w, F32)
    np.testing.assert_allclose(out, w.astype(np.float64) @ x, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("T,N,Kdim", [(2, 1, 1), (3, 17, 13), (9, 29, 53), (33, 131, 67), (2, 8, 64), (5, 20, 67), (6, 33, 160), (7, 9, 613),
                                      (63, 20, 67), (65, 20, 67), (66, 21, 67), (67, 9, 613)])
def test_matmul(T, N, Kdim):
    """Every tile shape decode's batches take (a tile's rows of x, then a narrower tile for the
    rest) and prefill's sweep (from SWEEP_FROM rows, its last rows of x in a narrower tile) equals
    the matvec bit for bit."""
    x, w = rand(T, Kdim), rand(N, Kdim)
    out = np.empty((T, N), np.float32)
    K.matmul(out, x, w, F32)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-4)
    for t in range(T):
        row = np.empty(N, np.float32)
        matvec(row, x[t], w, F32)
        np.testing.assert_array_equal(row, out[t])


def ref_bf16(x):
    """float32 rounded to the nearest bfloat16 (ties to even), as float32."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def low_precision(w, dtype):
    """(weights, their format, scales, float32 weights they stand for, activation rounding) at a precision."""
    if dtype == "bfloat16":
        wb = np.empty(w.shape, np.uint16)
        K.to_bf16(wb, w)
        return wb, BF16, None, (wb.astype(np.uint32) << 16).view(np.float32), ref_bf16
    q = np.empty(w.shape, np.int8)
    s = np.empty((w.shape[0], -(-w.shape[1] // K.QBLOCK)), np.uint16)  # float16 bits
    K.quantize_int8(q, s, w)
    return q, I8, s, K.dequantize(q, I8, s), ref_int16_blocks


def ref_int16_blocks(x):
    """Each full block of 32 along the last axis quantized to int16 (levels of its largest
    magnitude / 32767) and back, as float64; the tail past the last full block unchanged."""
    x = x.astype(np.float64)
    full = x.shape[-1] - x.shape[-1] % K.QBLOCK
    blocks = x[..., :full].reshape(*x.shape[:-1], -1, K.QBLOCK).astype(np.float32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.where(amax > 0, np.rint(blocks * (np.float32(32767) / amax)), 0)
    x[..., :full] = (q * (amax / np.float32(32767)).astype(np.float64)).reshape(*x.shape[:-1], full)
    return x


def test_activation_blocks_quantize_as_the_reference_and_keep_nan():
    """Activations as int8 weights meet them (kernels.activation_operands.quantize_blocks): levels and scales as the NumPy
    reference; an all-zero block stays zero; NaN or Inf in a block makes its scale NaN (so the
    outputs are NaN, as in float arithmetic); the tail past the last block is left alone."""
    x = rand(3, 5 * K.QBLOCK + 7)
    x[1, K.QBLOCK : 2 * K.QBLOCK] = 0
    x[2, 3] = np.nan
    x[2, 2 * K.QBLOCK + 1] = -np.inf
    q = np.full(x.shape, 99, np.int16)
    s = np.zeros((3, 5), np.float32)
    K.quantize_activations(q, s, x)
    full = 5 * K.QBLOCK
    back = q[:, :full].reshape(3, 5, K.QBLOCK) * s[:, :, None].astype(np.float64)
    np.testing.assert_array_equal(back[:2].reshape(2, full), ref_int16_blocks(x[:2])[:, :full])
    assert np.abs(q[:, :full]).max() <= 32767 and (q[:2, :full] != 0).any()
    assert (q[1, K.QBLOCK : 2 * K.QBLOCK] == 0).all() and s[1, 1] == 0
    assert np.isnan(s[2, 0]) and np.isnan(s[2, 2]) and np.isfinite(s[2, [1, 3, 4]]).all()
    assert (q[:, full:] == 99).all()
    w, fmt, ws, _, _ = low_precision(rand(4, x.shape[1]), "int8")
    out = np.empty(4, np.float32)
    matvec(out, x[2], w, fmt, ws)
    assert np.isnan(out).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("T,N,Kdim", [(1, 1, 1), (3, 17, 13), (9, 29, 53), (33, 131, 67), (6, 12, 128), (5, 21, 613), (19, 40, 613),
                                      (4, 20, 96), (7, 37, 160), (31, 20, 96), (47, 21, 67), (49, 20, 96), (50, 21, 67),
                                      (51, 9, 613)])
def test_low_precision_matmul_and_matvec(dtype, T, N, Kdim):
    """bfloat16 weights meet activations rounded to bfloat16, int8 weights activations quantized
    to int16 per block of 32; the matmul's every output equals the matvec (decode) dot product
    bit for bit."""
    x = rand(T, Kdim)
    w, fmt, s, w_ref, act = low_precision(rand(N, Kdim), dtype)
    out = np.empty((T, N), np.float32)
    K.matmul(out, x, w, fmt, s)
    expected = act(x).astype(np.float64) @ w_ref.T.astype(np.float64)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)
    for t in range(T):
        row = np.empty(N, np.float32)
        matvec(row, x[t], w, fmt, s)
        np.testing.assert_array_equal(row, out[t])


def test_add_bias():
    out, b = rand(3, 11), rand(11)
    expected = out + b
    K.add_bias(out, b)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("T,heads,hd,pos0", [(1, 1, 2, 0), (1, 3, 6, 40), (7, 5, 10, 3), (13, 2, 34, 0)])
def test_rope(T, heads, hd, pos0):
    ctx = 64
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    cos, sin = K.rope_tables(inv_freq, ctx)
    positions = np.arange(pos0, pos0 + T, dtype=np.int64) % ctx
    x = rand(T, heads * hd)
    expected = ref_rope(x, cos, sin, positions, hd)
    K.rope(x, cos, sin, positions, hd)
    np.testing.assert_allclose(x, expected, rtol=1e-5, atol=1e-5)


def test_rope_tables_match_angles():
    inv_freq = np.array([1.0, 0.1, 0.01], np.float32)
    cos, sin = K.rope_tables(inv_freq, 11)
    angles = np.arange(11, dtype=np.float32)[:, None] * inv_freq
    np.testing.assert_allclose(cos, np.cos(angles), atol=1e-6)
    np.testing.assert_allclose(sin, np.sin(angles), atol=1e-6)


@pytest.mark.parametrize(
    "T,nh,nkv,hd,pos0",
    [(1, 1, 1, 2, 0), (1, 9, 3, 14, 21), (5, 6, 2, 10, 0), (7, 5, 5, 6, 9), (11, 4, 1, 18, 3), (13, 6, 2, 64, 50)],
)
def test_attention(T, nh, nkv, hd, pos0):
    ctx = 67
    k_cache, v_cache = rand(nkv, ctx, hd), rand(nkv, ctx, hd)
    q = rand(T, nh * hd)
    out = np.empty_like(q)
    scores = np.empty((K.QUERIES_PER_TASK * numba.config.NUMBA_NUM_THREADS, ctx), np.float32)
    K.attention(out, q, k_cache, v_cache, pos0, scores, 0, np.float32(hd**-0.5), np.float32(0.0), NO_SINKS)
    np.testing.assert_allclose(out, ref_attention(q, k_cache, v_cache, pos0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,softcap,sinks", [(1, 0.0, False), (5, 0.0, False), (9, 0.7, False), (100, 0.0, False), (0, 3.0, False),
                                                  (0, 0.0, True), (5, 0.0, True), (1, 0.0, True)])
def test_attention_window_scale_softcap(window, softcap, sinks):
    """A sliding window (the last `window` keys), another scale, soft-capped scores, attention
    sinks (gpt-oss); and each query of a prefill equals attend on that query alone, bit for bit."""
    T, nh, nkv, hd, pos0, ctx = 13, 4, 2, 20, 6, 40
    k_cache, v_cache = rand(nkv, ctx, hd), rand(nkv, ctx, hd)
    q = rand(T, nh * hd) * 3
    out = np.empty_like(q)
    scores = np.empty((K.QUERIES_PER_TASK * numba.config.NUMBA_NUM_THREADS, ctx), np.float32)
    scale, cap = np.float32(0.3), np.float32(softcap)
    sink = (rand(nh) * 4).astype(np.float32) if sinks else NO_SINKS
    K.attention(out, q, k_cache, v_cache, pos0, scores, window, scale, cap, sink)
    expected = ref_attention(q, k_cache, v_cache, pos0, window, float(scale), softcap, sink if sinks else None)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    s = np.empty((1, ctx), np.float32)
    for t in range(T):
        p = pos0 + t
        lo = max(0, p - window + 1) if window else 0
        for h in range(nh):
            alone = np.empty(hd, np.float32)
            kv = h // (nh // nkv)
            K.attend(alone, q[t, h * hd : (h + 1) * hd], k_cache[kv, lo:], v_cache[kv, lo:], p + 1 - lo, s, scale, cap, None if sink is None else sink[h : h + 1])
            np.testing.assert_array_equal(alone, out[t, h * hd : (h + 1) * hd])


@pytest.mark.parametrize("heads,hd,n_keys", [(2, 64, 1), (3, 64, 33), (4, 20, 16), (5, 72, 47), (7, 16, 50)])
def test_attend_heads_each_as_alone(heads, hd, n_keys):
    """attend over several query heads of one KV head (decode's GQA tasks, values read in passes
    of up to 3 heads) gives each head what attend gives it alone, bit for bit, and the reference."""
    ctx = 64
    keys, values = rand(ctx, hd), rand(ctx, hd)
    q = rand(heads * hd) * 2
    scale, cap = np.float32(hd**-0.5), np.float32(0.0)
    out = np.empty(heads * hd, np.float32)
    K.attend(out, q, keys, values, n_keys, np.empty((heads, ctx), np.float32), scale, cap, NO_SINKS)
    for h in range(heads):
        alone = np.empty(hd, np.float32)
        K.attend(alone, q[h * hd : (h + 1) * hd], keys, values, n_keys, np.empty((1, ctx), np.float32), scale, cap, NO_SINKS)
        np.testing.assert_array_equal(out[h * hd : (h + 1) * hd], alone)
        scores = keys[:n_keys].astype(np.float64) @ q[h * hd : (h + 1) * hd] * float(scale)
        weights = np.exp(scores - scores.max())
        expected = (weights / weights.sum()) @ values[:n_keys]
        np.testing.assert_allclose(out[h * hd : (h + 1) * hd], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,I", [(1, 1), (3, 37), (8, 131)])
def test_gelu_tanh_gate(T, I):
    gate, up = rand(T, I) * 4, rand(T, I)
    g = gate.astype(np.float64)
    expected = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * up
    out = np.empty_like(gate)
    K.gated(out, gate, up, K.GELU_TANH, 0.0, 0.0)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    K.gated(out, gate, up, K.SILU, 0.0, 0.0)
    np.testing.assert_allclose(out, g / (1 + np.exp(-g)) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("limit", [7.0, 0.5])
def test_clamped_swiglu(limit):
    """gpt-oss's experts: gate clamped above, up to [-limit, limit], (up + 1) * g * sigmoid(1.702 g)."""
    gate, up = rand(5, 67) * 3, rand(5, 67) * 3
    g, u = np.minimum(gate.astype(np.float64), limit), np.clip(up.astype(np.float64), -limit, limit)
    out = np.empty_like(gate)
    K.gated(out, gate, up, K.CLAMPED_SWIGLU, 1.702, limit)
    np.testing.assert_allclose(out, (u + 1) * g / (1 + np.exp(-1.702 * g)), rtol=1e-5, atol=1e-6)


def test_xielu():
    """Apertus's xIELU (alpha_p x^2 + beta x above 0, (expm1(min(x, eps)) - x) alpha_n + beta x
    below) against NumPy in float64, near 0 too, where expm1 keeps what exp(x) - 1 would lose."""
    from minillm.kernels.swiglu import xielu_row

    x = np.concatenate([rand(200) * 4, np.float32([0.0, -1e-7, -2e-6, 1e-7, -30.0])]).astype(np.float32)
    alpha_p, alpha_n, beta, eps = np.float32(0.8), np.float32(1.3), np.float32(0.5), np.float32(-1e-6)
    v = x.astype(np.float64)
    expected = np.where(v > 0, 0.8 * v * v + 0.5 * v, (np.expm1(np.minimum(v, -1e-6)) - v) * 1.3 + 0.5 * v)
    out = x.copy()
    xielu_row(out, alpha_p, alpha_n, beta, eps)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-9)


def test_softcap():
    x = (rand(300) * 80).astype(np.float32)
    x[:3] = [np.inf, -np.inf, 0.0]
    expected = 30.0 * np.tanh(x.astype(np.float64) / 30.0)
    K.softcap_row(x, 30.0)
    np.testing.assert_allclose(x, expected, rtol=1e-6, atol=3e-6)


def test_kv_write():
    nkv, ctx, hd, T, pos0 = 3, 19, 6, 5, 7
    k_cache, v_cache = np.zeros((nkv, ctx, hd), np.float32), np.zeros((nkv, ctx, hd), np.float32)
    k, v = rand(T, nkv * hd), rand(T, nkv * hd)
    K.kv_write(k_cache, v_cache, k, v, pos0)
    np.testing.assert_array_equal(k_cache[:, pos0 : pos0 + T], k.reshape(T, nkv, hd).transpose(1, 0, 2))
    np.testing.assert_array_equal(v_cache[:, pos0 : pos0 + T], v.reshape(T, nkv, hd).transpose(1, 0, 2))
    assert not k_cache[:, :pos0].any() and not k_cache[:, pos0 + T :].any()


@pytest.mark.parametrize("T,I", [(1, 1), (3, 37), (8, 131)])
def test_swiglu(T, I):
    gate, up = rand(T, I) * 4, rand(T, I)
    g64 = gate.astype(np.float64)
    expected = g64 / (1 + np.exp(-g64)) * up
    out = np.empty_like(gate)
    K.swiglu(out, gate, up)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


@numba.njit(fastmath={"contract"})
def _exp_all(out, x):
    for i in range(x.shape[0]):
        out[i] = exp_f32(x[i])


def test_exp_f32_within_two_ulp_and_special_values():
    """The softmax/SiLU exp against float64 exp, over its whole range and at the edges."""
    x = np.concatenate([RNG.uniform(-110, 90, 200_000), RNG.uniform(-2, 2, 100_000)]).astype(np.float32)
    out = np.empty_like(x)
    _exp_all(out, x)
    exact = np.exp(x.astype(np.float64))
    with np.errstate(over="ignore"):
        rounded = exact.astype(np.float32)
    normal = np.isfinite(rounded) & (rounded >= np.finfo(np.float32).tiny)
    ulps = np.abs(out[normal] - exact[normal]) / np.spacing(rounded[normal])
    assert ulps.max() <= 2
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 88.8, -104.0, -200.0], np.float32)
    got = np.empty_like(special)
    _exp_all(got, special)
    np.testing.assert_array_equal(got, np.array([1, 1, np.inf, 0, np.nan, np.inf, 0, 0], np.float32))


@numba.njit(fastmath={"contract"})
def _divide_all(out, a, b):
    for i in range(a.shape[0]):
        out[i] = divide(a[i], b[i])


def test_divide_is_ieee_division():
    """divide (SiLU's and softmax's, without Numba's zero check) gives NumPy's float32 quotient."""
    a = np.concatenate([RNG.standard_normal(1000) * 10, [1, -1, 0, np.inf, np.nan, 1e-38]]).astype(np.float32)
    b = np.concatenate([RNG.standard_normal(1000) * 10, [0, 0, 0, np.inf, 1, 1e30]]).astype(np.float32)
    out = np.empty_like(a)
    _divide_all(out, a, b)
    with np.errstate(divide="ignore", invalid="ignore", under="ignore"):
        np.testing.assert_array_equal(out, a / b)


def test_mask_logits_clears_every_token_whose_bit_is_off():
    rng = np.random.default_rng(5)
    V = 1000  # not a multiple of 32: the last word is partial
    allowed = rng.random(V) < 0.3
    words = np.zeros((V + 31) // 32, np.uint32)
    for i in np.flatnonzero(allowed):
        words[i // 32] |= np.uint32(1) << np.uint32(i % 32)
    logits = rand(V)
    expected = np.where(allowed, logits, -np.inf).astype(np.float32)
    K.mask_logits(logits, words.view(np.int32))
    np.testing.assert_array_equal(logits, expected)


@pytest.mark.parametrize("k", [1, 7, 40, 1000])
def test_top_k_is_the_k_largest_best_first_ties_in_index_order(k):
    rng = np.random.default_rng(11)
    logits = np.round(rng.standard_normal(1000) * 4).astype(np.float32)  # many ties
    logits[[3, 500]] = -np.inf
    logits[::97] = np.float32(9.0)
    expected = np.lexsort((np.arange(1000), -logits))[:k]  # by logit descending, then index
    out, values = np.empty(k, np.int64), np.empty(k, np.float32)
    K.top_k(out, values, logits)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(values, logits[expected])
    ascending = np.arange(300, dtype=np.float32)  # every logit displaces one kept before
    out = np.empty(min(k, 300), np.int64)
    K.top_k(out, np.empty(len(out), np.float32), ascending)
    np.testing.assert_array_equal(out, np.arange(299, 299 - len(out), -1))


class _Pair(typing.NamedTuple):
    a: np.ndarray
    b: np.ndarray


@numba.njit(cache=False)
def _pair_sum(p, scale):
    return (p.a.sum() + p.b.sum()) * scale


def test_typed_list_holds_the_arrays_themselves():
    from minillm.kernels.jit import typed_list
    from numba.typed import List

    arrays = [np.arange(6, dtype=np.uint8).reshape(2, 3), np.zeros((4, 3), np.uint8)]
    built = typed_list(arrays)
    assert isinstance(built, List) and len(built) == 2
    built[1][0, 0] = 9  # views of the same memory (memory-mapped weights are used in place)
    assert arrays[1][0, 0] == 9 and np.array_equal(built[0], arrays[0])


def test_numba_registries_load_without_scipy_and_cffi():
    """cli.py loads Numba's registries with SciPy's BLAS and cffi hidden (~20 MB): the kernels
    run, and both stay importable afterwards. In a fresh process: this one has them loaded."""
    code = (
        "import sys, numpy as np\n"
        "from minillm.kernels.jit import load_numba_registries\n"
        "load_numba_registries()\n"
        "assert 'scipy.linalg' not in sys.modules and 'cffi' not in sys.modules\n"
        "from minillm import kernels as K\n"
        "x = np.ones((2, 64), np.float32)\n"
        "K.rmsnorm(x, x, np.ones(64, np.float32), 1e-5)\n"
        "assert abs(float(x[0, 0]) - 1.0) < 1e-4\n"
        "import importlib.util\n"
        "if importlib.util.find_spec('scipy') is not None:\n"
        "    import scipy.linalg\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_direct_call_keeps_one_entry_per_key_and_gives_the_dispatchers_results():
    from minillm.kernels.jit import DirectCall, array_key

    call = DirectCall(_pair_sum)
    floats = _Pair(np.ones(3), np.arange(4.0))
    ints = _Pair(np.ones(3, np.int64), np.arange(4))
    for pair in (floats, ints, floats._replace(b=np.arange(5.0)), ints):
        key = (array_key(pair.a), array_key(pair.b))
        assert call(key, pair, 2.0) == _pair_sum(pair, 2.0)
    assert len(call._entries) == 2  # float64 arrays and int64 arrays; a new length is not a new type
