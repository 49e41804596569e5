"""Batched decode steps without the server: the time of one step for 1, 2, 4 and 8 sequences, and
what 8 sequences give over one, on the model and precision given.

    python benchmarks/batch_steps.py [--model PATH] [--dtype D] [--threads N] [--rounds 5] [--depth 128]
                                     [--sizes 1,2,4,8]

Every sequence is prefilled to --depth tokens; each step then runs the same token again at the
same position (the cache length is put back), so every round times the same work. Batch sizes
alternate within each round, so a noisy neighbour hits them alike; reported are medians over
rounds of each round's median step. The ceiling on what the server can reach (serve_load.py): at
8 concurrent streams its aggregate tok/s over one stream is at most `8 / (step 8 / step 1)`,
before sampling, HTTP and prefills take their share.
Benchmarks are not tests: nothing here runs under pytest.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba

import minillm
from minillm.core.cache import KVPool

SIZES = "1,2,4,8"


def timed_steps(model, sequences: int, depth: int):
    """`sequences` sequences prefilled to `depth` tokens (prompt b: tokens 7 b, 7 b + 1, ...), and
    step(B): the seconds of one decode step for the first B of them, whose positions are then
    taken back out of the caches, so every step times the same work."""
    pool = KVPool(model.config, model.ctx, sequences)
    slots, caches = [], []
    for b in range(sequences):
        slot, cache = pool.acquire()
        model.forward([(7 * b + i) % model.config.vocab_size for i in range(depth)], cache)
        slots.append(slot)
        caches.append(cache)

    def step(B: int) -> float:
        start = time.perf_counter()
        model.decode_batch([5] * B, caches[:B], slots[:B], pool)
        elapsed = time.perf_counter() - start
        for c in caches[:B]:
            c.length -= 1
        return elapsed

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory or GGUF file (default: the default model)")
    ap.add_argument("--dtype", help="as cli.py takes it (default: float32, or a GGUF as stored)")
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="steps per batch size and round")
    ap.add_argument("--depth", type=int, default=128, help="tokens already in each sequence's cache")
    ap.add_argument("--sizes", default=SIZES, help="comma-separated batch sizes (1 is always timed: the ratios' base)")
    args = ap.parse_args()
    sizes = sorted({1, *map(int, args.sizes.split(","))})

    numba.set_num_threads(args.threads)
    model = minillm.load(args.model, dtype=args.dtype).model if args.model else minillm.load(dtype=args.dtype).model
    step = timed_steps(model, max(sizes), args.depth)
    for B in sizes:  # warm-up: every batch size's buffers made, kernels loaded
        step(B)
    per_round: dict[int, list[float]] = {B: [] for B in sizes}
    for _ in range(args.rounds):
        for B in sizes:
            per_round[B].append(statistics.median(step(B) for _ in range(args.steps)))

    one = statistics.median(per_round[1])
    what = f"{args.model or 'default model'}, {args.dtype or 'default precision'}, {args.threads} threads, depth {args.depth}"
    print(f"batched decode steps, {what}, medians of {args.rounds} rounds")
    print("| sequences | step ms | x step of 1 | tok/s | x tok/s of 1 |")
    print("|---|---|---|---|---|")
    for B in sizes:
        t = statistics.median(per_round[B])
        print(f"| {B} | {t * 1000:.2f} | {t / one:.2f} | {B / t:.1f} | {B * one / t:.2f} |")


if __name__ == "__main__":
    main()
