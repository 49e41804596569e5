"""Granite 3 (IBM): Llama with four multipliers: embeddings, attention scores (in place of
head_dim^-1/2), each sub-block's output before the residual add, and the logits (divided)."""

import numpy as np

from .base import Fields
from .llama import Llama


class Granite(Llama):
    hf_names = ("GraniteForCausalLM",)
    gguf_name = "granite"  # its converter is Llama's: Q and K permuted
    embed_scale_outside = True
    docs = ("before, `x * w`", "-", "SiLU gate", "full; scores times `attention_multiplier`",
            "as Llama; `embedding_multiplier`, `residual_multiplier`, `logits_scaling`")

    def variant(self, fields: Fields, hidden: int) -> dict:
        return dict(embed_scale=fields.number("embedding_multiplier", 1.0), attention_multiplier=fields.number("attention_multiplier", 1.0),
                    residual_multiplier=fields.number("residual_multiplier", 1.0), logits_scaling=fields.number("logits_scaling", 1.0))

    def gguf_config(self, meta, p: str, config: dict, rope: dict) -> None:
        for field, key in (("embedding_multiplier", "embedding_scale"), ("attention_multiplier", "attention.scale"),
                           ("residual_multiplier", "residual_scale"), ("logits_scaling", "logit_scale")):
            value = meta.typed(p + key, float)
            if value is not None:
                config[field] = float(value)
        super().gguf_config(meta, p, config, rope)


class GraniteMoe(Granite):
    """Granite 3 mixtures of experts: Granite's multipliers; a router whose top k logits are
    weighted by their own softmax; experts stacked as input_linear (gate rows, then up) and
    output_linear under block_sparse_moe."""

    hf_names = ("GraniteMoeForCausalLM",)
    gguf_name = "granitemoe"
    mixture_of_experts = True
    expert_count_field = "num_local_experts"
    checkpoint_renames = ((r"block_sparse_moe\.input_linear\.weight$", "mlp.experts.gate_up_proj"),
                          (r"block_sparse_moe\.output_linear\.weight$", "mlp.experts.down_proj"),
                          (r"block_sparse_moe\.router\.layer\.weight$", "mlp.gate.weight"))
    gguf_norm_topk = True  # llama.cpp: softmax over all, the top k renormalised (the same weights)
    docs = ("before, `x * w`", "-", "experts: the top k logits weighted by their own softmax", "full; scores times `attention_multiplier`",
            "as Granite")

    def experts(self, fields: Fields, layers: int, count: int) -> dict:
        return dict(norm_topk_prob=False, sparse_layers=(True,) * layers, router="topk_softmax")

    def gguf_experts(self, meta, p: str, experts: int) -> dict:
        return {key: value for key, value in super().gguf_experts(meta, p, experts).items() if key != "norm_topk_prob"}

    stacked_experts_on_hub = True

    def hub_experts(self, cfg, tensors: dict) -> None:
        """As its checkpoints hold them: input_linear (gate rows, then up), output_linear and
        router.layer under block_sparse_moe."""
        for i in range(cfg.num_hidden_layers):
            mlp, moe = f"model.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
            gate_up = tensors.pop(f"{mlp}experts.gate_up_proj.weight", None)  # llama.cpp's fused ffn_gate_up_exps, or apart
            if gate_up is None:
                gate_up = np.concatenate([tensors.pop(f"{mlp}experts.{kind}_proj.weight") for kind in ("gate", "up")], axis=1)
            tensors.update({moe + "input_linear.weight": gate_up, moe + "output_linear.weight": tensors.pop(f"{mlp}experts.down_proj.weight"),
                            moe + "router.layer.weight": tensors.pop(mlp + "gate.weight")})
