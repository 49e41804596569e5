"""gpt-oss: attention with q/k/v/o biases and a learned sink per head, sliding and full layers by
turns; a router with a bias whose top k logits are weighted by their own softmax; experts with
biases and a clamped SwiGLU, shipped as MXFP4 (run as stored). Its checkpoints keep the experts
stacked, gate and up interleaved and transposed; llama.cpp's GGUF splits them."""

import numpy as np

from .base import Architecture, Fields, attention_bias


class GptOss(Architecture):
    hf_names = ("GptOssForCausalLM",)
    rope_theta = 150_000.0  # GptOssConfig's
    gguf_name = "gpt-oss"
    mixture_of_experts = True
    default_window = 128  # GptOssConfig's
    router_tensor = "router.weight"
    stacked_experts_on_hub = True
    transposed_experts = True
    docs = ("before, `x * w`", "-", "experts: a router with a bias, the top k logits weighted by their own softmax; experts with "
            "biases and gpt-oss's clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`); q/k/v/o biases",
            "sliding and full layers by turns (`layer_types`), attention sinks", "as Llama (YaRN as it ships, `truncate: false`)")

    def activation(self, fields: Fields) -> str:
        return "clamped_swiglu"  # its experts' own, whatever hidden_act says (GptOssExperts ignores it)

    def biases(self, fields: Fields) -> dict:
        return attention_bias(fields.boolean("attention_bias", default=True))

    def allows_quantization(self, method) -> bool:
        return method == "mxfp4"

    def layer_types(self, fields: Fields, layers: int, rope_layers) -> list[str]:
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]  # sliding, full, ..

    def experts(self, fields: Fields, layers: int, count: int) -> dict:
        return dict(norm_topk_prob=False, sparse_layers=(True,) * layers, router="topk_softmax", router_bias=True, attention_sinks=True,
                    swiglu_alpha=fields.number("swiglu_alpha", 1.702), swiglu_limit=fields.number("swiglu_limit", 7.0))

    def gguf_config(self, meta, p: str, config: dict, rope: dict) -> None:
        config["sliding_window"] = meta.require(p + "attention.sliding_window", int)
        if rope.get("rope_type") == "yarn":
            rope["truncate"] = False  # GptOssConfig's YaRN; llama.cpp's converter writes no key for it
        super().gguf_config(meta, p, config, rope)

    def gguf_experts(self, meta, p: str, experts: int) -> dict:
        # its router and experts are the architecture's own (no gating keys)
        return {"num_local_experts": experts, "num_experts_per_tok": meta.require(p + "expert_used_count", int),
                "intermediate_size": meta.require(p + "expert_feed_forward_length", int)}

    def hub_experts(self, cfg, tensors: dict) -> None:
        """gate and up interleaved (gate at even columns) and transposed, (E, H, 2 I); down
        transposed, (E, I, H); the biases beside them as `<name>_bias`."""
        for i in range(cfg.num_hidden_layers):
            moe = f"model.layers.{i}.mlp.experts."
            gate, up, down = (tensors.pop(f"{moe}{kind}_proj.weight") for kind in ("gate", "up", "down"))
            gate_bias, up_bias, down_bias = (tensors.pop(f"{moe}{kind}_proj.bias") for kind in ("gate", "up", "down"))
            gate_up = np.empty((gate.shape[0], gate.shape[2], 2 * gate.shape[1]), np.float32)
            gate_up[..., 0::2], gate_up[..., 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
            bias = np.empty((gate.shape[0], 2 * gate.shape[1]), np.float32)
            bias[:, 0::2], bias[:, 1::2] = gate_bias, up_bias
            tensors.update({moe + "gate_up_proj": gate_up, moe + "gate_up_proj_bias": bias,
                            moe + "down_proj": np.ascontiguousarray(down.transpose(0, 2, 1)), moe + "down_proj_bias": down_bias})
