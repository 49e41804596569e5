"""GGUF files written from tiny HF checkpoints with gguf-py's own writer, the way llama.cpp's
convert_hf_to_gguf.py writes them: its metadata keys per architecture, tensor names from gguf-py's
tables, Llama's Q/K rows permuted, Gemma's norms stored as 1 + w, Phi-3's longrope factors as
tensors; and small vocabularies of either kind (byte-level BPE or SentencePiece)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# HF architecture -> GGUF architecture name
GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Olmo2ForCausalLM": "olmo2",
             "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
             "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe", "OlmoeForCausalLM": "olmoe",
             "GptOssForCausalLM": "gpt-oss", "GraniteForCausalLM": "granite", "Olmo3ForCausalLM": "olmo2", "Exaone4ForCausalLM": "exaone4",
             "SeedOssForCausalLM": "seed_oss", "Ernie4_5ForCausalLM": "ernie4_5", "Glm4ForCausalLM": "glm4",
             "GraniteMoeForCausalLM": "granitemoe", "Cohere2ForCausalLM": "cohere2", "Ernie4_5_MoeForCausalLM": "ernie4_5-moe",
             "Glm4MoeForCausalLM": "glm4moe", "ApertusForCausalLM": "apertus", "DeepseekV3ForCausalLM": "deepseek2",
             "DeepseekV2ForCausalLM": "deepseek2", "Llama4ForCausalLM": "llama4"}
PERMUTED_QK = ("llama", "granite", "granitemoe")  # the converter permutes Q and K for llama.cpp's RoPE on pairs
SPM = ("gemma2", "gemma3", "phi3")  # written with a SentencePiece vocabulary, as their models ship


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's permute(): HF's split-half RoPE rows to llama.cpp's interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, path: Path, qtype=None, vocab: dict | None = None, fuse_gate_up_exps: bool = False, split_max_tensors: int = 0,
               split_kv_b: bool = True) -> Path:
    """Convert the checkpoint in hf_dir to a GGUF at path: F32 tensors, or 2-D weights (and 3-D
    experts) quantized to `qtype` (a gguf.GGMLQuantizationType, or a function of the GGUF tensor
    name giving one or None) where their rows allow it. vocab: tokenizer metadata (make_vocab's),
    by default one of the right kind and size. A mixture of experts' per-expert matrices are
    stacked into ffn_{gate,up,down}_exps (or with fuse_gate_up_exps, ffn_gate_up_exps), as the
    converter stacks them. DeepSeek's kv_b_proj is split into attn_k_b (transposed) and attn_v_b,
    as the converter does since its MLA change, or with split_kv_b=False kept whole, as before."""
    from gguf import MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["architectures"][0]]
    L, H, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or H // heads
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    rope_dims = int(head_dim * (cfg.get("partial_rotary_factor") or full.get("partial_rotary_factor") or 1.0))  # GLM-4: half of each head
    w = GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)  # split: gguf-split's NAME-0000i-of-0000N.gguf
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(H)
    nextn = cfg.get("num_nextn_predict_layers", 0) if arch == "glm4moe" else 0
    w.add_block_count(L + nextn)  # GLM-4.5's converter counts its multi-token prediction layers
    w.add_feed_forward_length(cfg["intermediate_size_mlp"] if arch == "llama4" else cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1 if arch == "deepseek2" else kv_heads)  # DeepSeek: latent attention as llama.cpp's MQA
    if arch == "cohere2":  # a LayerNorm: its epsilon and logit scale, the window and each layer's kind
        w.add_layer_norm_eps(cfg["layer_norm_eps"])
        w.add_logit_scale(cfg["logit_scale"])
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    else:
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(full.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("moe_num_experts") or cfg.get("n_routed_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.get("num_experts_per_tok") or cfg["moe_k"])
        if "moe_intermediate_size" in cfg:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch == "ernie4_5-moe":  # as its converter (its shared width: intermediate_size / kv heads, unread)
        w.add_interleave_moe_layer_step(cfg["moe_layer_interval"])
        w.add_leading_dense_block_count(cfg["moe_layer_start_index"])
        w.add_expert_shared_count(cfg["moe_num_shared_experts"])
        w.add_expert_shared_feed_forward_length(cfg["intermediate_size"] // kv_heads)
    if arch == "glm4moe":  # as its converter
        from gguf import ExpertGatingFuncType

        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_nextn_predict_layers(nextn)
    if arch == "deepseek2":
        _deepseek_metadata(w, cfg, full, split_kv_b)
    if arch == "llama4":  # as its converter: the experts' width is intermediate_size (llama.cpp fixes the rest)
        w.add_interleave_moe_layer_step(cfg["interleave_moe_layer_step"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
    if arch == "gpt-oss":  # as its converter: the expert width, the window, YaRN
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_sliding_window(cfg["sliding_window"])
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(full["factor"])
        w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
    if arch == "deepseek2":
        pass  # its sizes above
    elif arch in ("qwen3", "qwen3moe", "gemma2", "gemma3", "gpt-oss") or cfg.get("head_dim") and arch not in PERMUTED_QK + ("phi3", "olmo2"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        if rope_dims != head_dim:
            w.add_rope_dimension_count(rope_dims)
    else:
        w.add_rope_dimension_count(rope_dims)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg["sliding_window"])
        types = cfg.get("layer_types") or []
        if arch == "gemma3" and types != ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(L)]:
            w.add_sliding_window_pattern([t == "sliding_attention" for t in types])  # not Gemma 3's usual 5:1
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        if arch == "gemma2":
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if arch in ("granite", "granitemoe"):  # as its converter: the four multipliers
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    if arch in ("olmo2", "exaone4") and cfg.get("sliding_window"):  # OLMo 3 (every fourth layer full), EXAONE 4
        w.add_sliding_window(cfg["sliding_window"])
        if arch == "exaone4":
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if full.get("rope_type") == "linear":
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(cfg.get("original_max_position_embeddings", cfg["max_position_embeddings"]))
    _add_vocab(w, vocab or make_vocab(cfg["vocab_size"], "spm" if arch in SPM else "bpe"))

    tensors = load_file(str(hf_dir / "model.safetensors"))
    if arch == "apertus":  # its converter: each layer's raw xIELU parameters as metadata arrays
        for name in ("alpha_p", "alpha_n", "beta", "eps"):
            values = [float(tensors.pop(f"model.layers.{i}.mlp.act_fn.{name}").reshape(-1)[0]) for i in range(L)]
            getattr(w, f"add_xielu_{name}")(values)
    if arch == "granitemoe":  # its converter splits input_linear into gate and up
        tensors = _granite_experts(tensors)
    if arch == "llama4":  # its converter: gate_up (E, H, 2 I) transposed and split, down (E, I, H) transposed
        tensors = _llama4_experts(tensors)
    if arch == "gpt-oss":
        tensors = _split_gpt_oss_experts(tensors)
    elif arch not in ("granitemoe", "llama4"):  # (stacked already)
        tensors = _stack_experts(tensors, experts or 0, fuse_gate_up_exps)
    elif fuse_gate_up_exps:
        for i in range(L):
            if f"model.layers.{i}.mlp.experts.gate_proj.weight" in tensors:  # (Llama 4's dense layers have none)
                gate, up = tensors.pop(f"model.layers.{i}.mlp.experts.gate_proj.weight"), tensors.pop(f"model.layers.{i}.mlp.experts.up_proj.weight")
                tensors[f"model.layers.{i}.mlp.experts.gate_up_proj.weight"] = np.concatenate([gate, up], axis=1)
    if arch == "deepseek2" and split_kv_b:
        tensors = _split_kv_b(tensors, cfg)
    names = get_tensor_name_map(next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), L)
    written = {}  # GGUF name -> (data, quantization type or None)
    for hf, t in tensors.items():
        t = t.astype(np.float32)
        base, suffix = hf.rsplit(".", 1)
        if suffix == "sinks":  # gpt-oss: the converter names it attn_sinks.weight
            base, suffix = hf, "weight"
        elif suffix == "e_score_correction_bias":  # the converter writes it as exp_probs_b.bias
            base, suffix = hf[: -len("_bias")], "bias"
        name = f"{names.get_name(base)}.{suffix}"
        if base.endswith("experts.gate_up_proj"):  # newer than gguf-py's tables for these architectures
            name = f"blk.{base.split('.')[2]}.ffn_gate_up_exps.{suffix}"
        if base.endswith("shared_expert_gate"):
            t = t.reshape(-1)  # the converter keeps Qwen2-MoE's (1, H) gate as (H,)
        if arch in PERMUTED_QK and base.endswith("q_proj"):
            t = permute(t, heads)
        elif arch in PERMUTED_QK and base.endswith("k_proj"):
            t = permute(t, kv_heads)
        if arch in ("gemma2", "gemma3") and hf.endswith("norm.weight"):
            t = t + np.float32(1.0)
        kind = qtype(name) if callable(qtype) else qtype
        if kind is not None and t.ndim >= 2 and "ffn_gate_inp" not in name and not name.endswith(".bias") and _fits(t, kind):
            q = quantize(t, kind) if kind not in NO_QUANTIZER else random_blocks(
                kind, int(np.prod(t.shape[:-1])), t.shape[-1], scale=float(np.abs(t).mean())).reshape(*t.shape[:-1], -1)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=kind)
            written[name] = (q, kind)
        else:
            w.add_tensor(name, np.ascontiguousarray(t))
            written[name] = (np.ascontiguousarray(t), None)
    for layer in range(L, L + nextn):  # GLM-4.5's multi-token prediction layer: a whole layer (here the last one's
        # tensors again) and its own; transformers skips it, so does minillm
        for name, (data, kind) in list(written.items()):
            if name.startswith(f"blk.{L - 1}."):
                w.add_tensor(f"blk.{layer}." + name.split(".", 2)[2], data, raw_shape=data.shape, raw_dtype=kind)
        w.add_tensor(f"blk.{layer}.nextn.eh_proj.weight", np.zeros((H, 2 * H), np.float32))
        for norm in ("enorm", "hnorm", "shared_head_norm"):
            w.add_tensor(f"blk.{layer}.nextn.{norm}.weight", np.ones(H, np.float32))
    if full.get("rope_type") == "longrope":
        w.add_tensor("rope_factors_long.weight", np.array(full["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(full["short_factor"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    first = w.format_shard_names(Path(path))[0]  # path itself unless split
    w.close()
    return first


def _deepseek_metadata(w, cfg: dict, rope: dict, split_kv_b: bool) -> None:
    """DeepseekV2Model.set_gguf_parameters' keys: the latent's lengths as llama.cpp's MQA (key:
    kv_lora_rank + RoPE dims, value: kv_lora_rank) and the heads' as the _mla ones (before its MLA
    change: the heads' as the plain ones), the router's (its gating function from the real models'
    scoring_func: V3's sigmoid, V2's softmax), YaRN's log multiplier."""
    from gguf import ExpertGatingFuncType, RopeScalingType

    rank, rope_dims = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    if split_kv_b:
        w.add_key_length(rank + rope_dims)
        w.add_value_length(rank)
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope_dims)
        w.add_value_length_mla(cfg["v_head_dim"])
    else:
        w.add_key_length(cfg["qk_nope_head_dim"] + rope_dims)
        w.add_value_length(cfg["v_head_dim"])
    w.add_rope_dimension_count(rope_dims)
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    v3 = cfg["architectures"][0] == "DeepseekV3ForCausalLM"
    if v3 and cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if v3 else ExpertGatingFuncType.SOFTMAX)
    if v3 or cfg.get("topk_method") == "group_limited_greedy":
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _split_kv_b(tensors: dict, cfg: dict) -> dict:
    """DeepSeek's kv_b_proj as the converter writes it: k_b_proj (heads, kv_lora_rank, own part),
    each head's key rows transposed, and v_b_proj (heads, v_head_dim, kv_lora_rank)."""
    heads, own, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    out = {}
    for name, t in tensors.items():
        if name.endswith("kv_b_proj.weight"):
            kv_b = t.reshape(heads, own + v, t.shape[-1])
            out[name.replace("kv_b_proj", "k_b_proj")] = np.ascontiguousarray(kv_b[:, :own].transpose(0, 2, 1))
            out[name.replace("kv_b_proj", "v_b_proj")] = np.ascontiguousarray(kv_b[:, own:])
        else:
            out[name] = t
    return out


def _llama4_experts(tensors: dict) -> dict:
    """Llama 4's experts as its converter writes them, under `mlp.` (gguf-py maps it as `feed_forward.`)."""
    out = {}
    for name, t in tensors.items():
        name = name.replace(".feed_forward.", ".mlp.")
        if name.endswith("experts.gate_up_proj"):
            gate, up = np.split(t.transpose(0, 2, 1), 2, axis=1)
            out[name.replace("gate_up_proj", "gate_proj.weight")] = np.ascontiguousarray(gate)
            out[name.replace("gate_up_proj", "up_proj.weight")] = np.ascontiguousarray(up)
        elif name.endswith("experts.down_proj"):
            out[name + ".weight"] = np.ascontiguousarray(t.transpose(0, 2, 1))
        else:
            out[name] = t
    return out


def _split_gpt_oss_experts(tensors: dict) -> dict:
    """gpt-oss's transposed, interleaved gate_up_proj (E, H, 2 I) and transposed down_proj (E, I,
    H), with their `_bias` tensors, as its converter writes them: gate_proj and up_proj (E, I, H),
    down_proj (E, H, I), each with a bias."""
    out = {}
    for hf, t in tensors.items():
        if hf.endswith("experts.gate_up_proj"):
            t = t.transpose(0, 2, 1)
            out[hf.replace("gate_up_proj", "gate_proj.weight")], out[hf.replace("gate_up_proj", "up_proj.weight")] = t[:, 0::2], t[:, 1::2]
        elif hf.endswith("experts.gate_up_proj_bias"):
            out[hf.replace("gate_up_proj_bias", "gate_proj.bias")], out[hf.replace("gate_up_proj_bias", "up_proj.bias")] = t[:, 0::2], t[:, 1::2]
        elif hf.endswith("experts.down_proj"):
            out[hf + ".weight"] = t.transpose(0, 2, 1)
        elif hf.endswith("experts.down_proj_bias"):
            out[hf.replace("down_proj_bias", "down_proj.bias")] = t
        else:
            out[hf] = t
    return {name: np.ascontiguousarray(t) for name, t in out.items()}


def _granite_experts(tensors: dict) -> dict:
    """Granite MoE's block_sparse_moe.input_linear (E, 2 I, H), output_linear and router.layer as
    the stacked gate_proj, up_proj, down_proj and router gate gguf-py's tables name."""
    out = {}
    for hf, t in tensors.items():
        i = hf.split(".")[2] if hf.startswith("model.layers.") else None
        if hf.endswith("block_sparse_moe.input_linear.weight"):
            half = t.shape[1] // 2
            out[f"model.layers.{i}.mlp.experts.gate_proj.weight"], out[f"model.layers.{i}.mlp.experts.up_proj.weight"] = t[:, :half], t[:, half:]
        elif hf.endswith("block_sparse_moe.output_linear.weight"):
            out[f"model.layers.{i}.mlp.experts.down_proj.weight"] = t
        elif hf.endswith("block_sparse_moe.router.layer.weight"):
            out[f"model.layers.{i}.mlp.gate.weight"] = t
        else:
            out[hf] = t
    return {name: np.ascontiguousarray(t) for name, t in out.items()}


def _stack_experts(tensors: dict, experts: int, fuse: bool) -> dict:
    """Per-expert matrices (Mixtral's w1, w3, w2; others' gate_proj, up_proj, down_proj) stacked
    into (E, N, K) tensors named as gguf-py's tables know them (`model.layers.i.mlp.experts.gate_proj`)."""
    if not experts:
        return tensors
    out, stacks = {}, {}
    kinds = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj", "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
    for hf, t in tensors.items():
        parts = hf.split(".")
        if "experts" in parts:  # model.layers.i.<moe>.experts.e.<kind>.weight
            i, e, kind = parts[2], int(parts[parts.index("experts") + 1]), kinds[parts[parts.index("experts") + 2]]
            stacks.setdefault((i, kind), [None] * experts)[e] = t
        else:
            out[hf] = t
    for (i, kind), ts in sorted(stacks.items()):
        out[f"model.layers.{i}.mlp.experts.{kind}.weight"] = np.stack(ts)
    if fuse:
        for i in {i for i, _ in stacks}:
            gate, up = out.pop(f"model.layers.{i}.mlp.experts.gate_proj.weight"), out.pop(f"model.layers.{i}.mlp.experts.up_proj.weight")
            out[f"model.layers.{i}.mlp.experts.gate_up_proj.weight"] = np.concatenate([gate, up], axis=1)
    return out


NO_QUANTIZER = (12, 13, 14, 20)  # Q4_K, Q5_K, Q6_K, IQ4_NL: gguf-py cannot quantize these


def random_blocks(qtype, rows: int, cols: int, scale: float = 0.02, seed: int = 0) -> np.ndarray:
    """Rows of random blocks of a ggml type, (rows, bytes per row) uint8: random levels and
    packed scales, with float16 scales about `scale` / 8 (so values are of that magnitude)."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    d = (np.abs(rng.standard_normal((rows, cols // block))) * scale / 8 + scale / 64).astype(np.float16).view(np.uint8)
    if int(qtype) == 39:  # MXFP4: a power-of-two scale byte, 2^(e - 128) about scale / 8; two subnormal ones
        raw[:, :, 0] = np.clip(np.round(np.log2(scale / 8)) + 128 + rng.integers(-2, 3, size=(rows, cols // block)), 2, 254)
        raw[0, 0, 0], raw[-1, -1, 0] = 0, 1
        return raw.reshape(rows, -1)
    offsets = {12: (0, 2), 13: (0, 2), 14: (208,)}.get(int(qtype), (0, 2) if int(qtype) in (3, 7) else (0,))
    for off in offsets:
        raw[:, :, off : off + 2] = d.reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def _fits(t: np.ndarray, qtype) -> bool:
    from gguf import GGML_QUANT_SIZES

    return t.shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0


def make_vocab(size: int, kind: str = "bpe") -> dict:
    """Tokenizer metadata for `size` tokens. "bpe": byte-level, the first byte characters and
    merges of pairs of them. "spm": SentencePiece, control tokens, the 256 byte tokens only when
    size allows, then pieces with "▁", with scores; no merges (recovered from the scores)."""
    from minillm.loading.gguf_tokenizer import bytes_to_unicode

    if kind == "bpe":
        base = list(bytes_to_unicode().values())[: size - 12]
        pairs = [base[i] + base[i + 1] for i in range(len(base) - 1)][: size - 2 - len(base)]
        tokens = base + pairs + ["<|end|>", "<|user|>"]
        merges = [f"{p[0]} {p[1]}" for p in pairs]
        return {"model": "gpt2", "tokens": tokens, "merges": merges, "types": [1] * (size - 2) + [3, 4], "bos": size - 2, "eos": size - 2}
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    letters = list("abcdefghijklmnopqrstuvwxyz")
    pieces = ["\u2581"] + letters + ["\u2581" + c for c in letters] + ["th", "he", "\u2581th", "\u2581the", "in", "\u2581in", "er", "an", "\u2581an", "\u2581and"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)] if size >= 256 + len(specials) + len(pieces) else []
    tokens = (specials + byte_tokens + pieces + [f"x{i}" for i in range(size)])[:size]
    types = [3] * len(specials) + [6] * len(byte_tokens) + [1] * (size - len(specials) - len(byte_tokens))
    scores = [0.0] * len(specials) + [0.0] * len(byte_tokens) + [-float(i) for i in range(size - len(specials) - len(byte_tokens))]
    return {"model": "llama", "tokens": tokens, "scores": scores, "types": types, "bos": 2, "eos": 1, "unk": 3}


def _add_vocab(w, vocab: dict) -> None:
    w.add_tokenizer_model(vocab["model"])
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    if "unk" in vocab:
        w.add_unk_token_id(vocab["unk"])
    w.add_chat_template("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
