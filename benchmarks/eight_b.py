"""An 8B model of our own against llama.cpp: a random Llama-3.1-8B-shaped GGUF written straight
into blocks (no 16 GB float checkpoint needed), then minillm and llama.cpp on the very same file,
alternating, each run a fresh process.

    python benchmarks/eight_b.py [--quants Q4_0,Q4_K_M,Q8_0] [--rounds 5] [--threads 2] [--activations 16,8]
    python benchmarks/eight_b.py --write-only          # just the files, benchmarks/.cache/random-8b-*.gguf
    NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=... python benchmarks/eight_b.py   # minillm as an AVX2 CPU runs it

Per engine, medians over the rounds of: prefill of 512 tokens, decode of 32 tokens after 128,
launch to first token (loading the file, then the 128-token prompt's first token: a fresh
process's load_s + ttft_s) and peak RSS; minillm once per --activations. Each round also samples
the machine's read bandwidth (bench_vs_llamacpp's parallel row sums over 2 GB, --threads threads),
and decode is reported as a share of it: tok/s x the bytes a decode step reads (every tensor of the
file but the token embeddings, of which it reads one row), per round against that round's sample.
Writes benchmarks/eight_b_results.<target>.json (the CPU name minillm compiled for: znver3
natively on a Zen 3, haswell under NUMBA_CPU_NAME=haswell), after each file.
Benchmarks are not tests.

The files: Llama 3.1 8B's shape (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336,
vocab 128256), random levels with scales of weights ~0.02, a SentencePiece-style vocabulary of
128256 pieces (the ids are what both engines read). Each tensor's type as llama.cpp's quantizer
picks it for that file type: Q4_0 and Q8_0 every matrix but the output (Q6_K for Q4_0, as
llama.cpp's); Q4_K_M Q4_K, with Q6_K for attn_v and ffn_down in llama.cpp's "more bits" layers and
for the output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]
import bench_vs_llamacpp as bench  # noqa: E402  (its llama.cpp worker and minillm runner)

SHAPE = {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "intermediate": 14336, "vocab": 128256}
CACHE = ROOT / "benchmarks" / ".cache"


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_types(quant: str, layers: int):
    """(name, rows, cols, ggml type name) of every matrix of the file, in order."""
    from gguf import GGMLQuantizationType as QT

    H, I, V = SHAPE["hidden"], SHAPE["intermediate"], SHAPE["vocab"]
    kv = H // SHAPE["heads"] * SHAPE["kv_heads"]
    base = {"Q4_0": QT.Q4_0, "Q8_0": QT.Q8_0, "Q4_K_M": QT.Q4_K}[quant]
    out_type = {"Q4_0": QT.Q6_K, "Q8_0": QT.Q8_0, "Q4_K_M": QT.Q6_K}[quant]
    yield "token_embd.weight", V, H, base
    for i in range(layers):
        richer = QT.Q6_K if quant == "Q4_K_M" and more_bits(i, layers) else base
        for name, rows, cols, qtype in (("attn_q", H, H, base), ("attn_k", kv, H, base), ("attn_v", kv, H, richer), ("attn_output", H, H, base),
                                        ("ffn_gate", I, H, base), ("ffn_up", I, H, base), ("ffn_down", H, I, richer)):
            yield f"blk.{i}.{name}.weight", rows, cols, qtype
    yield "output.weight", V, H, out_type


def write_random_8b(quant: str, layers: int = SHAPE["layers"]) -> Path:
    """benchmarks/.cache/random-8b-QUANT.gguf, written once (to a temporary name, then renamed)."""
    import gguf
    from gguf_tiny import make_vocab, random_blocks

    path = CACHE / f"random-8b-{quant}.gguf" if layers == SHAPE["layers"] else CACHE / f"random-8b-{layers}l-{quant}.gguf"
    if path.exists():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    print(f"writing {path.name} ...", flush=True)
    H = SHAPE["hidden"]
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_context_length(8192)
    w.add_embedding_length(H)
    w.add_block_count(layers)
    w.add_feed_forward_length(SHAPE["intermediate"])
    w.add_head_count(SHAPE["heads"])
    w.add_head_count_kv(SHAPE["kv_heads"])
    w.add_rope_dimension_count(H // SHAPE["heads"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(SHAPE["vocab"])
    w.add_file_type({"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15}[quant])  # llama.cpp's LLAMA_FTYPE_MOSTLY_*
    vocab = make_vocab(SHAPE["vocab"], "spm")
    w.add_tokenizer_model(vocab["model"])
    w.add_token_list(vocab["tokens"])
    w.add_token_scores(vocab["scores"])
    w.add_token_types(vocab["types"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    w.add_unk_token_id(vocab["unk"])
    matrices = list(tensor_types(quant, layers))
    norms = ["output_norm.weight"] + [f"blk.{i}.{n}.weight" for i in range(layers) for n in ("attn_norm", "ffn_norm")]
    sizes = gguf.GGML_QUANT_SIZES
    for name, rows, cols, qtype in matrices:
        block, size = sizes[qtype]
        w.add_tensor_info(name, (rows, cols // block * size), np.dtype(np.uint8), rows * cols // block * size, raw_dtype=qtype)
    for name in norms:
        w.add_tensor_info(name, (H,), np.dtype(np.float32), H * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for seed, (name, rows, cols, qtype) in enumerate(matrices):
        w.write_tensor_data(random_blocks(qtype, rows, cols, seed=seed))
    for name in norms:
        w.write_tensor_data(np.ones(H, np.float32))
    w.close()
    tmp.rename(path)
    return path


def decode_bytes(path: Path) -> int:
    """The bytes one decode step reads of the file: every tensor but the token embeddings."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if t.name != "token_embd.weight")


def measure(path: Path, widths: list[int], rounds: int, threads: int) -> dict:
    """Every run's figures per engine ("minillm a16", "minillm a8", "llama.cpp"), alternating, and
    the read bandwidth sampled at the start of each round ("bandwidth_gb_s")."""
    engines = [f"minillm a{a}" for a in widths] + ["llama.cpp"]
    figures = {e: {"prefill512": [], "decode32@128": [], "launch_to_first_token_s": [], "peak_rss_mb": []} for e in engines}
    figures["bandwidth_gb_s"] = []
    for r in range(rounds):
        figures["bandwidth_gb_s"].append(bench.bandwidth_gb_s(threads))
        print(f"  round {r + 1}: read bandwidth {figures['bandwidth_gb_s'][-1]:.1f} GB/s", flush=True)
        for engine in engines if r % 2 == 0 else engines[::-1]:
            if engine == "llama.cpp":
                run = lambda P, G: bench.run_llama(path, P, G, threads)
            else:
                run = lambda P, G, a=int(engine.split("a")[-1]): bench.run_minillm(path, None, P, G, threads, a)
            short = run(128, 32)
            long = run(512, 0)
            f = figures[engine]
            f["decode32@128"].append(short["decode_tok_s"])
            f["launch_to_first_token_s"].append(short["load_s"] + short["ttft_s"])
            f["prefill512"].append(long["prefill_tok_s"])
            f["peak_rss_mb"].append(max(short["peak_rss_mb"], long["peak_rss_mb"]))
            print(f"  round {r + 1} {engine}: prefill {long['prefill_tok_s']:.1f} tok/s, decode {short['decode_tok_s']:.2f} tok/s, "
                  f"first token {f['launch_to_first_token_s'][-1]:.1f} s, peak RSS {f['peak_rss_mb'][-1]:.0f} MB", flush=True)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quants", default="Q4_0,Q4_K_M,Q8_0")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--activations", default="16,8", help="minillm run at each (comma-separated)")
    ap.add_argument("--layers", type=int, default=SHAPE["layers"], help="fewer layers: a quicker, smaller file of the same matrices")
    ap.add_argument("--write-only", action="store_true")
    args = ap.parse_args()
    quants = args.quants.split(",")
    paths = {q: write_random_8b(q, args.layers) for q in quants}
    if args.write_only:
        return
    bench.ensure_llama_cpp()
    from minillm.kernels import target

    widths = [int(a) for a in args.activations.split(",")]
    out = ROOT / "benchmarks" / f"eight_b_results.{target.target_name()}.json"
    results = {"date": time.strftime("%Y-%m-%d"), "minillm_target": target.describe(), "rounds": args.rounds, "threads": args.threads,
               "layers": args.layers, "files": {}}
    for quant, path in paths.items():
        print(f"{path.name} ({path.stat().st_size / 1e9:.2f} GB), {args.rounds} rounds, {args.threads} threads", flush=True)
        figures = measure(path, widths, args.rounds, args.threads)
        bandwidth = figures.pop("bandwidth_gb_s")
        step_gb = decode_bytes(path) / 1e9
        for f in figures.values():  # per round, against that round's bandwidth
            f["decode_bandwidth_share"] = [tok_s * step_gb / bw for tok_s, bw in zip(f["decode32@128"], bandwidth)]
        medians = {e: {m: statistics.median(v) for m, v in f.items()} for e, f in figures.items()}
        results["files"][quant] = {"medians": medians, "runs": figures, "bandwidth_gb_s": bandwidth, "decode_step_gb": step_gb}
        theirs = medians["llama.cpp"]
        print(f"  read bandwidth median {statistics.median(bandwidth):.1f} GB/s; a decode step reads {step_gb:.2f} GB; "
              f"llama.cpp decode at {theirs['decode_bandwidth_share']:.0%} of it", flush=True)
        for engine, mine in medians.items():
            if engine != "llama.cpp":
                print(f"  {engine} / llama.cpp: prefill {mine['prefill512'] / theirs['prefill512']:.2f}x, decode "
                      f"{mine['decode32@128'] / theirs['decode32@128']:.2f}x ({mine['decode_bandwidth_share']:.0%} of the bandwidth), "
                      f"first token {mine['launch_to_first_token_s']:.1f} vs {theirs['launch_to_first_token_s']:.1f} s, "
                      f"peak RSS {mine['peak_rss_mb'] / theirs['peak_rss_mb']:.2f}x", flush=True)
        out.write_text(json.dumps(results, indent=2) + "\n")  # after each file: an hour's run keeps what it measured


if __name__ == "__main__":
    main()
