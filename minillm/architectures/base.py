"""What an architecture is to minillm: one spec object, read by everything that must know it.

A family's module subclasses `Architecture` and states only where it differs from Llama: the
config.json fields it reads and their defaults, its tensor names, its GGUF metadata and what
llama.cpp's converter changed, its row of the docs' model table. The config turns a spec into
knobs (ModelConfig fields); the one compiled forward pass reads those knobs and never a name.
"""

from __future__ import annotations

import math

from ..errors import ConfigError, GGUFError

LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")  # chunked: Llama 4's (its spec reads them)

# The HF tensor name of each norm of a layer, by norm placement (None: no such norm).
NORM_NAMES = {
    "pre": dict(attn_norm="input_layernorm", attn_out_norm=None, mlp_norm="post_attention_layernorm", mlp_out_norm=None),
    "post": dict(attn_norm=None, attn_out_norm="post_attention_layernorm", mlp_norm=None, mlp_out_norm="post_feedforward_layernorm"),
    "sandwich": dict(attn_norm="input_layernorm", attn_out_norm="post_attention_layernorm",
                     mlp_norm="pre_feedforward_layernorm", mlp_out_norm="post_feedforward_layernorm"),
}


class Fields:
    """Typed access to config.json fields, with errors that name the field."""

    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def positive_int(self, name: str, default: int | None = None) -> int:
        value = self.raw.get(name, default)
        if value is None:
            raise ConfigError(f"{self.source}: missing field '{name}'")
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{self.source}: field '{name}' must be a positive integer, got {value!r}")
        return value

    def non_negative_int(self, name: str, default: int) -> int:
        value = self.raw.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{self.source}: field '{name}' must be a non-negative integer, got {value!r}")
        return value

    def number(self, name: str, default: float) -> float:
        value = self.raw.get(name, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ConfigError(f"{self.source}: field '{name}' must be a finite number, got {value!r}")
        return float(value)

    def optional_positive(self, name: str, default: float | None = None) -> float | None:
        if self.raw.get(name, default) is None:
            return None
        value = self.number(name, default)
        if value <= 0:
            raise ConfigError(f"{self.source}: field '{name}' must be a positive number or null, got {value!r}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.raw.get(name, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.source}: field '{name}' must be true or false, got {value!r}")
        return value

    def int_list(self, name: str, default: list | None = None) -> list[int]:
        value = self.raw.get(name, default)
        if value is None:
            value = []
        if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            raise ConfigError(f"{self.source}: field '{name}' must be a list of integers")
        return value


class Architecture:
    """Llama's choices; a family overrides what it changes. Class attributes are plain facts,
    methods read config.json (`fields`, a Fields) or GGUF metadata (`meta`, gguf_file.Metadata)."""

    hf_names: tuple[str, ...] = ()  # config.json "architectures" values this spec reads
    gguf_name: str | None = None  # GGUF general.architecture (None: llama.cpp writes none of its own)
    docs: tuple[str, str, str, str, str] = ("", "", "", "", "")  # the model table: norms, q/k norm, MLP, attention, RoPE
    docs_note = ""  # after the name in that table

    # ---------------------------------------------------------------- the layer's shape
    norm_placement = "pre"  # "pre", "post" (after each sub-block) or "sandwich" (before and after)
    norm_offset = False  # norms scale by (1 + w)
    qk_norm: str | None = None  # "head" or "projection"
    fused_qkv = False  # q, k and v stored as one qkv_proj
    fused_gate_up = False  # gate and up stored as one gate_up_proj (gate rows first)
    interleaved_rope = False  # RoPE rotates neighbouring pairs of q and k (not HF's two halves)
    partial_rotary = False  # reads partial_rotary_factor (RoPE on the first part of each head only)
    default_rotary_factor = 1.0  # partial_rotary_factor when config.json names none (the config class's)
    activation_field, default_activation = "hidden_act", "silu"
    activations = ("silu", "gelu_pytorch_tanh")  # the hidden_act values the family's MLP may have
    gated_mlp = True  # down(act(gate(x)) * up(x)); False: down(act(up(x))) (Apertus)
    activation_tensors: dict[str, tuple[int, ...]] = {}  # a layer's activation parameters under mlp.act_fn, and their shapes
    default_head_dim: int | None = None  # when config.json has no head_dim (else hidden / heads)
    rope_theta = 10000.0  # when config.json names none (the config class's default_theta)
    mixture_of_experts = False
    layer_norm = False  # norms subtract the mean first (LayerNorm without a bias), else RMSNorm
    eps_field, default_eps = "rms_norm_eps", 1e-6  # the norms' epsilon and its default (LlamaConfig's)
    parallel_block = False  # attention and MLP both read norm(x), and both add to x
    embed_scale_outside = False  # transformers scales the embedding after its embed_tokens module (what compare hooks)

    @property
    def norm_names(self) -> dict:
        """The HF name of each norm of a layer (None: no such norm)."""
        return NORM_NAMES[self.norm_placement]

    def biases(self, fields: Fields) -> dict:
        """qkv_bias (q, k, v), o_bias, mlp_bias; Llama's attention_bias is the first two."""
        return attention_bias(fields.boolean("attention_bias", default=False))

    def qk_norm_kind(self, fields: Fields) -> str | None:
        """The q/k norm ("head", "projection" or None), where config.json may switch it."""
        return self.qk_norm

    def latent_attention(self, fields: Fields) -> dict:
        """Multi-head latent attention's sizes (ModelConfig's head_dim, rotary_dim, kv_lora_rank,
        q_lora_rank, value_head_dim); {} for attention over q, k and v projections."""
        return {}

    def variant(self, fields: Fields, hidden: int) -> dict:
        """Further ModelConfig fields where the family differs (scales, soft caps, multipliers)."""
        return {}

    def activation(self, fields: Fields) -> str:
        act = fields.raw.get(self.activation_field, self.default_activation)
        if act not in self.activations:
            raise ConfigError(f"{fields.source}: field '{self.activation_field}' is {act!r}; supported: {', '.join(map(repr, self.activations))}")
        return act

    def layer_activation(self, vector, prefix: str):
        """A layer's activation parameters as the forward pass reads them (vector(name) reads a
        tensor; prefix: "model.layers.N."), or None."""
        return None

    def gguf_metadata_tensors(self, meta, p: str, layers: int) -> dict:
        """Tensors llama.cpp keeps as metadata (HF name -> float32 array), or {}."""
        return {}

    def refuse(self, fields: Fields) -> None:
        """Fields of this family that minillm does not implement: an error naming the field."""

    def allows_quantization(self, method) -> bool:
        """Whether config.json's quantization_config method runs as stored (gpt-oss's MXFP4)."""
        return False

    # ---------------------------------------------------------------- RoPE
    def rope_type(self, rope_type: str) -> str:
        """The RoPE type as the family's config class reads the name (Phi-3: "su" is longrope)."""
        return rope_type

    original_context: int | None = None  # original_max_position_embeddings when config.json names none

    def local_rope(self, fields: Fields, read) -> tuple | None:
        """The RoPE base and scaling of sliding layers when they have their own (read(layer_type,
        default_theta) reads one); None: the same as every layer's."""
        return None

    def rope_layers(self, fields: Fields, layers: int) -> tuple[bool, ...]:
        """Per layer: False where a layer has no RoPE; () for all."""
        return ()

    # ---------------------------------------------------------------- sliding windows
    default_window: int | None = None  # the window when config.json has no "sliding_window" field

    def window(self, fields: Fields) -> int | None:
        """The window of sliding layers, as the family's config class reads it."""
        return fields.raw["sliding_window"] if "sliding_window" in fields.raw else self.default_window

    def layer_types(self, fields: Fields, layers: int, rope_layers: tuple[bool, ...]) -> list[str]:
        """Each layer's attention when config.json lists no layer_types and a window is set."""
        return ["sliding_attention"] * layers

    # ---------------------------------------------------------------- mixtures of experts
    expert_count_field = "num_experts"  # read first; "num_local_experts" when absent
    default_top_k: int | None = None
    top_k_field = "num_experts_per_tok"
    router_fields: tuple[str, ...] = ()  # DeepSeek-style router fields the family reads (others are refused)
    shared_expert_prefix = "shared_expert."  # under the MoE prefix: its gate_proj, up_proj, down_proj
    shared_expert_gate = True  # the shared expert is scaled by the sigmoid of its own gate (Qwen2-MoE's shared_expert_gate)
    selection_bias_tensor: str | None = None  # under the MoE prefix: the bias the router chooses by (e_score_correction_bias)
    expert_width_field = "intermediate_size"  # each expert's MLP width
    chunked_attention = False  # layer_types may say "chunked_attention" (the spec's variant reads them)
    dense_width_field = "intermediate_size"  # a dense layer's MLP width (Llama 4: intermediate_size_mlp)
    transposed_experts = False  # stacked experts stored (E, K, N), gate_up's gate and up side by side or interleaved (gpt-oss, Llama 4)
    router_tensor = "gate.weight"  # under the layer's MoE prefix
    expert_tensors = ("gate_proj", "up_proj", "down_proj")  # per expert: gate, up, down
    per_expert_block = "mlp."  # the MoE prefix of per-expert checkpoints (stacked ones: "mlp.")
    # (pattern, replacement) for tensor names a family's checkpoints spell otherwise, applied when a
    # directory is opened (as transformers' conversion mapping renames them)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def experts(self, fields: Fields, layers: int, count: int) -> dict:
        """ModelConfig fields of the router and the layers' sparseness, beyond the counts."""
        return dict(norm_topk_prob=fields.boolean("norm_topk_prob", default=False), sparse_layers=(True,) * layers)

    # ---------------------------------------------------------------- GGUF
    gguf_head_dim_from_rope = False  # transformers reads rope.dimension_count as head_dim (Llama)
    gguf_permuted_qk = False  # convert_hf_to_gguf permuted Q and K rows for llama.cpp's pairwise RoPE
    gguf_norm_topk: bool | None = None  # llama.cpp's renormalisation of the top k when the file is silent
    gguf_bias_fields: dict[str, str] = {}  # config field -> the tensor whose presence sets it (llama.cpp writes no key)
    gguf_eps_key = "attention.layer_norm_rms_epsilon"
    gguf_rope_theta = 10000.0  # llama.cpp's when the file has no rope.freq_base
    gguf_tokenizer = "llama"  # SentencePiece spelling: "llama" (Metaspace), "phi3" or "gemma"
    stacked_experts_on_hub = False  # an import keeps the experts stacked (as the family's checkpoints are)

    def gguf_config(self, meta, p: str, config: dict, rope: dict) -> None:
        """Fill config.json fields from metadata (prefix `p`): RoPE (`rope`: its base and scaling
        as config fields) and whatever the family reads beyond the common keys."""
        config["rope_theta"] = rope.pop("rope_theta")
        if rope:
            config["rope_scaling"] = rope

    def selection_bias_shape(self, experts: int) -> tuple[int, ...]:
        """The stored shape of the selection bias (selection_bias_tensor)."""
        return (experts,)

    def gguf_experts(self, meta, p: str, experts: int) -> dict:
        """A mixture of experts' config fields from llama.cpp's expert keys (every layer sparse,
        as llama.cpp runs them)."""
        if self.gguf_norm_topk is None:
            raise GGUFError(f"{meta.path}: metadata '{p}expert_count' is set, but {self.hf_names[0]} has no experts")
        gating = meta.typed(p + "expert_gating_func", int)
        if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
            raise GGUFError(f"{meta.path}: metadata '{p}expert_gating_func' is {gating}; only the softmax router is supported")
        return {self.expert_count_field: experts, "num_experts_per_tok": meta.require(p + "expert_used_count", int),
                "norm_topk_prob": bool(meta.typed(p + "expert_weights_norm", bool, self.gguf_norm_topk))}

    def ignores(self, name: str, layers: int) -> bool:
        """Whether a checkpoint tensor is one transformers skips too (multi-token prediction layers)."""
        return False

    def hub_experts(self, cfg, tensors: dict) -> None:
        """Rewrite an import's stacked experts in place as the family's checkpoints store them
        (with stacked_experts_on_hub)."""


def attention_bias(on: bool, mlp: bool = False) -> dict:
    """Biases on q, k, v and o, or none; on the MLP's matrices with `mlp`."""
    return dict(qkv_bias=on, o_bias=on, mlp_bias=mlp)


def sliding_every(pattern: int, layers: int) -> list[str]:
    """Sliding layers with every `pattern`-th a full one (Gemma, OLMo 3, EXAONE 4)."""
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def rope_on_sliding_layers(spec: Architecture, fields: Fields, layers: int) -> tuple[bool, ...]:
    """RoPE on the sliding layers only, when the model has a window (Cohere 2, EXAONE 4); () for
    every layer."""
    if spec.window(fields) is None:
        return ()
    types = fields.raw.get("layer_types") or spec.layer_types(fields, layers, ())
    return tuple(t == "sliding_attention" for t in types) if len(types) == layers else ()


def gguf_windowed_layers(meta, p: str, config: dict, default: int) -> None:
    """config's sliding_window from the file and, where it has one, each layer's kind
    (gguf_layer_types; every `default`-th layer full when the file is silent)."""
    window = config["sliding_window"] = meta.typed(p + "attention.sliding_window", int)
    if window:
        config["layer_types"] = gguf_layer_types(meta, p, config["num_hidden_layers"], default)


def gguf_layer_types(meta, p: str, layers: int, default: int) -> list[str]:
    """Layer kinds from attention.sliding_window_pattern: every n-th layer full (n `default` when
    the file is silent), or a list with true where a layer slides."""
    pattern = meta.get(p + "attention.sliding_window_pattern", default)
    if isinstance(pattern, list):
        sliding = [bool(v) for v in pattern]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    else:
        raise GGUFError(f"{meta.path}: metadata '{p}attention.sliding_window_pattern' must be a positive integer or a list")
    if len(sliding) != layers:
        raise GGUFError(f"{meta.path}: metadata '{p}attention.sliding_window_pattern' must list {layers} layers")
    return ["sliding_attention" if s else "full_attention" for s in sliding]
