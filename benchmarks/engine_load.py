"""The batching engine under load without HTTP: aggregate generated tok/s at concurrency 1 and 8
(or --levels), and where the engine thread's time goes: decode steps, prefills, and the rest
(sampling, admitting and ending requests, handing tokens over).

    python benchmarks/engine_load.py [--model PATH] [--dtype D] [--levels 1,8] [--rounds 3]
                                     [--requests-per-client 4] [--max-tokens 64]

The same load as serve_load.py (distinct short prompts, sampled with a seed, temperature 0.8 and
OpenAI's defaults otherwise, ignore end-of-sequence), sent from client threads straight to
`minillm.load(...).engine`. Levels alternate within each round; reported are medians over rounds.
It sits between batch_steps.py (one step, no engine) and serve_load.py (the whole server): the
ratio here, against serve_load.py's, is what HTTP and the load generator cost on the same cores.
Benchmarks are not tests: nothing here runs under pytest.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import minillm
from minillm.core.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import TEMPERATURE, prompt_text  # noqa: E402  (the same load)


class Timed:
    """Wraps one of the model's methods, summing the wall time spent in it."""

    def __init__(self, model, name: str):
        self.inner, self.seconds, self.calls = getattr(model, name), 0.0, 0
        setattr(model, name, self)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def level(llm, steps: Timed, prefills: Timed, clients: int, per_client: int, max_tokens: int) -> dict:
    engine, tokenizer = llm.engine, llm.tokenizer
    ttfts, lock = [], threading.Lock()

    def one(i: int) -> None:
        prompt = tokenizer.encode(prompt_text(i))
        handle = engine.submit(prompt, SamplingParams(temperature=TEMPERATURE, top_k=0, top_p=1.0, min_p=0.0, seed=i), max_tokens)
        for _ in handle:
            pass
        with lock:
            ttfts.append(handle.first_token_at - handle.submitted)

    def client(c: int) -> None:
        for r in range(per_client):
            one(c * per_client + r)

    steps.reset()
    prefills.reset()
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {
        "tok_s": clients * per_client * max_tokens / wall,
        "step_ms": 1000 * steps.seconds / max(steps.calls, 1),
        "steps": steps.seconds / wall,
        "prefills": prefills.seconds / wall,
        "ttft_ms": 1000 * statistics.median(ttfts),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory or GGUF file (default: the default model)")
    ap.add_argument("--dtype", help="as minillm.load takes it (default: float32, or a GGUF as stored)")
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    kwargs = {"dtype": args.dtype} if args.dtype else {}
    llm = minillm.load(args.model, ctx=1024, max_batch=8, progress=False, **kwargs)  # as serve_load.py serves it
    steps, prefills = Timed(llm.model, "step"), Timed(llm.model, "forward")  # the engine steps every row through step()
    levels = [int(c) for c in args.levels.split(",")]
    level(llm, steps, prefills, 2, 1, 8)  # warm-up: kernels loaded, the batch path run
    runs = {c: [] for c in levels}
    for r in range(args.rounds):
        for c in levels:
            runs[c].append(level(llm, steps, prefills, c, args.requests_per_client, args.max_tokens))
            print(f"round {r + 1}, concurrency {c}: {runs[c][-1]['tok_s']:.1f} tok/s", flush=True)

    def med(c, key):
        return statistics.median(x[key] for x in runs[c])

    one = med(levels[0], "tok_s")
    print(f"\nengine load, {args.model or 'default model'}, {args.dtype or 'default precision'}, max_tokens {args.max_tokens}, "
          f"{args.requests_per_client} requests per client, medians of {args.rounds} rounds")
    print("| concurrency | tok/s | x lowest | step ms | wall in steps | in prefills | rest | TTFT p50 |")
    print("|---|---|---|---|---|---|---|---|")
    for c in levels:
        steps_share, prefill_share = med(c, "steps"), med(c, "prefills")
        print(f"| {c} | {med(c, 'tok_s'):.1f} | {med(c, 'tok_s') / one:.2f} | {med(c, 'step_ms'):.2f} | {steps_share:.0%} | "
              f"{prefill_share:.0%} | {1 - steps_share - prefill_share:.0%} | {med(c, 'ttft_ms'):.0f} ms |")


if __name__ == "__main__":
    main()
