"""4-bit GGUF accuracy, minillm against llama.cpp, on the same files, tokens and windows.

    python benchmarks/perplexity_vs_llamacpp.py [--file tests/data/lighthouse.txt] [--ctx 256] [--stride 128]

For each GGUF of the default model (Q4_0 and Q4_K_M made by llama.cpp's quantizer from its F32
GGUF, and the shipped Q4_1 file) it reports:
- minillm running the file as stored against the same file dequantized to float32 (imported) and
  run at float32: top-1 agreement over every scored position, max abs logit difference; with
  16-bit activations (the default) and with 8-bit ones (`--activations 8`, llama.cpp's numerics);
- the perplexity of each engine on the file and on the float32 weights (minillm: the float32
  import of the default model; llama.cpp: the F32 GGUF), and the increase the 4-bit file costs.
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


def minillm_run(model, ids, ctx, stride):
    """(perplexity, logits of every window concatenated) of a loaded minillm Model."""
    from minillm.compare import window_nll, windows

    total, count, all_logits = 0.0, 0, []
    for begin, end, n_targets in windows(len(ids), ctx, stride):
        logits = model.forward(ids[begin:end], model.new_cache(), all_logits=True)
        nll, n = window_nll(logits, ids[begin:end], n_targets)
        total, count = total + nll, count + n
        all_logits.append(logits[len(logits) - n - 1 : len(logits) - 1])  # the scored predictions
    return float(np.exp(total / count)), np.concatenate(all_logits)


def llama_perplexity(path: Path, ids_file: Path, ctx: int, stride: int, kv: str | None = None) -> float:
    """llama.cpp's perplexity on the same token ids and windows; kv: its KV cache type (default its own, f16)."""
    out = subprocess.run([sys.executable, "-c", WORKER_LLAMA, str(path), str(ids_file), str(ctx), str(stride), *([kv] if kv else [])],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["perplexity"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", default=str(ROOT / "tests" / "data" / "lighthouse.txt"))
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
    files = {"Q4_0": bench.quantized(f32_gguf, "Q4_0"), "Q4_K_M": bench.quantized(f32_gguf, "Q4_K_M"), "Q4_1 (shipped)": find_default_gguf()}
    ids = Tokenizer(f32_dir).encode(Path(args.file).read_text(encoding="utf-8"))
    ids_file = Path(tempfile.mkdtemp()) / "ids.json"
    ids_file.write_text(json.dumps(ids))

    ours_f32, _ = minillm_run(Model.load(f32_dir), ids, args.ctx, args.stride)
    theirs_f32 = llama_perplexity(f32_gguf, ids_file, args.ctx, args.stride)
    report = {"file": args.file, "tokens": len(ids), "ctx": args.ctx, "stride": args.stride,
              "float32": {"minillm": ours_f32, "llama.cpp": theirs_f32}, "files": {}}
    print(f"{args.file}: {len(ids)} tokens, windows of {args.ctx} every {args.stride}")
    print(f"float32 weights: minillm {ours_f32:.4f}, llama.cpp (F32 GGUF) {theirs_f32:.4f}")
    for name, path in files.items():
        ours, logits = minillm_run(Model.load(path), ids, args.ctx, args.stride)
        ours8, logits8 = minillm_run(Model.load(path, activations=8), ids, args.ctx, args.stride)
        with tempfile.TemporaryDirectory() as tmp:  # the same file dequantized to float32
            dequantized, ref_logits = minillm_run(Model.load(import_gguf(path, Path(tmp) / "m", progress=False)), ids, args.ctx, args.stride)
        theirs = llama_perplexity(path, ids_file, args.ctx, args.stride)
        row = {
            "top1_vs_dequantized": float((logits.argmax(-1) == ref_logits.argmax(-1)).mean()),
            "max_abs_vs_dequantized": float(np.abs(logits - ref_logits).max()),
            "positions": len(logits),
            "minillm": ours, "minillm_dequantized_float32": dequantized, "llama.cpp": theirs,
            "minillm_increase": ours / ours_f32 - 1, "llama.cpp_increase": theirs / theirs_f32 - 1,
            "minillm_8bit": ours8, "minillm_8bit_increase": ours8 / ours_f32 - 1,
            "top1_8bit_vs_dequantized": float((logits8.argmax(-1) == ref_logits.argmax(-1)).mean()),
            "max_abs_8bit_vs_dequantized": float(np.abs(logits8 - ref_logits).max()),
        }
        report["files"][name] = row
        print(f"{name}: minillm {ours:.4f} ({row['minillm_increase'] * 100:+.2f}% over float32), "
              f"llama.cpp {theirs:.4f} ({row['llama.cpp_increase'] * 100:+.2f}%); minillm vs the dequantized file at "
              f"float32: top-1 {row['top1_vs_dequantized'] * 100:.1f}% of {row['positions']}, max abs {row['max_abs_vs_dequantized']:.2g}; "
              f"8-bit activations {ours8:.4f} ({row['minillm_8bit_increase'] * 100:+.2f}%), top-1 {row['top1_8bit_vs_dequantized'] * 100:.1f}%, "
              f"max abs {row['max_abs_8bit_vs_dequantized']:.2g}")
    (ROOT / "benchmarks" / "perplexity_results.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
