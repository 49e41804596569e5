"""Whole model against transformers on tiny random checkpoints, and cached decode against a full forward."""

import numpy as np
import pytest
import torch
from hf_tiny import VOCAB, assert_batched_decode_equals_alone, hf_logits, make_checkpoint

from minillm.core.model import Model

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
    # sliding windows shorter than the 40-token prompt
    "mistral-window": dict(arch="mistral", sliding_window=7),
    "qwen2-window": dict(arch="qwen2", use_sliding_window=True, sliding_window=9, max_window_layers=1),
    # q/k norm per head, head_dim != hidden / heads, tied and untied, MQA
    "qwen3-tied": dict(arch="qwen3", tie_word_embeddings=True, head_dim=16),
    "qwen3-mqa-untied": dict(arch="qwen3", tie_word_embeddings=False, num_key_value_heads=1, head_dim=8),
    "qwen3-window": dict(arch="qwen3", use_sliding_window=True, sliding_window=6, max_window_layers=0),
    # norms after the sub-blocks, q/k norm over the whole projection
    "olmo2": dict(arch="olmo2"),
    "olmo2-mha-untied": dict(arch="olmo2", num_key_value_heads=6, tie_word_embeddings=False),
    # layers without RoPE
    "smollm3": dict(arch="smollm3", no_rope_layer_interval=2, tie_word_embeddings=True),
    "smollm3-3-layers": dict(arch="smollm3", num_hidden_layers=3, no_rope_layers=[0, 1, 0]),
    # fused qkv_proj and gate_up_proj
    "phi3": dict(arch="phi3"),
    "phi3-window": dict(arch="phi3", sliding_window=10, num_key_value_heads=6),
    # (1 + w) norms before and after each sub-block, GELU-tanh, scaled embeddings, q/k norm,
    # query_pre_attn_scalar, sliding and full layers with their own RoPE bases, soft-capping
    "gemma3": dict(arch="gemma3", head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=3.0),
    "gemma3-mqa-linear": dict(
        arch="gemma3", head_dim=8, num_key_value_heads=1, sliding_window=5, num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}},
    ),
    # RoPE scaling past the original context (40 tokens); "ctx" is the context minillm runs at
    "llama-rope-yarn": dict(arch="llama", max_position_embeddings=64, head_dim=16, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}),
    "qwen3-rope-yarn-factors": dict(arch="qwen3", max_position_embeddings=64, head_dim=16, rope_parameters={
        "rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 12, "rope_theta": 5000.0,
        "attention_factor": 1.3, "beta_fast": 16, "beta_slow": 2, "truncate": False}),
    "llama-rope-dynamic": dict(arch="llama", max_position_embeddings=16, ctx=40, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    "phi3-longrope": dict(arch="phi3", max_position_embeddings=64, original_max_position_embeddings=16, ctx=40,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "long_factor": [1.0, 1.5, 2.0, 3.0], "short_factor": [1.0, 1.1, 1.2, 1.3]}),
    "phi3-longrope-short": dict(arch="phi3", max_position_embeddings=128, original_max_position_embeddings=64, ctx=64,
                                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                 "long_factor": [1.0, 1.5, 2.0, 3.0], "short_factor": [1.0, 1.1, 1.2, 1.3]}),
    # Gemma 2: as Gemma 3 without q/k norm, with attention and final soft-capping (defaults 50, 30)
    "gemma2": dict(arch="gemma2", head_dim=16, query_pre_attn_scalar=12, sliding_window=6,
                   attn_logit_softcapping=0.5, final_logit_softcapping=2.0),
    # Granite 3: multipliers on the embeddings, the scores, each sub-block's output and the logits
    "granite": dict(arch="granite", embedding_multiplier=6.0, attention_multiplier=0.09, residual_multiplier=0.3, logits_scaling=2.5),
    # OLMo 3: OLMo 2 with sliding layers (three to each full one), RoPE scaling on the full layers only
    "olmo3": dict(arch="olmo3", num_hidden_layers=4, sliding_window=7, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # EXAONE 4: norms after the sub-blocks, q/k norm per head, no RoPE on the full layers
    "exaone4": dict(arch="exaone4", num_hidden_layers=4, sliding_window=6, sliding_window_pattern=2, head_dim=16),
    # Seed-OSS: q/k/v biases, and an o bias of its own
    "seed_oss": dict(arch="seed_oss", head_dim=8, attention_bias=True, attention_out_bias=True),
    "seed_oss-qkv-bias": dict(arch="seed_oss", head_dim=16, attention_bias=True, attention_out_bias=False, num_key_value_heads=1),
    # Ernie 4.5: RoPE on neighbouring pairs, biases everywhere
    "ernie4_5": dict(arch="ernie4_5", head_dim=8, use_bias=True, tie_word_embeddings=False),
    # GLM-4: sandwich norms of its own names, fused gate_up, RoPE on pairs of half of each head
    "glm4": dict(arch="glm4", head_dim=16, tie_word_embeddings=False),
    # partial RoPE on HF's halves, with longrope's attention factor past the original context
    "phi3-partial": dict(arch="phi3", partial_rotary_factor=0.5),
    # Ministral: Mistral with sliding and full layers
    "ministral": dict(arch="ministral", num_hidden_layers=3, sliding_window=5, head_dim=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # Cohere 2: one LayerNorm, attention and MLP side by side, RoPE on pairs of the sliding layers, logit_scale
    "cohere2": dict(arch="cohere2", num_hidden_layers=4, sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2,
                    logit_scale=0.3, layer_norm_eps=1e-5),
    # Apertus: an MLP without a gate, xIELU with its parameters per layer, q/k norms, Llama 3 RoPE (its default)
    "apertus": dict(arch="apertus", head_dim=16, num_hidden_layers=3),
    "phi3-partial-longrope": dict(arch="phi3", partial_rotary_factor=0.5, max_position_embeddings=64, original_max_position_embeddings=16,
                                  ctx=40, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                                           "long_factor": [1.0, 1.5], "short_factor": [1.0, 1.1]}),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    options = dict(CASES[request.param])
    ctx = options.pop("ctx", None)
    oracle = make_checkpoint(path, **options)
    return request.param, path, oracle, ctx


def test_logits_match_transformers(checkpoint):
    name, path, oracle, ctx = checkpoint
    ours = Model.load(path, ctx=ctx)
    got = ours.forward(TOKENS, ours.new_cache(), all_logits=True)
    expected = hf_logits(oracle, TOKENS)
    assert got.shape == expected.shape == (len(TOKENS), VOCAB)
    assert np.abs(got - expected).max() <= 1e-4, name
    assert ((got - expected) ** 2).mean() / expected.var() <= 1e-8, name
    assert (got.argmax(-1) == expected.argmax(-1)).all(), name


def test_sharded_checkpoint_really_has_shards(tmp_path):
    make_checkpoint(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2


@pytest.mark.parametrize("n_prefill", [1, 7, 25])
def test_prefill_then_decode_equals_full_forward(checkpoint, n_prefill):
    """Bit for bit, for every architecture, past every sliding window."""
    _, path, _, ctx = checkpoint
    model = Model.load(path, ctx=ctx)
    full = model.forward(TOKENS, model.new_cache(), all_logits=True)
    cache = model.new_cache()
    steps = [model.forward(TOKENS[:n_prefill], cache).copy()]
    for t in TOKENS[n_prefill:]:
        steps.append(model.forward([t], cache).copy())
    assert cache.length == len(TOKENS)
    np.testing.assert_array_equal(np.stack(steps), full[n_prefill - 1 :])


def test_chunked_prefill_equals_single_pass(tmp_path, monkeypatch):
    import minillm.core.model as M

    make_checkpoint(tmp_path)
    model = Model.load(tmp_path)
    whole = model.forward(TOKENS, model.new_cache(), all_logits=True)
    monkeypatch.setattr(M, "PREFILL_CHUNK", 6)
    chunked_model = Model.load(tmp_path)
    chunked = chunked_model.forward(TOKENS, chunked_model.new_cache(), all_logits=True)
    assert np.abs(whole - chunked).max() <= 1e-5


BATCH_CASES = {"llama": dict(tie_word_embeddings=False, attention_bias=True), "gemma3": CASES["gemma3"],
               "olmo2": CASES["olmo2"], "qwen3-window": CASES["qwen3-window"], "phi3-window": CASES["phi3-window"],
               **{name: CASES[name] for name in ("granite", "olmo3", "exaone4", "seed_oss", "ernie4_5", "glm4", "cohere2", "apertus")}}


# every precision on llama and on the new architectures' norm and activation paths
@pytest.mark.parametrize("case,dtype", [("llama", d) for d in ("float32", "bfloat16", "int8")] + [(c, "float32") for c in list(BATCH_CASES)[1:]]
                         + [("gemma3", "int8"), ("gemma3", "bfloat16"), ("olmo2", "int8"), ("qwen3-window", "bfloat16")])
def test_batched_decode_is_bit_identical_to_alone(tmp_path, dtype, case):
    """Sequences of different lengths decoded together give exactly what each gives alone."""
    make_checkpoint(tmp_path, **BATCH_CASES[case])
    assert_batched_decode_equals_alone(Model.load(tmp_path, dtype=dtype), TOKENS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_decode_equals_prefill_bit_for_bit_with_long_rows(tmp_path, dtype):
    """Rows of K >= kernels.matmul.LONG_ROW (the down projection here, with a ragged tail) take the
    four-rows-at-once decode path at float32; it must still sum in the prefill's order. bfloat16
    rows go one at a time in two accumulators: odd counts of chunks (129 in the down rows, 3 in
    the hidden rows) leave a last chunk outside the even/odd pairs. int8 rows go one at a time in
    blocks of 32 against int16 activations, with float32 tails of 3 and 16 elements."""
    from minillm.kernels.matmul import LONG_ROW

    intermediate = LONG_ROW + 32 + 3
    make_checkpoint(tmp_path, intermediate_size=intermediate, hidden_size=112, num_attention_heads=4, num_key_value_heads=2)
    model = Model.load(tmp_path, dtype=dtype)
    full = model.forward(TOKENS[:12], model.new_cache(), all_logits=True)
    cache = model.new_cache()
    steps = [model.forward(TOKENS[:4], cache).copy()] + [model.forward([t], cache).copy() for t in TOKENS[4:12]]
    np.testing.assert_array_equal(np.stack(steps), full[3:])


@pytest.mark.parametrize("case,dtype", [("gemma3", "bfloat16"), ("gemma3", "int8"), ("qwen3-tied", "int8"), ("olmo2", "bfloat16"), ("phi3", "int8")])
def test_low_precision_stays_close_to_float32(tmp_path, case, dtype):
    """The new architectures at bfloat16 and int8: logits near float32's and decode equal to prefill."""
    options = dict(CASES[case])
    options.pop("ctx", None)
    make_checkpoint(tmp_path, **options)
    exact = Model.load(tmp_path).forward(TOKENS, Model.load(tmp_path).new_cache(), all_logits=True)
    model = Model.load(tmp_path, dtype=dtype)
    low = model.forward(TOKENS, model.new_cache(), all_logits=True)
    assert np.abs(low - exact).max() < 0.1 * np.abs(exact).max()
    assert ((low - exact) ** 2).mean() / exact.var() < 2e-3
    cache = model.new_cache()
    steps = [model.forward(TOKENS[:9], cache).copy()] + [model.forward([t], cache).copy() for t in TOKENS[9:20]]
    np.testing.assert_array_equal(np.stack(steps), low[8:20])


@pytest.mark.parametrize("batch", [5, 9])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_batches_of_four_and_eight_use_register_tiles_and_stay_bit_identical(tmp_path, dtype, batch):
    """From four sequences on, decode multiplies weight rows into 4 x 4 register tiles, four
    sequences at a time (kernels.matmul._batch_tiles; int8 from eight, in sweep_rows' halves of
    a task), the rest one row dot at a time; rows of 48 and 72 leave tails past the chunks. Every
    row of the batch equals that sequence decoded alone."""
    from minillm.core.cache import KVPool

    make_checkpoint(tmp_path, tie_word_embeddings=False)
    model = Model.load(tmp_path, dtype=dtype)
    prompts = [TOKENS[i : i + 2 + i] for i in range(batch)]
    steps = [[int(t) for t in TOKENS[20 + i : 24 + i]] for i in range(batch)]
    alone = []
    for prompt, step in zip(prompts, steps):
        cache = model.new_cache()
        model.forward(prompt, cache)
        alone.append(np.stack([model.forward([t], cache).copy() for t in step]))
    pool = KVPool(model.config, model.ctx, batch)
    held = [pool.acquire() for _ in prompts]
    slots, caches = [s for s, _ in held], [c for _, c in held]
    for prompt, cache in zip(prompts, caches):
        model.forward(prompt, cache)
    together = [model.decode_batch([s[i] for s in steps], caches, slots, pool).copy() for i in range(4)]
    for b in range(batch):
        np.testing.assert_array_equal(np.stack([t[b] for t in together]), alone[b])
