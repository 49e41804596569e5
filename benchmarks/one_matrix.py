"""One weight matrix through the forward pass's linear kernel for a few rows of x: where a change
to the tiles shows without the rest of a step around it.

    python benchmarks/one_matrix.py [--format Q4_1] [--rows 6144] [--cols 2048] [--tokens 1,2,3,4,8,12]

Random weights of the format (GGUF blocks as tests/gguf_tiny.py makes them; I8 quantized from
normal floats), then for each count of rows of x the best of 5 blocks of 20 calls, in
microseconds. Comparing two trees: run it in each (PYTHONPATH=TREE, its own NUMBA_CACHE_DIR),
alternating, several times. Benchmarks are not tests: nothing here runs under pytest.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from minillm import kernels as K

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gguf_tiny import random_blocks  # noqa: E402


def weights(fmt, rows: int, cols: int):
    """(weights as the kernel takes them, int8's scales or None)."""
    if fmt.name == "I8":
        w, s = np.empty((rows, cols), np.int8), np.empty((rows, cols // K.QBLOCK), np.uint16)
        K.quantize_int8(w, s, np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32))
        return w, s
    if fmt.ggml_type is None or fmt.name in ("F32", "F16", "BF16"):
        raise SystemExit(f"--format {fmt.name}: I8 or a GGUF block format as a file stores it (Q4_1, Q5_K, ...)")
    return random_blocks(fmt.ggml_type, rows, cols, seed=0), None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", default="Q4_1")
    p.add_argument("--rows", type=int, default=6144)
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--tokens", default="1,2,3,4,8,12")
    args = p.parse_args()
    fmt = K.BY_NAME[args.format]
    w, s = weights(fmt, args.rows, args.cols)
    times = []
    for T in (int(t) for t in args.tokens.split(",")):
        x = np.random.default_rng(1).standard_normal((T, args.cols)).astype(np.float32)
        out = np.zeros((T, args.rows), np.float32)
        K.matmul(out, x, w, fmt, s)  # compile, or load the cache
        blocks = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(20):
                K.matmul(out, x, w, fmt, s)
            blocks.append((time.perf_counter() - start) / 20)
        times.append(f"{T}:{min(blocks) * 1e6:.0f}")
    print(f"{fmt.name} {args.rows} x {args.cols}, best of 5 x 20 calls, us per call by rows of x:", " ".join(times))


if __name__ == "__main__":
    main()
