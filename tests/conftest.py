import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

try:  # the openai package brings httpx2 (same API) or httpx, depending on its version
    import httpx2 as httpx
except ImportError:
    import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def pytest_addoption(parser):
    parser.addoption("--every-format", action="store_true",
                     help="tests/test_targets.py: every GGUF format on the other CPU targets (default: one of each kernel family)")


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
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


@contextmanager
def running_server(app):
    """`app` served by uvicorn on a free local port in a thread: yields its base URL; stops the
    server and waits for its thread on exit."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
