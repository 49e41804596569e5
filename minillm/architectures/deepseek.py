"""DeepSeek-V3 (and Kimi K2, which is its architecture): multi-head latent attention, and after
first_k_dense_replace dense layers GLM-4.5's experts (which are DeepSeek-V3's: sigmoid scores plus
a selection bias, chosen among the best groups, renormalised and scaled, shared experts added).

Latent attention: q = q_b(norm(q_a(x))) (or q_proj(x) without q_lora_rank); kv_a(x) gives a latent
of kv_lora_rank, normed, and one RoPE key of qk_rope_head_dim that every head shares; kv_b turns the
latent into each head's own key part and its value. Each head's key is [own part | shared RoPE
part], its query likewise, its value v_head_dim wide. The loader gives the forward pass that as
attention over heads of head_dim = qk_nope + qk_rope (kernels.forward: the latent steps), so the
cache holds each head's key and value, as transformers' eager attention computes them; the
latent itself is not what is cached."""

import math

from ..errors import ConfigError
from .base import Fields
from .glm import Glm4Moe


class DeepseekV3(Glm4Moe):
    hf_names = ("DeepseekV3ForCausalLM",)
    gguf_name = None  # llama.cpp's "deepseek2" files: not read yet
    partial_rotary = False
    default_rotary_factor = 1.0
    default_top_k = 8
    default_dense_layers = 3  # DeepseekV3Config's
    default_groups = (8, 4)
    router_fields = ("n_shared_experts", "first_k_dense_replace", "n_group", "topk_method", "scoring_func", "moe_layer_freq")
    gguf_bias_fields = {}
    docs = ("before, `x * w`; the latents' own", "-", "dense layers first, then experts: sigmoid router with a selection bias "
            "and groups, top k renormalised and scaled, plus shared experts", "latent (MLA): q and kv from normed low-rank latents",
            "on neighbouring pairs of each head's last `qk_rope_head_dim`, the key's part shared by the heads")

    def refuse(self, fields: Fields) -> None:
        raw, source = fields.raw, fields.source
        if raw.get("attention_bias"):
            raise ConfigError(f"{source}: field 'attention_bias' is true; latent attention with biases is not supported")
        if raw.get("rope_interleave", True) is not True:
            raise ConfigError(f"{source}: field 'rope_interleave' is {raw['rope_interleave']!r}; only RoPE on neighbouring pairs "
                              "(true, DeepSeek's own) is supported")
        # transformers reads neither: its router is always the sigmoid with groups, every layer after the dense ones sparse
        for field, value in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid"), ("moe_layer_freq", 1)):
            if raw.get(field, value) != value:
                raise ConfigError(f"{source}: field '{field}' is {raw[field]!r}; DeepSeek-V3's is {value!r}")

    def qk_norm_kind(self, fields: Fields) -> str | None:
        return None

    def biases(self, fields: Fields) -> dict:
        return dict(qkv_bias=False, o_bias=False, mlp_bias=False)

    def latent_attention(self, fields: Fields) -> dict:
        own, rope = fields.positive_int("qk_nope_head_dim", default=128), fields.positive_int("qk_rope_head_dim", default=64)
        value = fields.positive_int("v_head_dim", default=128)
        for field, width in (("qk_rope_head_dim", rope), ("qk_nope_head_dim", own)):
            if width % 2:  # RoPE's pairs; the loader splits the own part between the halves the kernel turns
                raise ConfigError(f"{fields.source}: field '{field}' ({width}) must be even")
        if value > own + rope:
            raise ConfigError(f"{fields.source}: field 'v_head_dim' ({value}) is wider than a key ({own + rope}); not supported")
        q_rank = 0 if fields.raw.get("q_lora_rank", 1536) is None else fields.positive_int("q_lora_rank", default=1536)
        return dict(head_dim=own + rope, rotary_dim=rope, kv_lora_rank=fields.positive_int("kv_lora_rank", default=512),
                    q_lora_rank=q_rank, value_head_dim=value)

    def variant(self, fields: Fields, hidden: int) -> dict:
        """Scores scaled by the key's width and, under YaRN, by mscale_all_dim's factor squared
        (transformers' yarn_apply_mscale)."""
        dims = self.latent_attention(fields)
        scale = dims["head_dim"] ** -0.5
        params = fields.raw.get("rope_parameters") or fields.raw.get("rope_scaling") or {}
        kind = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
        if kind != "default" and params.get("mscale_all_dim"):
            factor = float(params.get("factor", 1.0))
            mscale = 0.1 * float(params["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale *= mscale * mscale
        return dict(attention_multiplier=scale)
