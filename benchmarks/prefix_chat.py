"""The prefix cache through the server and the official openai client.

    python benchmarks/prefix_chat.py [--history-tokens 2350] [--concurrent 8]

1. A 3-turn chat whose history is a long system prompt: time to first token of each turn and the
   cached tokens each reports (streamed, with include_usage).
2. N concurrent chats sharing one system prompt: prompt tokens prefilled (minillm_prompt_tokens_total
   in /metrics) with the prefix cache and with --cache-mb 0, side by side.
Each server is `cli.py serve` on the default model in its own process.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:  # the openai package brings httpx2 (same API) or httpx, depending on its version
    import httpx2 as httpx
except ImportError:
    import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "tests" / "data" / "lighthouse.txt").read_text()


def start_server(cache_mb: float | None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, str(ROOT / "cli.py"), "serve", "--port", str(port), "--ctx", "4096"]
    if cache_mb is not None:
        cmd += ["--cache-mb", str(cache_mb)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not start")


def metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def system_prompt(tokens: int) -> str:
    words = TEXT.split()
    # sized in words (tokens / 1.3): 2660 gives a system prompt of about 2,350 tokens with SmolLM2's tokenizer
    return "You answer questions about this story.\n\n" + " ".join(words[i % len(words)] for i in range(int(tokens / 1.3)))


def turn(client, messages) -> tuple[float, str, int, int]:
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    for chunk in client.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content and ttft is None:
            ttft = time.perf_counter() - t0
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    return ttft, "".join(text), usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--history-tokens", type=int, default=2660, help="the system prompt's size (2660 gives a 2,350-token history)")
    p.add_argument("--concurrent", type=int, default=8)
    args = p.parse_args()
    system = system_prompt(args.history_tokens)
    results = {}

    proc, base = start_server(None)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Who keeps the lighthouse?"}]
        turns = []
        for question in ("What happens at night?", "How does it end?", None):
            ttft, text, prompt_tokens, cached = turn(client, messages)
            turns.append({"ttft_s": ttft, "prompt_tokens": prompt_tokens, "cached_tokens": cached})
            if question:
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": question}]
        results["chat"] = turns
        for i, t in enumerate(turns, 1):
            print(f"turn {i}: prompt {t['prompt_tokens']} tokens, cached {t['cached_tokens']}, "
                  f"TTFT {t['ttft_s'] * 1000:.0f} ms ({t['ttft_s'] / turns[0]['ttft_s'] * 100:.1f}% of turn 1)")
    finally:
        proc.terminate()
        proc.wait()

    prefill = {}
    for label, cache_mb in (("cache", None), ("no cache", 0)):
        proc, base = start_server(cache_mb)
        try:
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
            before = metric(base, "minillm_prompt_tokens_total")
            chats = [[{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: what is line {i} about?"}]
                     for i in range(args.concurrent)]
            with ThreadPoolExecutor(args.concurrent) as pool:
                list(pool.map(lambda m: turn(client, m), chats))
            prefill[label] = metric(base, "minillm_prompt_tokens_total") - before
        finally:
            proc.terminate()
            proc.wait()
    results["concurrent_prefill_tokens"] = prefill
    print(f"{args.concurrent} concurrent chats sharing the system prompt: prefilled {prefill['cache']:.0f} tokens with the "
          f"prefix cache, {prefill['no cache']:.0f} without ({prefill['cache'] / prefill['no cache'] * 100:.1f}%)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
