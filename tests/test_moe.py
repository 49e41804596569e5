"""Mixtures of experts against transformers on tiny random checkpoints: Mixtral, Qwen2-MoE (a
shared expert), Qwen3-MoE, OLMoE, gpt-oss, Granite MoE, ERNIE 4.5 and GLM-4.5 (selection biases,
sigmoid scores, groups), with dense layers among sparse ones; decode,
batched decode and prefill bit for bit; the stacked expert layout; the other precisions; GGUF
files (gpt-oss's MXFP4 experts too); the errors."""

import json

import numpy as np
import pytest
import torch
from hf_tiny import VOCAB, assert_batched_decode_equals_alone, hf_logits, make_checkpoint

from minillm.core.cache import KVPool
from minillm.core.model import Model
from minillm.errors import ConfigError
from minillm.loading.config import ModelConfig

TOKENS = np.random.default_rng(2).integers(0, VOCAB, size=40)

CASES = {
    # softmax router, top 2 renormalised; every layer sparse
    "mixtral": dict(arch="mixtral", num_local_experts=6, num_experts_per_tok=2),
    "mixtral-window": dict(arch="mixtral", num_local_experts=4, num_experts_per_tok=3, sliding_window=9, head_dim=8),
    # top 3 without renormalising, a shared expert under its sigmoid gate, a dense layer (mlp_only_layers)
    # and decoder_sparse_step 2 (odd layers only)
    "qwen2_moe": dict(arch="qwen2_moe", num_hidden_layers=3, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                      shared_expert_intermediate_size=40, mlp_only_layers=[1]),
    "qwen2_moe-step": dict(arch="qwen2_moe", num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                           shared_expert_intermediate_size=16, decoder_sparse_step=2, norm_topk_prob=True),
    # q/k norm per head, renormalised top k, a dense layer wider than the experts
    "qwen3_moe": dict(arch="qwen3_moe", num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      head_dim=16, mlp_only_layers=[0], norm_topk_prob=True),
    # q/k norm over the whole projection, top 4 of 8 as they stand
    "olmoe": dict(arch="olmoe", num_experts=8, num_experts_per_tok=4, intermediate_size=40),
    # a router with a bias, the top 3 logits' own softmax; experts with biases and the clamped
    # SwiGLU (a limit the gate and up values cross); attention sinks; sliding and full layers by
    # turns (a window of 7 over 40 tokens); YaRN
    "gpt_oss": dict(arch="gpt_oss", num_hidden_layers=3, num_local_experts=6, num_experts_per_tok=3, intermediate_size=32, head_dim=8,
                    sliding_window=7, swiglu_limit=0.1),
    # ERNIE 4.5: a dense layer first, a softmax router choosing by score + selection bias (moe_statics), the top 3
    # renormalised, a shared expert added as it is; RoPE on neighbouring pairs
    "ernie4_5_moe": dict(arch="ernie4_5_moe", num_hidden_layers=3, moe_num_experts=8, moe_k=3, moe_intermediate_size=32,
                         moe_num_shared_experts=1),
    # GLM-4.5: a dense layer first, sigmoid scores + selection bias, renormalised and scaled (routed_scaling_factor),
    # a shared expert; RoPE on the first half of each head
    "glm4_moe": dict(arch="glm4_moe", num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                     head_dim=16, routed_scaling_factor=2.5),
    # the best 2 of 4 groups (DeepSeek-V3's routing), q/k norms and biases, two shared experts, every layer sparse
    "glm4_moe-groups": dict(arch="glm4_moe", num_hidden_layers=3, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                            n_group=4, topk_group=2, use_qk_norm=True, attention_bias=True, first_k_dense_replace=0, n_shared_experts=2),
    # DeepSeek-V3: latent attention (q and kv latents, normed; a RoPE key shared by the heads; values narrower
    # than keys; YaRN with mscale_all_dim), a dense layer first, then GLM-4.5's routing in groups
    "deepseek_v3": dict(arch="deepseek_v3", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                        num_experts_per_tok=3, moe_intermediate_size=32, n_group=4, topk_group=2, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
                        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0,
                                             beta_fast=32.0, beta_slow=1.0, rope_theta=10000.0)),
    # without a q latent (DeepSeek-V2-Lite's q_proj), plain RoPE
    "deepseek_v3-q_proj": dict(arch="deepseek_v3", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                               num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1, first_k_dense_replace=1,
                               q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=12),
    # DeepSeek-V2: the same attention; a softmax router among the best 2 of 4 groups by their best score, weights
    # scaled and not renormalised, two shared experts
    "deepseek_v2": dict(arch="deepseek_v2", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                        num_experts_per_tok=3, moe_intermediate_size=32, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                        first_k_dense_replace=1, routed_scaling_factor=1.5, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
                        qk_rope_head_dim=8, v_head_dim=10),
    # DeepSeek-V2-Lite's shape: no q latent, greedy top k, every layer sparse
    "deepseek_v2-lite": dict(arch="deepseek_v2", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=12,
                             qk_rope_head_dim=8, v_head_dim=12, n_shared_experts=1),
    # Llama 4: RoPE layers with chunked attention (chunks of 8 over 40 tokens) and a q/k norm without weights, layers without
    # RoPE whose queries take the temperature (floor 4: it grows within 40 tokens), dense and sparse layers by turns (the dense
    # ones wider), the top logit's sigmoid scaling its expert's input, a shared expert
    "llama4": dict(arch="llama4", num_hidden_layers=4, head_dim=8, num_local_experts=4, num_experts_per_tok=1, intermediate_size=32,
                   intermediate_size_mlp=80, interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=8, floor_scale=4),
    # the top 2, every layer sparse, no q/k norm, no temperature tuning
    "llama4-top2": dict(arch="llama4", num_hidden_layers=3, head_dim=8, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                        no_rope_layer_interval=3, attention_chunk_size=16, use_qk_norm=False, attn_temperature_tuning=False),
    # Granite MoE: the top k logits' own softmax, experts stacked as input_linear/output_linear, Granite's multipliers
    "granitemoe": dict(arch="granitemoe", num_local_experts=6, num_experts_per_tok=2, embedding_multiplier=3.0, attention_multiplier=0.2,
                       residual_multiplier=0.5, logits_scaling=1.5),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    oracle = make_checkpoint(path, **CASES[request.param])
    return request.param, path, oracle


def _close(got, expected, name):
    assert got.shape == expected.shape == (len(TOKENS), VOCAB)
    assert np.abs(got - expected).max() <= 1e-4, name
    assert ((got - expected) ** 2).mean() / expected.var() <= 1e-8, name
    assert (got.argmax(-1) == expected.argmax(-1)).all(), name


def test_logits_match_transformers(checkpoint):
    name, path, oracle = checkpoint
    model = Model.load(path)
    assert model.config.num_experts > 0
    _close(model.forward(TOKENS, model.new_cache(), all_logits=True), hf_logits(oracle, TOKENS), name)


def test_the_router_really_chooses(checkpoint):
    """The checkpoints' routers are far from ties, and each sparse layer uses several experts."""
    name, path, oracle = checkpoint
    cfg = ModelConfig.from_file(path / "config.json")
    assert any(cfg.sparse_layers) and (not all(cfg.sparse_layers) or name.startswith(("mixtral", "olmoe", "gpt_oss", "granitemoe", "glm4_moe-groups", "deepseek_v2-lite", "llama4-top2")))
    chosen = set()
    with torch.no_grad():
        out = oracle(torch.tensor([list(TOKENS)]), output_router_logits=True)
    for logits in out.router_logits:
        top = torch.topk(logits.float(), cfg.experts_per_token, dim=-1).indices
        chosen |= set(top.flatten().tolist())
    assert len(chosen) == cfg.num_experts


@pytest.mark.parametrize("n_prefill", [1, 9])
def test_prefill_then_decode_equals_full_forward(checkpoint, n_prefill):
    _, path, _ = checkpoint
    model = Model.load(path)
    full = model.forward(TOKENS, model.new_cache(), all_logits=True)
    cache = model.new_cache()
    steps = [model.forward(TOKENS[:n_prefill], cache).copy()] + [model.forward([t], cache).copy() for t in TOKENS[n_prefill:]]
    np.testing.assert_array_equal(np.stack(steps), full[n_prefill - 1 :])


def test_batched_decode_is_bit_identical_to_alone(checkpoint):
    """Beside other sequences each row takes its own experts and sums them in the same order."""
    assert_batched_decode_equals_alone(Model.load(checkpoint[1]), TOKENS)


def test_a_step_mixing_prefill_and_decode_rows(checkpoint):
    """A prefill chunk of one sequence beside a decode of another: the experts take rows of both."""
    _, path, _ = checkpoint
    model = Model.load(path)
    ref = model.forward(TOKENS, model.new_cache(), all_logits=True)
    pool = KVPool(model.config, model.ctx, 2)
    (s0, c0), (s1, _) = pool.acquire(), pool.acquire()
    model.forward(TOKENS[:12], c0)
    tokens = [TOKENS[12], *TOKENS[:20]]
    logits = model.step(tokens, [12, *range(20)], [s0] + [s1] * 20, pool).copy()
    np.testing.assert_array_equal(logits[0], ref[12])
    np.testing.assert_array_equal(logits[1:], ref[:20])


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "q4_0"])
def test_other_precisions(tmp_path, dtype):
    """Experts converted like every matrix (the router stays float32): near float32's logits,
    decode == prefill and batched == alone."""
    # rows of whole Q4_0 blocks (32), expert matrices of whole groups of 16 rows
    make_checkpoint(tmp_path, **{**CASES["qwen2_moe"], "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 96,
                                 "shared_expert_intermediate_size": 64})
    exact = Model.load(tmp_path).forward(TOKENS, Model.load(tmp_path).new_cache(), all_logits=True)
    model = Model.load(tmp_path, dtype=dtype)
    low = model.forward(TOKENS, model.new_cache(), all_logits=True)
    assert ((low - exact) ** 2).mean() / exact.var() < (2e-2 if dtype == "q4_0" else 2e-3)
    cache = model.new_cache()
    steps = [model.forward(TOKENS[:9], cache).copy()] + [model.forward([t], cache).copy() for t in TOKENS[9:20]]
    np.testing.assert_array_equal(np.stack(steps), low[8:20])
    assert_batched_decode_equals_alone(model, TOKENS)


def test_stacked_expert_layout(tmp_path):
    """Experts stored as transformers 5 holds them, 3-D gate_up_proj and down_proj under `mlp`
    (some checkpoints ship so): the same logits as the per-expert files, at float32 and converted."""
    from safetensors.torch import save_file

    per_expert = tmp_path / "per_expert"
    oracle = make_checkpoint(per_expert, **CASES["mixtral"])
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    state = {k: v.contiguous() for k, v in oracle.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, stacked / "model.safetensors")
    (stacked / "config.json").write_text((per_expert / "config.json").read_text())
    for dtype in ("float32", "int8"):
        a = Model.load(per_expert, dtype=dtype)
        b = Model.load(stacked, dtype=dtype)
        np.testing.assert_array_equal(b.forward(TOKENS, b.new_cache(), all_logits=True), a.forward(TOKENS, a.new_cache(), all_logits=True))


def _as_shipped_mxfp4(w):
    """(E, N, K) float32 rows as gpt-oss's checkpoints pack them, by gguf-py's MXFP4 quantizer:
    blocks (E, N, K / 32, 16), two values a byte (low nibble first), and exponents (E, N, K / 32)."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import quantize

    E, N, K = w.shape
    q = quantize(w.reshape(E * N, K), QT.MXFP4).reshape(E, N, K // 32, 17)  # GGUF: values j and j + 16 in byte j
    values = np.concatenate([q[..., 1:] & 15, q[..., 1:] >> 4], axis=-1)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8), q[..., 0].copy()


def test_gpt_oss_as_it_ships_mxfp4(tmp_path):
    """A gpt-oss checkpoint with MXFP4 experts (_blocks and _scales, quantization_config mxfp4):
    the experts run as stored, as GGUF MXFP4 blocks, at every load precision; float32 gives the
    logits transformers gives the same checkpoint (which dequantizes it); decode == prefill ==
    batched decode."""
    from safetensors.numpy import load_file, save_file
    from transformers import AutoModelForCausalLM, Mxfp4Config

    make_checkpoint(tmp_path / "float", **dict(GGUF_CASES["gpt_oss"]))
    packed = {}
    for name, t in load_file(str(tmp_path / "float" / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # stored transposed: (E, K, N)
            packed[name + "_blocks"], packed[name + "_scales"] = _as_shipped_mxfp4(np.ascontiguousarray(t.transpose(0, 2, 1)))
        else:
            packed[name] = t
    (tmp_path / "mxfp4").mkdir()
    save_file(packed, str(tmp_path / "mxfp4" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                                         "model.embed_tokens", "lm_head"]}
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))
    oracle = AutoModelForCausalLM.from_pretrained(tmp_path / "mxfp4", dtype=torch.float32, attn_implementation="eager",
                                                  quantization_config=Mxfp4Config(dequantize=True)).eval()
    model = Model.load(tmp_path / "mxfp4")
    assert {f.group_of or f.name for f in model.weights.formats} == {"F32", "MXFP4"}
    got = model.forward(TOKENS, model.new_cache(), all_logits=True)
    _close(got, hf_logits(oracle, TOKENS), "gpt_oss mxfp4")
    cache = model.new_cache()
    steps = [model.forward(TOKENS[:5], cache).copy()] + [model.forward([t], cache).copy() for t in TOKENS[5:20]]
    np.testing.assert_array_equal(np.stack(steps), got[4:20])
    assert_batched_decode_equals_alone(model, TOKENS)
    assert "MXFP4" in {f.group_of or f.name for f in Model.load(tmp_path / "mxfp4", dtype="int8").weights.formats}


def test_other_quantization_configs_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="quantization_config.quant_method"):
        ModelConfig.from_file(_config(tmp_path, quantization_config={"quant_method": "gptq", "bits": 4}))


def test_the_engine_batches_them_as_any_model(tmp_path):
    """Greedy and seeded requests decoded together with chunked prompts beside them and the
    prefix cache on: each stream equal to the same request run alone."""
    from minillm.core.engine import Engine
    from minillm.core.sampling import SamplingParams
    from minillm.options import Options

    make_checkpoint(tmp_path, **CASES["qwen3_moe"])
    model = Model.load(tmp_path)
    requests = [(list(TOKENS[:8]), SamplingParams(temperature=0.0)), (list(TOKENS[5:30]), SamplingParams(temperature=0.8, seed=3)),
                (list(TOKENS[:12]), SamplingParams(temperature=0.0))]

    def run(engine, prompt, params):
        return [(e.token, e.logprob) for e in engine.submit(prompt, params, 12, logprobs=1)]

    alone = [run(Engine(model, Options(max_batch=1, cache_mb=0)), *r) for r in requests]
    engine = Engine(model, Options(max_batch=3, cache_mb=8, prefill_chunk=4))
    handles = [engine.submit(prompt, params, 12, logprobs=1) for prompt, params in requests]
    together = [[(e.token, e.logprob) for e in h] for h in handles]
    assert together == alone
    assert run(engine, *requests[2]) == alone[2]  # a prefix cache hit
    # prompt lookup on a repeating prompt: verification rows of a mixture of experts, the same text
    spec = Engine(model, Options(max_batch=2, cache_mb=0, speculative="ngram", spec_tokens=4))
    repeating = [list(TOKENS[:10]) * 3, SamplingParams(temperature=0.0)]
    assert run(spec, *repeating) == run(Engine(model, Options(max_batch=1, cache_mb=0)), *repeating)
    assert spec.stats.spec_draft_tokens > 0


def _config(tmp_path, **fields):
    base = dict(architectures=["MixtralForCausalLM"], vocab_size=97, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    base.update(fields)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(base))
    return path


@pytest.mark.parametrize("fields,named", [
    (dict(architectures=["Qwen3NextForCausalLM"]), "architectures"),
    (dict(architectures=["Llama4ForCausalLM"], intermediate_size_mlp=96, attn_temperature_tuning="yes"), "attn_temperature_tuning"),
    (dict(architectures=["DeepseekV2ForCausalLM"], n_routed_experts=8, moe_intermediate_size=8, topk_method="noaux_tc"), "topk_method"),
    (dict(architectures=["DeepseekV3ForCausalLM"], n_routed_experts=8, moe_intermediate_size=8, topk_method="greedy"), "topk_method"),
    (dict(architectures=["DeepseekV3ForCausalLM"], n_routed_experts=8, moe_intermediate_size=8, rope_interleave=False), "rope_interleave"),
    (dict(architectures=["DeepseekV3ForCausalLM"], n_routed_experts=8, moe_intermediate_size=8, n_group=8, topk_group=4,
          attention_bias=True), "attention_bias"),
    (dict(architectures=["DeepseekV3ForCausalLM"], n_routed_experts=8, moe_intermediate_size=8, n_group=8, topk_group=4,
          qk_nope_head_dim=7), "qk_nope_head_dim"),
    (dict(scoring_func="sigmoid"), "scoring_func"),
    (dict(n_group=4), "n_group"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(num_local_experts=0), "num_local_experts"),
    (dict(architectures=["OlmoeForCausalLM"], num_experts=4, clip_qkv=8.0), "clip_qkv"),
    (dict(architectures=["LlamaForCausalLM"]), "num_local_experts"),
    (dict(architectures=["Qwen2MoeForCausalLM"], num_experts=4, moe_intermediate_size=8, mlp_only_layers="1"), "mlp_only_layers"),
])
def test_unsupported_moe_variants_name_the_field(tmp_path, fields, named):
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_file(_config(tmp_path, **fields))


# ---------------------------------------------------------------- GGUF files, as llama.cpp's converter writes them

# rows of whole blocks of 32 (experts 32 wide, hidden 64) and whole groups of 16 rows
GGUF_SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
GGUF_CASES = {
    "mixtral": dict(CASES["mixtral"], **GGUF_SHAPE),  # llama.cpp's "llama" with experts, Q/K rows permuted
    "qwen2_moe": dict(arch="qwen2_moe", num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                      **GGUF_SHAPE),
    "qwen3_moe": dict(arch="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True,
                      **GGUF_SHAPE),
    "olmoe": dict(arch="olmoe", num_experts=8, num_experts_per_tok=4, **dict(GGUF_SHAPE, intermediate_size=32)),
    # the limit is llama.cpp's own (the file has no key for it): transformers' default
    "gpt_oss": dict(arch="gpt_oss", num_local_experts=6, num_experts_per_tok=2, head_dim=16, sliding_window=7, **dict(GGUF_SHAPE, intermediate_size=32)),
    "granitemoe": dict(CASES["granitemoe"], **dict(GGUF_SHAPE, intermediate_size=32)),
    "ernie4_5_moe": dict(CASES["ernie4_5_moe"], **GGUF_SHAPE),
    "glm4_moe": dict(CASES["glm4_moe"], **GGUF_SHAPE),  # written with its multi-token prediction layer, skipped
    # llama.cpp's "deepseek2", kv_b_proj split into attn_k_b (transposed: kept Q8_0 from a block format) and attn_v_b; latents of
    # whole blocks; YaRN's mscale_all_dim as its log multiplier
    "deepseek_v3": dict(CASES["deepseek_v3"], **dict(GGUF_SHAPE, num_key_value_heads=4), q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32,
                        v_head_dim=32),
    "deepseek_v2": dict(CASES["deepseek_v2"], **dict(GGUF_SHAPE, num_key_value_heads=4), q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32,
                        v_head_dim=32),
    # llama.cpp fixes Llama 4's chunks (8192), its fourth layer without RoPE and the temperature's 8192 and 0.1: these are
    # transformers' defaults; dense and sparse layers by turns
    "llama4": dict(arch="llama4", num_hidden_layers=4, head_dim=16, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=96,
                   interleave_moe_layer_step=2, **dict(GGUF_SHAPE, intermediate_size=32)),
}


@pytest.fixture(scope="module", params=list(GGUF_CASES))
def gguf_case(request, tmp_path_factory):
    from gguf_tiny import write_gguf

    from minillm.loading.gguf_import import import_gguf

    root = tmp_path_factory.mktemp("gguf-" + request.param)
    oracle = make_checkpoint(root / "hf", **GGUF_CASES[request.param])
    f32 = write_gguf(root / "hf", root / "f32.gguf")
    import_gguf(f32, root / "imported", progress=False)
    return request.param, root, oracle


def test_gguf_runs_directly_and_imported_as_transformers(gguf_case):
    """The same checkpoint written as GGUF by gguf-py (experts stacked in ffn_*_exps): the logits
    of transformers, run directly and imported (one matrix per expert again)."""
    name, root, oracle = gguf_case
    expected = hf_logits(oracle, TOKENS)
    direct = Model.load(root / "f32.gguf")
    assert direct.config.num_experts > 0 and direct.config.architecture == oracle.config.architectures[0]
    _close(direct.forward(TOKENS, direct.new_cache(), all_logits=True), expected, name)
    imported = Model.load(root / "imported")
    _close(imported.forward(TOKENS, imported.new_cache(), all_logits=True), expected, name)
    written = json.loads((root / "imported" / "model.safetensors").read_bytes()[8:][
        : int.from_bytes((root / "imported" / "model.safetensors").read_bytes()[:8], "little")])
    # as checkpoints on the Hub hold them: one matrix per expert, or gpt-oss's own stacked tensors
    assert any({"gpt_oss": ".experts.gate_up_proj", "granitemoe": ".input_linear."}.get(name, ".experts.0.") in n for n in written)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_1", "MXFP4", "fused Q4_0"])
def test_gguf_experts_as_stored(gguf_case, qtype):
    """Experts in block formats run as stored (regrouped where they can be), near the same file
    dequantized, with decode == prefill == batched decode; a fused ffn_gate_up_exps too (not
    gpt-oss's: its converter always writes gate and up apart); MXFP4, as gpt-oss ships."""
    name, root, _ = gguf_case
    _as_stored_near_dequantized(root, qtype, name)


def _as_stored_near_dequantized(root, qtype, name):
    from gguf import GGMLQuantizationType as QT
    from gguf_tiny import write_gguf

    from minillm.loading.gguf_import import import_gguf

    kind = QT[qtype.split()[-1]]
    path = write_gguf(root / "hf", root / f"{qtype}.gguf", qtype=lambda n: QT.Q6_K if kind == QT.Q4_K and "down" in n else kind,
                      fuse_gate_up_exps=qtype.startswith("fused"))
    model = Model.load(path, activations=16)  # within 16-bit activations' error of the dequantized file
    assert model.dtype == "gguf" and {f.group_of or f.name for f in model.weights.formats} >= {qtype.split()[-1]}
    got = model.forward(TOKENS, model.new_cache(), all_logits=True)
    import_gguf(path, root / f"{qtype}-imported", progress=False)
    exact = Model.load(root / f"{qtype}-imported")
    reference = exact.forward(TOKENS, exact.new_cache(), all_logits=True)
    scale = np.abs(reference).max(axis=-1, keepdims=True)
    assert (np.abs(got - reference) <= 5e-3 * scale).all(), name
    default = Model.load(path)  # each format's default: 8-bit activations for most (llama.cpp's numerics)
    for m, logits in ((model, got), (default, default.forward(TOKENS, default.new_cache(), all_logits=True))):
        cache = m.new_cache()
        steps = [m.forward(TOKENS[:7], cache).copy()] + [m.forward([t], cache).copy() for t in TOKENS[7:20]]
        np.testing.assert_array_equal(np.stack(steps), logits[6:20])
        assert_batched_decode_equals_alone(m, TOKENS)
    # 8-bit levels against these random models' outliers: each position within a tenth of its
    # largest logit (measured at most 7.5%, llama4's Q8_0 experts; 0.3-2% typically)
    assert (np.abs(logits - reference).max(-1) <= 0.1 * scale[:, 0]).all(), name


def test_gguf_k_quant_experts(tmp_path):
    """Q4_K experts with Q6_K down projections (as llama.cpp's Q4_K_M), rows of whole 256 blocks."""
    make_checkpoint(tmp_path / "hf", arch="qwen3_moe", hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_experts=4,
                    num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=2)
    _as_stored_near_dequantized(tmp_path, "Q4_K", "qwen3_moe")


def test_compare_per_layer_compares_the_routers(checkpoint):
    """`compare --per-layer` on a mixture of experts: each sparse layer's choices against
    transformers' router, every token the same experts."""
    from minillm.compare import compare

    name, path, oracle = checkpoint
    model = Model.load(path)
    result = compare(model, oracle, TOKENS[:24], per_layer=True)
    routers = result["layers"]["routers"]
    assert [r["layer"] for r in routers] == [i for i in range(model.config.num_hidden_layers) if model.config.layer_is_sparse(i)]
    assert all(r["same_experts"] == 1.0 and r["same_choices"] == 1.0 for r in routers), routers
    assert result["layers"]["first_divergence"] is None


@pytest.mark.slow  # a server
def test_the_server_serves_a_mixture_of_experts(tmp_path, request):
    """A tiny Qwen3-MoE GGUF (with its vocabulary) behind the OpenAI server: chat, a JSON schema,
    a forced tool call, through the official client."""
    import socket
    import threading

    import jsonschema
    import openai
    import uvicorn
    from conftest import wait_until_healthy
    from gguf_tiny import write_gguf

    import minillm
    from minillm.serving.server import create_app

    # every byte a token (JSON can be written), room for the tools in the prompt
    make_checkpoint(tmp_path / "hf", **dict(GGUF_CASES["qwen3_moe"], vocab_size=300, max_position_embeddings=2048))
    llm = minillm.load(write_gguf(tmp_path / "hf", tmp_path / "moe.gguf"), progress=False)
    request.addfinalizer(llm.close)  # its server's routes outlive the test (FastAPI caches them)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(llm, "moe", "key"), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        assert wait_until_healthy(f"http://127.0.0.1:{port}", 60)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="key", max_retries=0, timeout=60)
        chat = dict(model="moe", messages=[{"role": "user", "content": "hi"}], temperature=0)
        assert client.chat.completions.create(max_tokens=8, **chat).choices[0].message.content
        # bounded values: a random model's integers could outrun max_tokens
        schema = {"type": "object", "required": ["n"], "properties": {"n": {"enum": [1, 2, 3]}}, "additionalProperties": False}
        reply = client.chat.completions.create(max_tokens=60, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}, **chat)
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
        tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "required": ["a"], "properties": {"a": {"enum": [1, 2]}},
                                                                              "additionalProperties": False}}}
        call = client.chat.completions.create(max_tokens=60, tools=[tool], tool_choice="required", **chat).choices[0].message.tool_calls[0]
        assert call.function.name == "add" and json.loads(call.function.arguments)["a"] in (1, 2)
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


@pytest.mark.parametrize("name", ["ernie4_5_moe", "glm4_moe"])
def test_the_selection_bias_changes_choices(tmp_path, name):
    """The selection bias of these checkpoints moves experts in and out of rows' top k: without it
    transformers' logits differ, so matching them checks that minillm chooses by it."""
    oracle = make_checkpoint(tmp_path, **CASES[name])
    with_bias = hf_logits(oracle, TOKENS)
    with torch.no_grad():
        for module_name, b in list(oracle.named_buffers()) + list(oracle.named_parameters()):
            if module_name.endswith("e_score_correction_bias"):
                b.zero_()
    assert np.abs(hf_logits(oracle, TOKENS) - with_bias).max() > 1e-3
    model = Model.load(tmp_path)
    _close(model.forward(TOKENS, model.new_cache(), all_logits=True), with_bias, name)
