"""Loading an HF checkpoint directory into float32 weights with HF names and (out, in) layouts.

This is the one boundary for weight names: every expected tensor is checked for presence and
shape here, before any kernel can see it (a Numba kernel does not check bounds).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .errors import CheckpointError
from .safetensors_io import SafetensorsFile

# Tensors some checkpoints carry that the forward pass recomputes or does not need.
HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LayerWeights:
    input_norm: np.ndarray  # (H,)
    wq: np.ndarray  # (q_dim, H)
    wk: np.ndarray  # (kv_dim, H)
    wv: np.ndarray  # (kv_dim, H)
    wo: np.ndarray  # (H, q_dim)
    bq: np.ndarray | None
    bk: np.ndarray | None
    bv: np.ndarray | None
    bo: np.ndarray | None
    post_norm: np.ndarray  # (H,)
    w_gate: np.ndarray  # (I, H)
    w_up: np.ndarray  # (I, H)
    w_down: np.ndarray  # (H, I)
    b_gate: np.ndarray | None
    b_up: np.ndarray | None
    b_down: np.ndarray | None


@dataclass
class Weights:
    embed: np.ndarray  # (V, H)
    layers: list[LayerWeights]
    norm: np.ndarray  # (H,)
    lm_head: np.ndarray  # (V, H); the embedding itself when tied


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the config implies, by HF name."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        attn = {"q": (cfg.q_dim, H), "k": (cfg.kv_dim, H), "v": (cfg.kv_dim, H), "o": (H, cfg.q_dim)}
        for name, shape in attn.items():
            shapes[p + f"self_attn.{name}_proj.weight"] = shape
            if cfg.attention_bias or (cfg.qkv_bias and name != "o"):
                shapes[p + f"self_attn.{name}_proj.bias"] = shape[:1]
        mlp = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        for name, shape in mlp.items():
            shapes[p + f"mlp.{name}_proj.weight"] = shape
            if cfg.mlp_bias:
                shapes[p + f"mlp.{name}_proj.bias"] = shape[:1]
    return shapes


def open_shards(model_dir: Path) -> dict[str, SafetensorsFile]:
    """{tensor name: the file holding it}, from model.safetensors or a sharded index."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a valid index: {e}") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: field 'weight_map' must be an object")
        files: dict[str, SafetensorsFile] = {}
        owner: dict[str, SafetensorsFile] = {}
        for name, shard in weight_map.items():
            if shard not in files:
                files[shard] = SafetensorsFile(_shard_path(model_dir, index, shard))
            if name not in files[shard].tensors:
                raise CheckpointError(f"{index}: tensor {name!r} is mapped to {shard}, which does not hold it")
            owner[name] = files[shard]
        for shard, f in files.items():
            for name in f.tensors:
                if owner.get(name) is not f:
                    raise CheckpointError(f"{f.path}: tensor {name!r} is not mapped to this shard by {index.name}")
        return owner
    if single.exists():
        f = SafetensorsFile(single)
        return {name: f for name in f.tensors}
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def _shard_path(model_dir: Path, index: Path, shard) -> Path:
    """A shard named by the index: a plain file name inside the model directory, never a way out."""
    if (
        not isinstance(shard, str)
        or not shard
        or shard in (".", "..")
        or "/" in shard
        or "\\" in shard
        or "\0" in shard
        or os.path.isabs(shard)
    ):
        raise CheckpointError(f"{index}: shard name {shard!r} is not a plain file name")
    path = model_dir / shard
    if not path.resolve().is_relative_to(model_dir.resolve()):
        raise CheckpointError(f"{index}: shard {shard!r} leads outside the model directory")
    if not path.is_file():
        raise CheckpointError(f"{index}: shard {shard!r} does not exist")
    return path


def load_checkpoint(model_dir: str | Path, check_finite: bool = False) -> tuple[ModelConfig, Weights]:
    """Config and float32 weights (views of the files where stored as F32), checked against each other."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a model directory")
    cfg = ModelConfig.from_file(model_dir / "config.json")
    owner = open_shards(model_dir)
    if not cfg.tie_word_embeddings and "lm_head.weight" not in owner:
        # A checkpoint that omits lm_head.weight ties it to the embeddings, whatever the flag says.
        cfg = replace(cfg, tie_word_embeddings=True)
    shapes = expected_shapes(cfg)

    for name, shape in shapes.items():
        if name not in owner:
            raise CheckpointError(f"{model_dir}: missing tensor {name!r}")
        found = owner[name].tensors[name].shape
        if found != shape:
            raise CheckpointError(f"{owner[name].path}: tensor {name!r} has shape {list(found)}, config implies {list(shape)}")
    for name in owner:
        harmless = name.endswith(HARMLESS_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings)
        if name not in shapes and not harmless:
            raise CheckpointError(f"{owner[name].path}: unexpected tensor {name!r} for {cfg.architecture}")

    def get(name: str) -> np.ndarray | None:
        if name not in shapes:
            return None
        arr = np.ascontiguousarray(owner[name].float32(name))
        if check_finite and not np.isfinite(arr).all():
            raise CheckpointError(f"{owner[name].path}: tensor {name!r} contains NaN or Inf")
        return arr

    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        layers.append(
            LayerWeights(
                input_norm=get(p + "input_layernorm.weight"),
                wq=get(a + "q_proj.weight"),
                wk=get(a + "k_proj.weight"),
                wv=get(a + "v_proj.weight"),
                wo=get(a + "o_proj.weight"),
                bq=get(a + "q_proj.bias"),
                bk=get(a + "k_proj.bias"),
                bv=get(a + "v_proj.bias"),
                bo=get(a + "o_proj.bias"),
                post_norm=get(p + "post_attention_layernorm.weight"),
                w_gate=get(m + "gate_proj.weight"),
                w_up=get(m + "up_proj.weight"),
                w_down=get(m + "down_proj.weight"),
                b_gate=get(m + "gate_proj.bias"),
                b_up=get(m + "up_proj.bias"),
                b_down=get(m + "down_proj.bias"),
            )
        )
    embed = get("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else get("lm_head.weight")
    return cfg, Weights(embed=embed, layers=layers, norm=get("model.norm.weight"), lm_head=lm_head)
