"""The tensors a config implies, by HF name and shape, and the one check of a checkpoint's set.

Both loaders use it: safetensors directories (checkpoint.py) and GGUF files (gguf_file.py, whose
tensors are renamed to these names).
"""

from __future__ import annotations

import numpy as np

from ..errors import CheckpointError
from .config import ModelConfig

# Tensors some checkpoints carry that the forward pass recomputes or does not need.
HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)

# A mixture of experts' tensors under a sparse layer's prefix: the router, then each expert's
# gate, up and down matrices, per expert (as checkpoints on the Hub store them) or stacked in 3-D
# tensors (as transformers 5 holds them in memory, and some checkpoints store them). The names
# are the architecture's spec's (router_tensor, expert_tensors, per_expert_block).
STACKED_GATE_UP, STACKED_DOWN = "experts.gate_up_proj", "experts.down_proj"  # (E, 2 I, H): gate rows then up; (E, H, I)
# gpt-oss stores them transposed, gate and up interleaved: (E, H, 2 I) gate at even columns, up at
# odd; (E, I, H); each with a bias (E, 2 I), (E, H) named with "_bias"; its router is `mlp.router`.
# As gpt-oss ships them they are MXFP4 ("mxfp4" layout): `<name>_blocks` (E, N, K / 32, 16) uint8,
# two FP4 values a byte (low nibble first), and `<name>_scales` (E, N, K / 32) uint8 exponents,
# rows N not transposed (gate_up's rows interleaved, gate first).


def router_name(cfg: ModelConfig, layer: int, stacked: bool = False) -> str:
    """The HF name of layer `layer`'s router matrix."""
    return moe_prefix(cfg, layer, stacked) + cfg.spec.router_tensor


def moe_prefix(cfg: ModelConfig, layer: int, stacked: bool = False) -> str:
    """The HF name prefix of layer `layer`'s mixture of experts (transformers 5 names Mixtral's
    `mlp` too, in the stacked layout)."""
    return f"model.layers.{layer}." + ("mlp." if stacked else cfg.spec.per_expert_block)


def expert_matrix(cfg: ModelConfig, layer: int, expert: int, kind: str) -> str:
    """The per-expert name of expert `expert`'s `kind` ("gate", "up" or "down") matrix in layer `layer`."""
    names = cfg.spec.expert_tensors
    return moe_prefix(cfg, layer) + f"experts.{expert}.{names[('gate', 'up', 'down').index(kind)]}.weight"


EXPERT_LAYOUTS = ("per_expert", "stacked", "gguf", "gguf_fused", "mxfp4")


def expected_shapes(cfg: ModelConfig, expert_layout: str = "per_expert", split_kv_b: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor the config implies, by HF name; a mixture of experts' matrices in one of
    EXPERT_LAYOUTS: per expert, stacked as transformers 5 holds them (STACKED_GATE_UP,
    STACKED_DOWN), or stacked as llama.cpp's converter writes them, named so that gguf-py's
    tables map them (`mlp.experts.gate_proj.weight` .., or gate_up fused); latent attention's
    kv_b_proj as one, or with split_kv_b as the converter splits it (latent_shapes)."""
    assert expert_layout in EXPERT_LAYOUTS, expert_layout
    H, I, V, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for name in cfg.spec.norm_names.values():
            if name is not None:
                shapes[p + name + ".weight"] = (H,)
        if cfg.qk_norm in ("head", "projection"):  # ("weightless": none stored)
            shapes[p + "self_attn.q_norm.weight"] = (hd,) if cfg.qk_norm == "head" else (cfg.q_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,) if cfg.qk_norm == "head" else (cfg.kv_dim,)
        if cfg.latent:
            attn = {}
            shapes.update({p + f"self_attn.{name}.weight": shape for name, shape in latent_shapes(cfg, split_kv_b).items()})
        elif cfg.fused_qkv:
            attn = {"qkv": (cfg.q_dim + 2 * cfg.kv_dim, H), "o": (H, cfg.q_dim)}
        else:
            attn = {"q": (cfg.q_dim, H), "k": (cfg.kv_dim, H), "v": (cfg.kv_dim, H), "o": (H, cfg.q_dim)}
        mlp = {"gate_up": (2 * I, H), "down": (H, I)} if cfg.fused_gate_up else {"gate": (I, H), "up": (I, H), "down": (H, I)}
        if not cfg.gated_mlp:
            del mlp["gate"]
        for name, shape in cfg.spec.activation_tensors.items():
            shapes[p + "mlp.act_fn." + name] = shape
        for name, shape in attn.items():
            shapes[p + f"self_attn.{name}_proj.weight"] = shape
            if cfg.o_bias if name == "o" else cfg.qkv_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = shape[:1]
        if cfg.attention_sinks:
            shapes[p + "self_attn.sinks"] = (cfg.num_attention_heads,)
        if cfg.layer_is_sparse(i):
            shapes.update(_expert_shapes(cfg, i, expert_layout))
            continue
        for name, shape in mlp.items():
            shapes[p + f"mlp.{name}_proj.weight"] = shape
            if cfg.mlp_bias:
                shapes[p + f"mlp.{name}_proj.bias"] = shape[:1]
    return shapes


def latent_shapes(cfg: ModelConfig, split_kv_b: bool = False) -> dict[str, tuple[int, ...]]:
    """Latent attention's weights under self_attn. (DeepseekV3Attention's), without ".weight".
    split_kv_b: kv_b_proj as llama.cpp's converter writes it, k_b_proj (heads, kv_lora_rank, own
    part: each head's key rows transposed) and v_b_proj (heads, v_head_dim, kv_lora_rank)."""
    H, heads, own, rank = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim - cfg.rope_dim, cfg.kv_lora_rank
    q = {"q_a_proj": (cfg.q_lora_rank, H), "q_a_layernorm": (cfg.q_lora_rank,), "q_b_proj": (cfg.q_dim, cfg.q_lora_rank)}
    kv_b = {"k_b_proj": (heads, rank, own), "v_b_proj": (heads, cfg.value_dim, rank)} if split_kv_b else {"kv_b_proj": (heads * (own + cfg.value_dim), rank)}
    return {**(q if cfg.q_lora_rank else {"q_proj": (cfg.q_dim, H)}), "kv_a_proj_with_mqa": (rank + cfg.rope_dim, H),
            "kv_a_layernorm": (rank,), **kv_b, "o_proj": (H, heads * cfg.value_dim)}


def fused_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """kv_b_proj (heads * (own + v_head_dim), kv_lora_rank) from the converter's split k_b_proj
    and v_b_proj (latent_shapes)."""
    rank = k_b.shape[1]
    return np.ascontiguousarray(np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, rank))


def _expert_shapes(cfg: ModelConfig, i: int, layout: str) -> dict[str, tuple[int, ...]]:
    H, E, I = cfg.hidden_size, cfg.num_experts, cfg.expert_intermediate_size
    moe = moe_prefix(cfg, i, stacked=layout != "per_expert")
    shapes: dict[str, tuple[int, ...]] = {router_name(cfg, i, stacked=layout != "per_expert"): (E, H)}
    if cfg.router_bias:
        shapes[moe + "router.bias"] = (E,)
    if layout == "stacked" and cfg.spec.transposed_experts:  # gpt-oss (interleaved, with biases), Llama 4
        shapes.update({moe + STACKED_GATE_UP: (E, H, 2 * I), moe + STACKED_DOWN: (E, I, H)})
        if cfg.router_bias:
            shapes.update({moe + STACKED_GATE_UP + "_bias": (E, 2 * I), moe + STACKED_DOWN + "_bias": (E, H)})
    elif layout == "mxfp4":
        for name, (N, K) in ((STACKED_GATE_UP, (2 * I, H)), (STACKED_DOWN, (H, I))):
            shapes.update({moe + name + "_blocks": (E, N, K // 32, 16), moe + name + "_scales": (E, N, K // 32),
                           moe + name + "_bias": (E, N)})
    elif layout == "stacked":
        shapes[moe + STACKED_GATE_UP] = (E, 2 * I, H)
        shapes[moe + STACKED_DOWN] = (E, H, I)
    elif layout == "gguf":
        shapes.update({moe + "experts.gate_proj.weight": (E, I, H), moe + "experts.up_proj.weight": (E, I, H),
                       moe + "experts.down_proj.weight": (E, H, I)})
        if cfg.router_bias:
            shapes.update({moe + "experts.gate_proj.bias": (E, I), moe + "experts.up_proj.bias": (E, I), moe + "experts.down_proj.bias": (E, H)})
    elif layout == "gguf_fused":
        shapes.update({moe + "experts.gate_up_proj.weight": (E, 2 * I, H), moe + "experts.down_proj.weight": (E, H, I)})
    else:
        for e in range(E):
            shapes[expert_matrix(cfg, i, e, "gate")] = shapes[expert_matrix(cfg, i, e, "up")] = (I, H)
            shapes[expert_matrix(cfg, i, e, "down")] = (H, I)
    spec = cfg.spec
    if cfg.shared_expert_intermediate_size:
        S, shared = cfg.shared_expert_intermediate_size, moe + spec.shared_expert_prefix
        shapes.update({shared + "gate_proj.weight": (S, H), shared + "up_proj.weight": (S, H), shared + "down_proj.weight": (H, S)})
        if spec.shared_expert_gate:
            shapes[moe + "shared_expert_gate.weight"] = (1, H)
    if cfg.selection_bias:
        shapes[moe + spec.selection_bias_tensor] = spec.selection_bias_shape(E)
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




def rope_halves_order(cfg: ModelConfig, name: str, rows: int, pairs: bool | None = None, rotary: int | None = None) -> np.ndarray | None:
    """The row order that puts a q or k tensor (weight, bias or q/k norm) in the layout the RoPE
    kernel turns: each head's rotated pairs at (j, j + head_dim / 2), the dimensions RoPE leaves
    alone (partial_rotary_factor) after them in each half, where their frequency is 0. `pairs`:
    the stored rows rotate neighbours (2i, 2i + 1) (default: cfg.interleaved_rope; HF's own
    halves (i, i + rotary / 2) otherwise); `rotary`: the dimensions turned (default cfg.rope_dim).
    None where nothing moves. Attention is unchanged: q and k are reordered alike."""
    pairs = cfg.interleaved_rope if pairs is None else pairs
    hd, r = cfg.head_dim, cfg.rope_dim if rotary is None else rotary
    if not pairs and r == hd:
        return None
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):  # fused: q's rows, k's, then v's as they are
        q, k = (rope_halves_order(cfg, f"{kind}_proj.weight", rows, pairs, rotary) for kind in ("q", "k"))
        return np.concatenate([q, k + cfg.q_dim, np.arange(cfg.q_dim + cfg.kv_dim, rows)])
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        heads = cfg.num_attention_heads
    elif name.endswith(("k_proj.weight", "k_proj.bias")):
        heads = cfg.num_key_value_heads
    elif name.endswith(("q_norm.weight", "k_norm.weight")):
        heads = rows // hd
    else:
        return None
    turned = (np.arange(0, r, 2), np.arange(1, r, 2)) if pairs else (np.arange(r // 2), np.arange(r // 2, r))
    still = np.arange(r, hd)
    head = np.concatenate([turned[0], still[: len(still) // 2], turned[1], still[len(still) // 2 :]])
    return (np.arange(heads)[:, None] * hd + head[None, :]).reshape(-1)


def latent_rows(cfg: ModelConfig, which: str, split_kv_b: bool = False) -> np.ndarray:
    """Latent attention's matrices as the forward pass reads them: the stored rows of q_b_proj (or
    q_proj) for "q", of kv_b_proj for "k" and "v", of kv_a_proj_with_mqa for "kv_a", in order, -1
    for a row of zeros. A head of q or k is [own part | RoPE part] as stored; here the RoPE part
    comes first, in the halves the RoPE kernel turns (rope_halves_order: its neighbouring pairs
    split into their first and second members), so that every head's q and k are reordered alike
    and attention is unchanged. k's RoPE rows are zeros: the forward pass writes the shared key
    there, kv_a's last rows, which are given in those halves too. A value is v_head_dim wide,
    zeros after it up to head_dim (the cache's rows are one width). split_kv_b: "k" and "v" are
    rows of the converter's k_b_proj (each head's transposed back) and v_b_proj (latent_shapes)."""
    hd, r, heads, v = cfg.head_dim, cfg.rope_dim, cfg.num_attention_heads, cfg.value_dim
    own = hd - r
    halves = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])
    if which == "kv_a":
        return np.concatenate([np.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + halves])
    # the RoPE kernel's head: the turned halves, each followed by half of the dimensions it leaves alone
    still = np.arange(r, hd)
    head = np.concatenate([halves[: r // 2], still[: own // 2], halves[r // 2 :], still[own // 2 :]])
    stride = own + v  # kv_b_proj's rows per head: the key's own part, then the value
    k_stride, v_stride, v_start = (own, v, 0) if split_kv_b else (stride, stride, own)
    per_head = []
    for h in range(heads):
        if which == "q":  # stored [own | rope] -> [rope | own]
            virtual = np.concatenate([h * hd + own + np.arange(r), h * hd + np.arange(own)])
        elif which == "k":
            virtual = np.concatenate([np.full(r, -1), h * k_stride + np.arange(own)])
        else:
            per_head.append(np.concatenate([h * v_stride + v_start + np.arange(v), np.full(hd - v, -1)]))
            continue
        per_head.append(virtual[head])
    return np.concatenate(per_head)
