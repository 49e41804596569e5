"""SmolLM3: Llama with layers that skip RoPE (no_rope_layers: despite the name, 1 where a layer
uses it) and, with use_sliding_window, sliding windows on exactly those."""

from ..errors import ConfigError
from .base import Architecture, Fields, attention_bias


class SmolLM3(Architecture):
    hf_names = ("SmolLM3ForCausalLM",)
    rope_theta = 2_000_000.0  # SmolLM3Config's
    docs = ("before, `x * w`", "-", "SiLU gate", "full or sliding", "none in `no_rope_layers` layers")

    def biases(self, fields: Fields) -> dict:
        return attention_bias(fields.boolean("attention_bias", default=False), mlp=fields.boolean("mlp_bias", default=False))

    def window(self, fields: Fields) -> int | None:
        return fields.raw.get("sliding_window") if fields.raw.get("use_sliding_window") else None

    def rope_layers(self, fields: Fields, layers: int) -> tuple[bool, ...]:
        return no_rope_layers(fields, layers)

    def layer_types(self, fields: Fields, layers: int, rope_layers) -> list[str]:
        return ["full_attention" if rope_layers[i] else "sliding_attention" for i in range(layers)]


def no_rope_layers(fields: Fields, layers: int) -> tuple[bool, ...]:
    """The layers that use RoPE: no_rope_layers (1 where a layer does), else all but every
    no_rope_layer_interval-th (SmolLM3's and Llama 4's fields and default)."""
    flags = fields.raw.get("no_rope_layers")
    if flags is None:
        interval = fields.raw.get("no_rope_layer_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
            raise ConfigError(f"{fields.source}: field 'no_rope_layer_interval' must be a positive integer")
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise ConfigError(f"{fields.source}: field 'no_rope_layers' must list 0 or 1 for each of the {layers} layers")
    return tuple(bool(f) for f in flags)
