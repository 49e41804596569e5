"""Ernie 4.5 (Baidu), dense: Llama whose RoPE rotates neighbouring pairs of q and k (the loader
puts their rows in HF's halves), with biases on every projection when use_bias."""

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
