"""Whole model against transformers on tiny random checkpoints, and cached decode against a full forward."""

import numpy as np
import pytest
import torch

from hf_tiny import VOCAB, hf_logits, make_checkpoint
from minillm.model import Model

TOKENS = np.random.default_rng(1).integers(0, VOCAB, size=40)

CASES = {
    "llama-gqa-untied": dict(arch="llama", tie_word_embeddings=False),
    "llama-gqa-tied": dict(arch="llama", tie_word_embeddings=True),
    "llama-mha": dict(arch="llama", num_key_value_heads=6),
    "llama-head-dim": dict(arch="llama", head_dim=12),  # 6 heads x 12 != hidden 48
    "llama-rope-linear": dict(arch="llama", rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0}),
    "llama-rope-llama3": dict(
        arch="llama",
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
            "rope_theta": 10000.0,
        },
        head_dim=16,
    ),
    "llama-biases": dict(arch="llama", attention_bias=True, mlp_bias=True),
    "llama-f16": dict(arch="llama", dtype=torch.float16),
    "llama-bf16": dict(arch="llama", dtype=torch.bfloat16),
    "llama-sharded": dict(arch="llama", max_shard_size="20KB"),
    "qwen2-biases": dict(arch="qwen2", tie_word_embeddings=False),
    "mistral": dict(arch="mistral", sliding_window=None, head_dim=8),
    "mistral-window-ok": dict(arch="mistral", sliding_window=256),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    oracle = make_checkpoint(path, **CASES[request.param])
    return request.param, path, oracle


def test_logits_match_transformers(checkpoint):
    name, path, oracle = checkpoint
    ours = Model.load(path)
    got = ours.forward(TOKENS, ours.new_cache(), all_logits=True)
    expected = hf_logits(oracle, TOKENS)
    assert got.shape == expected.shape == (len(TOKENS), VOCAB)
    assert np.abs(got - expected).max() <= 1e-4, name


def test_sharded_checkpoint_really_has_shards(tmp_path):
    make_checkpoint(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2


@pytest.mark.parametrize("n_prefill", [1, 7, 25])
def test_prefill_then_decode_equals_full_forward(checkpoint, n_prefill):
    _, path, _ = checkpoint
    model = Model.load(path)
    full = model.forward(TOKENS, model.new_cache(), all_logits=True)
    cache = model.new_cache()
    steps = [model.forward(TOKENS[:n_prefill], cache).copy()]
    for t in TOKENS[n_prefill:]:
        steps.append(model.forward([t], cache).copy())
    assert cache.length == len(TOKENS)
    assert np.abs(np.stack(steps) - full[n_prefill - 1 :]).max() <= 1e-5


def test_chunked_prefill_equals_single_pass(tmp_path, monkeypatch):
    import minillm.model as M

    make_checkpoint(tmp_path)
    model = Model.load(tmp_path)
    whole = model.forward(TOKENS, model.new_cache(), all_logits=True)
    monkeypatch.setattr(M, "PREFILL_CHUNK", 6)
    chunked_model = Model.load(tmp_path)
    chunked = chunked_model.forward(TOKENS, chunked_model.new_cache(), all_logits=True)
    assert np.abs(whole - chunked).max() <= 1e-5


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_batched_decode_is_bit_identical_to_alone(tmp_path, dtype):
    """Sequences of different lengths decoded together give exactly what each gives alone."""
    from minillm.cache import KVPool

    make_checkpoint(tmp_path, tie_word_embeddings=False, attention_bias=True)
    model = Model.load(tmp_path, dtype=dtype)
    prompts = [TOKENS[:5], TOKENS[3:20], TOKENS[10:11]]
    steps = [TOKENS[20:26], TOKENS[26:32], TOKENS[32:38]]
    alone = []
    for prompt, step in zip(prompts, steps):
        cache = model.new_cache()
        model.forward(prompt, cache)
        alone.append(np.stack([model.forward([t], cache).copy() for t in step]))
    pool = KVPool(model.config, model.ctx, 4)
    held = [pool.acquire() for _ in prompts]
    slots, caches = [s for s, _ in held], [c for _, c in held]
    for prompt, cache in zip(prompts, caches):
        model.forward(prompt, cache)
    together = [model.decode_batch([s[i] for s in steps], caches, slots, pool).copy() for i in range(len(steps[0]))]
    for b in range(len(prompts)):
        np.testing.assert_array_equal(np.stack([t[b] for t in together]), alone[b])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_decode_equals_prefill_bit_for_bit_with_long_rows(tmp_path, dtype):
    """Rows of K >= kernels.decode.LONG_ROW (the down projection here, with a ragged tail) take the
    four-rows-at-once decode path at float32; it must still sum in the prefill's order. bfloat16
    rows go one at a time in two accumulators: odd counts of chunks (129 in the down rows, 3 in
    the hidden rows) leave a last chunk outside the even/odd pairs. int8 rows go one at a time in
    blocks of 32 against int16 activations, with float32 tails of 3 and 16 elements."""
    import kernels.decode

    intermediate = kernels.decode.LONG_ROW + 32 + 3
    make_checkpoint(tmp_path, intermediate_size=intermediate, hidden_size=112, num_attention_heads=4, num_key_value_heads=2)
    model = Model.load(tmp_path, dtype=dtype)
    full = model.forward(TOKENS[:12], model.new_cache(), all_logits=True)
    cache = model.new_cache()
    steps = [model.forward(TOKENS[:4], cache).copy()] + [model.forward([t], cache).copy() for t in TOKENS[4:12]]
    np.testing.assert_array_equal(np.stack(steps), full[3:])
