"""GLM-4 (Zhipu): norms before and after each sub-block (under their own names), q/k/v biases,
gate and up as one matrix, and RoPE on neighbouring pairs of the first half of each head
(partial_rotary_factor 0.5)."""

from .base import Architecture, Fields


class Glm4(Architecture):
    hf_names = ("Glm4ForCausalLM",)
    gguf_name = "glm4"
    norm_placement = "sandwich"
    fused_gate_up = True
    interleaved_rope = True
    partial_rotary = True
    gguf_bias_fields = {"attention_bias": "attn_q.bias"}
    docs = ("before and after each sub-block, `x * w`", "-", "SiLU gate, fused `gate_up_proj`; q/k/v biases", "full",
            "on neighbouring pairs of the first `partial_rotary_factor` of each head")

    @property
    def norm_names(self) -> dict:
        return dict(attn_norm="input_layernorm", attn_out_norm="post_self_attn_layernorm",
                    mlp_norm="post_attention_layernorm", mlp_out_norm="post_mlp_layernorm")

    def biases(self, fields: Fields) -> dict:
        return dict(qkv_bias=fields.boolean("attention_bias", default=True), o_bias=False, mlp_bias=False)
