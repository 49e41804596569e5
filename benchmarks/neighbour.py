"""A server beside a CPU-bound neighbour: how long 32 tokens take, quiet and shared.

    python benchmarks/neighbour.py [--trees . /tmp/before] [--model PATH] [--neighbour bench|spin] [--rounds 3]

For each tree (a minillm checkout; several are measured in turn, side by side in one run), starts
`cli.py serve` on a free loopback port, then times a 32-token greedy completion (EOS ignored):
`--rounds` times on the quiet machine, then `--rounds` times while a neighbour keeps every core
busy, then reports the medians and their ratio. The neighbour is another minillm process decoding
(`bench`: `cli.py bench` of the same tree, threads spinning as minillm's do) or plain processes
spinning, one per core (`spin`). Benchmarks are not tests: nothing here runs under pytest.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import free_port, start_server, stop_server  # noqa: E402  (the same server runner)

try:
    import httpx2 as httpx
except ImportError:
    import httpx

SPIN = "import time\nend = time.time() + 3600\nwhile time.time() < end: pass\n"


def thirty_two_tokens(base: str) -> float:
    body = {"model": "m", "prompt": "Once upon a time, in a small village by the sea,", "max_tokens": 32, "temperature": 0,
            "ignore_eos": True}
    start = time.perf_counter()
    response = httpx.post(base + "/v1/completions", json=body, timeout=900)
    response.raise_for_status()
    assert response.json()["usage"]["completion_tokens"] == 32
    return time.perf_counter() - start


def neighbours(kind: str, tree: Path, model: str | None) -> list[subprocess.Popen]:
    if kind == "spin":
        return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(os.cpu_count() or 2)]
    cmd = [sys.executable, "cli.py", "bench", "--prompt-tokens", "64", "--gen-tokens", "100000"] + (["--model", model] if model else [])
    return [subprocess.Popen(cmd, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]


def measure(tree: Path, args) -> dict:
    port = free_port()
    server = start_server(tree, port, args.model)
    base = f"http://127.0.0.1:{port}"
    try:
        thirty_two_tokens(base)  # warm-up
        quiet = [thirty_two_tokens(base) for _ in range(args.rounds)]
        others = neighbours(args.neighbour, tree, args.model)
        try:
            time.sleep(args.settle)  # the neighbour loads and starts decoding
            shared = [thirty_two_tokens(base) for _ in range(args.rounds)]
        finally:
            for p in others:
                p.terminate()
                p.wait()
    finally:
        stop_server(server)
    return {"quiet": quiet, "shared": shared}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs="+", type=Path, default=[Path(__file__).resolve().parent.parent])
    ap.add_argument("--model", default=None)
    ap.add_argument("--neighbour", choices=("bench", "spin"), default="bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=8.0, help="seconds the neighbour runs before timing")
    args = ap.parse_args()
    for tree in args.trees:
        r = measure(tree.resolve(), args)
        q, s = statistics.median(r["quiet"]), statistics.median(r["shared"])
        print(f"{tree}: 32 tokens quiet {q:.2f} s, beside a {args.neighbour} neighbour {s:.2f} s: {s / q:.1f}x "
              f"(quiet {', '.join(f'{v:.2f}' for v in r['quiet'])}; shared {', '.join(f'{v:.2f}' for v in r['shared'])})", flush=True)


if __name__ == "__main__":
    main()
