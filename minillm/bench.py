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
from .loading.lora import combined, load_adapter, parse_lora_spec
from .options import Options


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run(
    model_dir: str | Path,
    dtype: str | None = None,
    prompt_tokens: int = 128,
    gen_tokens: int = 128,
    ctx: int | None = None,
    seed: int = 0,
    speculation: Options | None = None,
    prompt: list[int] | None = None,
    kv_dtype: str = "float32",
    lora: tuple[str, ...] = (),
    activations: int | None = None,
) -> dict:
    """Load, warm up, then time a prefill of `prompt_tokens` and `gen_tokens` greedy decode steps
    (of `prompt` when given: a text whose output repeats it shows what speculation gains). With
    `speculation` (Options whose speculative is set: its spec_* and draft_* fields), also the same
    greedy generation through the engine with and without it: tokens/s from the first token on,
    and the tokens proposed and accepted. lora: LoRA adapters ("[NAME=]PATH[:SCALE]") every step
    runs with, their updates summed (load_s includes reading them). activations: 16 or 8 bits
    against GGUF blocks run on integer products (None: each format's default)."""
    t0 = time.perf_counter()
    model = Model.load(model_dir, ctx=ctx, dtype=dtype, kv_dtype=kv_dtype, activations=activations)
    adapter = None
    if lora:
        adapter = combined([load_adapter(path, model.config, name, scale) for name, path, scale in map(parse_lora_spec, lora)])
        model.set_adapters([adapter])
    load_s = time.perf_counter() - t0
    V = model.config.vocab_size
    if prompt is None:
        prompt = np.random.default_rng(seed).integers(0, V, size=prompt_tokens)
    prompt = np.asarray(prompt, np.int64)
    prompt_tokens = len(prompt)

    t0 = time.perf_counter()  # first calls load (or compile) the kernels
    warm = model.new_cache()
    model.forward(prompt[: min(8, prompt_tokens)], warm, adapter=adapter)
    model.forward(prompt[:1], warm, adapter=adapter)
    warmup_s = time.perf_counter() - t0

    cache = model.new_cache()
    t0 = time.perf_counter()
    logits = model.forward(prompt, cache, adapter=adapter)
    token = int(np.argmax(logits))
    ttft_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    for _ in range(gen_tokens):
        token = int(np.argmax(model.forward([token], cache, adapter=adapter)))
    decode_s = time.perf_counter() - t0
    spec = {}
    if speculation is not None and speculation.speculative and gen_tokens > 1:
        spec = _speculative(model, model_dir, prompt.tolist(), gen_tokens, speculation, adapter)

    return {
        "model": str(model_dir),
        "dtype": model.dtype,
        "kv_dtype": model.kv_dtype,
        "activations": model.activations,
        "kv_bytes_per_token": model.kv_bytes_per_token,  # keys and values, every layer
        "ctx": model.ctx,
        "prompt_tokens": prompt_tokens,
        "gen_tokens": gen_tokens,
        "prefill_tok_s": prompt_tokens / ttft_s,
        "decode_tok_s": gen_tokens / decode_s if gen_tokens else None,
        "ttft_s": ttft_s,
        "load_s": load_s,
        "warmup_s": warmup_s,
        "weight_mb": model.weights.nbytes / 2**20,
        "lora": list(lora),
        "peak_rss_mb": peak_rss_mb(),
        **spec,
    }


def _speculative(model: Model, source, prompt: list[int], gen_tokens: int, speculation: Options, adapter=None) -> dict:
    """Greedy generation through the engine, plain and speculative, timed from the first token."""
    from .api import load_draft
    from .core.engine import Engine
    from .core.sampling import SamplingParams

    draft = load_draft(model, source, speculation) if speculation.speculative == "draft" else None

    def generate(options: Options, draft=None):
        engine = Engine(model, options, draft=draft)
        times, tokens = [], []
        for event in engine.submit(prompt, SamplingParams(temperature=0), gen_tokens, (), adapter=adapter):
            times.append(time.perf_counter())
            tokens.append(event.token)
        return (len(tokens) - 1) / (times[-1] - times[0]), tokens, engine.stats

    alone = speculation.replace(max_batch=1, cache_mb=0)
    plain_tok_s, plain, _ = generate(alone.replace(speculative=None, spec_tokens=None, spec_ngram=None, draft_model=None, draft_dtype=None))
    spec_tok_s, tokens, stats = generate(alone, draft)
    assert tokens == plain, "speculative decoding changed the text"
    return {"engine_decode_tok_s": plain_tok_s, "spec_decode_tok_s": spec_tok_s, "spec_speedup": spec_tok_s / plain_tok_s,
            "spec_draft_tokens": stats.spec_draft_tokens, "spec_accepted_tokens": stats.spec_accepted_tokens}
