"""minillm against llama.cpp (and transformers once), side by side in one run.

    python benchmarks/bench_vs_llamacpp.py [--rounds 5] [--shapes smollm,1b] [--threads 2]

What it does, all on this machine:
1. installs llama-cpp-python from PyPI if missing, built from source with -DGGML_NATIVE=ON;
2. takes `convert_hf_to_gguf.py` from that version's source distribution and converts the same
   HF weights minillm reads to GGUF F32, BF16 and Q8_0, and quantizes them to Q4_0 and Q4_K_M
   with llama.cpp's own quantizer (llama_model_quantize, what `llama-quantize` runs);
3. in each of `--rounds` rounds, measures the machine's read bandwidth (a parallel Numba sum over a
   2 GB array), then runs minillm and llama.cpp alternately, each run in a fresh process: prefill of
   128 and 512 tokens, and 128 decode steps after a 128-token prompt (both engines at the same
   context depth), all with 2 threads. Rows: minillm's float32 / bfloat16 / int8 against
   llama.cpp's F32 / BF16 / Q8_0, and 4-bit GGUF files given to both engines as they are
   (minillm runs them as stored: `--model FILE.gguf`), the shipped Q4_1 file among them;
4. runs transformers once (float32 and bfloat16);
5. prints medians and minillm/llama.cpp ratios, and writes them to benchmarks/results.json.

Shapes: `smollm` is the default model (SmolLM2-135M-Instruct); `1b` is a random-weight Llama of
~1.2B parameters (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, vocab 49152),
compared on its BF16, Q8_0, Q4_0 and Q4_K_M GGUFs and at int8 (its float32 GGUF alone would be
5 GB).
Benchmarks are not tests: nothing here runs under pytest.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "benchmarks" / ".cache"
LLAMA_CPP_VERSION = "0.3.36"
# Rows: (label, what minillm runs: "dir" or a GGUF's name, minillm dtype or None, llama.cpp's GGUF)
SMOLLM_ROWS = [
    ("float32 vs F32", "dir", "float32", "f32"),
    ("bfloat16 vs BF16", "dir", "bfloat16", "bf16"),
    ("int8 vs Q8_0", "dir", "int8", "q8_0"),
    ("Q4_0 file, both", "Q4_0", None, "Q4_0"),
    ("Q4_1 file (shipped), both", "shipped", None, "shipped"),
    ("Q4_K_M file, both", "Q4_K_M", None, "Q4_K_M"),
]
ONE_B_ROWS = [
    ("BF16 file, both", "bf16", None, "bf16"),
    ("Q8_0 file, both", "q8_0", None, "q8_0"),
    ("int8 vs Q8_0", "dir", "int8", "q8_0"),
    ("Q4_0 file, both", "Q4_0", None, "Q4_0"),
    ("Q4_K_M file, both", "Q4_K_M", None, "Q4_K_M"),
]
QUANTIZE = r"""
import sys, llama_cpp as L
p = L.llama_model_quantize_default_params()
p.ftype = getattr(L, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
p.nthread = 2
if L.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p) != 0:
    raise SystemExit("llama_model_quantize failed")
"""

WORKER_LLAMA = r"""
import ctypes, json, sys, time
import numpy as np
import llama_cpp as L
path, P, G, threads, n_ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
kv = sys.argv[6] if len(sys.argv) > 6 else None  # the KV cache's type (-ctk/-ctv): f32, f16, q8_0
L.llama_backend_init()
mp = L.llama_model_default_params()
t0 = time.perf_counter()
model = L.llama_load_model_from_file(path.encode(), mp)
cp = L.llama_context_default_params()
cp.n_ctx = n_ctx; cp.n_batch = 512; cp.n_ubatch = 512
cp.n_threads = threads; cp.n_threads_batch = threads
if kv:
    cp.type_k = cp.type_v = {"f32": 0, "f16": 1, "q8_0": 8, "bf16": 30}[kv]  # ggml types (the bindings lack BF16's name)
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED  # a quantized V cache needs it
ctx = L.llama_init_from_model(model, cp)
load_s = time.perf_counter() - t0
V = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
rng = np.random.default_rng(0)
prompt = rng.integers(0, V, size=P).astype(np.int32)
mem = L.llama_get_memory(ctx)

def decode(tokens):
    for start in range(0, len(tokens), cp.n_batch):  # at most n_batch tokens a call
        part = tokens[start : start + cp.n_batch]
        arr = (L.llama_token * len(part))(*[int(t) for t in part])
        if L.llama_decode(ctx, L.llama_batch_get_one(arr, len(part))) != 0:
            raise SystemExit("llama_decode failed")
    return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(V,))

decode(prompt[:8]); decode(prompt[:1]); L.llama_memory_clear(mem, True)  # warm-up
t0 = time.perf_counter()
token = int(np.argmax(decode(prompt)))
ttft = time.perf_counter() - t0
t0 = time.perf_counter()
for _ in range(G):
    token = int(np.argmax(decode([token])))
dec = time.perf_counter() - t0
import resource
print(json.dumps({"prefill_tok_s": P / ttft, "decode_tok_s": G / dec if G else None, "ttft_s": ttft, "load_s": load_s,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

WORKER_HF = r"""
import json, sys, time
import numpy as np, torch
from transformers import AutoModelForCausalLM
path, dtype, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(threads)
model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
V = model.config.vocab_size
out = {}
with torch.inference_mode():
    for P in (128, 512):
        prompt = torch.tensor(np.random.default_rng(0).integers(0, V, size=(1, P)))
        model(prompt[:, :8])
        t0 = time.perf_counter(); res = model(prompt, use_cache=True); out[f"prefill{P}"] = P / (time.perf_counter() - t0)
        if P == 128:
            past, token = res.past_key_values, res.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(128):
                res = model(token, past_key_values=past, use_cache=True)
                past, token = res.past_key_values, res.logits[:, -1:].argmax(-1)
            out["decode128"] = 128 / (time.perf_counter() - t0)
print(json.dumps(out))
"""

WORKER_BANDWIDTH = r"""
import json, time
import numpy as np
from numba import njit, prange
@njit(parallel=True, fastmath={"reassoc", "contract"})
def row_sums(out, a):  # the access pattern of a decode matvec: one row per task, vectorised
    for r in prange(a.shape[0]):
        s = np.float32(0.0)
        for k in range(a.shape[1]):
            s += a[r, k]
        out[r] = s
a = np.ones(2 * 1024**3 // 4, np.float32).reshape(-1, 4096)
out = np.zeros(a.shape[0], np.float32)
row_sums(out, a)
times = []
for _ in range(7):
    t0 = time.perf_counter(); row_sums(out, a); times.append(time.perf_counter() - t0)
print(json.dumps({"bandwidth_gb_s": a.nbytes / sorted(times)[len(times) // 2] / 1e9}))
"""


def sh(cmd, env=None, timeout=None) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if result.returncode != 0:
        raise SystemExit(f"failed: {' '.join(map(str, cmd))}\n{result.stderr[-3000:]}")
    return result.stdout


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


# ------------------------------------------------------------------ setup


def ensure_llama_cpp() -> None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print(f"building llama-cpp-python {LLAMA_CPP_VERSION} from source with -DGGML_NATIVE=ON (slow) ...", flush=True)
        env = dict(os.environ, CMAKE_ARGS="-DGGML_NATIVE=ON", CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
        sh([sys.executable, "-m", "pip", "install", "--no-binary", "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_VERSION}"], env=env)


def converter() -> Path:
    """convert_hf_to_gguf.py and convert_lora_to_gguf.py (with their gguf-py and conversion/
    folders) from the sdist."""
    root = CACHE / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp"
    if (root / "convert_hf_to_gguf.py").exists() and (root / "convert_lora_to_gguf.py").exists():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    sdist = CACHE / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
    if not sdist.exists():
        sh([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(CACHE)])
    prefix = f"llama_cpp_python-{LLAMA_CPP_VERSION}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [
            m for m in tar.getmembers()
            if m.name in (prefix + "convert_hf_to_gguf.py", prefix + "convert_lora_to_gguf.py") or m.name.startswith(prefix + "gguf-py/")
            or m.name.startswith(prefix + "conversion/")
        ]
        tar.extractall(CACHE, members=members, filter="data")
    return root


CONVERT_SHIM = r"""
import sys
sys.path.insert(0, sys.argv.pop(1))
import convert_hf_to_gguf
from conversion.base import TextModel
from conversion.llama import LlamaModel
# minillm writes the byte-level tokenizer as transformers builds it from the GGUF; its hash is not in
# the converter's table, and the pre-tokenizer does not affect speed. It is a GPT-2-style BPE
# vocabulary, so go straight there instead of trying sentencepiece first.
TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
convert_hf_to_gguf.main()
"""


def to_gguf(model_dir: Path, outtype: str) -> Path:
    out = CACHE / f"{model_dir.name}-{outtype}.gguf"
    if not out.exists():
        print(f"converting {model_dir.name} to GGUF {outtype} ...", flush=True)
        tmp = out.with_suffix(".tmp")
        sh([sys.executable, "-c", CONVERT_SHIM, str(converter()), str(model_dir), "--outtype", outtype, "--outfile", str(tmp)])
        tmp.rename(out)
    return out


def quantized(source: Path, ftype: str) -> Path:
    """`source` (a GGUF) quantized by llama.cpp's quantizer to ftype (Q4_0, Q4_K_M, ..)."""
    out = source.with_name(source.name.rsplit("-", 1)[0] + f"-{ftype}.gguf")
    if not out.exists():
        print(f"quantizing {source.name} to {ftype} ...", flush=True)
        tmp = out.with_suffix(".tmp")
        sh([sys.executable, "-c", QUANTIZE, str(source), str(tmp), ftype])
        tmp.rename(out)
    return out


def row_files(model_dir: Path, rows) -> dict[str, Path]:
    """Every GGUF the rows name: converted (f32, bf16, q8_0), quantized from the most precise
    of those, or the shipped default-model file."""
    from minillm.loading.default_model import find_default_gguf

    names = {name for _, ours, _, theirs in rows for name in (ours, theirs) if name != "dir"}
    files = {}
    for name in sorted(names, key=lambda n: n not in ("f32", "bf16", "q8_0")):
        if name == "shipped":
            files[name] = find_default_gguf()
        elif name in ("f32", "bf16", "q8_0"):
            files[name] = to_gguf(model_dir, name)
        else:
            files[name] = quantized(files.get("f32") or files.get("bf16") or to_gguf(model_dir, "bf16"), name)
    return files


def random_1b() -> Path:
    """A ~1.2B-parameter Llama with random bf16 weights and the default model's tokenizer."""
    import numpy as np

    path = CACHE / "llama-1b-random"
    if (path / "config.json").exists():
        return path
    from minillm.loading.default_model import default_model_dir

    print("writing a random ~1.2B Llama checkpoint (bf16) ...", flush=True)
    tmp = CACHE / "llama-1b-random.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    H, I, L, nh, nkv, V = 2048, 8192, 16, 32, 8, 49152
    hd = H // nh
    rng = np.random.default_rng(0)

    def bf16(shape, scale=0.02):
        w = (rng.standard_normal(shape, dtype=np.float32) * scale).view(np.uint32)
        return ((w + 0x7FFF + ((w >> 16) & 1)) >> 16).astype(np.uint16)

    tensors = {"model.embed_tokens.weight": bf16((V, H)), "model.norm.weight": bf16((H,), 0) + 0x3F80}
    for i in range(L):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": bf16((H,), 0) + 0x3F80,  # 1.0
            p + "post_attention_layernorm.weight": bf16((H,), 0) + 0x3F80,
            p + "self_attn.q_proj.weight": bf16((nh * hd, H)),
            p + "self_attn.k_proj.weight": bf16((nkv * hd, H)),
            p + "self_attn.v_proj.weight": bf16((nkv * hd, H)),
            p + "self_attn.o_proj.weight": bf16((H, nh * hd)),
            p + "mlp.gate_proj.weight": bf16((I, H)),
            p + "mlp.up_proj.weight": bf16((I, H)),
            p + "mlp.down_proj.weight": bf16((H, I)),
        }
    save_bf16(tensors, tmp / "model.safetensors")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": H,
        "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": nh, "num_key_value_heads": nkv,
        "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(default_model_dir() / name, tmp / name)
    tmp.rename(path)
    return path


def save_bf16(tensors: dict, path: Path) -> None:
    """Write uint16 bfloat16 bit patterns as a BF16 safetensors file (safetensors.numpy has no bfloat16)."""
    header, offset = {}, 0
    for name, arr in tensors.items():
        header[name] = {"dtype": "BF16", "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for arr in tensors.values():
            f.write(arr.tobytes())


# ------------------------------------------------------------------ runs


def context_size(P: int, G: int) -> int:
    """Both engines' context: 1024, or the prompt and generated tokens rounded up to 256."""
    return max(1024, -(-(P + G) // 256) * 256)


def run_minillm(model: Path, dtype: str | None, P: int, G: int, threads: int, activations: int | None = None) -> dict:
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads))
    cmd = [sys.executable, str(ROOT / "cli.py"), "bench", "--model", str(model), "--prompt-tokens", str(P),
           "--gen-tokens", str(G), "--ctx", str(context_size(P, G)), "--json"] + (["--dtype", dtype] if dtype else [])
    cmd += ["--activations", str(activations)] if activations else []
    return last_json(sh(cmd, env=env))


def run_llama(gguf: Path, P: int, G: int, threads: int) -> dict:
    return last_json(sh([sys.executable, "-c", WORKER_LLAMA, str(gguf), str(P), str(G), str(threads), str(context_size(P, G))]))


def bandwidth_gb_s(threads: int) -> float:
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads))
    return last_json(sh([sys.executable, "-c", WORKER_BANDWIDTH], env=env))["bandwidth_gb_s"]


def measure(shape: str, model_dir: Path, rows, rounds: int, threads: int) -> dict:
    """Every run's figures, as lists with one entry per round: (engine, row label, metric) ->
    values, and ("bandwidth",) -> the read bandwidth sampled at the start of each round."""
    files = row_files(model_dir, rows)
    samples: dict = {}

    def add(key, value):
        samples.setdefault(key, []).append(value)

    for r in range(rounds):
        # Sampled in every round, next to the runs it is compared with: this machine's bandwidth
        # drifts by a third over minutes, so one sample at the start can be a burst or a trough.
        add(("bandwidth",), bandwidth_gb_s(threads))
        print(f"[{shape}] round {r + 1}/{rounds}, read bandwidth {samples[('bandwidth',)][-1]:.1f} GB/s", flush=True)
        for label, ours, dtype, theirs in rows:
            ours_model = model_dir if ours == "dir" else files[ours]
            # Alternate which engine goes first, so neither always runs on a cooler machine.
            order = ["minillm", "llama.cpp"]
            for engine in order if r % 2 == 0 else order[::-1]:
                run = (lambda P, G: run_minillm(ours_model, dtype, P, G, threads)) if engine == "minillm" else (
                    lambda P, G: run_llama(files[theirs], P, G, threads))
                a, b = run(128, 128), run(512, 0)
                add((engine, label, "prefill128"), a["prefill_tok_s"])
                add((engine, label, "decode128"), a["decode_tok_s"])
                add((engine, label, "prefill512"), b["prefill_tok_s"])
                add((engine, label, "peak_rss_mb"), max(a["peak_rss_mb"], b["peak_rss_mb"]))
                if engine == "minillm":
                    add((engine, label, "weight_mb"), a["weight_mb"])
                    if ours != "dir":
                        add((engine, label, "file_mb"), files[ours].stat().st_size / 2**20)
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="smollm,1b", help='comma-separated; "render" only rewrites benchmarks/README.md')
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers run")
    args = ap.parse_args()
    if args.shapes == "render":  # rewrite benchmarks/README.md from the last results.json
        write_readme(json.loads((ROOT / "benchmarks" / "results.json").read_text()))
        return
    sys.path.insert(0, str(ROOT))
    from minillm.loading.default_model import default_model_dir

    ensure_llama_cpp()
    out = ROOT / "benchmarks" / "results.json"
    report = {"date": datetime.date.today().isoformat(), "machine": machine(), "threads": args.threads,
              "rounds": args.rounds, "shapes": {}, "samples": {}}
    if out.exists():  # a run of some shapes keeps the others' last results (their own date kept)
        previous = json.loads(out.read_text())
        for shape in previous.get("shapes", {}):
            report["shapes"][shape] = previous["shapes"][shape]
            report["samples"][shape] = previous["samples"][shape]
            report.setdefault("dates", {})[shape] = previous.get("dates", {}).get(shape, previous.get("date"))
            report.setdefault("machines", {})[shape] = previous.get("machines", {}).get(shape, previous.get("machine"))

    def save():  # after every shape, so a long run that stops early still leaves its results
        out.write_text(json.dumps(report, indent=2) + "\n")

    def record(shape, samples, rows):
        report.setdefault("dates", {})[shape] = report["date"]
        report.setdefault("machines", {})[shape] = report["machine"]
        report["shapes"][shape] = table(samples, rows)
        report["samples"][shape] = {"/".join(k): v for k, v in samples.items()}

    shapes = args.shapes.split(",")
    if "smollm" in shapes:
        d = default_model_dir()
        record("smollm", measure("smollm", d, SMOLLM_ROWS, args.rounds, args.threads), SMOLLM_ROWS)
        if not args.no_hf:
            hf = {dt: last_json(sh([sys.executable, "-c", WORKER_HF, str(d), dt, str(args.threads)])) for dt in ("float32", "bfloat16")}
            report["shapes"]["smollm"]["transformers"] = hf
        save()
        print_report(report)
    if "1b" in shapes:
        record("1b", measure("1b", random_1b(), ONE_B_ROWS, args.rounds, args.threads), ONE_B_ROWS)
        save()
    print_report(report)
    write_readme(report)
    print(f"\nwrote {out} and benchmarks/README.md")


def table(samples: dict, rows) -> dict:
    """Medians and ratios of medians; `ahead` counts the rounds in which minillm's run beat the
    llama.cpp run next to it. The decode share of bandwidth is taken per round, against the sample
    of that round, and its median reported."""
    bandwidth = samples[("bandwidth",)]
    out = {"bandwidth_gb_s": statistics.median(bandwidth)}
    for label, *_ in rows:
        row = {}
        for metric in ("prefill128", "prefill512", "decode128"):
            ours, theirs = samples[("minillm", label, metric)], samples[("llama.cpp", label, metric)]
            mo, mt = statistics.median(ours), statistics.median(theirs)
            row[metric] = {"minillm": mo, "llama.cpp": mt, "ratio": mo / mt,
                           "ahead": sum(o >= t for o, t in zip(ours, theirs)), "rounds": len(ours)}
        for key in ("peak_rss_mb", "weight_mb", "file_mb"):
            if ("minillm", label, key) in samples:
                row[key] = statistics.median(samples[("minillm", label, key)])
        if ("llama.cpp", label, "peak_rss_mb") in samples:
            row["llama_cpp_peak_rss_mb"] = statistics.median(samples[("llama.cpp", label, "peak_rss_mb")])
        # Bytes read per decoded token are (about) the weights; tok/s x bytes = achieved bandwidth.
        weight_gb = row["weight_mb"] * 2**20 / 1e9
        row["decode_bandwidth_share"] = statistics.median(
            tok_s * weight_gb / bw for tok_s, bw in zip(samples[("minillm", label, "decode128")], bandwidth))
        out[label] = row
    return out


def _engine_rows(rows: dict):
    return [(name, row) for name, row in rows.items() if name not in ("transformers", "bandwidth_gb_s")]


HAND_WRITTEN = "## The server under load"  # benchmarks/README.md from here on is written by hand


def write_readme(report: dict) -> None:
    """Rewrite the generated tables at the top of benchmarks/README.md, keeping the notes below."""
    path = ROOT / "benchmarks" / "README.md"
    old = path.read_text() if path.exists() else ""
    notes = old[old.index(HAND_WRITTEN):] if HAND_WRITTEN in old else ""
    path.write_text(markdown(report) + ("\n" + notes if notes else ""))


def _cell(c: dict, bold: str = "") -> str:
    return f"{c['minillm']:.0f} / {c['llama.cpp']:.0f} = {bold}{c['ratio']:.2f}{bold} ({c['ahead']}/{c['rounds']})"


def markdown(report: dict) -> str:
    """benchmarks/README.md: the latest table, with its date and machine."""
    out = [
        "# Benchmarks",
        "",
        "Not tests: timings never run under pytest. `bench_vs_llamacpp.py` builds llama.cpp from",
        "llama-cpp-python's source (`-DGGML_NATIVE=ON`), converts the same weights to GGUF with the converter",
        "in that source, and runs minillm and llama.cpp alternately, each run in a fresh process; the table",
        "holds medians and minillm/llama.cpp ratios from one run, and in brackets the rounds in which",
        "minillm's run was ahead of the llama.cpp run next to it. Read bandwidth (parallel Numba row sums",
        "over 2 GB) is sampled at the start of every round; the decode share of bandwidth is the median of",
        "each round's share against its own sample. `results.json` keeps every run's figures.",
        "`serve_load.py` loads the HTTP server.",
        "",
        f"Latest run: {report['date']}, {report['machine']}, {report['threads']} threads, medians of "
        f"{report['rounds']} alternating runs.",
    ]
    names = {"smollm": "SmolLM2-135M-Instruct (the default model)", "1b": "random ~1.2B Llama (hidden 2048, 16 layers, 32/8 heads, intermediate 8192)"}
    for shape, rows in report["shapes"].items():
        bw = report["samples"][shape]["bandwidth"]
        out += ["", f"## {names.get(shape, shape)}", "",
                f"Run {report.get('dates', {}).get(shape, report['date'])}, {report.get('machines', {}).get(shape, report['machine'])}. Read bandwidth: median {rows['bandwidth_gb_s']:.1f} GB/s "
                f"(samples {min(bw):.1f} to {max(bw):.1f}).", "",
                "| tok/s: minillm / llama.cpp = ratio | prefill 128 | prefill 512 | decode 128 (after 128) | peak RSS | decode share of bandwidth |",
                "|---|---|---|---|---|---|"]
        for name, row in _engine_rows(rows):
            cells = [_cell(row[m], "**") for m in ("prefill128", "prefill512", "decode128")]
            memory = f"{row['peak_rss_mb']:.0f} MiB ({row['weight_mb']:.0f} MiB weights" + (f", {row['file_mb']:.0f} MiB file)" if "file_mb" in row else ")")
            out.append(f"| {name} | {' | '.join(cells)} | {memory} | {row['decode_bandwidth_share'] * 100:.0f}% |")
        if "transformers" in rows:
            out += ["", "transformers (torch 2.13, same threads), once:", ""]
            for dt, r in rows["transformers"].items():
                out.append(f"- {dt}: prefill 128 {r['prefill128']:.0f}, prefill 512 {r['prefill512']:.0f}, decode {r['decode128']:.1f} tok/s")
    return "\n".join(out) + "\n"


def print_report(report: dict) -> None:
    print(f"\n{report['date']}, {report['machine']}, {report['threads']} threads, medians of {report['rounds']} alternating runs")
    for shape, rows in report["shapes"].items():
        print(f"\n{shape}: read bandwidth (parallel Numba sum over 2 GB), median of rounds {rows['bandwidth_gb_s']:.1f} GB/s")
        print(f"| {'tok/s (minillm / llama.cpp = ratio (rounds ahead))':<52} | {'prefill 128':>30} | {'prefill 512':>30} | {'decode 128':>30} |")
        print("|" + "---|" * 4)
        for name, row in _engine_rows(rows):
            cells = [_cell(row[m]) for m in ("prefill128", "prefill512", "decode128")]
            print(f"| {name:<52} | {cells[0]:>30} | {cells[1]:>30} | {cells[2]:>30} |")
        for name, row in _engine_rows(rows):
            print(f"{name}: weights {row['weight_mb']:.0f} MiB, peak RSS {row['peak_rss_mb']:.0f} MiB, "
                      f"decode reads {row['decode_bandwidth_share'] * 100:.0f}% of the measured bandwidth")
        if "transformers" in rows:
            for dt, r in rows["transformers"].items():
                print(f"transformers {dt}: prefill128 {r['prefill128']:.0f}, prefill512 {r['prefill512']:.0f}, decode128 {r['decode128']:.1f} tok/s")


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}"


if __name__ == "__main__":
    main()
