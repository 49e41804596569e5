"""minillm: a CPU inference engine for Llama-family models on NumPy and Numba.

    import minillm
    llm = minillm.load()                      # the bundled model; or load("dir"), load("model.gguf")

`load`, `LLM` and `SamplingParams` are imported on first use, so that `minillm.options` and the
errors can be read without loading the kernels (the CLI parses its flags that way).

The Numba kernels are `minillm.kernels`. A checkout keeps them at the top (kernels/, beside
this package, as cli.py is); an installed minillm has them inside (setuptools maps the folder,
pyproject.toml), so installing adds nothing to site-packages but minillm. From a checkout this
package's path reaches the folder beside it.
"""

from pathlib import Path as _Path

if not (_Path(__file__).parent / "kernels").is_dir() and (_Path(__file__).parent.parent / "kernels" / "__init__.py").is_file():
    __path__.append(str(_Path(__file__).parent.parent))  # minillm.kernels is ../kernels

from .errors import (
    CheckpointError,
    ConfigError,
    GenerationError,
    GGUFError,
    HubError,
    MiniLLMError,
    TokenizerError,
    UsageError,
)
from .options import Options

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "load",
    "Options",
    "SamplingParams",
    "MiniLLMError",
    "ConfigError",
    "CheckpointError",
    "GGUFError",
    "HubError",
    "TokenizerError",
    "GenerationError",
    "UsageError",
]


def __getattr__(name):
    if name in ("LLM", "load"):
        from . import api

        return getattr(api, name)
    if name == "SamplingParams":
        from .core.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'minillm' has no attribute {name!r}")
