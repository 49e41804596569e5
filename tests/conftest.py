import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def default_model_dir():
    """The imported default model (imports it on first use, as a user's first run would)."""
    from minillm.loading.default_model import default_model_dir as locate

    return locate(progress=False)


@pytest.fixture(scope="session")
def default_gguf():
    from minillm.loading.default_model import find_default_gguf

    return find_default_gguf()
