"""Tiny random checkpoints made by transformers, saved as HF directories, with the oracle model."""

from __future__ import annotations

import torch

VOCAB = 97


def make_checkpoint(path, arch: str = "llama", dtype=torch.float32, max_shard_size=None, seed=0, **overrides):
    """Save a random tiny model of `arch` to `path`; returns the transformers model in float32,
    loaded back from the saved files (so f16/bf16 rounding is in both sides)."""
    import transformers as tf
    from transformers import AutoModelForCausalLM

    base = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    if arch in ("smollm3", "phi3", "gemma2", "gemma3", "olmoe", "seed_oss", "ernie4_5", "exaone4", "glm4", "cohere2",
                "ernie4_5_moe", "glm4_moe"):  # their defaults name ids of a real vocabulary
        base.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base.update(overrides)
    config_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM),
        "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM),
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
        "granite": (tf.GraniteConfig, tf.GraniteForCausalLM),
        "olmo3": (tf.Olmo3Config, tf.Olmo3ForCausalLM),
        "exaone4": (tf.Exaone4Config, tf.Exaone4ForCausalLM),
        "seed_oss": (tf.SeedOssConfig, tf.SeedOssForCausalLM),
        "ernie4_5": (tf.Ernie4_5Config, tf.Ernie4_5ForCausalLM),
        "glm4": (tf.Glm4Config, tf.Glm4ForCausalLM),
        "granitemoe": (tf.GraniteMoeConfig, tf.GraniteMoeForCausalLM),
        "cohere2": (tf.Cohere2Config, tf.Cohere2ForCausalLM),
        "ministral": (tf.MinistralConfig, tf.MinistralForCausalLM),
        "ernie4_5_moe": (tf.Ernie4_5_MoeConfig, tf.Ernie4_5_MoeForCausalLM),
        "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM),
        "apertus": (tf.ApertusConfig, tf.ApertusForCausalLM),
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
        "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM),
        "llama4": (tf.Llama4TextConfig, tf.Llama4ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**base)).eval()
    with torch.no_grad():  # make norms and biases non-trivial so a skipped one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith((".bias", "_bias")):
                p.copy_(1.0 + 0.5 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
            elif name.endswith((".gate.weight", "shared_expert_gate.weight", ".router.weight")):  # a router: choices far from ties
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith(".sinks"):  # gpt-oss: sinks that take a real share of each softmax
                p.copy_(1.0 + torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM-4.5's selection bias: one that changes choices
                b.copy_(0.1 * torch.randn_like(b))
    model = model.to(dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    oracle = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return oracle


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([list(tokens)])).logits[0].float().numpy()


def assert_batched_decode_equals_alone(model, tokens):
    """Three sequences of different lengths decoded together, six steps, give exactly what each
    gives decoded alone (tokens: at least 38)."""
    import numpy as np

    from minillm.core.cache import KVPool

    prompts = [tokens[:5], tokens[3:20], tokens[10:11]]
    steps = [tokens[20:26], tokens[26:32], tokens[32:38]]
    alone = []
    for prompt, step in zip(prompts, steps):
        cache = model.new_cache()
        model.forward(prompt, cache)
        alone.append(np.stack([model.forward([t], cache).copy() for t in step]))
    pool = KVPool(model.config, model.ctx, 4, model.kv_format)
    held = [pool.acquire() for _ in prompts]
    slots, caches = [s for s, _ in held], [c for _, c in held]
    for prompt, cache in zip(prompts, caches):
        model.forward(prompt, cache)
    together = [model.decode_batch([s[i] for s in steps], caches, slots, pool).copy() for i in range(len(steps[0]))]
    for b in range(len(prompts)):
        np.testing.assert_array_equal(np.stack([t[b] for t in together]), alone[b])
