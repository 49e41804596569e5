"""OLMo 2 (norms after each sub-block, q/k norm over the whole projection) and OLMoE (its
mixture of experts, norms before)."""

from .base import Architecture, Fields, sliding_every


class Olmo2(Architecture):
    hf_names = ("Olmo2ForCausalLM",)
    gguf_name = "olmo2"
    norm_placement = "post"
    qk_norm = "projection"
    docs = ("after each sub-block, `x * w`", "over the projection", "SiLU gate", "full", "as Llama")

    def gguf_config(self, meta, p: str, config: dict, rope: dict) -> None:
        """A window makes it OLMo 3 (llama.cpp writes both as "olmo2"), each fourth layer full."""
        window = meta.typed(p + "attention.sliding_window", int)
        if window:
            config.update(architectures=["Olmo3ForCausalLM"], sliding_window=window, layer_types=sliding_every(4, config["num_hidden_layers"]))
        super().gguf_config(meta, p, config, rope)


class Olmoe(Architecture):
    hf_names = ("OlmoeForCausalLM",)
    gguf_name = "olmoe"
    qk_norm = "projection"
    mixture_of_experts = True
    gguf_norm_topk = False
    docs = ("before, `x * w`", "over the projection", "experts (`norm_topk_prob`)", "full", "as Llama")

    def window(self, fields: Fields) -> int | None:
        return None  # OLMoE attends to every earlier key


class Olmo3(Olmo2):
    """OLMo 2 with three sliding layers to each full one; RoPE scaling on the full layers only.
    llama.cpp writes it as "olmo2" with a window."""

    hf_names = ("Olmo3ForCausalLM",)
    rope_theta = 500_000.0  # Olmo3Config's
    gguf_name = None
    default_window = 4096  # Olmo3Config's
    docs = ("after each sub-block, `x * w`", "over the projection", "SiLU gate", "three sliding layers to each full one (`layer_types`)",
            "scaling on full layers only")

    def layer_types(self, fields: Fields, layers: int, rope_layers) -> list[str]:
        return sliding_every(4, layers)

    def local_rope(self, fields: Fields, read) -> tuple:
        return read("sliding_attention", fields.raw.get("rope_theta", self.rope_theta))
