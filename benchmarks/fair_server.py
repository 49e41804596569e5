"""The fair server, measured as a client meets it: two streams' pace while a long prompt arrives.

    python benchmarks/fair_server.py [--model PATH] [--dtype D] [--rounds 3] [--prompt-tokens 4000]
                                     [--stream-tokens 300] [--tree .]

Starts `cli.py serve` of `--tree` on a free loopback port (the environment passes through, so
`NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=...` measures the AVX2 build). Each round, for a
~4,000-token completions prompt and then an embeddings input of that length: two greedy streaming
completions while, half a second in, the long input arrives, between two shorter runs of the same
streams alone (the quiet pace, before and after, since this machine's speed drifts over minutes). Each long input starts with the round's number, so the prefix cache (on, as served) never
holds it before. Reported, as medians over rounds: the quiet streams' median inter-token gap, the
worst gap while each long input is read, their ratio (#66's bar: <= 3), the long request's time to
its first token (or vector), and whether every stream's text equals its quiet run's.
Benchmarks are not tests: nothing here runs under pytest.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import free_port, httpx, start_server, stop_server  # noqa: E402  (the same server runner)

SHORT = ["Once upon a time", "My favourite food is"]
SENTENCE = "The history of the sea is long and full of stories about ships. "  # ~14 tokens


def stream(base: str, prompt: str, n: int) -> tuple[str, list[float]]:
    """A greedy streaming completion of exactly n tokens: its text and each token's gap. A chunk
    carrying k tokens (text the server held back: a stop string's possible start, a character
    split across tokens) counts as k gaps of a k-th of its wait each: the engine's pace, which is
    what a long prompt beside the stream could slow."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 0}
    text, gaps, last = [], [], None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    now, k = time.perf_counter(), len(chunk["choices"][0]["logprobs"]["tokens"])
                    if last is not None:
                        gaps += [(now - last) / k] * k
                    last = now
                    text.append(chunk["choices"][0]["text"])
    return "".join(text), gaps


def long_request(base: str, kind: str, text: str) -> float:
    """Seconds to the first token of a long completions prompt, or to an embeddings vector."""
    started = time.perf_counter()
    if kind == "completions":
        body = {"model": "bench", "prompt": text, "max_tokens": 4, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    return time.perf_counter() - started
    r = httpx.post(f"{base}/v1/embeddings", json={"model": "bench", "input": text}, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - started


def two_streams(base: str, n: int, arriving: tuple[str, str] | None) -> tuple[list[str], list[float], float | None]:
    """The two streams at once (and, half a second in, the long input): texts, their gaps, and the
    long request's latency."""
    out: dict = {}
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, stream(base, SHORT[i], n))) for i in range(2)]
    for t in threads:
        t.start()
    first = None
    if arriving is not None:
        time.sleep(0.5)
        first = long_request(base, *arriving)
    for t in threads:
        t.join()
    return [out[i][0] for i in range(2)], out[0][1] + out[1][1], first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--dtype")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--stream-tokens", type=int, default=300)
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    args = ap.parse_args()
    # This client's own collector would pause its reading threads (a 44 ms full collection seen
    # here), and the pause would count as a gap in the server's pace: nothing here needs it.
    gc.collect()
    gc.disable()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    extra = ["--ctx", str(args.prompt_tokens + 512)] + (["--dtype", args.dtype] if args.dtype else [])
    server = start_server(args.tree, port, args.model, extra)
    rows = {"completions": [], "embeddings": []}
    try:
        two_streams(base, 8, ("completions", "0 " + SENTENCE * 20))  # warm-up: every path compiled and loaded
        two_streams(base, 8, ("embeddings", "0 " + SENTENCE * 20))
        for r in range(1, args.rounds + 1):
            long_text = f"{r} " + SENTENCE * (args.prompt_tokens // 14)
            for kind in rows:
                # the quiet pace just before and just after: this machine's speed drifts by 2x over minutes
                quiet_texts, before, _ = two_streams(base, args.stream_tokens // 3, None)
                texts, busy, first = two_streams(base, args.stream_tokens, (kind, long_text))
                _, after, _ = two_streams(base, args.stream_tokens // 3, None)
                quiet = statistics.median(before + after)
                texts = [t[: len(q)] for t, q in zip(texts, quiet_texts)]
                rows[kind].append({"quiet": quiet, "p50": statistics.median(busy), "max": max(busy), "ratio": max(busy) / quiet,
                                   "first": first, "same": texts == quiet_texts})
                print(f"round {r} {kind}: quiet p50 {quiet * 1e3:.1f} ms, busy p50 {rows[kind][-1]['p50'] * 1e3:.1f}, "
                      f"max {max(busy) * 1e3:.1f} ({max(busy) / quiet:.2f}x), first {first:.1f} s", flush=True)
    finally:
        stop_server(server)
    print(f"\n2 streams of {args.stream_tokens} tokens, a ~{args.prompt_tokens}-token input arriving; "
          f"medians of {args.rounds} rounds (ms)")
    print(f"{'arriving':12} {'quiet p50':>9} {'busy p50':>9} {'max':>8} {'max/quiet':>9} {'long first (s)':>15}  outputs")
    for kind, runs in rows.items():
        med = {k: statistics.median(run[k] for run in runs) for k in ("quiet", "p50", "max", "ratio", "first")}
        same = "identical" if all(run["same"] for run in runs) else "DIFFER"
        print(f"{kind:12} {med['quiet'] * 1e3:9.1f} {med['p50'] * 1e3:9.1f} {med['max'] * 1e3:8.1f} {med['ratio']:9.2f} "
              f"{med['first']:15.1f}  {same}")


if __name__ == "__main__":
    main()
