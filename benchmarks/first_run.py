"""A newcomer's first run: `cli.py generate` with an empty Numba cache, wall time to the end.

    python benchmarks/first_run.py                                      # the default model, native CPU
    python benchmarks/first_run.py --models default FILE.gguf --targets native haswell

Each run gets a fresh NUMBA_CACHE_DIR, so it compiles everything its model needs; a second run on
the same cache shows what later runs cost. `haswell` compiles for an AVX2 laptop (Numba's haswell
target with Haswell's features), `x86-64-v2` and `generic` for portable caches. The default model
is imported into the weights store before timing (a one-time step, not a compile). Prints the wall
time of each run and the compile message minillm showed. Benchmarks are not tests.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from minillm.warmup import HASWELL_FEATURES

TARGETS = {"native": None, "haswell": HASWELL_FEATURES, "x86-64-v2": "", "generic": ""}


def target_env(target: str, cache: str) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    env.pop("NUMBA_CPU_NAME", None)
    env.pop("NUMBA_CPU_FEATURES", None)
    if target != "native":
        env["NUMBA_CPU_NAME"] = target
        if TARGETS[target]:
            env["NUMBA_CPU_FEATURES"] = TARGETS[target]
    return env


def generate(model: str, env: dict) -> tuple[float, str]:
    command = [sys.executable, str(ROOT / "cli.py"), "generate", "--prompt", "Hello", "--max-tokens", "8"]
    if model != "default":
        command += ["--model", model]
    start = time.perf_counter()
    run = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{run.stderr[-2000:]}")
    notice = " / ".join(line.strip() for line in run.stderr.splitlines() if "compil" in line)
    return wall, notice


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["default"], help="'default' or a checkpoint/GGUF path")
    ap.add_argument("--targets", nargs="+", choices=list(TARGETS), default=["native"])
    ap.add_argument("--warm", action="store_true", help="also time a second run on the same cache")
    args = ap.parse_args()
    if "default" in args.models:  # the one-time import into the weights store, outside the timing
        from minillm.loading.default_model import default_model_dir

        default_model_dir()
    for target in args.targets:
        for model in args.models:
            with tempfile.TemporaryDirectory() as cache:
                wall, notice = generate(model, target_env(target, cache))
                line = f"{Path(model).name:40s} {target:10s} first run {wall:6.1f} s"
                if args.warm:
                    line += f", then {generate(model, target_env(target, cache))[0]:.1f} s"
                print(f"{line}\n    {notice or '(no compile message)'}", flush=True)


if __name__ == "__main__":
    main()
