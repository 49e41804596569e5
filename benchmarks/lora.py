"""LoRA adapters' cost: decode and prefill with a rank-r all-linear adapter against the base alone,
side by side in one process (alternating rounds, medians), on the default model; and against
llama.cpp with the same adapter as GGUF on the same Q4_0 file.

    python benchmarks/lora.py [--dtypes q4_0 float32] [--ranks 8 16 64] [--rounds 5]
    python benchmarks/lora.py --llama-cpp [--ranks 16] [--rounds 5]

The adapters are random PEFT adapters on every linear layer (written once under benchmarks/.cache
by peft, which the tests install). In the first form base rows run with the adapters loaded but
not chosen, so the base figure includes what merely having adapters costs. With --llama-cpp each
run is a fresh process, minillm and llama.cpp alternating (bench_vs_llamacpp's build of
llama-cpp-python, its quantizer for the Q4_0 file, and llama.cpp's convert_lora_to_gguf.py for the
adapter, which both engines then load). Not a test: nothing here runs under pytest.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
CACHE = ROOT / "benchmarks" / ".cache" / "lora"


def adapter_dir(model_dir: Path, rank: int) -> Path:
    """A random rank-`rank` all-linear PEFT adapter for the model (small B, so text stays text)."""
    path = CACHE / f"{model_dir.name}-r{rank}"
    if not (path / "adapter_model.safetensors").exists():
        import torch
        from lora_tiny import make_adapter
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = make_adapter(path, base, r=rank, lora_alpha=2 * rank, target_modules="all-linear")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.05)
        model.save_pretrained(path)
    return path


def timed(model, adapter, prompt, gen: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of `prompt` then `gen` greedy steps."""
    cache = model.new_cache()
    t0 = time.perf_counter()
    token = int(np.argmax(model.forward(prompt, cache, adapter=adapter)))
    prefill = len(prompt) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(gen):
        token = int(np.argmax(model.forward([token], cache, adapter=adapter)))
    return prefill, gen / (time.perf_counter() - t0)


WORKER_MINILLM = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from minillm.core.model import Model
from minillm.loading.lora import load_adapter
path, lora, P, G = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
t0 = time.perf_counter()
model = Model.load(path)
adapter = None
if lora != "-":
    adapter = load_adapter(lora, model.config)
    model.set_adapters([adapter])
load_s = time.perf_counter() - t0
prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, size=P)
warm = model.new_cache(); model.forward(prompt[:8], warm, adapter=adapter); model.forward(prompt[:1], warm, adapter=adapter)
cache = model.new_cache()
t0 = time.perf_counter(); token = int(np.argmax(model.forward(prompt, cache, adapter=adapter))); ttft = time.perf_counter() - t0
t0 = time.perf_counter()
for _ in range(G):
    token = int(np.argmax(model.forward([token], cache, adapter=adapter)))
print(json.dumps({"prefill_tok_s": P / ttft, "decode_tok_s": G / (time.perf_counter() - t0), "load_s": load_s}))
"""

WORKER_LLAMA = r"""
import ctypes, json, sys, time
import numpy as np
import llama_cpp as L
path, lora, P, G = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
L.llama_backend_init()
t0 = time.perf_counter()
model = L.llama_load_model_from_file(path.encode(), L.llama_model_default_params())
cp = L.llama_context_default_params()
cp.n_ctx = 1024; cp.n_batch = 512; cp.n_ubatch = 512; cp.n_threads = 2; cp.n_threads_batch = 2
ctx = L.llama_init_from_model(model, cp)
if lora != "-":
    adapter = L.llama_adapter_lora_init(model, lora.encode())
    if not adapter:
        raise SystemExit("llama_adapter_lora_init failed")
    if L.llama_set_adapters_lora(ctx, (L.llama_adapter_lora_p_ctypes * 1)(adapter), 1, (ctypes.c_float * 1)(1.0)) != 0:
        raise SystemExit("llama_set_adapters_lora failed")
load_s = time.perf_counter() - t0
V = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
prompt = np.random.default_rng(0).integers(0, V, size=P).astype(np.int32)
mem = L.llama_get_memory(ctx)

def decode(tokens):
    for start in range(0, len(tokens), cp.n_batch):
        part = tokens[start : start + cp.n_batch]
        arr = (L.llama_token * len(part))(*[int(t) for t in part])
        if L.llama_decode(ctx, L.llama_batch_get_one(arr, len(part))) != 0:
            raise SystemExit("llama_decode failed")
    return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(V,))

decode(prompt[:8]); decode(prompt[:1]); L.llama_memory_clear(mem, True)
t0 = time.perf_counter(); token = int(np.argmax(decode(prompt))); ttft = time.perf_counter() - t0
t0 = time.perf_counter()
for _ in range(G):
    token = int(np.argmax(decode([token])))
print(json.dumps({"prefill_tok_s": P / ttft, "decode_tok_s": G / (time.perf_counter() - t0), "load_s": load_s}))
"""


def against_llama_cpp(ranks: list[int], rounds: int, prompt: int, gen: int, outtype: str) -> None:
    """The Q4_0 file (llama.cpp's quantizer) with each rank's adapter as GGUF (llama.cpp's
    converter), minillm and llama.cpp alternating, each run a fresh process."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_vs_llamacpp as B
    from minillm.loading.default_model import default_model_dir

    B.ensure_llama_cpp()
    model_dir = default_model_dir(progress=False)
    base = B.quantized(B.to_gguf(model_dir, "f32"), "Q4_0")
    converter = B.converter()
    adapters = {}
    for r in ranks:
        out = CACHE / f"{model_dir.name}-r{r}-{outtype}.gguf"
        if not out.exists():
            env = dict(os.environ, PYTHONPATH=f"{converter / 'gguf-py'}:{converter}")
            B.sh([sys.executable, str(converter / "convert_lora_to_gguf.py"), str(adapter_dir(model_dir, r)), "--base", str(model_dir),
                  "--outtype", outtype, "--outfile", str(out)], env=env)
        adapters[r] = out
    runs: dict = {}
    for _ in range(rounds):
        for r in [None, *ranks]:
            lora = "-" if r is None else str(adapters[r])
            ours = B.last_json(B.sh([sys.executable, "-c", WORKER_MINILLM, str(ROOT), str(base), lora, str(prompt), str(gen)]))
            theirs = B.last_json(B.sh([sys.executable, "-c", WORKER_LLAMA, str(base), lora, str(prompt), str(gen)]))
            runs.setdefault(r, []).append((ours, theirs))
    print(f"\nQ4_0 file (llama.cpp's quantizer), adapters as llama.cpp's converter writes them (--outtype {outtype}); 2 threads, "
          f"medians of {rounds} alternating rounds")
    print(f"| adapter | prefill {prompt}: minillm / llama.cpp | decode {gen}: minillm / llama.cpp | minillm decode x its base | llama.cpp decode x its base |")
    print("|---|---|---|---|---|")
    med = {r: {k: (statistics.median(o[k] for o, _ in v), statistics.median(t[k] for _, t in v)) for k in ("prefill_tok_s", "decode_tok_s")}
           for r, v in runs.items()}
    for r, m in med.items():
        (po, pt), (do, dt) = m["prefill_tok_s"], m["decode_tok_s"]
        label = "none" if r is None else f"rank {r} all-linear"
        print(f"| {label} | {po:.0f} / {pt:.0f} = **{po / pt:.2f}** | {do:.1f} / {dt:.1f} = **{do / dt:.2f}** | "
              f"{do / med[None]['decode_tok_s'][0]:.2f} | {dt / med[None]['decode_tok_s'][1]:.2f} |")


def main() -> int:
    from minillm.core.model import Model
    from minillm.loading.default_model import default_model_dir
    from minillm.loading.lora import load_adapter

    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", nargs="+", default=["q4_0", "float32"])
    p.add_argument("--ranks", nargs="+", type=int, default=[8, 16, 64])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--llama-cpp", action="store_true", help="against llama.cpp on the Q4_0 file, the adapters as GGUF")
    p.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16"], help="with --llama-cpp: the adapters' GGUF precision")
    args = p.parse_args()
    if args.llama_cpp:
        against_llama_cpp(args.ranks, args.rounds, args.prompt, args.gen, args.outtype)
        return 0
    model_dir = default_model_dir(progress=False)
    rng = np.random.default_rng(0)
    for dtype in args.dtypes:
        model = Model.load(model_dir, dtype=dtype)
        adapters = {r: load_adapter(adapter_dir(model_dir, r), model.config, f"r{r}") for r in args.ranks}
        model.set_adapters(adapters.values())
        prompt = rng.integers(0, model.config.vocab_size, size=args.prompt)
        runs: dict = {None: [], **{r: [] for r in args.ranks}}
        timed(model, None, prompt[:16], 4)
        for a in adapters.values():
            timed(model, a, prompt[:16], 4)
        for _ in range(args.rounds):
            for r in runs:
                runs[r].append(timed(model, adapters.get(r), prompt, args.gen))
        base_prefill = statistics.median(x[0] for x in runs[None])
        base_decode = statistics.median(x[1] for x in runs[None])
        print(f"\n{dtype}: base prefill {args.prompt} {base_prefill:.0f} tok/s, decode {args.gen} {base_decode:.1f} tok/s "
              f"(medians of {args.rounds} alternating rounds)")
        print("| adapter | prefill tok/s | x base | decode tok/s | x base |\n|---|---|---|---|---|")
        for r in args.ranks:
            prefill, decode = statistics.median(x[0] for x in runs[r]), statistics.median(x[1] for x in runs[r])
            print(f"| rank {r} all-linear | {prefill:.0f} | {prefill / base_prefill:.2f} | {decode:.1f} | {decode / base_decode:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
