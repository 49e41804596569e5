"""OLMo 2 (norms after each sub-block, q/k norm over the whole projection) and OLMoE (its
mixture of experts, norms before)."""

from .base import Architecture, Fields


class Olmo2(Architecture):
    hf_names = ("Olmo2ForCausalLM",)
    gguf_name = "olmo2"
    norm_placement = "post"
    qk_norm = "projection"
    docs = ("after each sub-block, `x * w`", "over the projection", "SiLU gate", "full", "as Llama")


class Olmoe(Architecture):
    hf_names = ("OlmoeForCausalLM",)
    gguf_name = "olmoe"
    qk_norm = "projection"
    mixture_of_experts = True
    gguf_norm_topk = False
    docs = ("before, `x * w`", "over the projection", "experts (`norm_topk_prob`)", "full", "as Llama")

    def window(self, fields: Fields) -> int | None:
        return None  # OLMoE attends to every earlier key
