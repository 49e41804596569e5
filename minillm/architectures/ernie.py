"""Ernie 4.5 (Baidu), dense: Llama whose RoPE rotates neighbouring pairs of q and k (the loader
puts their rows in HF's halves), with biases on every projection when use_bias."""

from ..errors import ConfigError
from .base import Architecture, Fields


class Ernie45(Architecture):
    hf_names = ("Ernie4_5ForCausalLM",)
    rope_theta = 500_000.0  # Ernie4_5Config's
    gguf_name = "ernie4_5"
    interleaved_rope = True
    default_head_dim = 128  # Ernie4_5Config's
    gguf_bias_fields = {"use_bias": "attn_q.bias"}
    docs = ("before, `x * w`", "-", "SiLU gate; biases everywhere with `use_bias`", "full", "as Llama, on neighbouring pairs")

    def biases(self, fields: Fields) -> dict:
        on = fields.boolean("use_bias", default=False)
        return dict(qkv_bias=on, o_bias=on, mlp_bias=on)


class Ernie45Moe(Ernie45):
    """ERNIE 4.5 mixtures of experts (21B-A3B, 300B-A47B): dense layers before
    moe_layer_start_index, then every moe_layer_interval-th layer's MLP the experts: a softmax
    router whose choice adds a selection bias (moe_statics), the top k renormalised (the sum at
    least moe_norm_min), plus moe_num_shared_experts shared experts added as they are. The
    multi-token prediction tensors are skipped, as transformers skips them."""

    hf_names = ("Ernie4_5_MoeForCausalLM",)
    gguf_name = "ernie4_5-moe"
    default_head_dim = None  # Ernie4_5_MoeConfig has none: hidden / heads
    mixture_of_experts = True
    expert_count_field = "moe_num_experts"
    top_k_field = "moe_k"
    default_top_k = 6
    expert_width_field = "moe_intermediate_size"
    shared_expert_prefix = "shared_experts."
    shared_expert_gate = False
    selection_bias_tensor = "moe_statics.e_score_correction_bias"
    gguf_norm_topk = True
    docs = ("before, `x * w`", "-", "dense layers first, then experts: softmax router with a selection bias, top k renormalised, "
            "plus shared experts", "full", "as Llama, on neighbouring pairs")

    def refuse(self, fields: Fields) -> None:
        if fields.boolean("use_bias", default=False):
            raise ConfigError(f"{fields.source}: field 'use_bias' is true; biases in ERNIE 4.5's mixture of experts are not supported")

    def experts(self, fields: Fields, layers: int, count: int) -> dict:
        start = fields.non_negative_int("moe_layer_start_index", default=1)
        end = fields.raw.get("moe_layer_end_index", -1)
        end = layers - 1 if end in (-1, None) else fields.non_negative_int("moe_layer_end_index", default=layers - 1)
        step = fields.positive_int("moe_layer_interval", default=1)
        shared = fields.non_negative_int("moe_num_shared_experts", default=2) * fields.positive_int("moe_intermediate_size")
        return dict(norm_topk_prob=True, sparse_layers=tuple((i + 1) % step == 0 and start <= i <= end for i in range(layers)),
                    shared_expert_intermediate_size=shared, selection_bias=True,
                    router_norm_min=fields.number("moe_norm_min", 1e-12))

    def selection_bias_shape(self, experts: int) -> tuple[int, ...]:
        return (1, experts)  # one group

    def ignores(self, name: str, layers: int) -> bool:
        return "mtp" in name

    def gguf_experts(self, meta, p: str, experts: int) -> dict:
        width = meta.require(p + "expert_feed_forward_length", int)
        return {"moe_num_experts": experts, "moe_k": meta.require(p + "expert_used_count", int), "moe_intermediate_size": width,
                "moe_layer_start_index": meta.typed(p + "leading_dense_block_count", int, 1),
                "moe_layer_interval": meta.typed(p + "interleave_moe_layer_step", int, 1),
                "moe_num_shared_experts": meta.typed(p + "expert_shared_count", int, 0)}
