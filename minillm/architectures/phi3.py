"""Phi-3: fused qkv_proj and gate_up_proj, longrope under its older names."""

from .base import Architecture, Fields, attention_bias


class Phi3(Architecture):
    hf_names = ("Phi3ForCausalLM",)
    gguf_name = "phi3"
    fused_qkv = fused_gate_up = True
    partial_rotary = True
    original_context = 4096  # Phi3Config reads original_max_position_embeddings with this default
    gguf_tokenizer = "phi3"
    docs = ("before, `x * w`", "-", "SiLU gate; fused `qkv_proj`, `gate_up_proj`", "full or sliding window",
            "as Llama (`su` and `yarn` read as `longrope`, as Phi3Config does)")

    def biases(self, fields: Fields) -> dict:
        return attention_bias(False)

    def rope_type(self, rope_type: str) -> str:
        return "longrope" if rope_type in ("su", "yarn") else rope_type
