"""What scoring a prompt costs (completions' echo + logprobs, lm-evaluation-harness's loglikelihood)
against reading it and generating one token, through the engine.

    python benchmarks/scoring.py [--model PATH] [--dtype D] [--tokens 448] [--rounds 5] [--top 1 5]

Each round times, in a rotating order: the prompt read and one token generated (plain), and the
prompt scored with each --top alternatives per token (every row through the LM head, each row's
log-softmax and best alternatives). Reported: medians over rounds and their ratio to plain.
Benchmarks are not tests: nothing here runs under pytest.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import minillm
from minillm.core.sampling import SamplingParams

TEXT = (Path(__file__).resolve().parents[1] / "tests" / "data" / "lighthouse.txt").read_text()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--tokens", type=int, default=448)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--top", type=int, nargs="+", default=[1, 5])
    args = p.parse_args()
    llm = minillm.load(args.model, dtype=args.dtype, cache_mb=0, progress=False)
    ids = llm.tokenizer.encode(TEXT)[: args.tokens]
    kinds = ["plain"] + [f"scored, top {k}" for k in args.top]
    seconds = {kind: [] for kind in kinds}
    for r in range(args.rounds):
        for kind in kinds[r % len(kinds):] + kinds[: r % len(kinds)]:
            top = None if kind == "plain" else int(kind.rsplit(" ", 1)[1])
            started = time.perf_counter()
            list(llm.engine.submit(ids, SamplingParams(temperature=0.0), 1 if top is None else 0, prompt_logprobs=top))
            seconds[kind].append(time.perf_counter() - started)
    plain = statistics.median(seconds["plain"])
    print(f"{len(ids)} prompt tokens, {args.rounds} rounds, medians")
    for kind in kinds:
        median = statistics.median(seconds[kind])
        print(f"{kind:>14}: {median:.3f} s  ({median / plain:.2f}x plain; {1000 * (median - plain) / len(ids):.2f} ms a token more)")


if __name__ == "__main__":
    main()
