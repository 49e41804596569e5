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

from ..errors import ConfigError, GGUFError
from .base import Fields
from .glm import Glm4Moe, expert_groups


class DeepseekV3(Glm4Moe):
    hf_names = ("DeepseekV3ForCausalLM",)
    gguf_name = "deepseek2"  # V2's and V3's files alike: the router's gating function tells them apart (gguf_experts)
    partial_rotary = False
    default_rotary_factor = 1.0
    default_top_k = 8
    default_dense_layers = 3  # DeepseekV3Config's
    default_groups = (8, 4)
    router_fields = ("n_shared_experts", "first_k_dense_replace", "n_group", "topk_method", "scoring_func", "moe_layer_freq")
    gguf_bias_fields = {}
    # the router's fields transformers does not read, with the values its code implements (the first
    # the default): V3's router is always the sigmoid with groups, every layer after the dense ones sparse
    router_values = (("topk_method", ("noaux_tc",)), ("scoring_func", ("sigmoid",)), ("moe_layer_freq", (1,)))
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
        for field, allowed in self.router_values:
            if raw.get(field, allowed[0]) not in allowed:
                raise ConfigError(f"{source}: field '{field}' is {raw[field]!r}; {self.hf_names[0]} takes {' or '.join(map(repr, allowed))}")

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

    def gguf_experts(self, meta, p: str, experts: int) -> dict:
        """The experts' fields, and which DeepSeek: a sigmoid router is V3's, a softmax (and a file
        from before the key) V2's."""
        gating = meta.typed(p + "expert_gating_func", int, 1)
        if gating not in (1, 2):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX, _SIGMOID
            raise GGUFError(f"{meta.path}: metadata '{p}expert_gating_func' is {gating}; DeepSeek's routers are the softmax (1) and the sigmoid (2)")
        groups, kept = meta.typed(p + "expert_group_count", int, 1), meta.typed(p + "expert_group_used_count", int, 1)
        fields = {"n_routed_experts": experts, "num_experts_per_tok": meta.require(p + "expert_used_count", int),
                  "moe_intermediate_size": meta.require(p + "expert_feed_forward_length", int),
                  "n_shared_experts": meta.typed(p + "expert_shared_count", int, 0),
                  "first_k_dense_replace": meta.typed(p + "leading_dense_block_count", int, 0),
                  "routed_scaling_factor": float(meta.typed(p + "expert_weights_scale", float, 1.0)), "n_group": groups, "topk_group": kept}
        if gating == 2:
            return {**fields, "architectures": ["DeepseekV3ForCausalLM"], "norm_topk_prob": bool(meta.typed(p + "expert_weights_norm", bool, False))}
        return {**fields, "architectures": ["DeepseekV2ForCausalLM"], "topk_method": "group_limited_greedy" if groups > 1 else "greedy"}

    def gguf_config(self, meta, p: str, config: dict, rope: dict) -> None:
        """Latent attention's sizes: llama.cpp's key and value lengths are the latent's (its MQA
        view, one KV head), its _mla ones the heads' (older files: the plain keys are the heads')."""
        rope_dims = meta.require(p + "rope.dimension_count", int)
        key = meta.typed(p + "attention.key_length_mla", int) or meta.require(p + "attention.key_length", int)
        value = meta.typed(p + "attention.value_length_mla", int) or meta.require(p + "attention.value_length", int)
        config.update(q_lora_rank=meta.typed(p + "attention.q_lora_rank", int), kv_lora_rank=meta.require(p + "attention.kv_lora_rank", int),
                      qk_rope_head_dim=rope_dims, qk_nope_head_dim=key - rope_dims, v_head_dim=value, head_dim=rope_dims,
                      num_key_value_heads=config["num_attention_heads"])
        config.pop("partial_rotary_factor", None)
        log_mul = meta.typed(p + "rope.scaling.yarn_log_multiplier", float)
        if log_mul and rope.get("rope_type") == "yarn":  # the converter's 0.1 * mscale_all_dim (mscale is the same in DeepSeek's configs)
            rope["mscale"] = rope["mscale_all_dim"] = log_mul / 0.1
        super().gguf_config(meta, p, config, rope)

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


class DeepseekV2(DeepseekV3):
    """DeepSeek-V2 (V2-Lite, V2.5, Coder-V2): V3's latent attention; after first_k_dense_replace
    dense layers, experts chosen by softmax scores (topk_method "greedy"), or among the topk_group
    groups whose best score is highest ("group_limited_greedy"), weighed by their scores as they
    are (transformers' router does not renormalise them) times routed_scaling_factor, with
    n_shared_experts shared experts added."""

    hf_names = ("DeepseekV2ForCausalLM",)
    gguf_name = None  # llama.cpp's "deepseek2" is read by DeepseekV3's spec, which names this one for a softmax router
    default_top_k = None
    default_dense_layers = 0  # DeepseekV2Config's
    router_values = (("topk_method", ("greedy", "group_limited_greedy")), ("scoring_func", ("softmax",)), ("moe_layer_freq", (1,)))
    docs = ("before, `x * w`; the latents' own", "-", "dense layers first, then experts: softmax router, top k (among the best "
            "groups with `group_limited_greedy`) scaled, plus shared experts", "latent (MLA), as DeepSeek-V3",
            "on neighbouring pairs of each head's last `qk_rope_head_dim`, the key's part shared by the heads")

    def experts(self, fields: Fields, layers: int, count: int) -> dict:
        dense = fields.non_negative_int("first_k_dense_replace", default=self.default_dense_layers)
        grouped = fields.raw.get("topk_method", "greedy") == "group_limited_greedy"
        return dict(norm_topk_prob=False, sparse_layers=tuple(i >= dense for i in range(layers)),
                    shared_expert_intermediate_size=fields.non_negative_int("n_shared_experts", default=2)
                    * fields.positive_int("moe_intermediate_size"),
                    router="softmax", selection_bias=False, routed_scaling=fields.number("routed_scaling_factor", 1.0),
                    **(dict(expert_groups(fields, count), router_group_best=1) if grouped else {}))
