"""Qwen 2 and 3 mixtures of experts: experts of moe_intermediate_size on the sparse layers
(mlp_only_layers and decoder_sparse_step choose them), Qwen2-MoE's shared expert under the
sigmoid of its own gate."""

from ..errors import ConfigError
from .base import Architecture, Fields
from .qwen import Qwen2


class Qwen2Moe(Qwen2):
    hf_names = ("Qwen2MoeForCausalLM",)
    gguf_name = "qwen2moe"
    mixture_of_experts = True
    expert_width_field = "moe_intermediate_size"
    gguf_norm_topk = False
    docs = ("before, `x * w`", "-", "experts (top k as they stand, or `norm_topk_prob`) plus a shared expert under its sigmoid "
            "gate; dense layers by `mlp_only_layers` and `decoder_sparse_step`; q/k/v biases", "as Qwen2", "as Llama")

    def biases(self, fields: Fields) -> dict:
        return dict(qkv_bias=fields.boolean("qkv_bias", default=True), o_bias=False, mlp_bias=False)

    def layer_types(self, fields: Fields, layers: int, rope_layers) -> list[str]:
        first = fields.raw.get("max_window_layers", 28)  # Qwen2MoeConfig: every other layer below it
        return ["sliding_attention" if (i + 1) % 2 and i < first else "full_attention" for i in range(layers)]

    def experts(self, fields: Fields, layers: int, count: int) -> dict:
        return dict(super().experts(fields, layers, count), sparse_layers=qwen_sparse_layers(fields, layers),
                    shared_expert_intermediate_size=fields.positive_int("shared_expert_intermediate_size"))

    def gguf_experts(self, meta, p: str, experts: int) -> dict:
        return dict(super().gguf_experts(meta, p, experts), moe_intermediate_size=meta.require(p + "expert_feed_forward_length", int),
                    shared_expert_intermediate_size=meta.require(p + "expert_shared_feed_forward_length", int))


class Qwen3Moe(Qwen2Moe):
    hf_names = ("Qwen3MoeForCausalLM",)
    gguf_name = "qwen3moe"
    qk_norm = "head"
    gguf_norm_topk = True
    docs = ("before, `x * w`", "per head", "experts (`norm_topk_prob`); dense layers as Qwen2-MoE", "full or sliding window", "as Llama")
    biases = Architecture.biases
    layer_types = Architecture.layer_types

    def experts(self, fields: Fields, layers: int, count: int) -> dict:
        return dict(Architecture.experts(self, fields, layers, count), sparse_layers=qwen_sparse_layers(fields, layers))

    def gguf_experts(self, meta, p: str, experts: int) -> dict:
        return dict(Architecture.gguf_experts(self, meta, p, experts), moe_intermediate_size=meta.require(p + "expert_feed_forward_length", int))


def qwen_sparse_layers(fields: Fields, layers: int) -> tuple[bool, ...]:
    """transformers: a layer is sparse unless listed in mlp_only_layers, every decoder_sparse_step-th."""
    step = fields.positive_int("decoder_sparse_step", default=1)
    try:
        dense = fields.int_list("mlp_only_layers")
    except ConfigError:
        raise ConfigError(f"{fields.source}: field 'mlp_only_layers' must be a list of layer indices") from None
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
