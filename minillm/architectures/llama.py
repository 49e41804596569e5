"""Llama (and every checkpoint that is Llama by another name: SmolLM2, TinyLlama, Llama 2/3)."""

from .base import Architecture, Fields, attention_bias


class Llama(Architecture):
    hf_names = ("LlamaForCausalLM",)
    gguf_name = "llama"
    gguf_head_dim_from_rope = True
    gguf_permuted_qk = True
    gguf_bias_fields = {"attention_bias": "attn_q.bias", "mlp_bias": "ffn_up.bias"}
    docs = ("before each sub-block, `x * w`", "-", "SiLU gate", "full",
            "default, `linear`, `llama3`, `yarn`, `longrope`, `dynamic`")

    def biases(self, fields: Fields) -> dict:
        return attention_bias(fields.boolean("attention_bias", default=False), mlp=fields.boolean("mlp_bias", default=False))


class Mistral(Architecture):
    """Llama with a sliding window on every layer (llama.cpp writes its GGUF as "llama")."""

    hf_names = ("MistralForCausalLM",)
    default_window = 4096  # MistralConfig's
    docs = ("before, `x * w`", "-", "SiLU gate", "sliding window (`sliding_window`)", "as Llama")
