"""One GGUF file given to minillm and to llama.cpp, side by side: alternating rounds, each run in a
fresh process with 2 threads, medians and minillm/llama.cpp ratios. A quicker, narrower check than
bench_vs_llamacpp.py (one file, no transformers, no bandwidth samples), for a change to one format.

    python benchmarks/pair_file.py FILE.gguf [--rounds 5] [--threads 2]

Prints prefill of 512 tokens and decode of 128 tokens after a 128-token prompt (both engines at
the same context depth), and each engine's figures per round. Benchmarks are not tests.
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_llamacpp as bench  # noqa: E402  (its llama.cpp worker and minillm runner)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    bench.ensure_llama_cpp()
    figures = {(engine, metric): [] for engine in ("minillm", "llama.cpp") for metric in ("prefill512", "decode128")}
    for r in range(args.rounds):
        order = ["minillm", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "minillm"]
        for engine in order:
            run = bench.run_minillm if engine == "minillm" else (lambda f, _d, P, G, t: bench.run_llama(f, P, G, t))
            figures[(engine, "decode128")].append(run(args.gguf, None, 128, 128, args.threads)["decode_tok_s"])
            figures[(engine, "prefill512")].append(run(args.gguf, None, 512, 0, args.threads)["prefill_tok_s"])
        print(f"round {r + 1}: " + ", ".join(f"{e} {m} {v[-1]:.1f}" for (e, m), v in figures.items()), flush=True)
    print(f"\n{args.gguf.name}, {args.rounds} rounds, {args.threads} threads: tok/s minillm / llama.cpp = ratio")
    for metric in ("prefill512", "decode128"):
        ours, theirs = statistics.median(figures[("minillm", metric)]), statistics.median(figures[("llama.cpp", metric)])
        ahead = sum(a > b for a, b in zip(figures[("minillm", metric)], figures[("llama.cpp", metric)]))
        print(f"  {metric}: {ours:.1f} / {theirs:.1f} = {ours / theirs:.2f} (minillm ahead in {ahead}/{args.rounds} rounds)")


if __name__ == "__main__":
    main()
