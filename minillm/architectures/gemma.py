"""Gemma 2 and 3 (text): norms before and after each sub-block scaling by (1 + w), GELU-tanh,
embeddings times sqrt(hidden), queries scaled by query_pre_attn_scalar, sliding and full layers,
soft-capping (Gemma 2's attention; the final logits), Gemma 3's per-head q/k norm and a RoPE base
per layer type. llama.cpp stores the norms as 1 + w (the loader undoes it: norm_offset)."""

from .base import Architecture, Fields, gguf_layer_types, sliding_every


class Gemma2(Architecture):
    hf_names = ("Gemma2ForCausalLM",)
    gguf_name = "gemma2"
    norm_placement = "sandwich"
    norm_offset = True
    activation_field, default_activation = "hidden_activation", "gelu_pytorch_tanh"
    default_head_dim = 256
    default_window = 4096
    window_pattern = 2  # every other layer full
    gguf_tokenizer = "gemma"
    gguf_big_layers = 46  # llama.cpp scales the 27B's queries by hidden / heads, not head_dim
    docs = ("before and after each sub-block, `x * (1 + w)`", "-", "GELU-tanh gate",
            "alternating sliding and full layers, `query_pre_attn_scalar`, attention and final soft-capping", "as Llama")

    def variant(self, fields: Fields, hidden: int) -> dict:
        return dict(embed_scale=hidden**0.5, query_pre_attn_scalar=fields.number("query_pre_attn_scalar", default=256),
                    attn_logit_softcapping=fields.optional_positive("attn_logit_softcapping", 50.0),
                    final_logit_softcapping=fields.optional_positive("final_logit_softcapping", 30.0))

    def layer_types(self, fields: Fields, layers: int, rope_layers) -> list[str]:
        return sliding_every(fields.raw.get("sliding_window_pattern", self.window_pattern), layers)

    def gguf_config(self, meta, p: str, config: dict, rope: dict) -> None:
        self.gguf_common(meta, p, config)
        super().gguf_config(meta, p, config, rope)

    def gguf_common(self, meta, p: str, config: dict) -> None:
        """What Gemma 2 and 3 read alike: soft caps, the window, llama.cpp's query scaling."""
        heads, hidden = config["num_attention_heads"], config["hidden_size"]
        config["hidden_activation"] = "gelu_pytorch_tanh"
        config["query_pre_attn_scalar"] = hidden // heads if config["num_hidden_layers"] == self.gguf_big_layers else config["head_dim"]
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            config[key] = meta.typed(p + key, float)
        config["sliding_window"] = meta.typed(p + "attention.sliding_window", int)


class Gemma3(Gemma2):
    hf_names = ("Gemma3ForCausalLM",)
    gguf_name = "gemma3"
    qk_norm = "head"
    rope_theta = gguf_rope_theta = 1_000_000.0
    window_pattern = 6
    gguf_big_layers = 62
    docs_note = " (text)"
    docs = ("before and after each sub-block, `x * (1 + w)`", "per head", "GELU-tanh gate",
            "sliding and full layers (`layer_types`), `query_pre_attn_scalar`, soft-capping", "one base per layer type")

    def variant(self, fields: Fields, hidden: int) -> dict:
        # Gemma 3 keeps attn_logit_softcapping in its config but transformers never applies it
        return dict(embed_scale=hidden**0.5, query_pre_attn_scalar=fields.number("query_pre_attn_scalar", default=256),
                    final_logit_softcapping=fields.optional_positive("final_logit_softcapping", None))

    def local_rope(self, fields: Fields, read) -> tuple:
        return read("sliding_attention", 10000.0)

    def gguf_config(self, meta, p: str, config: dict, rope: dict) -> None:
        """As Gemma 2, and each layer's kind from the sliding pattern (llama.cpp's default 6),
        with a RoPE base per kind (the sliding layers' freq_base_swa, default 10000)."""
        self.gguf_common(meta, p, config)
        layers = config["num_hidden_layers"]
        config["layer_types"] = gguf_layer_types(meta, p, layers, default=6) if config["sliding_window"] else ["full_attention"] * layers
        local = float(meta.typed(p + "rope.freq_base_swa", float, 10000.0))
        config["rope_parameters"] = {"full_attention": {"rope_type": "default", **rope},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": local}}
