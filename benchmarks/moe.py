"""A mixture of experts, minillm against llama.cpp on the same GGUF files, side by side in one run.

    python benchmarks/moe.py [--rounds 5] [--threads 2] [--files Q4_0,Q4_K_M]
    python benchmarks/moe.py --arch gpt-oss        # --files MXFP4_MOE: gpt-oss as llama.cpp ships it
    python benchmarks/moe.py --arch qwen3moe-2b    # ~2B total: 32 experts, 4 active, 12 layers
    NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=... python benchmarks/moe.py ...   # minillm as an AVX2 CPU runs it

The qwen3moe shape is Qwen3-30B-A3B's with 16 layers and 64 experts: hidden 2048, 32 query heads
and 4 KV heads of 128, 64 experts of intermediate 768, top 8 renormalised, vocabulary 49152 (the
default model's tokenizer); ~5.3B parameters, ~0.5B of them active per token. qwen3moe-2b is the
same layers with 32 experts, top 4, 12 of them: ~2.2B parameters, ~0.55B active. The gpt-oss shape
is gpt-oss-20b's layers (hidden 2880, 64 query heads and 8 KV heads of 64, 32 experts of 2880,
top 4, biases, attention sinks, a 128-token window every other layer), 4 of them, vocabulary
49152; ~3.5B parameters, ~0.6B active. Random bfloat16 weights are written as the architecture's
checkpoint (Qwen3-MoE one expert per tensor, gpt-oss its stacked tensors, as on the Hub),
converted by llama.cpp's own convert_hf_to_gguf.py to a BF16 GGUF (experts stacked in
ffn_*_exps), and quantized by llama.cpp's quantizer (llama_model_quantize) to each of --files
(MXFP4_MOE: the experts MXFP4, the rest Q8_0, as llama.cpp's gpt-oss files).

The rounds are bench_vs_llamacpp.py's (`measure`): read bandwidth sampled, then minillm and
llama.cpp alternately, each in a fresh process, 2 threads: prefill of 128 and 512 tokens, 128
decode steps after a 128-token prompt, both engines' peak RSS. Prints medians and ratios (and the
rounds minillm was ahead) and writes benchmarks/moe_results.json (gpt-oss: moe_gpt_oss_results.json,
qwen3moe-2b: moe_2b_results.json; for another NUMBA_CPU_NAME, .<name> before .json).
Benchmarks are not tests: nothing here runs under pytest.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_llamacpp import CACHE, ROOT, ensure_llama_cpp, machine, measure, row_files, table  # noqa: E402

SHAPES = {"qwen3moe": dict(H=2048, L=16, nh=32, nkv=4, hd=128, E=64, k=8, I=768, V=49152),
          "qwen3moe-2b": dict(H=2048, L=12, nh=32, nkv=4, hd=128, E=32, k=4, I=768, V=49152),
          "gpt-oss": dict(H=2880, L=4, nh=64, nkv=8, hd=64, E=32, k=4, I=2880, V=49152, window=128)}
FILES = {"qwen3moe": "Q4_0,Q4_K_M", "qwen3moe-2b": "Q4_0,Q4_K_M", "gpt-oss": "MXFP4_MOE"}
RESULTS = {"qwen3moe": "moe_results", "qwen3moe-2b": "moe_2b_results", "gpt-oss": "moe_gpt_oss_results"}


def random_moe(arch: str) -> Path:
    """The random checkpoint of `arch` (bf16), written tensor by tensor (never 10 GB in memory)."""
    import numpy as np

    path = CACHE / f"{arch.replace('-', '')}-random"
    if (path / "config.json").exists():
        return path
    sys.path.insert(0, str(ROOT))
    from minillm.loading.default_model import default_model_dir

    s = SHAPES[arch]
    H, L, nh, nkv, hd, E, I, V = s["H"], s["L"], s["nh"], s["nkv"], s["hd"], s["E"], s["I"], s["V"]
    print(f"writing a random {arch} checkpoint ({L} layers, {E} experts, bf16) ...", flush=True)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                   p + "self_attn.q_proj.weight": (nh * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
                   p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd)}
        if arch == "gpt-oss":  # biases everywhere, sinks, the router, stacked experts (gate and up interleaved, transposed)
            shapes |= {p + "self_attn.q_proj.bias": (nh * hd,), p + "self_attn.k_proj.bias": (nkv * hd,),
                       p + "self_attn.v_proj.bias": (nkv * hd,), p + "self_attn.o_proj.bias": (H,), p + "self_attn.sinks": (nh,),
                       p + "mlp.router.weight": (E, H), p + "mlp.router.bias": (E,),
                       p + "mlp.experts.gate_up_proj": (E, H, 2 * I), p + "mlp.experts.gate_up_proj_bias": (E, 2 * I),
                       p + "mlp.experts.down_proj": (E, I, H), p + "mlp.experts.down_proj_bias": (E, H)}
            continue
        shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,), p + "mlp.gate.weight": (E, H)}
        for e in range(E):
            q = p + f"mlp.experts.{e}."
            shapes |= {q + "gate_proj.weight": (I, H), q + "up_proj.weight": (I, H), q + "down_proj.weight": (H, I)}
    rng = np.random.default_rng(0)

    def bf16(name, shape):
        if name.endswith("norm.weight"):  # norms: 1.0
            return np.full(shape, 0x3F80, np.uint16)
        w = (rng.standard_normal(shape, dtype=np.float32) * 0.02).view(np.uint32)
        return ((w + 0x7FFF + ((w >> 16) & 1)) >> 16).astype(np.uint16)

    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(tmp / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape in shapes.items():
            f.write(bf16(name, shape).tobytes())
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": V, "hidden_size": H,
        "intermediate_size": 6144, "moe_intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": nh,
        "num_key_value_heads": nkv, "head_dim": hd, "num_experts": E, "num_experts_per_tok": s["k"], "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2, "use_sliding_window": False,
    }
    if arch == "gpt-oss":  # GptOssConfig's fields, its YaRN as gpt-oss-20b ships it
        config = {
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": V, "hidden_size": H, "intermediate_size": I,
            "num_hidden_layers": L, "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd, "num_local_experts": E,
            "num_experts_per_tok": s["k"], "sliding_window": s["window"], "attention_bias": True, "hidden_act": "silu",
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)],
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 4096},
            "rope_theta": 150000.0, "swiglu_limit": 7.0, "bos_token_id": 1, "eos_token_id": 2,
        }
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(default_model_dir() / name, tmp / name)
    tmp.rename(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arch", default="qwen3moe", choices=sorted(SHAPES))
    ap.add_argument("--files", help="llama.cpp quantization types, comma-separated (default: Q4_0,Q4_K_M; gpt-oss MXFP4_MOE)")
    ap.add_argument("--prepare", action="store_true", help="only write the checkpoint and the GGUF files")
    args = ap.parse_args()
    ensure_llama_cpp()
    rows = [(f"{name} file, both", name, None, name) for name in (args.files or FILES[args.arch]).split(",")]  # bench_vs_llamacpp's rows
    model_dir = random_moe(args.arch)
    if args.prepare:
        row_files(model_dir, rows)  # converted to BF16, then quantized by llama.cpp
        return
    samples = measure(args.arch, model_dir, rows, args.rounds, args.threads)
    result = table(samples, rows)
    for label, *_ in rows:
        row = result[label]
        pre, dec = row["prefill512"], row["decode128"]
        print(f"{label}: prefill 512 {pre['minillm']:.1f} vs {pre['llama.cpp']:.1f} tok/s ({pre['ratio']:.2f}x, ahead {pre['ahead']}/{pre['rounds']}), "
              f"decode {dec['minillm']:.2f} vs {dec['llama.cpp']:.2f} ({dec['ratio']:.2f}x, ahead {dec['ahead']}/{dec['rounds']}), "
              f"peak RSS {row['peak_rss_mb']:.0f} MiB (llama.cpp {row['llama_cpp_peak_rss_mb']:.0f}), file {row['file_mb']:.0f} MiB")
    named = os.environ.get("NUMBA_CPU_NAME")  # one file per target, as eight_b.py's
    out = ROOT / "benchmarks" / (RESULTS[args.arch] + (f".{named}" if named else "") + ".json")
    import llama_cpp

    out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "machine": machine(), "minillm_target": named or "native",
                               "llama.cpp": llama_cpp.llama_print_system_info().decode().strip(), "threads": args.threads,
                               "rounds": args.rounds, "arch": args.arch, "shape": SHAPES[args.arch], "table": result,
                               "samples": {"/".join(k): v for k, v in samples.items()}}, indent=2) + "\n")


if __name__ == "__main__":
    main()
