"""Two minillm trees side by side: `cli.py bench` in each, alternating, medians and ratios.

    python benchmarks/ab_trees.py --before /tmp/before --after . [--dtypes float32 int8] [--rounds 5]

For a change that must not cost speed: both trees run the same model (the default one unless
--model) in fresh processes, round after round in alternating order, so a noisy neighbour hits
both alike. Reports per dtype the median decode and prefill tok/s of each tree, after/before,
and in how many rounds the after tree was ahead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def bench(tree: Path, dtype: str, args) -> dict:
    cmd = [sys.executable, "cli.py", "bench", "--dtype", dtype, "--prompt-tokens", str(args.prompt_tokens),
           "--gen-tokens", str(args.gen_tokens), "--json"]
    if args.model:
        cmd += ["--model", args.model]
    env = dict(os.environ, MINILLM_WEIGHTS=str(Path(args.weights).resolve()))
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", default=".")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--model", default=None)
    p.add_argument("--weights", default=os.environ.get("MINILLM_WEIGHTS", str(Path(__file__).resolve().parents[1] / "weights")))
    args = p.parse_args()
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    for dtype in args.dtypes:
        for tree in trees.values():
            bench(tree, dtype, args)  # compile or load the kernel cache before timing
        runs = {"before": [], "after": []}
        for r in range(args.rounds):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for name in order:
                runs[name].append(bench(trees[name], dtype, args))
        for key in ("decode_tok_s", "prefill_tok_s"):
            before = [x[key] for x in runs["before"]]
            after = [x[key] for x in runs["after"]]
            ahead = sum(a > b for a, b in zip(after, before))
            mb, ma = statistics.median(before), statistics.median(after)
            print(f"{dtype:9s} {key:14s} before {mb:8.1f}  after {ma:8.1f}  ratio {ma / mb:.3f}  after ahead {ahead}/{args.rounds}")


if __name__ == "__main__":
    main()
