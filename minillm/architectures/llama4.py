"""Llama 4 (its text model, Llama4ForCausalLM): RoPE on neighbouring pairs, except every
no_rope_layer_interval-th layer (no_rope_layers: 1 where a layer uses it), whose queries are
scaled by a temperature that grows with the position instead; chunked attention on the RoPE
layers (a query sees the keys of its own chunk of attention_chunk_size); a q/k norm without
weights on the RoPE layers; every interleave_moe_layer_step-th layer (or moe_layers) a mixture of
experts whose router takes the top k logits and scales each chosen expert's input by its
sigmoid, plus a shared expert; the dense layers intermediate_size_mlp wide. Checkpoints name the
MLP `feed_forward` and stack the experts transposed, gate's columns before up's."""

from ..errors import ConfigError
from .base import Architecture, Fields, attention_bias
from .smollm3 import no_rope_layers


class Llama4(Architecture):
    hf_names = ("Llama4ForCausalLM",)
    gguf_name = "llama4"
    rope_theta = 500_000.0  # Llama4TextConfig's
    interleaved_rope = True
    mixture_of_experts = True
    chunked_attention = True
    expert_count_field = "num_local_experts"
    default_top_k = 1
    dense_width_field = "intermediate_size_mlp"
    transposed_experts = True
    router_tensor = "router.weight"
    shared_expert_gate = False
    eps_field, default_eps = "rms_norm_eps", 1e-5
    checkpoint_renames = ((r"^(model\.layers\.\d+)\.feed_forward\.", r"\1.mlp."),)
    docs = ("before, `x * w`", "per head, without weights, on RoPE layers", "dense and sparse layers by turns: the top k logits' "
            "sigmoids scale their experts' inputs, plus a shared expert", "chunked on RoPE layers (`attention_chunk_size`), full on the others",
            "on neighbouring pairs; none in `no_rope_layers` layers, whose queries take `attn_temperature_tuning`")

    def biases(self, fields: Fields) -> dict:
        return attention_bias(fields.boolean("attention_bias", default=False))

    def qk_norm_kind(self, fields: Fields) -> str | None:
        return "weightless" if fields.boolean("use_qk_norm", default=True) else None

    def rope_layers(self, fields: Fields, layers: int) -> tuple[bool, ...]:
        return no_rope_layers(fields, layers)  # SmolLM3's fields and default

    def variant(self, fields: Fields, hidden: int) -> dict:
        layers = fields.positive_int("num_hidden_layers")
        rope = self.rope_layers(fields, layers)
        chunk = fields.raw.get("attention_chunk_size", 8192)
        types = fields.raw.get("layer_types") or ["chunked_attention" if r and chunk is not None else "full_attention" for r in rope]
        chunked = tuple(t == "chunked_attention" for t in types)
        if any(chunked) and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0):
            raise ConfigError(f"{fields.source}: field 'attention_chunk_size' must be a positive integer for chunked_attention layers, got {chunk!r}")
        tuned = fields.raw.get("attn_temperature_tuning", True)
        if not isinstance(tuned, (bool, int)):  # Meta's own configs write a number (4): transformers takes any truthy value
            raise ConfigError(f"{fields.source}: field 'attn_temperature_tuning' must be true, false or a number, got {tuned!r}")
        return dict(attention_chunk=chunk if any(chunked) else 0, chunked_layers=chunked if any(chunked) else (), qk_norm_rope_only=True,
                    attn_temperature_floor=float(fields.number("floor_scale", 8192)) if tuned else 0.0,
                    attn_temperature_scale=float(fields.number("attn_scale", 0.1)) if tuned else 0.0)

    def experts(self, fields: Fields, layers: int, count: int) -> dict:
        moe_layers = fields.raw.get("moe_layers")
        if moe_layers is None:
            step = fields.positive_int("interleave_moe_layer_step", default=1)
            moe_layers = list(range(step - 1, layers, step))
        if not isinstance(moe_layers, list) or any(not isinstance(i, int) or not 0 <= i < layers for i in moe_layers):
            raise ConfigError(f"{fields.source}: field 'moe_layers' must list layers below {layers}")
        return dict(sparse_layers=tuple(i in moe_layers for i in range(layers)), router="topk_sigmoid_input",
                    shared_expert_intermediate_size=fields.positive_int("intermediate_size"))

    def gguf_experts(self, meta, p: str, experts: int) -> dict:
        return {"num_local_experts": experts, "num_experts_per_tok": meta.require(p + "expert_used_count", int),
                "intermediate_size": meta.require(p + "expert_feed_forward_length", int),
                "interleave_moe_layer_step": meta.typed(p + "interleave_moe_layer_step", int, 1)}

    def gguf_config(self, meta, p: str, config: dict, rope: dict) -> None:
        """What llama.cpp fixes for llama4 files rather than reading: chunks of 8192 on three layers
        in four and the fourth without RoPE, the temperature's 8192 and 0.1, the q/k norm but with
        128 experts; a sliding_window of 0 means full attention and RoPE on every layer."""
        config["intermediate_size_mlp"] = meta.require(p + "feed_forward_length", int)
        config["use_qk_norm"] = config["num_local_experts"] != 128
        if meta.typed(p + "attention.sliding_window", int) == 0:
            config.update(no_rope_layers=[1] * config["num_hidden_layers"], attention_chunk_size=None, attn_temperature_tuning=False)
        else:
            config.update(no_rope_layer_interval=4, attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1, attn_temperature_tuning=True)
        super().gguf_config(meta, p, config, rope)
