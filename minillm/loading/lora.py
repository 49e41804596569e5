"""LoRA adapters as PEFT writes them: `adapter_config.json` + `adapter_model.safetensors`.

An adapter is low-rank updates on some of the base model's linear layers: y = W x + s * B (A x),
A (r, K) and B (N, r), s = lora_alpha / r (or / sqrt(r) with rsLoRA), r and alpha per module where
rank_pattern / alpha_pattern say so. The base weights are never copied or changed: the forward
pass adds each row's adapter's updates beside the base products (kernels.lora). Files are
untrusted like checkpoints: a module the base model does not have, a shape that disagrees, a
PEFT feature this engine does not run is one CheckpointError naming the file.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, MiniLLMError
from .config import ModelConfig
from .safetensors_io import SafetensorsFile
from .tensor_names import expected_shapes, latent_rows, rope_halves_order

_keys = itertools.count()
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's names: base_model.model.<module>.lora_A.weight

# A module's name without its layer -> the projection it updates. Routers and experts are
# parameters in transformers 5, not linear modules, so PEFT's LoRA never targets them there.
_KINDS = {
    "self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v", "self_attn.o_proj": "o",
    "self_attn.qkv_proj": "qkv", "mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.down_proj": "down", "mlp.gate_up_proj": "gate_up",
    "mlp.shared_expert.gate_proj": "gate", "mlp.shared_expert.up_proj": "up", "mlp.shared_expert.down_proj": "down",
    "mlp.shared_expert_gate": "shared_gate",
    "mlp.shared_experts.gate_proj": "gate", "mlp.shared_experts.up_proj": "up", "mlp.shared_experts.down_proj": "down",
}


@dataclass(frozen=True)
class LoraUpdate:
    """One module's update: y += scale * b @ (a @ x)."""

    module: str  # PEFT's module name, "model.layers.3.self_attn.q_proj"
    layer: int  # -1: the LM head
    kind: str  # q k v o qkv gate up down gate_up shared_gate lm_head; router, expert_gate expert_up expert_down
    a: np.ndarray  # (r, K) as stored: float32, float16, or bfloat16 as uint16 bits (widened() reads any)
    b: np.ndarray  # (N, r) likewise, rows in the order the model holds the base matrix's (rope_halves_order)
    scale: float
    expert: int = -1  # the expert of an expert_* update


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    updates: tuple[LoraUpdate, ...]
    base_model: str | None  # adapter_config's base_model_name_or_path
    # never the same for two adapters loaded: what the prefix cache chains this adapter's keys
    # and values from (an adapter loaded again, or scaled, computes other keys and values)
    key: tuple = field(default_factory=lambda: ("lora", next(_keys)), compare=False)

    @property
    def rank(self) -> int:
        return max(u.a.shape[0] for u in self.updates)

    def scaled(self, factor: float) -> "Adapter":
        """The same adapter with every update's scale times `factor` (llama.cpp's --lora-scaled)."""
        updates = tuple(LoraUpdate(u.module, u.layer, u.kind, u.a, u.b, u.scale * factor, u.expert) for u in self.updates)
        return Adapter(self.name, self.path, updates, self.base_model)


def load_adapter(path: str | Path, cfg: ModelConfig, name: str | None = None, scale: float = 1.0) -> Adapter:
    """A PEFT LoRA adapter directory, or a GGUF LoRA adapter as llama.cpp's convert_lora_to_gguf.py
    writes it, checked against the base model's config `cfg`."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf_adapter(path, cfg, name, scale)
    if not path.is_dir():
        raise CheckpointError(f"{path}: a LoRA adapter is a directory with {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}, or a GGUF adapter file")
    settings = _adapter_config(path / ADAPTER_CONFIG)
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        pickle = " (adapter_model.bin is a pickle, which minillm does not open; save with safe_serialization)" if (path / "adapter_model.bin").exists() else ""
        raise CheckpointError(f"{weights}: missing{pickle}")
    f = SafetensorsFile(weights)
    shapes = expected_shapes(cfg)
    pairs: dict[str, dict[str, str]] = {}
    for key in f.tensors:
        match = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        saved_base = re.fullmatch(r"base_model\.model\.(lm_head|model\.embed_tokens)\.base_layer\.weight", key)
        if saved_base and tuple(f.tensors[key].shape) == (cfg.vocab_size, cfg.hidden_size):
            continue  # PEFT saves the base LM head beside its LoRA (save_embedding_layers): the base model's own
        if match is None:
            what = "an embedding's LoRA" if "lora_embedding" in key else "a tensor that is not a LoRA A or B matrix (modules_to_save, a bias, DoRA?)"
            raise CheckpointError(f"{weights}: tensor {key!r} is {what}; minillm runs LoRA updates of linear layers only")
        pairs.setdefault(match.group(1), {})[match.group(2)] = key
    if not pairs:
        raise CheckpointError(f"{weights}: no LoRA tensors")
    updates = []
    for module, keys in sorted(pairs.items(), key=lambda item: _module_order(item[0])):
        if set(keys) != {"A", "B"}:
            raise CheckpointError(f"{weights}: module {module!r} has lora_{'A' if 'B' in keys else 'B'} missing")
        a, b = _as_stored(f, keys["A"]), _as_stored(f, keys["B"])
        if re.fullmatch(r"model\.layers\.\d+\.mlp\.(experts(\.base_layer)*|gate)", module):  # PEFT's target_parameters
            updates += _parameter_updates(cfg, settings, path, module, a, b)
        else:
            r, rank_scale = _rank_and_scale(settings, module, path)
            updates.append(_update(cfg, shapes, weights, module, a, b, r, rank_scale))
    return Adapter(name or path.name, path, tuple(updates), settings.get("base_model_name_or_path")).scaled(scale)


def load_gguf_adapter(path: Path, cfg: ModelConfig, name: str | None = None, scale: float = 1.0) -> Adapter:
    """A GGUF LoRA adapter (general.type "adapter", adapter.type "lora"): `<base tensor>.lora_a`
    (r, K) and `.lora_b` (N, r) under the base model's GGUF names, scale adapter.lora.alpha / r
    (1 without an alpha, as llama.cpp reads it); Q and K's B rows un-permuted where the converter
    permuted the base model's."""
    from ..architectures import spec_of_gguf
    from .gguf_check import check_gguf
    from .gguf_file import FLOAT_TYPES, GGML_F16, Metadata, dequantized, gguf_names, tensor_bytes

    try:
        layout = check_gguf(path)
    except MiniLLMError as e:
        raise CheckpointError(str(e)) from None
    meta = Metadata(layout.metadata, path)
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise CheckpointError(f"{path}: metadata 'general.type' / 'adapter.type' are {meta.get('general.type')!r} / "
                              f"{meta.get('adapter.type')!r}, not a LoRA adapter ('adapter' / 'lora')")
    arch = meta.get("general.architecture")
    spec = spec_of_gguf(str(arch), experts=cfg.num_experts > 0)
    if spec is None or spec.hf_names != cfg.spec.hf_names:
        raise CheckpointError(f"{path}: metadata 'general.architecture' is {arch!r}, an adapter for another architecture than {cfg.architecture}")
    try:
        alpha = float(meta.typed("adapter.lora.alpha", float, 0.0))
    except MiniLLMError as e:
        raise CheckpointError(str(e)) from None
    shapes = expected_shapes(cfg)
    to_hf = gguf_names(str(arch), cfg.num_hidden_layers, shapes)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    stored = {**FLOAT_TYPES, GGML_F16: np.float16}  # read as the file holds them; other types dequantized
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    for t in layout.tensors:
        raw = tensor_bytes(mapped, layout, t)
        values = raw.view(stored[t.type]).reshape(tuple(reversed(t.shape))).copy() if t.type in stored else dequantized(raw, t, path)
        base, _, part = t.name.rpartition(".")
        hf = to_hf.get(base)
        if part not in ("lora_a", "lora_b") or hf is None or not hf.endswith(".weight"):
            raise CheckpointError(f"{path}: tensor {t.name!r} is not a LoRA A or B matrix of a weight of this {cfg.architecture} model")
        pairs.setdefault(hf[: -len(".weight")], {})[part] = values
    updates = []
    for module, parts in sorted(pairs.items(), key=lambda item: _module_order(item[0])):
        if set(parts) != {"lora_a", "lora_b"}:
            raise CheckpointError(f"{path}: module {module!r} has only {', '.join(parts)}")
        a, b = parts["lora_a"], parts["lora_b"]
        r = a.shape[0]
        if spec.gguf_permuted_qk:
            order = rope_halves_order(cfg, module + ".weight", b.shape[0], pairs=True, rotary=cfg.head_dim)
            b = b if order is None else b[order]
        updates.append(_update(cfg, shapes, path, module, a, b, r, alpha / r if alpha else 1.0))
    if not updates:
        raise CheckpointError(f"{path}: no LoRA tensors")
    return Adapter(name or path.stem, path, tuple(updates), None).scaled(scale)


def _rank_and_scale(settings: dict, key: str, path: Path) -> tuple[int, float]:
    """A module's (or parameter's) rank and scale: rank_pattern and alpha_pattern, rsLoRA."""
    r = _pattern_value(settings.get("rank_pattern") or {}, key, settings["r"], path / ADAPTER_CONFIG)
    alpha = _pattern_value(settings.get("alpha_pattern") or {}, key, settings["lora_alpha"], path / ADAPTER_CONFIG)
    return r, alpha / math.sqrt(r) if settings.get("use_rslora") else alpha / r


def _parameter_updates(cfg: ModelConfig, settings: dict, path: Path, module: str, a: np.ndarray, b: np.ndarray) -> list[LoraUpdate]:
    """PEFT's LoRA on a mixture of experts' parameters (target_parameters, which all-linear picks
    where experts are parameters): the router (`mlp.gate`, A (r, H), B (E, r)), or the stacked
    experts' gate_up_proj (E, 2 I, H) or down_proj (E, H, I) (`mlp.experts`, the second one
    wrapped as `.base_layer`: told apart by shape; patterns match `mlp.experts.gate_up_proj`, and
    peft doubles gate_up's rank), A (r E, K) holding expert e's A at rows e r.., B (N, r E) its
    B at columns j E + e, as peft's ParamWrapper reshapes them."""
    where = path / ADAPTER_WEIGHTS
    layer = int(module.split(".")[2])
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.expert_intermediate_size
    if not (layer < cfg.num_hidden_layers and cfg.layer_is_sparse(layer)):
        raise CheckpointError(f"{where}: module {module!r} is not a mixture of experts' layer of this {cfg.architecture} model")
    if cfg.hidden_act == "clamped_swiglu":  # gpt-oss: experts stored transposed, gate and up interleaved
        raise CheckpointError(f"{where}: module {module!r}: LoRA on gpt-oss's experts is not supported")
    if module.endswith(".gate"):
        r, scale = _rank_and_scale(settings, module + ".weight", path)
        return [_update(cfg, {module + ".weight": (E, H)}, where, module, a, b, r, scale, kind="router", layer=layer)]
    experts = module.split(".base_layer")[0]
    K, N = a.shape[1], b.shape[0]
    param = {(H, 2 * I): "gate_up_proj", (I, H): "down_proj"}.get((K, N))
    r, scale = _rank_and_scale(settings, f"{experts}.{param}", path) if param else (0, 0.0)
    if param is None or a.shape[0] != r * E or b.shape[1] != r * E:
        raise CheckpointError(f"{where}: module {module!r} has lora_A {list(a.shape)} and lora_B {list(b.shape)}: not a LoRA update of "
                              f"{E} experts' gate_up_proj [{2 * I}, {H}] or down_proj [{H}, {I}] at the rank adapter_config.json gives")
    updates = []
    for e in range(E):
        a_e, b_e = a[e * r : (e + 1) * r], b.reshape(N, r, E)[:, :, e]
        parts = (("expert_gate", b_e[:I]), ("expert_up", b_e[I:])) if (K, N) == (H, 2 * I) else (("expert_down", b_e),)
        for kind, rows in parts:
            updates.append(_update(cfg, {module + ".weight": rows.shape[:1] + (K,)}, where, module, np.ascontiguousarray(a_e),
                                   np.ascontiguousarray(rows), r, scale, kind=kind, layer=layer, expert=e))
    return updates


def _as_stored(f: SafetensorsFile, name: str) -> np.ndarray:
    """A tensor in the precision the file holds it where the forward pass reads that precision
    (float32; float16; bfloat16 as its bits), else widened to float32; a copy."""
    if f.tensors[name].dtype in ("F32", "F16", "BF16"):
        return np.array(f.raw(name))
    return np.array(f.float32(name))


def widened(values: np.ndarray) -> np.ndarray:
    """An update's A or B as float32, whatever its stored precision (bfloat16: uint16 bits)."""
    if values.dtype == np.uint16:
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32)


def _adapter_config(path: Path) -> dict:
    """adapter_config.json, refusing what changes the math beyond plain LoRA."""
    try:
        settings = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (a LoRA adapter as PEFT saves it)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(settings, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    if settings.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path}: peft_type {settings['peft_type']!r} is not supported (LORA only)")
    refused = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "layer_replication": "layer replication",
               "modules_to_save": "modules_to_save (whole replaced modules)", "trainable_token_indices": "trainable tokens"}
    for name, what in refused.items():
        if settings.get(name):
            raise CheckpointError(f"{path}: field {name!r}: {what} is not supported")
    if settings.get("bias", "none") != "none":
        raise CheckpointError(f"{path}: field 'bias' is {settings['bias']!r}: trained base biases are not supported (bias 'none' only)")
    for name in ("r", "lora_alpha"):
        if not isinstance(settings.get(name), (int, float)) or isinstance(settings.get(name), bool) or settings[name] <= 0:
            raise CheckpointError(f"{path}: field {name!r} must be a positive number, got {settings.get(name)!r}")
    for name in ("rank_pattern", "alpha_pattern"):
        pattern = settings.get(name) or {}
        if not isinstance(pattern, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in pattern.values()):
            raise CheckpointError(f"{path}: field {name!r} must map module patterns to positive numbers")
    return settings


def _pattern_value(pattern: dict, module: str, default, where: Path):
    """PEFT's rule (peft.utils.other.get_pattern_key): the first key that matches the module
    name's end, after a dot or from its start."""
    for key, value in pattern.items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error as e:
            raise CheckpointError(f"{where}: pattern {key!r} is not a regular expression ({e})") from None
    return default


def _module_order(module: str) -> tuple[int, str]:
    match = re.match(r"model\.layers\.(\d+)\.", module)
    return (int(match.group(1)) if match else 1 << 30, module)


def _update(cfg: ModelConfig, shapes: dict, where: Path, module: str, a: np.ndarray, b: np.ndarray, r: int, scale: float,
            kind: str | None = None, layer: int = -1, expert: int = -1) -> LoraUpdate:
    """One module's update of rank r, b's rows in HF's order, checked against the base matrix it
    updates (shapes[module + ".weight"]; kind and layer given for a parameter's update)."""
    if kind is not None:
        base = shapes[module + ".weight"]
    elif module == "lm_head":
        layer, kind = -1, "lm_head"
        base = (cfg.vocab_size, cfg.hidden_size)
    else:
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module)
        kind = _KINDS.get(match.group(2)) if match else None
        base = shapes.get(module + ".weight")
        if kind is None or base is None:
            raise CheckpointError(f"{where}: module {module!r} is not a linear layer of this {cfg.architecture} model that LoRA can update")
        layer = int(match.group(1))
    N, K = base
    widest = max(cfg.hidden_size, cfg.widest_mlp, cfg.q_dim)
    if r > 4 * widest:  # the forward pass keeps A x and part of B (A x) in a thread's scratch of 8 x widest
        raise CheckpointError(f"{where}: module {module!r} has rank {r}, above the {4 * widest} this model's buffers hold")
    if a.shape != (r, K) or b.shape != (N, r):
        raise CheckpointError(f"{where}: module {module!r} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, "
                              f"the base matrix {[N, K]} and rank {r} imply [{r}, {K}] and [{N}, {r}]")
    if not (np.isfinite(widened(a)).all() and np.isfinite(widened(b)).all()):
        raise CheckpointError(f"{where}: module {module!r} has values that are not finite")
    if cfg.latent:  # q_proj's rows as latent attention holds them; its other projections are not in _KINDS
        order = latent_rows(cfg, "q") if kind == "q" else None
    else:
        order = rope_halves_order(cfg, module.rsplit(".", 1)[-1] + ".weight", N)  # q and k rows as the model holds them
    if order is not None:
        b = b[order]
    return LoraUpdate(module, layer, kind, a, b, float(scale), expert)


def parse_lora_spec(text: str) -> tuple[str | None, str, float]:
    """"[NAME=]PATH[:SCALE]" (the --lora flag) -> (name or None, path, scale)."""
    name, _, rest = text.partition("=") if "=" in text else (None, "", text)
    path, scale = rest, 1.0
    head, colon, tail = rest.rpartition(":")
    if colon:
        try:
            path, scale = head, float(tail)
        except ValueError:
            pass  # a colon in the path
    if not path or (name is not None and not name):
        raise CheckpointError(f"--lora {text!r}: expected [NAME=]PATH[:SCALE]")
    return name, path, scale


def combined(adapters: list[Adapter]) -> Adapter:
    """Several adapters applied together, their updates summed (llama.cpp's several --lora)."""
    if len(adapters) == 1:
        return adapters[0]
    updates = tuple(u for a in adapters for u in a.updates)
    return Adapter("+".join(a.name for a in adapters), adapters[0].path, updates, adapters[0].base_model)
