"""One GGUF file given to minillm and to llama.cpp, side by side: alternating rounds, each run in a
fresh process with 2 threads, medians and minillm/llama.cpp ratios. A quicker, narrower check than
bench_vs_llamacpp.py (one file, no transformers, no bandwidth samples), for a change to one format.

    python benchmarks/pair_file.py FILE.gguf [--rounds 5] [--threads 2]

    python benchmarks/pair_file.py FILE.gguf --depths 128,1024,4000   # decode deeper into the context

Prints prefill of 512 tokens and decode of 128 tokens after a prompt of each --depths tokens (128
unless given; both engines at the same context depth), and each engine's figures per round.
Benchmarks are not tests.
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
    ap.add_argument("--depths", default="128", help="comma-separated prompt lengths to decode after")
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    metrics = ["prefill512"] + [f"decode@{d}" for d in depths]
    bench.ensure_llama_cpp()
    figures = {(engine, metric): [] for engine in ("minillm", "llama.cpp") for metric in metrics}
    for r in range(args.rounds):
        order = ["minillm", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "minillm"]
        for engine in order:
            run = bench.run_minillm if engine == "minillm" else (lambda f, _d, P, G, t: bench.run_llama(f, P, G, t))
            for d in depths:
                figures[(engine, f"decode@{d}")].append(run(args.gguf, None, d, 128, args.threads)["decode_tok_s"])
            figures[(engine, "prefill512")].append(run(args.gguf, None, 512, 0, args.threads)["prefill_tok_s"])
        print(f"round {r + 1}: " + ", ".join(f"{e} {m} {v[-1]:.1f}" for (e, m), v in figures.items()), flush=True)
    print(f"\n{args.gguf.name}, {args.rounds} rounds, {args.threads} threads: tok/s minillm / llama.cpp = ratio")
    for metric in metrics:
        ours, theirs = statistics.median(figures[("minillm", metric)]), statistics.median(figures[("llama.cpp", metric)])
        ahead = sum(a > b for a, b in zip(figures[("minillm", metric)], figures[("llama.cpp", metric)]))
        print(f"  {metric}: {ours:.1f} / {theirs:.1f} = {ours / theirs:.2f} (minillm ahead in {ahead}/{args.rounds} rounds)")


if __name__ == "__main__":
    main()
