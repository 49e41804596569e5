"""`cli.py bench`: prefill and decode speed of one model at one precision, in this process.

One invocation is one sample; benchmarks/ runs many, alternating with llama.cpp, and reports
medians and ratios (single absolute times on a shared machine mean little).
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import numpy as np

from .core.model import Model


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run(
    model_dir: str | Path,
    dtype: str | None = None,
    prompt_tokens: int = 128,
    gen_tokens: int = 128,
    ctx: int | None = None,
    seed: int = 0,
) -> dict:
    """Load, warm up, then time a prefill of `prompt_tokens` and `gen_tokens` greedy decode steps."""
    t0 = time.perf_counter()
    model = Model.load(model_dir, ctx=ctx, dtype=dtype)
    load_s = time.perf_counter() - t0
    V = model.config.vocab_size
    prompt = np.random.default_rng(seed).integers(0, V, size=prompt_tokens)

    t0 = time.perf_counter()  # first calls load (or compile) the kernels
    warm = model.new_cache()
    model.forward(prompt[: min(8, prompt_tokens)], warm)
    model.forward(prompt[:1], warm)
    warmup_s = time.perf_counter() - t0

    cache = model.new_cache()
    t0 = time.perf_counter()
    logits = model.forward(prompt, cache)
    token = int(np.argmax(logits))
    ttft_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    for _ in range(gen_tokens):
        token = int(np.argmax(model.forward([token], cache)))
    decode_s = time.perf_counter() - t0

    return {
        "model": str(model_dir),
        "dtype": model.dtype,
        "prompt_tokens": prompt_tokens,
        "gen_tokens": gen_tokens,
        "prefill_tok_s": prompt_tokens / ttft_s,
        "decode_tok_s": gen_tokens / decode_s if gen_tokens else None,
        "ttft_s": ttft_s,
        "load_s": load_s,
        "warmup_s": warmup_s,
        "weight_mb": model.weights.nbytes / 2**20,
        "peak_rss_mb": peak_rss_mb(),
    }
