"""KV memory of a long generation on a model with sliding-window layers, with and without giving
back the positions no later token reads (Model.release_outside_windows, as the engine does).

    python benchmarks/sliding_kv_memory.py [--tokens 4000]

A random 6-layer Gemma-3-like model (5 sliding layers with a 512-token window, 1 full layer, one KV
head of 256) from transformers; resident memory is read from /proc before and after decoding.
Expected: full layer 2 KiB x tokens, sliding layers 5 x 2 KiB x (512 + RELEASE_STEP) with the release,
all six layers 2 KiB x tokens each without. Not a test: nothing here runs under pytest.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4000)
    args = ap.parse_args()
    from hf_tiny import VOCAB, make_checkpoint

    from minillm.core.model import Model

    with tempfile.TemporaryDirectory() as path:
        make_checkpoint(Path(path), arch="gemma3", hidden_size=256, intermediate_size=256, num_attention_heads=1,
                        head_dim=256, num_key_value_heads=1, query_pre_attn_scalar=256, sliding_window=512,
                        num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                        max_position_embeddings=8192)
        model = Model.load(path, ctx=8192)
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=args.tokens)
    for release in (False, True):
        cache = model.new_cache()
        model.forward(tokens[:8], cache)
        before = rss_mib()
        for token in tokens[8:]:
            model.forward([token], cache)
            if release:
                model.release_outside_windows(cache)
        print(f"{'with' if release else 'without'} release: KV memory grew {rss_mib() - before:.1f} MiB over {args.tokens} tokens")
        del cache


if __name__ == "__main__":
    main()
