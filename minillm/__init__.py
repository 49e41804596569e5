"""minillm: a CPU inference engine for Llama-family models on NumPy and Numba."""

from .api import LLM, load
from .errors import (
    CheckpointError,
    ConfigError,
    GenerationError,
    GGUFError,
    MiniLLMError,
    TokenizerError,
    UsageError,
)
from .sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "load",
    "SamplingParams",
    "MiniLLMError",
    "ConfigError",
    "CheckpointError",
    "GGUFError",
    "TokenizerError",
    "GenerationError",
    "UsageError",
]
