"""GGUF block formats (kernels.gguf_blocks) against gguf-py: dequantization bit for bit, products equal
to the float32 path's fixed-order dot product of the dequantized rows for every tile shape, and
the Q4_0 quantizer equal to gguf-py's."""

import numpy as np
import pytest
from gguf_tiny import random_blocks
from minillm.kernels.row_products import row_dot
from numba import njit

from minillm import kernels as K

FORMATS = [f for f in K.FORMATS if f.ggml_type is not None]  # every GGUF type minillm runs as stored
FLOAT_ACTIVATIONS = [f for f in FORMATS if f.operand == K.Operand.FLOAT32]  # BF16 rounds them (test_kernels)


def blocks_of(fmt, rows, cols, seed=0):
    """Rows as a GGUF file stores them: F32 as float32, BF16 as its bits, F16 as bytes, block
    formats as random blocks."""
    rng = np.random.default_rng(seed)
    if fmt.name in ("F32", "F16", "BF16"):
        f = rng.standard_normal((rows, cols)).astype(np.float32)
        if fmt.name == "F16":
            return np.ascontiguousarray(f.astype(np.float16)).view(np.uint8).reshape(rows, -1)
        return f if fmt.name == "F32" else (f.view(np.uint32) >> 16).astype(np.uint16)
    return random_blocks(fmt.ggml_type, rows, cols, seed=seed)


def gguf_dequantize(w, fmt, rows, cols):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = np.ascontiguousarray(w).view(np.uint8).reshape(rows, -1)
    return np.ascontiguousarray(dequantize(raw, GGMLQuantizationType(fmt.ggml_type)).reshape(rows, cols).astype(np.float32))


@njit(cache=True)
def reference_products(out, wf, x):
    """The float32 path's dot product (row_dot) of each dequantized row and token."""
    for t in range(x.shape[0]):
        for n in range(wf.shape[0]):
            out[t, n] = row_dot(wf, wf[:1, :1], n, x[t], x[t, :0], x[t, :0])


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
def test_rows_dequantize_as_gguf_py_does(fmt):
    rows, cols = 9, 512
    w = blocks_of(fmt, rows, cols)
    ref = gguf_dequantize(w, fmt, rows, cols)
    out = K.dequantize(w, fmt)
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("T", [6, 7, 11, 13, 14, 18, 19, 37])
@pytest.mark.parametrize("fmt", FLOAT_ACTIVATIONS, ids=[f.name for f in FLOAT_ACTIVATIONS])
def test_products_are_the_float32_paths_on_dequantized_rows(fmt, T):
    """Every tile shape (below 8 rows of x: 4 or 1 weight rows by 4, 3, 2 or 1 rows of x; from 8: 2 or 1
    by 8, 4, then 3, 2 or 1; odd counts of both), the dequantized panels of prefill (from
    PANEL_TOKENS rows of x, the last 1-3 rows in a narrower tile), one row of x and many give the
    float32 path's bits."""
    rows, cols = 11, 768
    w = blocks_of(fmt, rows, cols, seed=1)
    wf = gguf_dequantize(w, fmt, rows, cols)
    x = np.random.default_rng(2).standard_normal((T, cols)).astype(np.float32)
    ref = np.zeros((T, rows), np.float32)
    reference_products(ref, wf, x)
    out = np.zeros((T, rows), np.float32)
    K.matmul(out, x, w, fmt)
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))
    one = np.zeros((1, rows), np.float32)
    K.matmul(one, x[3:4], w, fmt)
    np.testing.assert_array_equal(one[0], ref[3])
    dense = np.zeros((T, rows), np.float32)
    K.matmul(dense, x, wf, K.BY_NAME["F32"])  # the float32 kernel on the same rows
    np.testing.assert_array_equal(out, dense)


def test_q4_0_quantizer_is_gguf_pys():
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 576)) * rng.uniform(0.001, 2, size=(64, 1))).astype(np.float32)
    w[3, :32] = 0  # an all-zero block
    w[5, 40] = -np.abs(w[5, 32:64]).max()  # two largest magnitudes of opposite sign
    q = np.zeros((64, 576 // 32 * K.Q4_0_BYTES), np.uint8)
    K.quantize_q4_0(q, w)
    np.testing.assert_array_equal(q, quantize(w, GGMLQuantizationType.Q4_0))


def test_q8_0_quantizer_is_gguf_pys():
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 576)) * rng.uniform(0.001, 2, size=(64, 1))).astype(np.float32)
    w[3, :32] = 0  # an all-zero block
    w[7, :32] = np.append(127.0, np.arange(-15, 16) + 0.5)  # scale 1, levels at exact halves: rounded away from zero
    q = np.zeros((64, 576 // 32 * K.Q8_0_BYTES), np.uint8)
    K.quantize_q8_0(q, w)
    np.testing.assert_array_equal(q, quantize(w, GGMLQuantizationType.Q8_0))
