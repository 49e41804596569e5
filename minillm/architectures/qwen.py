"""Qwen 2 and 3 (dense): Qwen 2's q/k/v biases, Qwen 3's per-head q/k norm; sliding windows
only with use_sliding_window, from max_window_layers on."""

from .base import Architecture, Fields


class Qwen2(Architecture):
    hf_names = ("Qwen2ForCausalLM",)
    gguf_name = "qwen2"
    docs = ("before, `x * w`", "-", "SiLU gate; q/k/v biases",
            "full, or sliding from `max_window_layers` (`use_sliding_window`)", "as Llama")

    def biases(self, fields: Fields) -> dict:
        return dict(qkv_bias=True, o_bias=False, mlp_bias=False)

    def window(self, fields: Fields) -> int | None:
        return fields.raw.get("sliding_window") if fields.raw.get("use_sliding_window") else None

    def layer_types(self, fields: Fields, layers: int, rope_layers) -> list[str]:
        first = fields.raw.get("max_window_layers", 28)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]


class Qwen3(Qwen2):
    hf_names = ("Qwen3ForCausalLM",)
    gguf_name = "qwen3"
    qk_norm = "head"
    default_head_dim = 128  # Qwen3Config's
    docs = ("before, `x * w`", "per head", "SiLU gate", "as Qwen2", "as Llama")
    biases = Architecture.biases
