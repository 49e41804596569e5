"""The tensors a config implies, by HF name and shape, and the one check of a checkpoint's set.

Both loaders use it: safetensors directories (checkpoint.py) and GGUF files (gguf_file.py, whose
tensors are renamed to these names).
"""

from __future__ import annotations

from ..errors import CheckpointError
from .config import ModelConfig

# Tensors some checkpoints carry that the forward pass recomputes or does not need.
HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)

# The HF tensor name of each norm of a layer, by norm placement (None: no such norm).
NORM_NAMES = {
    "pre": dict(attn_norm="input_layernorm", attn_out_norm=None, mlp_norm="post_attention_layernorm", mlp_out_norm=None),
    "post": dict(attn_norm=None, attn_out_norm="post_attention_layernorm", mlp_norm=None, mlp_out_norm="post_feedforward_layernorm"),
    "sandwich": dict(attn_norm="input_layernorm", attn_out_norm="post_attention_layernorm",
                     mlp_norm="pre_feedforward_layernorm", mlp_out_norm="post_feedforward_layernorm"),
}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the config implies, by HF name."""
    H, I, V, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for name in NORM_NAMES[cfg.norm_placement].values():
            if name is not None:
                shapes[p + name + ".weight"] = (H,)
        if cfg.qk_norm is not None:
            shapes[p + "self_attn.q_norm.weight"] = (hd,) if cfg.qk_norm == "head" else (cfg.q_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,) if cfg.qk_norm == "head" else (cfg.kv_dim,)
        if cfg.fused_projections:
            attn = {"qkv": (cfg.q_dim + 2 * cfg.kv_dim, H), "o": (H, cfg.q_dim)}
            mlp = {"gate_up": (2 * I, H), "down": (H, I)}
        else:
            attn = {"q": (cfg.q_dim, H), "k": (cfg.kv_dim, H), "v": (cfg.kv_dim, H), "o": (H, cfg.q_dim)}
            mlp = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        for name, shape in attn.items():
            shapes[p + f"self_attn.{name}_proj.weight"] = shape
            if cfg.attention_bias or (cfg.qkv_bias and name != "o"):
                shapes[p + f"self_attn.{name}_proj.bias"] = shape[:1]
        for name, shape in mlp.items():
            shapes[p + f"mlp.{name}_proj.weight"] = shape
            if cfg.mlp_bias:
                shapes[p + f"mlp.{name}_proj.bias"] = shape[:1]
    return shapes


def check_tensor_set(found: dict, expected: dict, cfg: ModelConfig, where, ignorable=lambda name: False, error=CheckpointError) -> None:
    """The one tensor-set check: every tensor `expected` names (HF name -> shape, expected_shapes)
    is in `found` with that shape, and `found` holds nothing else but `ignorable` tensors.
    where(name): the file to name in the error; error: the exception type to raise."""
    for name, shape in expected.items():
        if name not in found:
            raise error(f"{where(name)}: missing tensor {name!r}")
        if tuple(found[name]) != tuple(shape):
            raise error(f"{where(name)}: tensor {name!r} has shape {list(found[name])}, config implies {list(shape)}")
    for name in found:
        if name not in expected and not ignorable(name):
            raise error(f"{where(name)}: unexpected tensor {name!r} for {cfg.architecture}")


