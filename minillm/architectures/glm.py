"""GLM-4 (Zhipu): norms before and after each sub-block (under their own names), q/k/v biases,
gate and up as one matrix, and RoPE on neighbouring pairs of the first half of each head
(partial_rotary_factor 0.5)."""

from ..errors import ConfigError, GGUFError
from .base import Architecture, Fields


class Glm4(Architecture):
    hf_names = ("Glm4ForCausalLM",)
    gguf_name = "glm4"
    norm_placement = "sandwich"
    fused_gate_up = True
    interleaved_rope = True
    partial_rotary = True
    default_rotary_factor = 0.5  # Glm4Config's
    gguf_bias_fields = {"attention_bias": "attn_q.bias"}
    docs = ("before and after each sub-block, `x * w`", "-", "SiLU gate, fused `gate_up_proj`; q/k/v biases", "full",
            "on neighbouring pairs of the first `partial_rotary_factor` of each head")

    @property
    def norm_names(self) -> dict:
        return dict(attn_norm="input_layernorm", attn_out_norm="post_self_attn_layernorm",
                    mlp_norm="post_attention_layernorm", mlp_out_norm="post_mlp_layernorm")

    def biases(self, fields: Fields) -> dict:
        return dict(qkv_bias=fields.boolean("attention_bias", default=True), o_bias=False, mlp_bias=False)


class Glm4Moe(Architecture):
    """GLM-4.5 / 4.6 / 4.7 (Air too): Llama's layer with RoPE on HF's halves of the first
    partial_rotary_factor of each head, q/k/v biases, optional q/k norms per head; after
    first_k_dense_replace dense layers, experts chosen by sigmoid scores plus a selection bias
    (among the best n_group groups when topk_group says so), their weights renormalised and
    scaled, and shared experts added as they are. The multi-token prediction layers after the
    last (num_nextn_predict_layers) are skipped, as transformers skips them."""

    hf_names = ("Glm4MoeForCausalLM",)
    gguf_name = "glm4moe"
    partial_rotary = True
    default_rotary_factor = 0.5  # Glm4MoeConfig's
    mixture_of_experts = True
    expert_count_field = "n_routed_experts"
    default_top_k = 8
    expert_width_field = "moe_intermediate_size"
    router_fields = ("n_shared_experts", "first_k_dense_replace", "n_group")
    shared_expert_prefix = "shared_experts."
    shared_expert_gate = False
    selection_bias_tensor = "gate.e_score_correction_bias"
    gguf_norm_topk = True
    gguf_bias_fields = {"attention_bias": "attn_q.bias", "use_qk_norm": "attn_q_norm.weight"}
    docs = ("before, `x * w`", "per head with `use_qk_norm`", "dense layers first, then experts: sigmoid router with a selection bias "
            "and groups, top k renormalised and scaled, plus shared experts; q/k/v biases", "full",
            "on HF's halves of the first `partial_rotary_factor` of each head")

    def qk_norm_kind(self, fields: Fields) -> str | None:
        return "head" if fields.boolean("use_qk_norm", default=False) else None

    def biases(self, fields: Fields) -> dict:
        return dict(qkv_bias=fields.boolean("attention_bias", default=False), o_bias=False, mlp_bias=False)

    default_dense_layers = 1  # first_k_dense_replace when config.json names none
    default_groups = (1, 1)  # n_group, topk_group when config.json names none

    def experts(self, fields: Fields, layers: int, count: int) -> dict:
        dense = fields.non_negative_int("first_k_dense_replace", default=self.default_dense_layers)
        return dict(norm_topk_prob=fields.boolean("norm_topk_prob", default=True), sparse_layers=tuple(i >= dense for i in range(layers)),
                    shared_expert_intermediate_size=fields.non_negative_int("n_shared_experts", default=1)
                    * fields.positive_int("moe_intermediate_size"),
                    router="sigmoid", selection_bias=True, routed_scaling=fields.number("routed_scaling_factor", 1.0),
                    **expert_groups(fields, count, self.default_groups))

    def ignores(self, name: str, layers: int) -> bool:
        return layer_of(name) >= layers  # the multi-token prediction layers

    def gguf_experts(self, meta, p: str, experts: int) -> dict:
        gating = meta.typed(p + "expert_gating_func", int)
        if gating != 2:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
            raise GGUFError(f"{meta.path}: metadata '{p}expert_gating_func' is {gating}; GLM-4.5's router is the sigmoid (2)")
        return {"n_routed_experts": experts, "num_experts_per_tok": meta.require(p + "expert_used_count", int),
                "moe_intermediate_size": meta.require(p + "expert_feed_forward_length", int),
                "n_shared_experts": meta.typed(p + "expert_shared_count", int, 1),
                "first_k_dense_replace": meta.typed(p + "leading_dense_block_count", int, 1),
                "norm_topk_prob": bool(meta.typed(p + "expert_weights_norm", bool, True)),
                "routed_scaling_factor": float(meta.typed(p + "expert_weights_scale", float, 1.0)),
                "n_group": meta.typed(p + "expert_group_count", int, 1), "topk_group": meta.typed(p + "expert_group_used_count", int, 1)}

    def gguf_config(self, meta, p: str, config: dict, rope: dict) -> None:
        super().gguf_config(meta, p, config, rope)
        # llama.cpp counts the multi-token prediction layers among its blocks
        config["num_hidden_layers"] -= meta.typed(p + "nextn_predict_layers", int, 0)


def expert_groups(fields: Fields, count: int, default: tuple[int, int] = (1, 1)) -> dict:
    """DeepSeek-V3's grouped routing (n_group groups of experts, the best topk_group kept)."""
    groups = fields.positive_int("n_group", default=default[0])
    keep = fields.positive_int("topk_group", default=default[1])
    if count % groups or keep > groups:
        raise ConfigError(f"{fields.source}: fields 'n_group' ({groups}) and 'topk_group' ({keep}) must split the {count} experts "
                          "into equal groups and keep at most all of them")
    return dict(router_groups=groups, router_group_topk=keep)


def layer_of(name: str) -> int:
    """The layer index in a checkpoint's (model.layers.N.) or a GGUF's (blk.N.) tensor name; -1 for none."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ("layers", "blk") and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return -1
