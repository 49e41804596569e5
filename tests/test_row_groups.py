"""Q4_0, Q5_0, Q8_0, Q4_K, Q6_K and MXFP4 in groups of 16 rows (kernels.grouped_layouts, kernels.integer_products) against
plain NumPy: regrouping keeps
every weight (dequantized bit for bit as gguf-py does), activations split into bytes exactly,
products equal to the integer reference's, and every tile (decode, batch, prefill) gives the
same bits."""

import minillm.kernels.activation_operands as KA
import minillm.kernels.grouped_layouts as KG
import minillm.kernels.integer_products as KQ
import numpy as np
import pytest
from gguf_tiny import random_blocks
from minillm.kernels.gguf_blocks import MXFP4_LEVELS
from numba import njit

from minillm import kernels as K

Q4_0, Q5_0, Q8_0, Q4_K, Q6_K, MXFP4 = (K.BY_NAME[name].ggml_type for name in ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K", "MXFP4"))
FORMATS = [Q4_0, Q5_0, Q8_0, Q4_K, Q6_K, MXFP4]


@njit(cache=True)
def split_rows(xo, xs, x):
    for b in range(x.shape[0]):
        KA.quantize_split(xo, xs, x, b)


def grouped(fmt, rows, cols, seed=0, bits=16):
    """(a ggml type's random blocks, the same regrouped, the grouped layout's WeightFormat met by
    activations of `bits` bits)."""
    q = random_blocks(fmt, rows, cols, seed=seed)
    g = np.empty(q.shape, np.uint8)
    layout = K.formats.with_activations(K.BY_CODE[KG.group_rows(g, q, fmt)], bits)
    return q, g, layout


def levels_and_scales(fmt, q, cols):
    """A matrix's levels less their offset, (N, units, size), float32 scales (N, units) and
    minimums (N, units; weight = scale * level - minimum): Q4_0 in blocks of 32 from its bytes,
    Q4_K in sub-blocks of 32, Q6_K of 16 (scale d * sub-block scale)."""
    N = q.shape[0]
    if fmt == Q4_0:
        blocks = q.reshape(N, cols // 32, 18)
        qs = blocks[:, :, 2:].astype(np.int64)
        d = blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
        return np.concatenate([qs & 15, qs >> 4], axis=2) - 8, d, np.zeros_like(d)
    if fmt == Q5_0:
        blocks = q.reshape(N, cols // 32, 22)
        d = blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
        qh = blocks[:, :, 2:6].copy().view("<u4").astype(np.int64)  # (N, blocks, 1)
        qs = blocks[:, :, 6:].astype(np.int64)
        fifth = (qh >> np.arange(32)) & 1
        return np.concatenate([qs & 15, qs >> 4], axis=2) + 16 * fifth - 16, d, np.zeros_like(d)
    if fmt == MXFP4:  # FP4 codes' levels (doubled values), scales 2^(e - 128)
        blocks = q.reshape(N, cols // 32, 17)
        qs = blocks[:, :, 1:].astype(np.int64)
        d = np.ldexp(np.float32(1.0), blocks[:, :, 0].astype(np.int32) - 128).astype(np.float32)
        return np.array(MXFP4_LEVELS)[np.concatenate([qs & 15, qs >> 4], axis=2)], d, np.zeros_like(d)
    if fmt == Q8_0:
        blocks = q.reshape(N, cols // 32, 34)
        d = blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
        return blocks[:, :, 2:].view(np.int8).astype(np.int64), d, np.zeros_like(d)
    f32 = lambda h: h.view(np.float16).astype(np.float32)[..., None]
    if fmt == Q4_K:
        levels, sc, mn, d, dmin = KG.q4_k_parts(q)
        return (levels.reshape(N, cols // 32, 32).astype(np.int64), (f32(d) * sc).reshape(N, -1).astype(np.float32),
                (f32(dmin) * mn).reshape(N, -1).astype(np.float32))
    levels, scales, d = KG.q6_k_parts(q)
    dw = (f32(d) * scales.astype(np.float32)).reshape(N, cols // 16)
    return levels.reshape(N, cols // 16, 16).astype(np.int64) - 32, dw, np.zeros_like(dw)


LEVELS = {16: 32639, 8: 127}  # quantize_split's int16 levels, quantize_bytes's int8 ones


def split_reference(x, bits=16):
    """quantize_split (bits 16) or quantize_bytes (8) in NumPy: levels per block (scale amax /
    the largest level), rounded to nearest even."""
    T, K = x.shape
    top = LEVELS[bits]
    blocks = x.reshape(T, K // 32, 32)
    amax = np.abs(blocks).max(-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(top) / amax, np.float32(0.0)).astype(np.float32)
    x16 = np.clip(np.rint(blocks * inv[..., None]), -top, top).astype(np.int64)
    return x16, (amax / np.float32(top)).astype(np.float32)


def products_reference(fmt, q, x, bits=16):
    """Each row . token as the kernels form it: the exact integer sum of a block's products, then
    blocks in order, total = total + float(sum) * (weight scale * activation scale), in float64
    rounded to float32 at each step (a fused multiply-add but for the rare double rounding)."""
    T, K = x.shape
    levels, dw, dm = levels_and_scales(fmt, q, K)
    size = levels.shape[2]
    x16, da = split_reference(x, bits)
    ints = np.einsum("nkj,tkj->tnk", levels, x16.reshape(T, K // size, size))
    sums = x16.reshape(T, K // size, size).sum(-1).astype(np.float32).astype(np.float64)
    total = np.zeros((T, q.shape[0]), np.float32)
    for k in range(K // size):
        a = da[:, None, k * size // 32]
        total = (ints[:, :, k].astype(np.float32).astype(np.float64) * (dw[None, :, k] * a).astype(np.float32) + total).astype(np.float32)
        if fmt == Q4_K:
            total = (sums[:, k, None] * -(dm[None, :, k] * a).astype(np.float32) + total).astype(np.float32)
    return total


@pytest.mark.parametrize("fmt", FORMATS)
def test_regrouped_rows_dequantize_as_gguf_py(fmt):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    q, g, layout = grouped(fmt, 48, 512)
    want = dequantize(q, GGMLQuantizationType(fmt)).reshape(48, 512).astype(np.float32)
    np.testing.assert_array_equal(K.dequantize(g, layout), want)
    assert g.nbytes == q.nbytes  # the same bytes, interleaved
    stored = K.BY_GGML_TYPE[fmt]
    assert K.formats.runnable(stored, 48) is layout and K.formats.runnable(stored, 40) is stored


def test_activations_split_into_bytes_exactly():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    x[1, :32] *= 1e4  # one large block beside small ones
    x[2, 32:64] = 0  # an all-zero block
    xo, xs = (np.empty(shape, dt) for shape, dt in zip(KA.operand_shapes(3, 128), (np.int16, np.float32)))
    split_rows(xo, xs, x)
    x16, da = split_reference(x)
    raw = xo.view(np.int8).reshape(3, 256).astype(np.int64)
    lo, hi = raw[:, :128], raw[:, 128:]
    np.testing.assert_array_equal(hi * 256 + lo, x16.reshape(3, 128))
    np.testing.assert_array_equal(xs[:, 0::3], da)
    np.testing.assert_array_equal(xs[:, 1::3].view(np.int32), x16[..., :16].sum(-1))
    np.testing.assert_array_equal(xs[:, 2::3].view(np.int32), x16[..., 16:].sum(-1))


def test_activations_quantized_to_bytes_as_llama_cpp_does():
    """8-bit activations: levels -127..127 per block of 32 at amax / 127 (Q8_0's), in the hi
    bytes' place, their sums beside; and the same levels as llama.cpp's quantize_row_q8_0
    (gguf-py's Q8_0 quantizer, whose scale is stored as float16: compared through the levels)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    x[1, :32] *= 1e4
    x[2, 32:64] = 0
    xo, xs = (np.empty(shape, dt) for shape, dt in zip(KA.operand_shapes(3, 128), (np.int16, np.float32)))
    byte_rows(xo, xs, x)
    x8, da = split_reference(x, 8)
    hi = xo.view(np.int8).reshape(3, 256)[:, 128:].astype(np.int64)
    np.testing.assert_array_equal(hi, x8.reshape(3, 128))
    np.testing.assert_array_equal(xs[:, 0::3], da)
    np.testing.assert_array_equal(xs[:, 1::3].view(np.int32), x8[..., :16].sum(-1))
    np.testing.assert_array_equal(xs[:, 2::3].view(np.int32), x8[..., 16:].sum(-1))
    theirs = quantize(x, GGMLQuantizationType.Q8_0).reshape(3, 4, 34)[:, :, 2:].view(np.int8).reshape(3, 128)
    assert (np.abs(theirs.astype(np.int64) - hi) <= 1).all() and (theirs == hi).mean() > 0.99  # gguf-py rounds half away from zero


@njit(cache=True)
def byte_rows(xo, xs, x):
    for b in range(x.shape[0]):
        KA.quantize_bytes(xo, xs, x, b)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T", [1, 3, 4, 9])
def test_products_equal_the_integer_reference(fmt, T, bits):
    q, g, layout = grouped(fmt, 32, 512, seed=T, bits=bits)
    x = np.random.default_rng(T).standard_normal((T, 512)).astype(np.float32)
    out = np.zeros((T, 32), np.float32)
    K.matmul(out, x, g, layout)
    np.testing.assert_allclose(out, products_reference(fmt, q, x, bits), rtol=1e-6, atol=1e-6 * np.abs(out).max())
    # and close to the dequantized rows' products in float64: the activations' rounding error
    levels, dw, dm = levels_and_scales(fmt, q, 512)
    exact = x.astype(np.float64) @ (levels * dw[..., None] - dm[..., None]).reshape(32, 512).T
    np.testing.assert_allclose(out, exact, rtol=0, atol=(2e-4 if bits == 16 else 2e-2) * np.abs(exact).max())


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_tile_gives_the_same_bits(fmt, bits):
    """Tokens alone (decode), in eights, fours, threes and twos (batches) and many at once
    (prefill) agree to the bit: 23 tokens take two tiles of 8, one of 4 and one of 3; 22 end in
    a tile of 2."""
    q, g, layout = grouped(fmt, 64, 256, seed=7, bits=bits)
    x = np.random.default_rng(7).standard_normal((23, 256)).astype(np.float32)
    alone = np.zeros((23, 64), np.float32)
    for t in range(23):
        K.matmul(alone[t : t + 1], x[t : t + 1], g, layout)
    for T in (23, 22):
        together = np.zeros((T, 64), np.float32)
        K.matmul(together, x[:T], g, layout)
        np.testing.assert_array_equal(alone[:T], together)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_nan_activation_reaches_its_outputs_only(fmt, bits):
    q, g, layout = grouped(fmt, 16, 256, bits=bits)
    x = np.ones((2, 256), np.float32)
    x[0, 5] = np.nan
    out = np.zeros((2, 16), np.float32)
    K.matmul(out, x, g, layout)
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()


@pytest.mark.parametrize("way,wide", [("vnni", True), ("avx2", False), ("avx2", True), ("plain", True)])
def test_every_way_of_summing_bytes_is_exact(way, wide):
    """vpdpbusd, AVX2's byte and word pair sums (levels below 128, and up to 255 as Q8_0's), and
    the plain vectors for other CPUs all give the exact sums."""
    from minillm.kernels.target import has
    from numba import types
    from numba.extending import intrinsic

    if way == "vnni" and not has("avx512vnni") or way == "avx2" and not has("avx2"):
        pytest.skip(f"this CPU cannot run the {way} way")

    @intrinsic
    def dot(typingctx, acc, u, s):
        def codegen(context, b, signature, args):
            ptrs = [context.make_array(t)(context, b, a).data for t, a in zip(signature.args, args)]
            load = lambda p, ty: b.load(b.bitcast(p, ty.as_pointer()), align=1)
            pa = b.bitcast(ptrs[0], KQ.I32_VEC.as_pointer())
            total = KQ._dpbusd(b, load(ptrs[0], KQ.I32_VEC), load(ptrs[1], KQ.BYTES64), load(ptrs[2], KQ.BYTES64), way=way, wide_levels=wide)
            b.store(total, pa, align=1)
            return context.get_dummy_value()

        return types.void(acc, u, s), codegen

    @njit
    def run(acc, u, s):
        dot(acc, u, s)

    rng = np.random.default_rng(3)
    top = 256 if wide else 64  # Q6_K's levels reach 63; Q8_0's stored levels 255
    acc = rng.integers(-(2**20), 2**20, 16).astype(np.int32)
    u, s = rng.integers(0, top, 64).astype(np.uint8), rng.integers(-128, 128, 64).astype(np.int8)
    u[:4], s[:4] = top - 1, -128  # the extremes
    u[4:8], s[4:8] = top - 1, 127
    want = acc + (u.astype(np.int64) * s).reshape(16, 4).sum(1)
    run(acc, u, s)
    np.testing.assert_array_equal(acc, want)


@pytest.mark.parametrize("fmt,kernel,reference", [(Q4_K, KG.group_q4_k, KG.group_q4_k_reference), (Q6_K, KG.group_q6_k, KG.group_q6_k_reference)])
def test_k_quant_regrouping_kernels_equal_their_numpy_reference(fmt, kernel, reference):
    """The Numba regrouping (10x faster at load) writes the bytes the NumPy layout describes."""
    w = random_blocks(fmt, 48, 3 * 256, seed=3)
    fast, slow = np.zeros_like(w), np.zeros_like(w)
    kernel(fast, w)
    reference(slow, w)
    np.testing.assert_array_equal(fast, slow)


@pytest.mark.parametrize("level_max", [15, 24, 31, 63])
def test_avx2_sums_several_parts_as_int16_exactly(level_max):
    """AVX2 adds up to 32767 // (256 level_max) parts' pair sums as int16 before widening them
    (Q4 levels: 8 parts); at the extremes (levels at their largest, activation bytes -128 or 127)
    that must neither wrap nor saturate (Q4's levels use it; the others are checked too). Each
    exact sum as _exact_sums forms it, with corr."""
    from minillm.kernels.target import has
    from numba import types
    from numba.extending import intrinsic

    if not has("avx2"):
        pytest.skip("this CPU cannot run the avx2 way")

    @intrinsic
    def sums(typingctx, out, levels, lo, hi, corr):
        def codegen(context, b, signature, args):
            ptr = lambda i: context.make_array(signature.args[i])(context, b, args[i]).data
            i8 = KQ.I8.as_pointer()
            parts = [(b.load(b.bitcast(b.gep(ptr(1), [KQ.I64(64 * i)]), KQ.BYTES64.as_pointer()), align=1), 4 * i) for i in range(8)]
            token = (b.bitcast(ptr(2), i8), b.bitcast(ptr(3), i8), None)
            total = KQ._avx2_sums(b, token, KQ.I64(0), parts, args[4], level_max)
            b.store(total, b.bitcast(ptr(0), KQ.I32_VEC.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.void(out, levels, lo, hi, corr), codegen

    @njit
    def run(out, levels, lo, hi, corr):
        sums(out, levels, lo, hi, corr)

    rng = np.random.default_rng(level_max)
    for extreme in (-128, 127, None):
        levels = np.full((8, 64), level_max, np.uint8) if extreme is not None else rng.integers(0, level_max + 1, (8, 64)).astype(np.uint8)
        lo, hi = (np.full(32, extreme, np.int8),) * 2 if extreme is not None else rng.integers(-128, 128, (2, 32)).astype(np.int8)
        out = np.zeros(16, np.int32)
        run(out, levels, lo, hi, np.int32(-12345))
        x = 256 * hi.astype(np.int64) + lo
        want = sum(levels[i].astype(np.int64).reshape(16, 4) @ x[4 * i : 4 * i + 4] for i in range(8)) - 12345
        np.testing.assert_array_equal(out, want)


def test_q8_0_regroup_is_the_layouts_numpy_formula():
    """Q8_0_R16 per group of 16 rows and block: the 16 float16 scales, then eight 64-byte words,
    word o holding every row's levels 4o..4o+3 (row r at 4r) plus 128; the compiled regroup against
    that written in NumPy's reshapes."""
    rows, cols = 48, 256
    q = random_blocks(Q8_0, rows, cols, seed=3)
    g = np.empty(q.shape, np.uint8)
    KG.group_rows(g, q, Q8_0)
    G, nb = rows // 16, cols // 32
    blocks = q.reshape(G, 16, nb, 34)
    d = np.ascontiguousarray(blocks[..., :2].transpose(0, 2, 1, 3)).reshape(G, nb, 32)
    levels = (blocks[..., 2:] ^ 0x80).reshape(G, 16, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(G, nb, 512)
    assert np.array_equal(g.reshape(G, nb, 544), np.concatenate([d, levels], axis=2))
