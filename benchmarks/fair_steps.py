"""Chunked prefill: what a long prompt arriving does to streams already running.

    python benchmarks/fair_steps.py [--model PATH] [--dtype D] [--rounds 5] [--prompt-tokens 3990]
                                    [--stream-tokens 160] [--embedding]

Two greedy streams decode; half a second in, a prompt of --prompt-tokens arrives (with
--embedding: an embeddings input of that length). Each round runs the engine both ways,
alternating: `chunked` (the default: a step reads as many prompt rows as cost about as much as
the decode rows, measured as it runs) and `whole` (--prefill-chunk at the context size: the prompt
read in one step, as before chunked prefill). Reported per mode, as medians over rounds: the
streams' inter-token gaps (p50, p90, p99, max), max / p50 (the bar: <= 3), the long request's
time to its first token (or to its vector), and whether every output equals its run alone.
Benchmarks are not tests: nothing here runs under pytest.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np

import minillm
from minillm.core.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
SHORT = ["Once upon a time", "My favourite food is"]


def stream(llm, prompt, n):
    handle = llm.engine.submit(prompt, GREEDY, n, ())
    times, tokens = [], []
    for event in handle:
        times.append(time.perf_counter())
        tokens.append(event.token)
    return tokens, np.diff(times), times


def one_round(llm, long_ids, stream_tokens, embedding, alone):
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, stream(llm, llm.tokenizer.encode(SHORT[i]), stream_tokens)))
               for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    started = time.perf_counter()
    if embedding:
        out = llm.embed([long_ids])[0]
        first = time.perf_counter() - started
        same_long = np.array_equal(out, alone["long"])
    else:
        tokens, _, times = stream(llm, long_ids, 4)
        first = times[0] - started
        same_long = tokens == alone["long"]
    for t in threads:
        t.join()
    gaps = np.concatenate([results[i][1] for i in range(2)])
    same = same_long and all(results[i][0] == alone[i] for i in range(2))
    return {"p50": np.percentile(gaps, 50), "p90": np.percentile(gaps, 90), "p99": np.percentile(gaps, 99), "max": gaps.max(),
            "first": first, "same": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--dtype")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=3990)
    ap.add_argument("--stream-tokens", type=int, default=160)
    ap.add_argument("--embedding", action="store_true")
    args = ap.parse_args()
    llm = minillm.load(args.model, dtype=args.dtype, ctx=4096, cache_mb=0)
    long_ids = (llm.tokenizer.encode("The history of the sea is long and full of stories about ships. ") * 1000)[: args.prompt_tokens]
    alone = {i: stream(llm, llm.tokenizer.encode(SHORT[i]), args.stream_tokens)[0] for i in range(2)}
    alone["long"] = llm.embed([long_ids])[0] if args.embedding else stream(llm, long_ids, 4)[0]
    modes = {"chunked": None, "whole": llm.model.ctx}
    rows = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else reversed(list(modes))):
            llm.engine.prefill_chunk = modes[mode]
            rows[mode].append(one_round(llm, long_ids, args.stream_tokens, args.embedding, alone))
    llm.engine.prefill_chunk = None
    what = "embeddings input" if args.embedding else "prompt"
    print(f"{args.prompt_tokens}-token {what} arriving beside 2 streams, {args.rounds} alternating rounds, medians (ms)")
    print(f"{'mode':8} {'p50':>7} {'p90':>7} {'p99':>7} {'max':>8} {'max/p50':>8} {'long first':>11}  outputs")
    for mode, runs in rows.items():
        med = {k: statistics.median(run[k] for run in runs) for k in ("p50", "p90", "p99", "max", "first")}
        ratio = statistics.median(run["max"] / run["p50"] for run in runs)
        same = "identical" if all(run["same"] for run in runs) else "DIFFER"
        print(f"{mode:8} {med['p50'] * 1e3:7.1f} {med['p90'] * 1e3:7.1f} {med['p99'] * 1e3:7.1f} {med['max'] * 1e3:8.1f} "
              f"{ratio:8.2f} {med['first'] * 1e3:11.0f}  {same}")


if __name__ == "__main__":
    main()
