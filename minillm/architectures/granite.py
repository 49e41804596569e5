"""Granite 3 (IBM): Llama with four multipliers: embeddings, attention scores (in place of
head_dim^-1/2), each sub-block's output before the residual add, and the logits (divided)."""

from .base import Fields
from .llama import Llama


class Granite(Llama):
    hf_names = ("GraniteForCausalLM",)
    gguf_name = "granite"  # its converter is Llama's: Q and K permuted
    docs = ("before, `x * w`", "-", "SiLU gate", "full; scores times `attention_multiplier`",
            "as Llama; `embedding_multiplier`, `residual_multiplier`, `logits_scaling`")

    def variant(self, fields: Fields, hidden: int) -> dict:
        return dict(embed_scale=fields.number("embedding_multiplier", 1.0), attention_multiplier=fields.number("attention_multiplier", 1.0),
                    residual_multiplier=fields.number("residual_multiplier", 1.0), logits_scaling=fields.number("logits_scaling", 1.0))

    def gguf_config(self, meta, p: str, config: dict, rope: dict) -> None:
        for field, key in (("embedding_multiplier", "embedding_scale"), ("attention_multiplier", "attention.scale"),
                           ("residual_multiplier", "residual_scale"), ("logits_scaling", "logit_scale")):
            value = meta.typed(p + key, float)
            if value is not None:
                config[field] = float(value)
        super().gguf_config(meta, p, config, rope)
