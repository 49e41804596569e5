"""The prefix cache across a restart (`serve --cache-dir`): time to first token of an earlier
conversation's next request on a fresh server (no cache), a warm one (the cache in memory), and
a restarted one (the cache read from disk), on the default model.

    python benchmarks/prefix_restart.py [--rounds 3] [--history-words 900] [--model PATH|NAME]

Each round: start `cli.py serve --cache-dir` on an empty directory; ask the chat once (cold) and
again (warm); stop it with SIGTERM (it writes the cache); start it again and ask again
(restored). Medians over the rounds, and the restored/warm ratio; the replies must be identical.
Benchmarks are not tests: nothing here runs under pytest.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:  # the openai package brings httpx2 (same API) or httpx, depending on its version
    import httpx2 as httpx
except ImportError:
    import httpx

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["lighthouses", "tides", "harbours", "charts", "storms", "compasses", "sails", "knots", "buoys"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str | None, cache_dir: str):
        self.port = free_port()
        flags = ["--model", model] if model else []
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "serve", *flags, "--port", str(self.port), "--ctx", "2048",
                                      "--cache-dir", cache_dir], cwd=ROOT, stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{self.port}"
        for _ in range(600):
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the server did not start")

    def ttft(self, body: dict) -> tuple[float, int, str]:
        """(seconds to the first streamed piece of text, cached prompt tokens, the whole reply)."""
        start, first, text, cached = time.perf_counter(), None, [], 0
        with httpx.stream("POST", self.base + "/v1/chat/completions", json=body, timeout=600) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
                for choice in event.get("choices", []):
                    if choice["delta"].get("content"):
                        first = first or time.perf_counter() - start
                        text.append(choice["delta"]["content"])
        return first, cached, "".join(text)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--history-words", type=int, default=900)
    parser.add_argument("--model")
    args = parser.parse_args()
    times = {"cold": [], "warm": [], "restored": []}
    for round_ in range(args.rounds):
        history = " ".join(f"{TOPICS[(i + round_) % len(TOPICS)]} matter at sea." for i in range(args.history_words // 4))
        body = {"messages": [{"role": "system", "content": history}, {"role": "user", "content": "Which of these matter most?"}],
                "max_tokens": 16, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        with tempfile.TemporaryDirectory() as cache_dir:
            server = Server(args.model, cache_dir)
            cold, _, reply = server.ttft(body)
            warm, warm_cached, again = server.ttft(body)
            server.stop()
            server = Server(args.model, cache_dir)
            restored, cached, restarted = server.ttft(body)
            server.stop()
        assert reply == again == restarted, (reply, again, restarted)
        times["cold"].append(cold)
        times["warm"].append(warm)
        times["restored"].append(restored)
        print(f"round {round_ + 1}: cold {cold * 1000:.0f} ms, warm {warm * 1000:.0f} ms ({warm_cached} cached), "
              f"after a restart {restored * 1000:.0f} ms ({cached} cached)", flush=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"medians: cold {median['cold'] * 1000:.0f} ms, warm {median['warm'] * 1000:.0f} ms, restored "
          f"{median['restored'] * 1000:.0f} ms; restored/warm {median['restored'] / median['warm']:.2f}x, "
          f"cold/restored {median['cold'] / median['restored']:.1f}x")


if __name__ == "__main__":
    main()
