"""Mixtral: Mistral whose MLPs are experts (w1, w3, w2 under block_sparse_moe), the top k
always renormalised. llama.cpp writes it as "llama" with an expert count."""

from .base import Fields, attention_bias
from .llama import Mistral


class Mixtral(Mistral):
    hf_names = ("MixtralForCausalLM",)
    rope_theta = 1_000_000.0  # MixtralConfig's
    gguf_name = "llama"
    gguf_permuted_qk = True
    gguf_head_dim_from_rope = True
    mixture_of_experts = True
    expert_count_field = "num_local_experts"
    default_top_k = 2
    expert_tensors = ("w1", "w3", "w2")
    per_expert_block = "block_sparse_moe."  # transformers 5 names stacked ones `mlp.` too
    gguf_norm_topk = True
    default_window = None
    docs = ("before, `x * w`", "-", "mixture of experts: softmax router, top k renormalised", "full or sliding window", "as Llama")

    def biases(self, fields: Fields) -> dict:
        return attention_bias(False)

    def experts(self, fields: Fields, layers: int, count: int) -> dict:
        return dict(norm_topk_prob=True, sparse_layers=(True,) * layers)
