"""Quantized GGUF accuracy, minillm against llama.cpp, on the same files, tokens and windows.

    python benchmarks/perplexity_vs_llamacpp.py [--texts tests/data/*.txt] [--ctx 256] [--stride 128]

For each GGUF of the default model (Q4_0, Q4_K_M and Q8_0 made by llama.cpp's quantizer from its
F32 GGUF, and the shipped Q4_1 file) and each choice of activations against its grouped layouts
(16 bits everywhere, 8 everywhere, 8 on one stored format only, and each format's default), it
reports:
- the perplexity over every text (their scored tokens pooled) and per text, and its increase over
  the engine's own float32 weights (minillm: the float32 import of the default model; llama.cpp:
  the F32 GGUF); the bar (#66) is llama.cpp's own increase + 0.5 points;
- minillm against the same file dequantized to float32 (imported) and run at float32: top-1
  agreement over every scored position, max abs logit difference.
Both engines score the very same token ids (minillm's tokenizer) in HF's sliding windows.
Writes benchmarks/perplexity_results.json. Not a test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

WORKER_LLAMA = r"""
import json, sys
import numpy as np
import llama_cpp as L
from minillm.compare import window_nll, windows
path, ids_file, ctx, stride = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
kv = sys.argv[5] if len(sys.argv) > 5 else None  # the KV cache's type (-ctk/-ctv): f32, f16, q8_0
ids = json.load(open(ids_file))
L.llama_backend_init()
model = L.llama_load_model_from_file(path.encode(), L.llama_model_default_params())
cp = L.llama_context_default_params()
cp.n_ctx = ctx; cp.n_batch = ctx; cp.n_ubatch = ctx; cp.n_threads = 2; cp.n_threads_batch = 2
if kv:
    cp.type_k = cp.type_v = {"f32": 0, "f16": 1, "q8_0": 8, "bf16": 30}[kv]  # ggml types (the bindings lack BF16's name)
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED  # a quantized V cache needs it
lctx = L.llama_init_from_model(model, cp)
V = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
mem = L.llama_get_memory(lctx)
total, count = 0.0, 0
for begin, end, n_targets in windows(len(ids), ctx, stride):
    window = ids[begin:end]
    L.llama_memory_clear(mem, True)
    batch = L.llama_batch_init(len(window), 0, 1)
    for i, t in enumerate(window):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 1
        batch.seq_id[i][0] = 0
    batch.n_tokens = len(window)
    if L.llama_decode(lctx, batch) != 0:
        raise SystemExit("llama_decode failed")
    logits = np.ctypeslib.as_array(L.llama_get_logits(lctx), shape=(len(window), V)).copy()
    L.llama_batch_free(batch)
    nll, n = window_nll(logits, window, n_targets)
    total, count = total + nll, count + n
print(json.dumps({"perplexity": float(np.exp(total / count)), "tokens_scored": count}))
"""


def minillm_run(model, texts, ctx, stride):
    """(summed NLL per text, scored tokens per text, logits of every window concatenated) of a
    loaded minillm Model over each text's token ids."""
    from minillm.compare import window_nll, windows

    nlls, counts, all_logits = [], [], []
    for ids in texts:
        total, count = 0.0, 0
        for begin, end, n_targets in windows(len(ids), ctx, stride):
            logits = model.forward(ids[begin:end], model.new_cache(), all_logits=True)
            nll, n = window_nll(logits, ids[begin:end], n_targets)
            total, count = total + nll, count + n
            all_logits.append(logits[len(logits) - n - 1 : len(logits) - 1])  # the scored predictions
        nlls.append(total)
        counts.append(count)
    return nlls, counts, np.concatenate(all_logits)


def llama_nll(path: Path, ids_files: list[Path], ctx: int, stride: int, kv: str | None = None) -> list[float]:
    """llama.cpp's summed NLL on each text's token ids, in the same windows; kv: its KV cache type
    (default its own, f16)."""
    nlls = []
    for ids_file in ids_files:
        out = subprocess.run([sys.executable, "-c", WORKER_LLAMA, str(path), str(ids_file), str(ctx), str(stride), *([kv] if kv else [])],
                             capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        nlls.append(float(np.log(row["perplexity"]) * row["tokens_scored"]))
    return nlls


def llama_perplexity(path: Path, ids_file: Path, ctx: int, stride: int, kv: str | None = None) -> float:
    """llama.cpp's perplexity on one text's token ids (benchmarks/kv_cache.py)."""
    out = subprocess.run([sys.executable, "-c", WORKER_LLAMA, str(path), str(ids_file), str(ctx), str(stride), *([kv] if kv else [])],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["perplexity"]


def perplexity(nlls, counts) -> float:
    return float(np.exp(sum(nlls) / sum(counts)))


def choices_for(path: Path) -> dict:
    """The activation choices worth scoring on a file: 16 and 8 everywhere, 8 on each of its
    regrouped formats alone, and each format's default (None)."""
    import gguf

    from minillm.kernels import formats as F

    stored = {F.BY_GGML_TYPE[int(t.tensor_type)].name for t in gguf.GGUFReader(path).tensors if int(t.tensor_type) in F.BY_GGML_TYPE}
    groupable = sorted(name for name in stored if F.BY_NAME[name].groupable)
    return {"16": 16, "8": 8, **{f"8 on {name}": {name: 8, **{o: 16 for o in groupable if o != name}} for name in groupable}, "default": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", nargs="+", default=[str(p) for p in sorted((ROOT / "tests" / "data").glob("*.txt"))])
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--stride", type=int, default=128)
    args = ap.parse_args()

    import bench_vs_llamacpp as bench

    from minillm.core.model import Model
    from minillm.core.tokenizer import Tokenizer
    from minillm.loading.default_model import default_model_dir, find_default_gguf
    from minillm.loading.gguf_import import import_gguf

    bench.ensure_llama_cpp()
    f32_dir = default_model_dir()
    f32_gguf = bench.to_gguf(f32_dir, "f32")
    files = {name: bench.quantized(f32_gguf, name) for name in ("Q4_0", "Q4_K_M", "Q8_0")}
    files["Q4_1 (shipped)"] = find_default_gguf()
    tokenizer = Tokenizer(f32_dir)
    texts = [tokenizer.encode(Path(t).read_text(encoding="utf-8")) for t in args.texts]
    tmp = Path(tempfile.mkdtemp())
    ids_files = []
    for i, ids in enumerate(texts):
        ids_files.append(tmp / f"ids{i}.json")
        ids_files[-1].write_text(json.dumps(ids))

    ours_nll, counts, _ = minillm_run(Model.load(f32_dir), texts, args.ctx, args.stride)
    theirs_nll = llama_nll(f32_gguf, ids_files, args.ctx, args.stride)
    ours_f32, theirs_f32 = perplexity(ours_nll, counts), perplexity(theirs_nll, counts)
    per_text = lambda nlls: {Path(t).name: float(np.exp(n / c)) for t, n, c in zip(args.texts, nlls, counts)}  # noqa: E731
    report = {"texts": {Path(t).name: c for t, c in zip(args.texts, counts)}, "ctx": args.ctx, "stride": args.stride,
              "float32": {"minillm": ours_f32, "llama.cpp": theirs_f32, "minillm_per_text": per_text(ours_nll), "llama.cpp_per_text": per_text(theirs_nll)},
              "files": {}}
    print(f"{len(texts)} texts, {sum(counts)} scored tokens, windows of {args.ctx} every {args.stride}")
    print(f"float32 weights: minillm {ours_f32:.4f}, llama.cpp (F32 GGUF) {theirs_f32:.4f}")
    for name, path in files.items():
        with tempfile.TemporaryDirectory() as dq:  # the same file dequantized to float32
            _, _, ref_logits = minillm_run(Model.load(import_gguf(path, Path(dq) / "m", progress=False)), texts, args.ctx, args.stride)
        theirs_nlls = llama_nll(path, ids_files, args.ctx, args.stride)
        theirs = perplexity(theirs_nlls, counts)
        row = {"llama.cpp": theirs, "llama.cpp_increase": theirs / theirs_f32 - 1, "llama.cpp_per_text": per_text(theirs_nlls),
               "positions": len(ref_logits), "minillm": {}}
        # each text's bar: llama.cpp's increase on that text over its float32 there, + 0.5 points
        bars = {t: row["llama.cpp_per_text"][t] / report["float32"]["llama.cpp_per_text"][t] - 1 + 0.005 for t in row["llama.cpp_per_text"]}
        print(f"{name}: llama.cpp {theirs:.4f} ({row['llama.cpp_increase'] * 100:+.2f}% over its float32; minillm's bar "
              f"{(row['llama.cpp_increase'] + 0.005) * 100:+.2f}%)")
        for label, activations in choices_for(path).items():
            nlls, _, logits = minillm_run(Model.load(path, activations=activations), texts, args.ctx, args.stride)
            ours = perplexity(nlls, counts)
            choice = {"perplexity": ours, "increase": ours / ours_f32 - 1, "per_text": per_text(nlls),
                      "top1_vs_dequantized": float((logits.argmax(-1) == ref_logits.argmax(-1)).mean()),
                      "max_abs_vs_dequantized": float(np.abs(logits - ref_logits).max()),
                      "within_bar": ours / ours_f32 - 1 <= row["llama.cpp_increase"] + 0.005}
            choice["texts_within_bar"] = sum(choice["per_text"][t] / report["float32"]["minillm_per_text"][t] - 1 <= bar for t, bar in bars.items())
            row["minillm"][label] = choice
            print(f"  minillm, activations {label}: {ours:.4f} ({choice['increase'] * 100:+.2f}%, "
                  f"{'within' if choice['within_bar'] else 'OVER'} the bar; each text's: {choice['texts_within_bar']} of {len(bars)}); vs the dequantized file top-1 "
                  f"{choice['top1_vs_dequantized'] * 100:.1f}% of {row['positions']}, max abs {choice['max_abs_vs_dequantized']:.2g}", flush=True)
        report["files"][name] = row
    (ROOT / "benchmarks" / "perplexity_results.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
