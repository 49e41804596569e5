"""`minillm merge-lora`: a checkpoint directory with LoRA adapters merged into its weights, for
users who want one model (PEFT's merge_and_unload, without torch): W += scale * B A, in float32,
stored back in each tensor's own dtype. Written under a temporary name and renamed: an
interrupted merge leaves nothing half-written."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from .. import kernels as K
from ..errors import CheckpointError, UsageError
from .checkpoint import checked_directory
from .lora import combined, load_adapter, widened
from .safetensors_io import write_safetensors
from .tensor_names import STACKED_DOWN, STACKED_GATE_UP, expert_matrix, moe_prefix, rope_halves_order, router_name


def merge_lora(model_dir: str | Path, adapters: list[tuple[str, float]], out_dir: str | Path) -> Path:
    """Merge the adapters ((path, scale) each; PEFT directories or GGUF adapters) into the
    safetensors checkpoint `model_dir`, written to `out_dir` (which must not exist)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / "config.json").is_file():
        raise UsageError(f"{model_dir}: merge-lora needs a checkpoint directory (config.json and safetensors), not a GGUF file")
    if out_dir.exists():
        raise UsageError(f"{out_dir}: already exists; merge-lora writes a new directory")
    cfg, owner, _ = checked_directory(model_dir)
    adapter = combined([load_adapter(path, cfg, scale=scale) for path, scale in adapters])
    deltas: dict[str, np.ndarray] = {}
    for u in adapter.updates:
        if u.kind == "lm_head" and cfg.tie_word_embeddings:
            raise CheckpointError(f"{u.module}: the LM head is tied to the embeddings here; merging its update would change both")
        name, at = _merged_tensor(cfg, owner, u)
        a, b = widened(u.a), widened(u.b)
        order = rope_halves_order(cfg, name, b.shape[0])
        if order is not None:
            b = np.ascontiguousarray(b[np.argsort(order)])  # back in the checkpoint's row order
        if name not in deltas:
            deltas[name] = np.zeros(owner[name].tensors[name].shape, np.float32)
        deltas[name][at] += (b @ a) * np.float32(u.scale)
    tmp = out_dir.with_name(f".{out_dir.name}.merging")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        files = {id(f): f for f in owner.values()}.values()
        for f in files:
            tensors, dtypes = {}, {}
            for name in f.tensors:
                stored = f.tensors[name].dtype
                tensors[name] = _merged(f.float32(name), deltas.pop(name), stored) if name in deltas else f.raw(name)
                if stored == "BF16":
                    dtypes[name] = "BF16"
            write_safetensors(tmp / f.path.name, tensors, f.metadata or None, dtypes)
        assert not deltas, f"updates on tensors no shard holds: {sorted(deltas)}"
        for item in model_dir.iterdir():  # config, tokenizer, generation config, the shard index
            if item.is_file() and item.suffix != ".safetensors":
                shutil.copyfile(item, tmp / item.name)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _merged_tensor(cfg, owner: dict, u) -> tuple[str, tuple]:
    """The checkpoint tensor an update changes, and where in it: a module's weight; a router's;
    an expert's matrix, per expert or in the experts' stacked tensors (gate rows then up)."""
    if u.kind == "lm_head":
        return "lm_head.weight", ()
    if u.kind == "router":
        return next(n for n in (router_name(cfg, u.layer), router_name(cfg, u.layer, stacked=True)) if n in owner), ()
    if u.kind.startswith("expert_"):
        kind = u.kind.removeprefix("expert_")
        name = expert_matrix(cfg, u.layer, u.expert, kind)
        if name in owner:
            return name, ()
        I = cfg.expert_intermediate_size
        stacked = moe_prefix(cfg, u.layer, stacked=True) + (STACKED_DOWN if kind == "down" else STACKED_GATE_UP)
        if stacked not in owner or cfg.hidden_act == "clamped_swiglu":
            raise CheckpointError(f"{u.module}: this checkpoint's experts are not stored as per-expert or stacked (E, 2 I, H) matrices")
        return stacked, (u.expert,) if kind == "down" else (u.expert, slice(0, I) if kind == "gate" else slice(I, 2 * I))
    return u.module + ".weight", ()


def _merged(w: np.ndarray, delta: np.ndarray, stored: str) -> np.ndarray:
    """w + delta in float32, in the stored dtype (BF16 as its bits, rounded to nearest even)."""
    total = w + delta
    if stored == "F32":
        return total
    if stored == "F16":
        return total.astype(np.float16)
    if stored == "BF16":
        rows = np.ascontiguousarray(total).reshape(-1, total.shape[-1])  # experts' stacked matrices as rows
        bits = np.empty(rows.shape, np.uint16)
        K.to_bf16(bits, rows)
        return bits.reshape(total.shape)
    raise CheckpointError(f"a weight stored as {stored} cannot take a LoRA update (F32, F16 or BF16 only)")
