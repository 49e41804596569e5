"""The KV cache's formats (`--kv-dtype`): what each costs in accuracy and gains in memory and speed,
minillm against llama.cpp at the same KV type on the same file.

    python benchmarks/kv_cache.py accuracy [--files TEXT ...] [--ctx 1024] [--stride 512]
    python benchmarks/kv_cache.py speed [--model GGUF] [--depths 1024 8192] [--rounds 5] [--kv q8_0 ...]
    python benchmarks/kv_cache.py deep [--model GGUF] [--depth 32768] [--rounds 5] [--kv float16]

accuracy: perplexity of the default model (its F32 GGUF, so only the cache's rounding differs)
at each KV format in both engines, over the same token ids and HF-style sliding windows, and each
engine's increase over its own float32 cache. llama.cpp runs with flash attention (its quantized V
cache needs it), its cache types f32, f16 and q8_0 (-ctk/-ctv). A third column is transformers
(float32, the same windows) with its keys and values rounded to the format as they enter attention,
as minillm stores them; and for q8_0 a fourth, transformers rounded llama.cpp's way (queries to
Q8_0 as well, keys in the GGUF file's interleaved order, levels rounded half to even). Two engines
that round the same values the same way differ only by float32 noise (5e-5 in the logits), so the
distance between them says how much of an increase is noise on that text.

speed: for each depth P and KV type, a prefill of P random tokens then 32 greedy decode steps,
in each engine in turn (alternating, fresh processes), 2 threads; medians and minillm/llama.cpp
ratios of the prefill and decode tokens/s and of peak RSS. Default model: the 1.2B shape at
Q4_0 (bench_vs_llamacpp.random_1b).

deep: decode at a depth too long to prefill once per round (llama.cpp's 32k prefill takes most of an
hour here): one long-lived process per engine prefills the P random tokens once (timed: one
prefill each), then the rounds alternate between them, each decoding 32 greedy tokens from that
state and taking them back out of the cache (minillm: the cache's length; llama.cpp:
llama_memory_seq_rm), so every round times the same work; then each reports its peak RSS.

Writes benchmarks/kv_results.json (merged by mode). Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_vs_llamacpp as bench  # noqa: E402
from perplexity_vs_llamacpp import llama_perplexity, minillm_run  # noqa: E402
from perplexity_vs_llamacpp import perplexity as pooled_perplexity  # noqa: E402

RESULTS = ROOT / "benchmarks" / "kv_results.json"
# minillm's KV format -> llama.cpp's cache type of the same precision (bfloat16 has none there)
LLAMA_KV = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "q8_0": "q8_0"}
DEFAULT_TEXTS = [ROOT / "tests" / "data" / "lighthouse.txt", Path("/usr/share/common-licenses/GPL-3")]
DECODE_STEPS = 32


class RoundedAttention:
    """transformers' SDPA attention over queries, keys and values rounded to a KV format on their
    way in (a registered attention function; `scheme` None leaves them as they are)."""

    def __init__(self):
        import torch
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self.torch, self.scheme = torch, None
        AttentionInterface.register("kv_rounded", lambda *a, **kw: sdpa_attention_forward(*self._round(*a), **kw))

    def _round(self, module, query, key, value, mask):
        if self.scheme is None:
            return module, query, key, value, mask
        kv, llama_way = self.scheme
        torch = self.torch
        if kv in ("float16", "bfloat16"):
            dtype = getattr(torch, kv)
            return module, query, key.to(dtype).float(), value.to(dtype).float(), mask
        hd = key.shape[-1]  # llama.cpp's K rows pair dimension i with i + hd/2 (its RoPE layout)
        order = torch.stack([torch.arange(hd // 2), torch.arange(hd // 2) + hd // 2], 1).reshape(-1)
        back = torch.argsort(order)

        def q8_0(x, reorder):
            x = x[..., order] if reorder else x
            blocks = x.reshape(*x.shape[:-1], hd // 32, 32)
            amax = blocks.abs().amax(-1, keepdim=True)
            d = amax / 127
            if llama_way:  # ggml's AVX quantize_row_q8_0: x * (127 / amax), rounded to nearest even
                levels = torch.round(blocks * torch.where(amax > 0, 127 / amax, 0))
            else:  # quantize_row_q8_0_ref (and minillm): x / d, rounded half away from zero
                v = blocks * torch.where(d > 0, 1 / d, 0)
                levels = torch.sign(v) * torch.floor(v.abs() + 0.5)
            x = (levels * d.half().float()).reshape(x.shape)
            return x[..., back] if reorder else x

        query = q8_0(query, True) if llama_way else query
        return module, query, q8_0(key, llama_way), q8_0(value, False), mask


def transformers_perplexity(model, rounding: RoundedAttention, scheme, ids, ctx: int, stride: int) -> float:
    from minillm.compare import hf_window_scorer, perplexity

    rounding.scheme = scheme
    return perplexity(hf_window_scorer(model), ids, ctx, stride)["perplexity"]


def accuracy(args) -> dict:
    from minillm.core.model import Model
    from minillm.core.tokenizer import Tokenizer
    from minillm.loading.default_model import default_model_dir

    bench.ensure_llama_cpp()
    f32_dir = default_model_dir()
    gguf = bench.to_gguf(f32_dir, "f32")
    tokenizer = Tokenizer(f32_dir)
    from transformers import AutoModelForCausalLM

    rounding = RoundedAttention()
    hf = AutoModelForCausalLM.from_pretrained(f32_dir, dtype="float32", attn_implementation="kv_rounded").eval()
    report = {"model": gguf.name, "ctx": args.ctx, "stride": args.stride, "texts": {}}
    for text in map(Path, args.files):
        if not text.exists():
            print(f"{text}: missing, skipped")
            continue
        ids = tokenizer.encode(text.read_text(encoding="utf-8"))
        ids_file = Path(tempfile.mkdtemp()) / "ids.json"
        ids_file.write_text(json.dumps(ids))
        ctx = min(args.ctx, len(ids))
        rows = {}
        for kv in args.kv:
            model = Model.load(gguf, ctx=ctx, kv_dtype=kv)
            ours = pooled_perplexity(*minillm_run(model, [ids], ctx, args.stride)[:2])
            try:
                theirs = llama_perplexity(gguf, ids_file, ctx, args.stride, LLAMA_KV[kv])
            except Exception as e:  # a cache type this llama.cpp build refuses
                print(f"llama.cpp with KV {LLAMA_KV[kv]}: {str(e)[-200:]}")
                theirs = None
            rows[kv] = {"minillm": ours, "llama.cpp": theirs,
                        "transformers": transformers_perplexity(hf, rounding, None if kv == "float32" else (kv, False), ids, ctx, args.stride)}
            if kv == "q8_0":
                rows[kv]["transformers_llama_way"] = transformers_perplexity(hf, rounding, (kv, True), ids, ctx, args.stride)
        for kv, row in rows.items():
            cells = []
            for engine in [name for name in ("minillm", "llama.cpp", "transformers", "transformers_llama_way") if name in row]:
                value = row[engine]
                base = rows["float32"]["transformers" if engine == "transformers_llama_way" else engine]
                row[f"{engine}_increase"] = None if value is None else value / base - 1
                cells.append(f"{engine} " + ("-" if value is None else f"{value:.4f} ({row[f'{engine}_increase'] * 100:+.3f}%)"))
            print(f"{text.name} ({len(ids)} tokens) KV {kv:9s} " + "  ".join(cells))
        report["texts"][text.name] = {"tokens": len(ids), "by_kv": rows}
    return report


def speed(args) -> dict:
    model = Path(args.model) if args.model else None
    if model is None:
        bench.ensure_llama_cpp()
        model = bench.quantized(bench.to_gguf(bench.random_1b(), "bf16"), "Q4_0")
    threads = 2
    samples: dict = {}
    for depth in args.depths:
        ctx = bench.context_size(depth, DECODE_STEPS)
        for kv in args.kv:
            for r in range(args.rounds):
                for engine in ("minillm", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "minillm"):
                    if engine == "minillm":
                        env = dict(os.environ, NUMBA_NUM_THREADS=str(threads))
                        out = bench.last_json(bench.sh([sys.executable, str(ROOT / "cli.py"), "bench", "--model", str(model), "--prompt-tokens", str(depth),
                                                        "--gen-tokens", str(DECODE_STEPS), "--ctx", str(ctx), "--kv-dtype", kv, "--json"], env=env))
                    else:
                        out = bench.last_json(bench.sh([sys.executable, "-c", bench.WORKER_LLAMA, str(model), str(depth), str(DECODE_STEPS), str(threads),
                                                        str(ctx), LLAMA_KV[kv]]))
                    cell = samples.setdefault(f"{depth}/{kv}", {}).setdefault(engine, {"prefill": [], "decode": [], "rss": []})
                    cell["prefill"].append(out["prefill_tok_s"])
                    cell["decode"].append(out["decode_tok_s"])
                    cell["rss"].append(out["peak_rss_mb"])
                    if engine == "minillm":
                        cell.setdefault("kv_bytes_per_token", out["kv_bytes_per_token"])
                    print(f"depth {depth} KV {kv} round {r + 1} {engine}: prefill {out['prefill_tok_s']:.1f} tok/s, decode {out['decode_tok_s']:.2f} tok/s, "
                          f"peak RSS {out['peak_rss_mb']:.0f} MiB", flush=True)
    table = {}
    for key, cell in samples.items():
        med = {e: {k: statistics.median(v) for k, v in c.items() if isinstance(v, list)} for e, c in cell.items()}
        table[key] = {"medians": med, "prefill_ratio": med["minillm"]["prefill"] / med["llama.cpp"]["prefill"],
                      "decode_ratio": med["minillm"]["decode"] / med["llama.cpp"]["decode"],
                      "rss_minus_llama_mb": med["minillm"]["rss"] - med["llama.cpp"]["rss"],
                      "kv_bytes_per_token": cell["minillm"].get("kv_bytes_per_token"), "rounds": args.rounds}
        print(f"{key}: prefill {table[key]['prefill_ratio']:.2f}x, decode {table[key]['decode_ratio']:.2f}x llama.cpp; "
              f"peak RSS {med['minillm']['rss']:.0f} vs {med['llama.cpp']['rss']:.0f} MiB")
    return {"model": model.name, "threads": threads, "decode_steps": DECODE_STEPS, "samples": samples, "table": table}


WORKER_MINILLM_DEEP = r"""
import json, sys, time
import numpy as np
from minillm.bench import peak_rss_mb
from minillm.core.model import Model
path, P, G, ctx, kv = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
model = Model.load(path, ctx=ctx, kv_dtype=kv)
prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, size=P)
cache = model.new_cache()
model.forward(prompt[:8], cache); model.forward(prompt[:1], cache); cache.length = 0  # warm-up
t0 = time.perf_counter()
first = int(np.argmax(model.forward(prompt, cache)))
print(json.dumps({"prefill_tok_s": P / (time.perf_counter() - t0)}), flush=True)
for line in sys.stdin:
    token, t0 = first, time.perf_counter()
    for _ in range(G):
        token = int(np.argmax(model.forward([token], cache)))
    seconds = time.perf_counter() - t0
    cache.length = P  # the decoded positions taken back out
    print(json.dumps({"decode_tok_s": G / seconds, "peak_rss_mb": peak_rss_mb()}), flush=True)
"""

# llama.cpp's worker for deep: its bench worker's setup and warm-up, then one prefill and decode
# rounds on request
_TIMED = "t0 = time.perf_counter()\ntoken = int("  # where the bench worker's timed part starts
assert _TIMED in bench.WORKER_LLAMA
WORKER_LLAMA_DEEP = bench.WORKER_LLAMA.split(_TIMED)[0] + r"""
t0 = time.perf_counter()
first = int(np.argmax(decode(prompt)))
print(json.dumps({"prefill_tok_s": P / (time.perf_counter() - t0)}), flush=True)
import resource
for line in sys.stdin:
    token, t0 = first, time.perf_counter()
    for _ in range(G):
        token = int(np.argmax(decode([token])))
    seconds = time.perf_counter() - t0
    L.llama_memory_seq_rm(mem, 0, P, -1)  # the decoded positions taken back out
    print(json.dumps({"decode_tok_s": G / seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)
"""


def deep(args) -> dict:
    model = Path(args.model) if args.model else None
    if model is None:
        bench.ensure_llama_cpp()
        model = bench.quantized(bench.to_gguf(bench.random_1b(), "bf16"), "Q4_0")
    threads, P = 2, args.depth
    ctx = bench.context_size(P, DECODE_STEPS)
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    commands = {"minillm": [sys.executable, "-c", WORKER_MINILLM_DEEP, str(model), str(P), str(DECODE_STEPS), str(ctx), args.kv],
                "llama.cpp": [sys.executable, "-c", WORKER_LLAMA_DEEP, str(model), str(P), str(DECODE_STEPS), str(threads), str(ctx), LLAMA_KV[args.kv]]}
    workers, cells = {}, {}
    try:
        for engine, cmd in commands.items():  # one prefill at a time: each has the cores to itself
            workers[engine] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            out = json.loads(workers[engine].stdout.readline())
            cells[engine] = {"prefill": out["prefill_tok_s"], "decode": [], "rss": None}
            print(f"depth {P} KV {args.kv} {engine}: prefill {out['prefill_tok_s']:.1f} tok/s", flush=True)
        for r in range(args.rounds):
            for engine in ("minillm", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "minillm"):
                workers[engine].stdin.write("decode\n")
                workers[engine].stdin.flush()
                out = json.loads(workers[engine].stdout.readline())
                cells[engine]["decode"].append(out["decode_tok_s"])
                cells[engine]["rss"] = out["peak_rss_mb"]
                print(f"depth {P} KV {args.kv} round {r + 1} {engine}: decode {out['decode_tok_s']:.2f} tok/s", flush=True)
    finally:
        for w in workers.values():
            w.kill()
    med = {e: statistics.median(c["decode"]) for e, c in cells.items()}
    result = {"model": model.name, "threads": threads, "depth": P, "kv": args.kv, "rounds": args.rounds, "decode_steps": DECODE_STEPS,
              "cells": cells, "decode_ratio": med["minillm"] / med["llama.cpp"],
              "prefill_ratio": cells["minillm"]["prefill"] / cells["llama.cpp"]["prefill"],
              "rss_minus_llama_mb": cells["minillm"]["rss"] - cells["llama.cpp"]["rss"]}
    print(f"depth {P} KV {args.kv}: decode {med['minillm']:.2f} / {med['llama.cpp']:.2f} = {result['decode_ratio']:.2f}x "
          f"(medians of {args.rounds}); prefill (one each) {result['prefill_ratio']:.2f}x; peak RSS {cells['minillm']['rss']:.0f} vs "
          f"{cells['llama.cpp']['rss']:.0f} MiB")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    acc = sub.add_parser("accuracy")
    acc.add_argument("--files", nargs="+", default=[str(p) for p in DEFAULT_TEXTS])
    acc.add_argument("--ctx", type=int, default=1024)
    acc.add_argument("--stride", type=int, default=512)
    acc.add_argument("--kv", nargs="+", default=["float32", "float16", "bfloat16", "q8_0"])
    sp = sub.add_parser("speed")
    sp.add_argument("--model", help="a GGUF file (default: the 1.2B shape at Q4_0)")
    sp.add_argument("--depths", nargs="+", type=int, default=[1024, 8192])
    sp.add_argument("--rounds", type=int, default=5)
    sp.add_argument("--kv", nargs="+", default=["float16", "q8_0"])
    dp = sub.add_parser("deep")
    dp.add_argument("--model", help="a GGUF file (default: the 1.2B shape at Q4_0)")
    dp.add_argument("--depth", type=int, default=32768)
    dp.add_argument("--rounds", type=int, default=5)
    dp.add_argument("--kv", default="float16", choices=list(LLAMA_KV))
    args = ap.parse_args()
    report = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.mode == "accuracy":
        report["accuracy"] = accuracy(args)
    elif args.mode == "deep":
        report.setdefault("deep", {})[f"{args.depth}/{args.kv}"] = deep(args)
    else:  # depths and cache types measured in separate runs gather under one model
        result, earlier = speed(args), report.get("speed", {})
        if earlier.get("model") == result["model"]:
            for key in ("samples", "table"):
                result[key] = {**earlier[key], **result[key]}
        report["speed"] = result
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
