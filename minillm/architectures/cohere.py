"""Cohere 2 (Command R7B, Command A): one LayerNorm (without a bias) per layer that attention and
the MLP both read, their outputs both added to x; RoPE on neighbouring pairs, on sliding layers
only (three to each full one); logits times logit_scale."""

from .base import Architecture, Fields, gguf_windowed_layers, rope_on_sliding_layers, sliding_every


class Cohere2(Architecture):
    hf_names = ("Cohere2ForCausalLM",)
    gguf_name = "cohere2"
    layer_norm = True
    eps_field, default_eps = "layer_norm_eps", 1e-5  # Cohere2Config's
    gguf_eps_key = "attention.layer_norm_epsilon"
    parallel_block = True
    interleaved_rope = True
    default_window = 4096  # Cohere2Config's
    docs = ("one LayerNorm (no bias) before both sub-blocks, `(x - mean) * w`", "-", "SiLU gate, beside attention (x + attn + mlp)",
            "three sliding layers to each full one", "on neighbouring pairs, sliding layers only; logits times `logit_scale`")

    @property
    def norm_names(self) -> dict:
        return dict(attn_norm="input_layernorm", attn_out_norm=None, mlp_norm=None, mlp_out_norm=None)

    def variant(self, fields: Fields, hidden: int) -> dict:
        return dict(logits_scaling=1.0 / fields.number("logit_scale", 0.0625))  # multiplied: divided by its inverse

    def layer_types(self, fields: Fields, layers: int, rope_layers) -> list[str]:
        return sliding_every(fields.raw.get("sliding_window_pattern", 4), layers)

    def rope_layers(self, fields: Fields, layers: int) -> tuple[bool, ...]:
        return rope_on_sliding_layers(self, fields, layers)

    def gguf_config(self, meta, p: str, config: dict, rope: dict) -> None:
        config["logit_scale"] = float(meta.typed(p + "logit_scale", float, 0.0625))
        gguf_windowed_layers(meta, p, config, default=4)
        super().gguf_config(meta, p, config, rope)
