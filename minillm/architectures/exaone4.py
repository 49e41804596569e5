"""EXAONE 4 (LG AI Research): OLMo 2's norms after each sub-block, a per-head q/k norm, sliding
layers with a full one every sliding_window_pattern-th (or as "L"/"G" letters); with a window,
the full layers take no RoPE."""

from ..errors import ConfigError
from .base import Architecture, Fields, gguf_windowed_layers, rope_on_sliding_layers, sliding_every


class Exaone4(Architecture):
    hf_names = ("Exaone4ForCausalLM",)
    gguf_name = "exaone4"
    norm_placement = "post"
    qk_norm = "head"
    default_window = 4096  # Exaone4Config's
    docs = ("after each sub-block, `x * w`", "per head", "SiLU gate", "sliding layers and a full one every `sliding_window_pattern`-th",
            "sliding layers only (none on full layers when there is a window)")

    def layer_types(self, fields: Fields, layers: int, rope_layers) -> list[str]:
        pattern = fields.raw.get("sliding_window_pattern", 4)
        if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:  # L local (sliding), G global
            return ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(layers)]
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern <= 0:
            raise ConfigError(f"{fields.source}: field 'sliding_window_pattern' must be a positive integer or letters L and G")
        return sliding_every(pattern, layers)

    def rope_layers(self, fields: Fields, layers: int) -> tuple[bool, ...]:
        return rope_on_sliding_layers(self, fields, layers)

    def gguf_config(self, meta, p: str, config: dict, rope: dict) -> None:
        gguf_windowed_layers(meta, p, config, default=4)
        super().gguf_config(meta, p, config, rope)
