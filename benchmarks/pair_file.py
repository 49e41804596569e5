"""One GGUF file given to minillm and to llama.cpp, side by side: alternating rounds, each run in a
fresh process with 2 threads, medians and minillm/llama.cpp ratios. A quicker, narrower check than
bench_vs_llamacpp.py (one file, no transformers, no bandwidth samples), for a change to one format.

    python benchmarks/pair_file.py FILE.gguf [--rounds 5] [--threads 2]

    python benchmarks/pair_file.py FILE.gguf --depths 128,1024,4000   # decode deeper into the context

    python benchmarks/pair_file.py Q8_0.gguf --minillm-model weights/SmolLM2-135M-Instruct --minillm-dtype int8
                                      # minillm on a checkpoint at a --dtype, llama.cpp on the file

    python benchmarks/pair_file.py Q4_0.gguf --activations 16,8   # minillm at each --activations, in the same rounds

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
    ap.add_argument("--minillm-model", type=Path, help="what minillm runs instead of the file (e.g. a checkpoint directory)")
    ap.add_argument("--minillm-dtype", help="minillm's --dtype for it")
    ap.add_argument("--activations", default="", help="comma-separated: minillm run at each --activations (default: its default)")
    args = ap.parse_args()
    widths = [int(a) for a in args.activations.split(",") if a] or [None]
    ours = {"minillm" if a is None else f"minillm a{a}": a for a in widths}
    depths = [int(d) for d in args.depths.split(",")]
    metrics = ["prefill512"] + [f"decode@{d}" for d in depths]
    bench.ensure_llama_cpp()
    engines = [*ours, "llama.cpp"]
    figures = {(engine, metric): [] for engine in engines for metric in metrics}
    for r in range(args.rounds):
        order = engines if r % 2 == 0 else engines[::-1]
        for engine in order:
            if engine in ours:
                run = lambda P, G: bench.run_minillm(args.minillm_model or args.gguf, args.minillm_dtype, P, G, args.threads, ours[engine])
            else:
                run = lambda P, G: bench.run_llama(args.gguf, P, G, args.threads)
            for d in depths:
                figures[(engine, f"decode@{d}")].append(run(d, 128)["decode_tok_s"])
            figures[(engine, "prefill512")].append(run(512, 0)["prefill_tok_s"])
        print(f"round {r + 1}: " + ", ".join(f"{e} {m} {v[-1]:.1f}" for (e, m), v in figures.items()), flush=True)
    ours_label = f"{args.minillm_model or args.gguf.name} {args.minillm_dtype or ''}".strip()
    print(f"\nminillm on {ours_label}, llama.cpp on {args.gguf.name}, {args.rounds} rounds, {args.threads} threads: tok/s minillm / llama.cpp = ratio")
    for engine in ours:
        for metric in metrics:
            mine, theirs = statistics.median(figures[(engine, metric)]), statistics.median(figures[("llama.cpp", metric)])
            ahead = sum(a > b for a, b in zip(figures[(engine, metric)], figures[("llama.cpp", metric)]))
            print(f"  {engine} {metric}: {mine:.1f} / {theirs:.1f} = {mine / theirs:.2f} (ahead in {ahead}/{args.rounds} rounds)")


if __name__ == "__main__":
    main()
