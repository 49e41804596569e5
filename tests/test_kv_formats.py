"""The KV cache's formats (`--kv-dtype`): rows stored as NumPy and torch round them, attention over
a stored format equal bit for bit to attention over its values widened to float32, and the whole
model's decode == batched decode == prefill at every format."""

import gguf
import numba
import numpy as np
import pytest
import torch
from hf_tiny import VOCAB, assert_batched_decode_equals_alone, make_checkpoint

from minillm import kernels as K
from minillm.core.model import Model
from minillm.errors import ConfigError, UsageError

NO_SINKS = None  # compiled without sinks

RNG = np.random.default_rng(7)
FORMATS = list(K.KV_FORMATS)
TOKENS = np.random.default_rng(1).integers(0, VOCAB, size=40)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def stored(name: str, x: np.ndarray) -> np.ndarray:
    """x (..., hd) float32 as the format's rows, by NumPy, torch and gguf-py (the references)."""
    if name == "float32":
        return x.copy()
    if name == "float16":
        return x.astype(np.float16).view(np.int16)
    if name == "bfloat16":
        return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    rows = gguf.quants.quantize(x.reshape(-1, x.shape[-1]), gguf.GGMLQuantizationType.Q8_0)
    return rows.reshape(*x.shape[:-1], -1)


def widened(name: str, rows: np.ndarray) -> np.ndarray:
    """A format's rows back to float32 values (exact)."""
    if name == "float32":
        return rows
    if name == "float16":
        return rows.view(np.float16).astype(np.float32)
    if name == "bfloat16":
        return (rows.astype(np.uint32) << 16).view(np.float32)
    flat = rows.reshape(-1, rows.shape[-1])
    values = gguf.quants.dequantize(flat, gguf.GGMLQuantizationType.Q8_0)
    return values.reshape(*rows.shape[:-1], -1).astype(np.float32)


@pytest.mark.parametrize("name", FORMATS)
def test_kv_write_stores_rows_as_the_references_round_them(name):
    fmt = K.KV_FORMATS[name]
    nkv, ctx, hd, T, pos0 = 3, 19, 64, 5, 7
    shape = (nkv, ctx, fmt.row_length(hd))
    k_cache, v_cache = np.zeros(shape, fmt.element), np.zeros(shape, fmt.element)
    k, v = rand(T, nkv * hd) * 3, rand(T, nkv * hd)
    k[0, :5] = [0.0, -0.0, 1e-8, 65504.0, -7e-5]  # zero, tiny (float16 subnormal), float16's largest
    K.kv_write(k_cache, v_cache, k, v, pos0)
    for cache, x in ((k_cache, k), (v_cache, v)):
        expected = stored(name, x.reshape(T, nkv, hd).transpose(1, 0, 2))
        np.testing.assert_array_equal(cache[:, pos0 : pos0 + T], expected)
        assert not cache[:, :pos0].any() and not cache[:, pos0 + T :].any()


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("heads,hd,n_keys", [(1, 64, 1), (3, 64, 37), (2, 128, 50), (4, 32, 16)])
def test_attend_over_a_format_equals_attend_over_its_widened_values(name, heads, hd, n_keys):
    """Decode's attention reads stored rows and widens them in registers: every output is the same
    bits as attention over the float32 copy of those values (so the format changes the values
    attention sees, never the order of its sums)."""
    ctx = 64
    keys, values = stored(name, rand(ctx, hd)), stored(name, rand(ctx, hd))
    q = rand(heads * hd) * 2
    scale, cap = np.float32(hd**-0.5), np.float32(0.0)
    out, expected = np.empty(heads * hd, np.float32), np.empty(heads * hd, np.float32)
    K.attend(out, q, keys, values, n_keys, np.empty((heads, ctx), np.float32), scale, cap, NO_SINKS)
    K.attend(expected, q, widened(name, keys), widened(name, values), n_keys, np.empty((heads, ctx), np.float32), scale, cap, NO_SINKS)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("window", [0, 5])
def test_prefill_attention_over_a_format_equals_decode_attention(name, window):
    """Prefill's 4 x 4 score tiles over stored rows: each query equals attend on it alone, and the
    whole equals prefill attention over the widened values; with attention sinks (gpt-oss) in the
    windowed case."""
    T, nh, nkv, hd, pos0, ctx = 13, 4, 2, 64, 6, 40
    k_cache, v_cache = stored(name, rand(nkv, ctx, hd)), stored(name, rand(nkv, ctx, hd))
    q = rand(T, nh * hd) * 3
    scale, cap = np.float32(0.3), np.float32(0.0)
    scores = np.empty((K.QUERIES_PER_TASK * numba.config.NUMBA_NUM_THREADS, ctx), np.float32)
    out, expected = np.empty_like(q), np.empty_like(q)
    sinks = rand(nh) * 3 if window else NO_SINKS
    K.attention(out, q, k_cache, v_cache, pos0, scores, window, scale, cap, sinks)
    K.attention(expected, q, widened(name, k_cache), widened(name, v_cache), pos0, scores, window, scale, cap, sinks)
    np.testing.assert_array_equal(out, expected)
    s = np.empty((1, ctx), np.float32)
    for t in range(T):
        p = pos0 + t
        lo = max(0, p - window + 1) if window else 0
        for h in range(nh):
            alone = np.empty(hd, np.float32)
            kv = h // (nh // nkv)
            K.attend(alone, q[t, h * hd : (h + 1) * hd], k_cache[kv, lo:], v_cache[kv, lo:], p + 1 - lo, s, scale, cap, None if sinks is None else sinks[h : h + 1])
            np.testing.assert_array_equal(alone, out[t, h * hd : (h + 1) * hd])


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_half_formats_take_any_head_size(name):
    """hd % 16 != 0: the tail columns are read one value at a time, widened the same way."""
    hd, ctx, n_keys = 20, 24, 19
    keys, values = stored(name, rand(ctx, hd)), stored(name, rand(ctx, hd))
    q = rand(2 * hd)
    out, expected = np.empty(2 * hd, np.float32), np.empty(2 * hd, np.float32)
    args = (n_keys, np.empty((2, ctx), np.float32), np.float32(0.25), np.float32(0.0), NO_SINKS)
    K.attend(out, q, keys, values, *args)
    K.attend(expected, q, widened(name, keys), widened(name, values), *args)
    np.testing.assert_array_equal(out, expected)


def test_kv_bytes_per_token():
    """float16 and bfloat16 hold half of float32's bytes, Q8_0 34/128 of them."""
    fmts = K.KV_FORMATS
    assert fmts["float16"].row_bytes(64) * 2 == fmts["float32"].row_bytes(64) == 256
    assert fmts["q8_0"].row_bytes(64) / fmts["float32"].row_bytes(64) == 34 / 128 <= 0.27


# ---------------------------------------------------------------- the whole model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama whose head size Q8_0 can hold (hd 32), GQA 4/2, biases."""
    path = tmp_path_factory.mktemp("kv-llama")
    make_checkpoint(path, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    return path


@pytest.mark.parametrize("kv_dtype", FORMATS[1:])
def test_decode_batched_and_prefill_agree_bit_for_bit_at_every_kv_dtype(tiny, kv_dtype):
    model = Model.load(tiny, kv_dtype=kv_dtype)
    full = model.forward(TOKENS[:30], model.new_cache(), all_logits=True)
    cache = model.new_cache()
    steps = [model.forward(TOKENS[:9], cache).copy()] + [model.forward([t], cache).copy() for t in TOKENS[9:30]]
    np.testing.assert_array_equal(np.stack(steps), full[8:30])
    assert_batched_decode_equals_alone(model, TOKENS)  # beside other sequences, in one step each


@pytest.mark.parametrize("kv_dtype", FORMATS[1:])
def test_reduced_kv_stays_close_to_float32(tiny, kv_dtype):
    exact = Model.load(tiny)
    reference = exact.forward(TOKENS, exact.new_cache(), all_logits=True)
    model = Model.load(tiny, kv_dtype=kv_dtype)
    logits = model.forward(TOKENS, model.new_cache(), all_logits=True)
    assert model.kv_bytes_per_token <= exact.kv_bytes_per_token * (0.27 if kv_dtype == "q8_0" else 0.5)
    nmse = ((logits - reference) ** 2).mean() / reference.var()
    assert 0 < nmse < (1e-3 if kv_dtype == "q8_0" else 2e-4), nmse
    assert (logits.argmax(-1) == reference.argmax(-1)).mean() >= 0.9


def test_kv_dtype_errors_name_the_choice_and_the_field(tmp_path, tiny):
    with pytest.raises(UsageError, match="kv-dtype 'fp8'"):
        Model.load(tiny, kv_dtype="fp8")
    make_checkpoint(tmp_path)  # head_dim 8
    with pytest.raises(ConfigError, match="head_dim 8 .* q8_0"):
        Model.load(tmp_path, kv_dtype="q8_0")


# ---------------------------------------------------------------- the engine on reduced caches


def _greedy(engine, prompt, n=12):
    from minillm.core.sampling import SamplingParams

    handle = engine.submit(prompt, SamplingParams(temperature=0), n, logprobs=2)
    return [(e.token, e.logprob, e.top_logprobs) for e in handle], handle.cached_tokens


def test_prefix_cache_keeps_blocks_in_the_kv_format(tiny):
    """Blocks are stored at the KV dtype (a q8_0 block takes 0.27 of a float32 one, so --cache-mb
    holds 3.8x more), and a request served from them gives the cold engine's tokens and logprobs."""
    from minillm.core.engine import Engine
    from minillm.core.prefix_cache import PrefixCache
    from minillm.options import Options

    model = Model.load(tiny, kv_dtype="q8_0")
    exact = PrefixCache(Model.load(tiny).config, 0).block_bytes
    assert Engine(model, Options(cache_mb=1)).prefix.block_bytes == exact * 34 // 128
    rng = np.random.default_rng(3)
    system = rng.integers(0, VOCAB, size=100).tolist()
    cached, cold = Engine(model, Options(cache_mb=4)), Engine(model, Options(cache_mb=0))
    first, hit = _greedy(cached, system)
    assert hit == 0 and first == _greedy(cold, system)[0]
    turn2 = system + [t for t, _, _ in first] + rng.integers(0, VOCAB, size=7).tolist()
    second, hit = _greedy(cached, turn2)
    assert hit >= 96 and second == _greedy(cold, turn2)[0]


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_speculation_on_a_reduced_cache_never_changes_a_token(tiny, mode):
    """Rejected positions are rolled back in a float16 cache as in a float32 one: the text of plain
    decoding on the same cache format (the draft keeps its own cache in the format too)."""
    from minillm.core.engine import Engine
    from minillm.options import Options

    model = Model.load(tiny, kv_dtype="float16")
    rng = np.random.default_rng(5)
    phrase = rng.integers(0, VOCAB, size=10).tolist()
    prompts = [(phrase * 20)[:150], rng.integers(0, VOCAB, size=40).tolist()]
    plain = Engine(model, Options(max_batch=2, cache_mb=0))
    expected = [_greedy(plain, p, 40)[0] for p in prompts]
    draft = Model.load(tiny, dtype="int8", kv_dtype="float16") if mode == "draft" else None
    spec = Engine(model, Options(max_batch=2, cache_mb=0, speculative=mode, spec_tokens=5), draft=draft)
    assert [_greedy(spec, p, 40)[0] for p in prompts] == expected
    assert spec.stats.spec_draft_tokens > 0


def test_sliding_window_release_on_a_reduced_cache(tmp_path):
    """Sliding-window layers give back old positions of a bfloat16 cache (RELEASE_STEP at a
    time) and the engine's tokens stay those of a cache that keeps everything."""
    from minillm.core.engine import Engine
    from minillm.options import Options

    make_checkpoint(tmp_path, arch="mistral", sliding_window=20, hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    model = Model.load(tmp_path, kv_dtype="bfloat16")
    prompt = np.random.default_rng(6).integers(0, VOCAB, size=150).tolist()
    cache = model.new_cache()
    logits = model.forward(prompt, cache)
    expected = []
    for _ in range(30):
        expected.append(int(np.argmax(logits)))
        logits = model.forward([expected[-1]], cache)
    assert cache.released == 0
    engine = Engine(model, Options(cache_mb=0))
    assert [t for t, _, _ in _greedy(engine, prompt, 30)[0]] == expected


def test_bench_reports_the_kv_cache(tiny):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(root / "cli.py"), "bench", "--model", str(tiny), "--prompt-tokens", "20", "--gen-tokens", "3",
                          "--ctx", "64", "--kv-dtype", "q8_0", "--json"], capture_output=True, text=True, timeout=600, cwd=root)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # 2 layers x 2 KV heads x (keys + values) x one Q8_0 block of 32 (34 bytes)
    assert (result["kv_dtype"], result["kv_bytes_per_token"], result["ctx"]) == ("q8_0", 2 * 2 * 2 * 34, 64)
