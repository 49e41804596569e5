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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(base: str, seconds: float) -> bool:
    """Poll `base`/health until it answers 200 (True) or `seconds` pass (False)."""
    import time

    try:  # the openai package brings httpx2 (same API) or httpx, depending on its version
        import httpx2 as httpx
    except ImportError:
        import httpx

    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False
