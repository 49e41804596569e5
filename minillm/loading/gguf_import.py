"""Importing a GGUF file as an ordinary HF checkpoint directory.

gguf_file.GGUFModel reads the file as an HF model (config fields, tensors by HF name with what
llama.cpp's converter changed undone, the tokenizer rebuilt from its vocabulary); here its
tensors are dequantized to float32 and written as model.safetensors beside config.json and the
tokenizer files. transformers reads the same GGUF (`from_pretrained(dir, gguf_file=...)`), so it
checks every file written here.

Everything is written into a temporary directory beside the destination and renamed at the end,
so an interrupted import never leaves a half-made model under the final name.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from ..errors import GGUFError
from .gguf_file import GGUFModel, write_text_files
from .safetensors_io import write_safetensors
from .tensor_names import expert_matrix, fused_kv_b, moe_prefix

TMP_PREFIX = ".importing-"


def import_gguf(gguf_path: str | Path, dest: str | Path, progress: bool = True) -> Path:
    """Import `gguf_path` into the HF-format directory `dest` (which must not exist yet)."""
    gguf_path, dest = Path(gguf_path), Path(dest)
    if dest.exists():
        raise GGUFError(f"{dest}: already exists")
    model = GGUFModel(gguf_path)  # everything below reads what its check parsed and validated
    files = model.text_files()

    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_imports(dest.parent)
    tmp = dest.parent / f"{TMP_PREFIX}{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        bar = _progress(len(model.names), f"importing {gguf_path.name}" if progress else None)
        tensors = {}
        for name in model.names:
            tensors.update(hub_tensors(model.cfg, name, model.float32(name)))
            bar.update(1)
        bar.close()
        if model.cfg.spec.stacked_experts_on_hub:
            model.cfg.spec.hub_experts(model.cfg, tensors)
        for k_b in [name for name in tensors if name.endswith("self_attn.k_b_proj.weight")]:  # latent attention, as on the Hub
            v_b = k_b.replace("k_b_proj", "v_b_proj")
            tensors[k_b.replace("k_b_proj", "kv_b_proj")] = fused_kv_b(tensors.pop(k_b), tensors.pop(v_b))
        write_safetensors(tmp / "model.safetensors", tensors, metadata={"format": "pt"})
        del tensors
        write_text_files(tmp, files)
        # Where the weights came from: `compare` uses transformers reading this same GGUF as the oracle.
        record = {"source": gguf_path.name, "path": str(gguf_path.resolve()), "size": gguf_path.stat().st_size}
        _write_json(tmp / "minillm_import.json", record)
        os.rename(tmp, dest)  # atomic: the model appears whole or not at all
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if (dest / "config.json").exists():  # another process finished the same import first
            return dest
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def hub_tensors(cfg, name: str, w):
    """{HF name: array} as checkpoints on the Hub store `name`: a mixture of experts' stacked
    matrices (llama.cpp's ffn_*_exps) as one matrix per expert, under the architecture's prefix."""
    parts = name.split(".")
    if not cfg.num_experts or cfg.spec.stacked_experts_on_hub or len(parts) < 5 or parts[3] != "mlp" or not cfg.layer_is_sparse(int(parts[2])):
        return {name: w}
    i = int(parts[2])
    rest = ".".join(parts[4:])
    if rest == "gate.weight":
        return {moe_prefix(cfg, i) + rest: w}
    if rest == "experts.gate_up_proj.weight":
        I = cfg.expert_intermediate_size
        return {expert_matrix(cfg, i, e, kind): np.ascontiguousarray(w[e, rows])
                for e in range(w.shape[0]) for kind, rows in (("gate", slice(0, I)), ("up", slice(I, 2 * I)))}
    if rest in ("experts.gate_proj.weight", "experts.up_proj.weight", "experts.down_proj.weight"):
        kind = rest.split(".")[1][: -len("_proj")]
        return {expert_matrix(cfg, i, e, kind): np.ascontiguousarray(w[e]) for e in range(w.shape[0])}
    return {name: w}


def _progress(total: int, desc: str | None):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=desc is None, file=sys.stderr, leave=False)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _remove_stale_imports(parent: Path) -> None:
    """Delete temporary directories left by imports that were killed (their process is gone)."""
    for tmp in parent.glob(TMP_PREFIX + "*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
