"""Seed-OSS (ByteDance): Llama with biases on q, k and v (attention_bias) and, apart, on o
(attention_out_bias)."""

from .base import Architecture, Fields


class SeedOss(Architecture):
    hf_names = ("SeedOssForCausalLM",)
    gguf_name = "seed_oss"
    default_head_dim = 128  # SeedOssConfig's
    gguf_bias_fields = {"attention_bias": "attn_q.bias", "attention_out_bias": "attn_output.bias", "mlp_bias": "ffn_up.bias"}
    docs = ("before, `x * w`", "-", "SiLU gate; q/k/v biases (`attention_bias`), o bias (`attention_out_bias`)", "full", "as Llama")

    def biases(self, fields: Fields) -> dict:
        return dict(qkv_bias=fields.boolean("attention_bias", default=True), o_bias=fields.boolean("attention_out_bias", default=False),
                    mlp_bias=fields.boolean("mlp_bias", default=False))
