"""Apertus (Swiss AI): Llama with norms of its own names, q/k norms per head, and an MLP without a
gate: down(xIELU(up(x))), xIELU's four parameters per layer (mlp.act_fn; llama.cpp's xielu.*
metadata arrays)."""

import numpy as np

from .base import Architecture
from .llama import Llama


class Apertus(Llama):
    hf_names = ("ApertusForCausalLM",)
    gguf_name = "apertus"
    gguf_permuted_qk = False  # its converter leaves q and k as they are (llama.cpp turns HF's halves for it)
    rope_theta = 12_000_000.0  # ApertusConfig's
    qk_norm = "head"
    default_activation = "xielu"
    activations = ("xielu",)
    gated_mlp = False
    activation_tensors = {"alpha_p": (1,), "alpha_n": (1,), "beta": (), "eps": ()}
    biases = Architecture.biases  # attention_bias on q, k, v and o; its MLP has none (no mlp_bias)
    docs = ("before, `x * w`", "per head", "no gate: `down(xIELU(up(x)))`, xIELU's parameters per layer", "full", "as Llama")

    @property
    def norm_names(self) -> dict:
        return dict(attn_norm="attention_layernorm", attn_out_norm=None, mlp_norm="feedforward_layernorm", mlp_out_norm=None)

    def layer_activation(self, vector, prefix: str) -> np.ndarray:
        """transformers' XIELUActivation: alpha_p = softplus(a_p), alpha_n = beta + softplus(a_n), in float32."""
        read = {name: np.float32(vector(prefix + "mlp.act_fn." + name).reshape(-1)[0]) for name in self.activation_tensors}
        return np.array([_softplus(read["alpha_p"]), read["beta"] + _softplus(read["alpha_n"]), read["beta"], read["eps"]], np.float32)

    def gguf_metadata_tensors(self, meta, p: str, layers: int) -> dict:
        """convert_hf_to_gguf writes each layer's raw xIELU parameters as metadata arrays."""
        out = {}
        for name, shape in self.activation_tensors.items():
            values = meta.require("xielu." + name, list)
            for i in range(layers):
                out[f"model.layers.{i}.mlp.act_fn.{name}"] = np.array(values[i], np.float32).reshape(shape)
        return out


def _softplus(x: np.float32) -> np.float32:
    """torch's softplus (beta 1, threshold 20) in float32."""
    return x if x > 20 else np.float32(np.log1p(np.exp(x, dtype=np.float32), dtype=np.float32))
