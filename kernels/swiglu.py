import numpy as np
from numba import njit, prange

from .jit import EXACT_MATH, kernel
from .vector_math import divide, exp_f32, tanh_f32


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)  # once per element: no call overhead
def silu_mul(g, u):
    """silu(g) * u with silu(g) = g * sigmoid(g), in float32. The divisor 1 + exp(-g) is never 0."""
    return divide(g, np.float32(1.0) + exp_f32(-g)) * u


SQRT_2_OVER_PI = np.float32(0.7978845608028654)
GELU_CUBIC = np.float32(0.044715)


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def gelu_tanh_mul(g, u):
    """gelu(g) * u with GELU's tanh form, in torch's order (gelu(approximate="tanh")):
    0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))."""
    inner = SQRT_2_OVER_PI * (g + GELU_CUBIC * (g * g * g))
    return np.float32(0.5) * g * (np.float32(1.0) + tanh_f32(inner)) * u


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def clamped_swiglu(g, u, alpha, limit):
    """gpt-oss's experts, in its order: g clamped above at limit, u to [-limit, limit], then
    (u + 1) * g * sigmoid(alpha g)."""
    g = min(g, limit)
    u = max(min(u, limit), -limit)
    return (u + np.float32(1.0)) * (g * divide(np.float32(1.0), np.float32(1.0) + exp_f32(-(g * alpha))))


# The MLP's activations: act(gate) * up, or XIELU's act(up) alone (an MLP without a gate)
SILU, GELU_TANH, CLAMPED_SWIGLU, XIELU = 0, 1, 2, 3


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def xielu_row(x, alpha_p, alpha_n, beta, eps):
    """Apertus's xIELU over one row, in place, in transformers' order: alpha_p x^2 + beta x where
    x > 0, else (expm1(min(x, eps)) - x) alpha_n + beta x; alpha_p and alpha_n already through
    their softplus (Architecture.layer_activation)."""
    for i in range(x.shape[0]):
        v = x[i]
        if v > 0:
            x[i] = alpha_p * v * v + beta * v
        else:
            x[i] = (np.expm1(min(v, eps)) - v) * alpha_n + beta * v


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def gated_row(g, u, gelu):
    """The MLP's gate over one row, in place: g = silu(g) * u, or with `gelu` GELU-tanh(g) * u
    (Gemma). The choice is made once, outside the loop: inside, it kept the loop scalar (81 ms of
    a 512-token bfloat16 prefill of the default model, 6 ms vectorised). In place, not into a
    third array that may alias g: an output that might overlap failed the loop's run-time overlap
    check and ran scalar too."""
    if gelu:
        for i in range(g.shape[0]):
            g[i] = gelu_tanh_mul(g[i], u[i])
    else:
        for i in range(g.shape[0]):
            g[i] = silu_mul(g[i], u[i])


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def clamped_gated_row(g, u, alpha, limit):
    """gpt-oss's gate over one row, in place: g = clamped_swiglu(g, u). A function of its own,
    so the other models' forward pass never compiles it."""
    a, lim = np.float32(alpha), np.float32(limit)
    for i in range(g.shape[0]):
        g[i] = clamped_swiglu(g[i], u[i], a, lim)


@kernel(fastmath=EXACT_MATH)
def gated(out, gate, up, act, alpha, limit):
    """out = act(gate) * up, act SILU, GELU_TANH or CLAMPED_SWIGLU (alpha, limit).  All (T, I);
    out may alias gate."""
    for t in prange(gate.shape[0]):
        out[t] = gate[t]
        if act == CLAMPED_SWIGLU:
            clamped_gated_row(out[t], up[t], alpha, limit)
        else:
            gated_row(out[t], up[t], act == GELU_TANH)


@kernel(fastmath=EXACT_MATH)
def swiglu(out, gate, up):
    """out = silu(gate) * up.  All (T, I); out may alias gate."""
    T, I = gate.shape
    for t in prange(T):
        for i in range(I):
            out[t, i] = silu_mul(gate[t, i], up[t, i])


@kernel(parallel=False, fastmath=EXACT_MATH, refcounts=False)
def softcap_row(x, cap):
    """x = cap * tanh(x / cap) in place (Gemma's final logit soft-capping).  x: (N,)."""
    for i in range(x.shape[0]):
        x[i] = tanh_f32(divide(x[i], np.float32(cap))) * np.float32(cap)
