"""Load on the OpenAI-compatible server: aggregate generated tok/s and time to first token at
concurrency 1, 2, 4 and 8, on the default model, over loopback.

    python benchmarks/serve_load.py [--model PATH] [--dtype D] [--requests-per-client 4] [--max-tokens 64]
                                    [--replicas N [--threads-per-replica T]]

Starts `cli.py serve` on a free loopback port, warms it up, then for each concurrency level runs
that many streaming clients, each sending the same number of requests back to back (distinct
prompts, sampled with a seed). Every loop is bounded in count; the server is stopped at the end.
With --replicas N it then does the same against `serve --replicas N` (Ray Serve, minillm[cluster])
and prints both side by side: the same machine, the same run.
Benchmarks are not tests: nothing here runs under pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:  # the openai package brings httpx2 (same API) or httpx, depending on its version
    import httpx2 as httpx
except ImportError:
    import httpx

ROOT = Path(__file__).resolve().parent.parent
WORDS = ["harbour", "lantern", "orchard", "glacier", "canyon", "meadow", "compass", "library", "forest", "island"]
TEMPERATURE = 0.8  # with OpenAI's other defaults: no top-k, top-p 1


def prompt_text(i: int) -> str:
    """Request i's prompt: distinct short prompts (engine_load.py sends the same ones)."""
    return f"Once upon a time, next to an old {WORDS[i % len(WORDS)]}, there lived"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_request(base: str, i: int, max_tokens: int) -> tuple[float, int, float]:
    """(time to first token, tokens generated, total time) of one streaming completion."""
    body = {
        "model": "bench", "prompt": prompt_text(i),
        "max_tokens": max_tokens, "temperature": TEMPERATURE, "seed": i, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, tokens = None, 0
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (first if first is not None else time.perf_counter() - start), tokens, time.perf_counter() - start


def level(base: str, clients: int, per_client: int, max_tokens: int) -> dict:
    def client(c):
        return [one_request(base, c * per_client + r, max_tokens) for r in range(per_client)]

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, range(clients)) for r in rs]
    wall = time.perf_counter() - start
    ttfts = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    return {
        "concurrency": clients,
        "requests": len(results),
        "generated_tokens": tokens,
        "aggregate_tok_s": tokens / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(round(0.99 * (len(ttfts) - 1))))],
    }


# Ray's process titles, as psutil reads them, to the part of the service each process is
PROCESS_KINDS = (("EngineReplica", "engine replicas"), ("Ingress", "ingress"), ("ProxyActor", "Ray HTTP proxy"))


def cpu_by_kind(server: subprocess.Popen) -> dict[str, float]:
    """CPU seconds used so far by the server process tree, summed by kind of process (psutil
    comes with the cluster extra; without it, nothing)."""
    try:
        import psutil
    except ImportError:
        return {}

    totals: dict[str, float] = {}
    root = psutil.Process(server.pid)
    for proc in [root] + root.children(recursive=True):
        try:
            title, times = " ".join(proc.cmdline()), proc.cpu_times()
        except psutil.Error:
            continue
        kind = next((k for key, k in PROCESS_KINDS if key in title), "server" if proc.pid == server.pid else "Ray other")
        totals[kind] = totals.get(kind, 0.0) + times.user + times.system
    return totals


def own_cpu_s() -> float:
    """CPU seconds this process (the load generator's client threads) has used so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def start_server(tree: Path, port: int, model: str | None = None, extra: list[str] = ()) -> subprocess.Popen:
    """`cli.py serve` of the checkout `tree` on a loopback port, once /health answers 200."""
    cmd = [sys.executable, "cli.py", "serve", "--port", str(port), "--max-batch", "8", "--ctx", "1024",
           "--model-name", "bench"] + (["--model", model] if model else []) + list(extra)
    server = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 1800
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise SystemExit(f"the server in {tree} stopped")
        time.sleep(0.5)
    stop_server(server)
    raise SystemExit("the server did not start")


def stop_server(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=120)


def measure(args, extra: list[str]) -> list[dict]:
    """Start a server (cli.py serve + extra flags), run every concurrency level, stop it."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(ROOT, port, args.model, (["--dtype", args.dtype] if args.dtype else []) + extra)
    try:
        level(base, 2, 1, 8)  # warm-up: kernels loaded, batch path exercised
        rows = []
        for c in args.levels.split(","):
            before, load_before = cpu_by_kind(server), own_cpu_s()
            rows.append(level(base, int(c), args.requests_per_client, args.max_tokens))
            after, load_after = cpu_by_kind(server), own_cpu_s()
            # where the CPU goes per generated token (a process that ended in between is left out);
            # the load generator (this process) runs on the same cores as the server
            tokens = rows[-1]["generated_tokens"]
            rows[-1]["cpu_ms_per_token"] = {k: 1000 * (after[k] - before.get(k, 0.0)) / tokens for k in after}
            rows[-1]["cpu_ms_per_token"]["load generator"] = 1000 * (load_after - load_before) / tokens
        return rows
    finally:
        stop_server(server)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory or GGUF file (default: the default model)")
    ap.add_argument("--dtype", help="as cli.py serve takes it (default: float32, or a GGUF as stored)")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--replicas", type=int, help="also measure serve --replicas N on Ray Serve, in the same run")
    ap.add_argument("--threads-per-replica", type=int, default=1)
    args = ap.parse_args()

    runs = {"single server": measure(args, [])}
    if args.replicas:
        name = f"{args.replicas} replicas x {args.threads_per_replica} thread"
        runs[name] = measure(args, ["--replicas", str(args.replicas), "--threads-per-replica", str(args.threads_per_replica)])

    what = f"{Path(args.model).name if args.model else 'default model'}, {args.dtype or 'default precision'}"
    print(f"\nserver load, {what}, max_tokens {args.max_tokens}, {args.requests_per_client} requests per client, loopback")
    print("| server | concurrency | requests | aggregate tok/s | x concurrency 1 | TTFT p50 | TTFT p99 |")
    print("|---|---|---|---|---|---|---|")
    for name, rows in runs.items():
        one = rows[0]["aggregate_tok_s"]
        for r in rows:
            print(f"| {name} | {r['concurrency']} | {r['requests']} | {r['aggregate_tok_s']:.1f} | {r['aggregate_tok_s'] / one:.2f} | "
                  f"{r['ttft_p50_s'] * 1000:.0f} ms | {r['ttft_p99_s'] * 1000:.0f} ms |")
    print("\nCPU ms per generated token, by process (the load generator shares the server's cores):")
    for name, rows in runs.items():
        for r in rows:
            print(f"- {name}, concurrency {r['concurrency']}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["cpu_ms_per_token"].items())))
    out = ROOT / "benchmarks" / "serve_results.json"
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "model": args.model, "dtype": args.dtype, "runs": runs}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
