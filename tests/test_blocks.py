"""GGUF block formats (kernels.blocks) against gguf-py: dequantization bit for bit, products equal
to the float32 path's fixed-order dot product of the dequantized rows for every tile shape, and
the Q4_0 quantizer equal to gguf-py's."""

import importlib

import numpy as np
import pytest
from numba import njit

import kernels as K
import kernels.blocks as KB
from gguf_tiny import random_blocks
from kernels.weight_products import row_dot

KM = importlib.import_module("kernels.matmul")  # the module; `kernels.matmul` is also the function

FORMATS = list(KB.FORMATS)


def blocks_of(fmt, rows, cols, seed=0):
    """Rows of a ggml type: float rows as their bytes, block formats as random blocks."""
    rng = np.random.default_rng(seed)
    if fmt in (KB.F32_TYPE, KB.F16_TYPE, KB.BF16_TYPE):
        f = rng.standard_normal((rows, cols)).astype(np.float32)
        stored = {KB.F32_TYPE: f, KB.F16_TYPE: f.astype(np.float16), KB.BF16_TYPE: (f.view(np.uint32) >> 16).astype(np.uint16)}[fmt]
        return np.ascontiguousarray(stored).view(np.uint8).reshape(rows, -1)
    return random_blocks(fmt, rows, cols, seed=seed)


def gguf_dequantize(w, fmt, rows, cols):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return np.ascontiguousarray(dequantize(w, GGMLQuantizationType(fmt)).reshape(rows, cols).astype(np.float32))


@njit(cache=True)
def reference_products(out, wf, x):
    """The float32 path's dot product (row_dot) of each dequantized row and token."""
    for t in range(x.shape[0]):
        for n in range(wf.shape[0]):
            out[t, n] = row_dot(wf, wf[:1, :1], n, x[t], x[t, :0], x[t, :0])


@pytest.mark.parametrize("fmt", FORMATS, ids=[KB.NAMES[f] for f in FORMATS])
def test_rows_dequantize_as_gguf_py_does(fmt):
    rows, cols = 9, 512
    w = blocks_of(fmt, rows, cols)
    ref = gguf_dequantize(w, fmt, rows, cols)
    out = np.empty((rows, cols), np.float32)
    s = np.array([[fmt]], np.uint16)
    K.dequantize(out, w, s)
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("T", [7, 13, 37])
@pytest.mark.parametrize("fmt", FORMATS, ids=[KB.NAMES[f] for f in FORMATS])
def test_products_are_the_float32_paths_on_dequantized_rows(fmt, T):
    """Every tile shape (below 8 tokens: 4 or 1 rows by 4 or 1 tokens; from 8: 2 or 1 rows by
    8, 4 or 1 tokens; odd counts of both), the dequantized panels of prefill (from PANEL_TOKENS
    tokens), matvec and matmul give the float32 path's bits."""
    rows, cols = 11, 768
    w = blocks_of(fmt, rows, cols, seed=1)
    wf = gguf_dequantize(w, fmt, rows, cols)
    x = np.random.default_rng(2).standard_normal((T, cols)).astype(np.float32)
    ref = np.zeros((T, rows), np.float32)
    reference_products(ref, wf, x)
    s = np.array([[fmt]], np.uint16)
    out = np.zeros((T, rows), np.float32)
    K.matmul(out, x, w, s)
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))
    tiles = np.zeros((T, rows), np.float32)
    KM.block_matmul(tiles, x, w, s)  # the block tiles, whatever matmul chose
    np.testing.assert_array_equal(tiles.view(np.uint32), ref.view(np.uint32))
    one = np.zeros(rows, np.float32)
    K.matvec(one, x[3], w, s)
    np.testing.assert_array_equal(one, ref[3])
    dense = np.zeros((T, rows), np.float32)
    K.matmul(dense, x, wf, np.zeros((1, 1), np.float32))  # the float32 kernel on the same rows
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
