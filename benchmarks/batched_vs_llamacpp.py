"""Batched decode against llama.cpp's own: one GGUF file, the step for 1 and for 8 sequences in each
engine, side by side on this machine.

    python benchmarks/batched_vs_llamacpp.py FILE.gguf [--rounds 5] [--depth 128] [--threads 2]

Every sequence is prefilled to --depth tokens; a step then decodes one token for each of B
sequences in one call (minillm: Model.decode_batch; llama.cpp: llama_decode of a batch with B
sequence ids), and the step's positions are taken back out of the caches, so every step times the
same work. Each round runs minillm and then llama.cpp, each in a fresh process; reported are the
medians over rounds of each round's median step, and what 8 sequences give over one in tokens/s:
the ceiling on what a server over that engine can reach at 8 streams (serve_load.py), before
sampling, HTTP and prefills take their share. llama.cpp runs with its defaults (a 16-bit KV cache;
minillm's is float32).
Benchmarks are not tests: nothing here runs under pytest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = (1, 8)

WORKER_MINILLM = r"""
import json, statistics, sys
import numba
path, depth, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
numba.set_num_threads(threads)
import minillm
sys.path.insert(0, "benchmarks")
from batch_steps import timed_steps
sizes = (1, 8)
step = timed_steps(minillm.load(path, progress=False).model, max(sizes), depth)
for B in sizes:
    step(B); step(B)
print(json.dumps({str(B): statistics.median(step(B) for _ in range(steps)) for B in sizes}))
"""

WORKER_LLAMA = r"""
import json, statistics, sys, time
import llama_cpp as L
path, depth, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sizes = (1, 8)
L.llama_backend_init()
model = L.llama_load_model_from_file(path.encode(), L.llama_model_default_params())
cp = L.llama_context_default_params()
cp.n_seq_max = max(sizes)
cp.n_ctx = max(sizes) * (depth + 64); cp.n_batch = max(512, depth); cp.n_ubatch = cp.n_batch
cp.n_threads = threads; cp.n_threads_batch = threads
ctx = L.llama_init_from_model(model, cp)
mem = L.llama_get_memory(ctx)
V = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
batch = L.llama_batch_init(max(depth, max(sizes)), 0, 1)

def run(entries):  # (token, position, sequence, wants logits)
    batch.n_tokens = len(entries)
    for i, (token, pos, seq, logits) in enumerate(entries):
        batch.token[i] = token; batch.pos[i] = pos; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = seq
        batch.logits[i] = logits
    if L.llama_decode(ctx, batch) != 0:
        raise SystemExit("llama_decode failed")

for b in range(max(sizes)):  # the same prompts as minillm's (batch_steps.timed_steps)
    run([((7 * b + i) % V, i, b, i == depth - 1) for i in range(depth)])

def step(B):
    t = time.perf_counter()
    run([(5, depth, b, True) for b in range(B)])
    for b in range(B):
        L.llama_get_logits_ith(ctx, b)
    elapsed = time.perf_counter() - t
    for b in range(B):
        L.llama_memory_seq_rm(mem, b, depth, -1)
    return elapsed

for B in sizes:
    step(B); step(B)
print(json.dumps({str(B): statistics.median(step(B) for _ in range(steps)) for B in sizes}))
"""


def run_worker(code: str, args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"worker failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--depth", type=int, default=128, help="tokens already in each sequence's cache")
    ap.add_argument("--steps", type=int, default=30, help="steps per batch size, engine and round")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise SystemExit("llama-cpp-python is not installed: run benchmarks/bench_vs_llamacpp.py once (it builds it)")

    worker_args = [str(Path(args.gguf).resolve()), str(args.depth), str(args.steps), str(args.threads)]
    steps = {"minillm": {B: [] for B in SIZES}, "llama.cpp": {B: [] for B in SIZES}}
    for r in range(args.rounds):
        for engine, code in (("minillm", WORKER_MINILLM), ("llama.cpp", WORKER_LLAMA)):
            result = run_worker(code, worker_args)
            for B in SIZES:
                steps[engine][B].append(result[str(B)])
        print(f"round {r + 1}: " + ", ".join(f"{e} step of {B} {1000 * steps[e][B][-1]:.2f} ms" for e in steps for B in SIZES), flush=True)

    print(f"\n{Path(args.gguf).name}, depth {args.depth}, {args.threads} threads, medians of {args.rounds} rounds")
    print("| engine | step of 1 | step of 8 | tok/s at 8 / tok/s at 1 |")
    print("|---|---|---|---|")
    for engine, per_size in steps.items():
        one, eight = statistics.median(per_size[1]), statistics.median(per_size[8])
        print(f"| {engine} | {1000 * one:.2f} ms | {1000 * eight:.2f} ms | {8 * one / eight:.2f} |")


if __name__ == "__main__":
    main()
