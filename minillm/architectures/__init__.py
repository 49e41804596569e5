"""Every architecture minillm runs, one spec each (base.Architecture), and how to find one: by
config.json's "architectures" value or by a GGUF file's general.architecture.

Adding a family: a module here with its spec, a line below, a tiny-checkpoint test."""

from __future__ import annotations

from .apertus import Apertus
from .base import Architecture, Fields, LAYER_TYPES
from .cohere import Cohere2
from .deepseek import DeepseekV2, DeepseekV3
from .ernie import Ernie45, Ernie45Moe
from .exaone4 import Exaone4
from .gemma import Gemma2, Gemma3
from .glm import Glm4, Glm4Moe
from .gpt_oss import GptOss
from .granite import Granite, GraniteMoe
from .llama import Llama, Mistral
from .llama4 import Llama4
from .ministral import Ministral
from .mixtral import Mixtral
from .olmo import Olmo2, Olmo3, Olmoe
from .phi3 import Phi3
from .qwen import Qwen2, Qwen3
from .qwen_moe import Qwen2Moe, Qwen3Moe
from .seed_oss import SeedOss
from .smollm3 import SmolLM3

SPECS: tuple[Architecture, ...] = (
    Llama(), Mistral(), Qwen2(), Qwen3(), Olmo2(), SmolLM3(), Phi3(), Gemma2(), Gemma3(),
    Mixtral(), Qwen2Moe(), Qwen3Moe(), Olmoe(), GptOss(),
    Granite(), Olmo3(), Exaone4(), SeedOss(), Ernie45(), Glm4(), GraniteMoe(), Cohere2(), Ministral(),
    Ernie45Moe(), Glm4Moe(), Apertus(), DeepseekV3(), DeepseekV2(), Llama4(),
)
BY_HF_NAME = {name: spec for spec in SPECS for name in spec.hf_names}
SUPPORTED = tuple(BY_HF_NAME)
MIXTURES_OF_EXPERTS = tuple(name for name, spec in BY_HF_NAME.items() if spec.mixture_of_experts)
GGUF_NAMES = tuple(dict.fromkeys(spec.gguf_name for spec in SPECS if spec.gguf_name))


def spec_named(hf_name: str) -> Architecture:
    """The spec of config.json's architecture `hf_name` (one of SUPPORTED)."""
    return BY_HF_NAME[hf_name]


def spec_of_gguf(gguf_name: str, experts: bool) -> Architecture | None:
    """The spec of a GGUF general.architecture, or None. llama.cpp writes two families under one
    name ("llama": Llama, and Mixtral when the file has experts)."""
    found = [spec for spec in SPECS if spec.gguf_name == gguf_name]
    return next((spec for spec in found if spec.mixture_of_experts == experts), found[0] if found else None)


def model_table() -> str:
    """docs/models.md's table of architectures, from the specs."""
    lines = ["| architecture | norms (placement, variant) | q/k norm | MLP | attention | RoPE |", "|---|---|---|---|---|---|"]
    for spec in SPECS:
        lines.append("| " + " | ".join((f"`{spec.hf_names[0]}`{spec.docs_note}", *spec.docs)) + " |")
    return "\n".join(lines)


__all__ = ["Architecture", "Fields", "LAYER_TYPES", "SPECS", "SUPPORTED", "MIXTURES_OF_EXPERTS", "GGUF_NAMES",
           "spec_named", "spec_of_gguf", "model_table"]
