"""The model configuration: one frozen dataclass built from HF `config.json` field names.

Anything we do not implement is an error naming the field, never a silent default.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..architectures import LAYER_TYPES, MIXTURES_OF_EXPERTS, SUPPORTED, Architecture, Fields, spec_named
from ..errors import ConfigError

# Every architecture's peculiarities live in its spec (minillm.architectures); here they become
# the knobs below, which the one forward pass reads.
SUPPORTED_ARCHITECTURES = SUPPORTED
MOE_ARCHITECTURES = MIXTURES_OF_EXPERTS
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
DEFAULT_CONTEXT = 4096


@dataclass(frozen=True)
class RopeScaling:
    """HF `rope_scaling` / `rope_parameters`, reduced to what the supported types use."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn, longrope
    attention_factor: float | None = None  # yarn, longrope: cos and sin scaled by it (None: derived)
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    long_factor: tuple[float, ...] = ()  # longrope: per frequency, past the original context
    short_factor: tuple[float, ...] = ()  # longrope: within it


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q, k and v
    o_bias: bool  # bias on o
    mlp_bias: bool
    sliding_window: int | None  # the window of "sliding_attention" layers; None: no such layers
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" or "sliding_attention"; () all full
    rope_layers: tuple[bool, ...] = ()  # per layer: False where a layer has no RoPE (SmolLM3); () all
    local_rope: tuple[float, RopeScaling] | None = None  # RoPE base and scaling of sliding layers (Gemma 3)
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh" (Gemma 3), "clamped_swiglu" (gpt-oss), "xielu" (Apertus)
    gated_mlp: bool = True  # down(act(gate(x)) * up(x)); else down(act(up(x))) (Apertus)
    norm_offset: bool = False  # Gemma: norms scale by (1 + w)
    qk_norm: str | None = None  # RMSNorm of q and k before RoPE: per "head", over the whole "projection", or per head without weights ("weightless")
    fused_qkv: bool = False  # q, k and v as one qkv_proj (Phi-3)
    fused_gate_up: bool = False  # gate and up as one gate_up_proj (Phi-3, GLM-4)
    rotary_dim: int = 0  # the dimensions of each head RoPE turns (partial_rotary_factor); 0: all of head_dim
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its -1/2 power, not head_dim's
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    num_experts: int = 0  # experts per sparse layer (MOE_ARCHITECTURES); 0: a dense model
    experts_per_token: int = 0  # the router's top k
    expert_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # the top k weights renormalised to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert; 0: none
    sparse_layers: tuple[bool, ...] = ()  # per layer: True where the MLP is the experts; () none
    router: str = "softmax"  # "softmax" over all experts, then the top k; "topk_softmax" (gpt-oss); "sigmoid" of each (GLM-4.5);
    #   or "topk_sigmoid_input": the top k logits' sigmoids scaling the experts' inputs (Llama 4)
    selection_bias: bool = False  # a per-expert bias added to the scores for choosing only (e_score_correction_bias)
    router_groups: int = 1  # experts in this many groups; a row chooses among the router_group_topk best groups
    router_group_topk: int = 1  #   (a group scored by the sum of its router_group_best best scores:
    router_group_best: int = 2  #   two in DeepSeek-V3 and GLM-4.5, one in DeepSeek-V2)
    routed_scaling: float = 1.0  # the chosen experts' weights times this (routed_scaling_factor)
    router_norm_min: float = 0.0  # the renormalising sum is at least this (Ernie 4.5's moe_norm_min)
    router_bias: bool = False  # the router's logits have a bias, and the experts' matrices too (gpt-oss)
    attention_sinks: bool = False  # a learned logit per head in attention's softmax denominator (gpt-oss)
    swiglu_alpha: float = 1.702  # hidden_act "clamped_swiglu" (gpt-oss): (up + 1) * g * sigmoid(alpha g),
    swiglu_limit: float = 7.0  # gate clamped above at limit, up to [-limit, limit]
    attention_multiplier: float | None = None  # Granite: what scores are multiplied by, in place of head_dim^-1/2
    residual_multiplier: float = 1.0  # Granite: each sub-block's output times this before the residual add
    logits_scaling: float = 1.0  # Granite: logits divided by it
    layer_norm: bool = False  # norms subtract the mean (LayerNorm without a bias, Cohere 2), else RMSNorm
    parallel_block: bool = False  # x + attn(norm(x)) + mlp(norm(x)): one norm, both sub-blocks on it (Cohere 2)
    interleaved_rope: bool = False  # q and k rotate neighbouring pairs (Ernie 4.5); the loader permutes their rows to halves
    # multi-head latent attention (DeepSeek-V2/V3): k and v from a latent of kv_lora_rank (normed),
    # q from one of q_lora_rank (0: q_proj reads the input itself); each head's key is head_dim
    # wide (its own part, then rotary_dim dimensions shared by all heads), its value value_head_dim
    kv_lora_rank: int = 0  # 0: not latent attention
    q_lora_rank: int = 0
    value_head_dim: int = 0  # 0: head_dim
    latent_norm_eps: float = 1e-6  # the latents' RMSNorm epsilon (DeepseekV3RMSNorm's default: config.json's is not passed)
    # Llama 4: chunked attention on chunked_layers (a query sees its own chunk of attention_chunk
    # positions), a q/k norm (qk_norm "weightless") on RoPE layers only, and on the other layers
    # queries times log1p(floor((pos + 1) / attn_temperature_floor)) * attn_temperature_scale + 1
    attention_chunk: int = 0
    chunked_layers: tuple[bool, ...] = ()
    qk_norm_rope_only: bool = False
    attn_temperature_floor: float = 0.0  # 0: none
    attn_temperature_scale: float = 0.0

    @property
    def spec(self) -> Architecture:
        """The architecture's spec (minillm.architectures): names, GGUF reading, docs."""
        return spec_named(self.architecture)

    # Derived sizes, named as the forward pass uses them.
    @property
    def n_rep(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def latent(self) -> bool:
        """Multi-head latent attention (kv_lora_rank)."""
        return self.kv_lora_rank > 0

    @property
    def value_dim(self) -> int:
        """Each head's value width (head_dim but under latent attention)."""
        return self.value_head_dim or self.head_dim

    @property
    def rope_dim(self) -> int:
        """The dimensions of each head RoPE turns (the rest pass through)."""
        return self.rotary_dim or self.head_dim

    @property
    def attn_scale(self) -> float:
        """What attention scores are multiplied by before softmax."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    def layer_window(self, i: int) -> int:
        """Keys layer i attends to before each query's own position, plus one: 0 for all of them;
        minus the chunk on a chunked layer (kernels.attention.first_key)."""
        if self.chunked_layers and self.chunked_layers[i]:
            return -self.attention_chunk
        sliding = self.layer_types and self.layer_types[i] == "sliding_attention"
        return self.sliding_window if sliding else 0

    def layer_is_sparse(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts (else the dense MLP of intermediate_size)."""
        return bool(self.sparse_layers) and self.sparse_layers[i]

    @property
    def widest_mlp(self) -> int:
        """The widest MLP intermediate of any layer, dense, expert or shared expert."""
        dense = any(not self.layer_is_sparse(i) for i in range(self.num_hidden_layers))
        return max(self.intermediate_size if dense else 0, self.expert_intermediate_size, self.shared_expert_intermediate_size)

    @property
    def widest_window(self) -> int:
        """The longest window of any sliding layer (0: no layer slides)."""
        return max((max(self.layer_window(i), 0) for i in range(self.num_hidden_layers)), default=0)

    def layer_rope(self, i: int) -> tuple[float, RopeScaling] | None:
        """Layer i's RoPE base and scaling; None for a layer without RoPE."""
        if self.rope_layers and not self.rope_layers[i]:
            return None
        if self.local_rope is not None and self.layer_window(i) > 0:
            return self.local_rope
        return self.rope_theta, self.rope_scaling

    def context_size(self, requested: int | None = None) -> int:
        """The KV-cache length to use: the user's setting, else min(max positions, 4096)."""
        ctx = min(self.max_position_embeddings, DEFAULT_CONTEXT) if requested is None else int(requested)
        if ctx <= 0:
            raise ConfigError(f"context size must be positive, got {ctx}")
        return ctx

    # ---------------------------------------------------------------- loading

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file (a model directory needs config.json)") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: cannot read: {e}") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON: {e}") from None
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        fields = Fields(raw, source)

        archs = raw.get("architectures")
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{source}: field 'architectures' is {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]

        spec = spec_named(arch)
        act = spec.activation(fields)
        _refuse_unsupported(fields, spec)

        hidden = fields.positive_int("hidden_size")
        heads = fields.positive_int("num_attention_heads")
        kv_heads = fields.positive_int("num_key_value_heads", default=heads)
        head_dim, rotary_dim, latent = _head_dims(fields, spec, hidden // heads)
        if heads % kv_heads:
            raise ConfigError(
                f"{source}: field 'num_key_value_heads' ({kv_heads}) must divide num_attention_heads ({heads})"
            )

        eps = fields.number(spec.eps_field, default=spec.default_eps)
        if not eps > 0:
            raise ConfigError(f"{source}: field '{spec.eps_field}' must be > 0, got {eps}")

        rope_theta, scaling = _rope(raw, source, spec, "full_attention", default_theta=spec.rope_theta)
        local_rope = spec.local_rope(fields, lambda layer_type, theta: _rope(raw, source, spec, layer_type, default_theta=theta))
        max_pos = fields.positive_int("max_position_embeddings", default=2048)
        layers = fields.positive_int("num_hidden_layers")
        sliding, layer_types, rope_layers = _layer_kinds(fields, spec, layers)

        bos, eos_ids = _special_tokens(raw, source)

        return cls(
            architecture=arch,
            vocab_size=fields.positive_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=fields.positive_int(spec.dense_width_field),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=eps,
            rope_theta=rope_theta,
            rope_scaling=scaling,
            tie_word_embeddings=fields.boolean("tie_word_embeddings", default=False),
            **spec.biases(fields),
            sliding_window=sliding,
            bos_token_id=bos,
            eos_token_id=eos_ids,
            layer_types=layer_types,
            rope_layers=rope_layers,
            local_rope=local_rope,
            hidden_act=act,
            norm_offset=spec.norm_offset,
            qk_norm=spec.qk_norm_kind(fields),
            fused_qkv=spec.fused_qkv,
            fused_gate_up=spec.fused_gate_up,
            gated_mlp=spec.gated_mlp,
            rotary_dim=rotary_dim,
            interleaved_rope=spec.interleaved_rope,
            layer_norm=spec.layer_norm,
            parallel_block=spec.parallel_block,
            **spec.variant(fields, hidden),
            **latent,
            **_experts(fields, spec, layers),
        )


def _head_dims(fields: Fields, spec: Architecture, default: int) -> tuple[int, int, dict]:
    """head_dim, rotary_dim (0: all of it) and latent attention's other sizes ({} without it).
    Under latent attention head_dim is the key's width, its own part and RoPE's (config.json's
    head_dim names RoPE's)."""
    latent = dict(spec.latent_attention(fields))
    if latent:
        return latent.pop("head_dim"), latent.pop("rotary_dim"), latent
    raw, source = fields.raw, fields.source
    head_dim = fields.positive_int("head_dim") if raw.get("head_dim") is not None else spec.default_head_dim or default
    if head_dim % 2:
        raise ConfigError(f"{source}: field 'head_dim' ({head_dim}) must be even for RoPE")
    return head_dim, _rotary_dim(raw, source, head_dim, spec), {}


def _rotary_dim(raw: dict, source: str, head_dim: int, spec: Architecture) -> int:
    """The dimensions of each head RoPE turns: head_dim times partial_rotary_factor (top level, or
    in rope_parameters), which must leave an even count; 0 for all of them. Only for a family
    whose transformers code reads the factor (spec.partial_rotary)."""
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    field, factor = "partial_rotary_factor", raw.get("partial_rotary_factor")
    if factor is None and "partial_rotary_factor" in params:
        field, factor = "rope_parameters.partial_rotary_factor", params["partial_rotary_factor"]
    if factor is None:
        factor = spec.default_rotary_factor
    if factor == 1.0:
        return 0
    if not spec.partial_rotary:
        raise ConfigError(f"{source}: field '{field}' other than 1.0 is not supported for {spec.hf_names[0]}")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor < 1:
        raise ConfigError(f"{source}: field '{field}' must be a number in (0, 1], got {factor!r}")
    dim = int(head_dim * factor)
    if dim <= 0 or dim % 2:
        raise ConfigError(f"{source}: field '{field}' ({factor}) turns {dim} of head_dim {head_dim}; RoPE needs an even count")
    return dim


def _special_tokens(raw: dict, source: str) -> tuple[int | None, tuple[int, ...]]:
    """bos_token_id, and eos_token_id as a tuple (config.json has one id or a list)."""
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos_ids):
        raise ConfigError(f"{source}: field 'eos_token_id' must be an integer or a list of integers")
    bos = raw.get("bos_token_id")
    if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool)):
        raise ConfigError(f"{source}: field 'bos_token_id' must be an integer")
    return bos, eos_ids


def _rope(raw: dict, source: str, spec: Architecture, layer_type: str = "full_attention", default_theta: float = 10000.0) -> tuple[float, RopeScaling]:
    """RoPE base and scaling of one kind of layer, from either spelling: v4's `rope_theta` +
    `rope_scaling` (and Gemma's `rope_local_base_freq` for sliding layers), or v5's
    `rope_parameters` (for Gemma, one entry per layer type)."""
    field = "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"
    params = raw.get(field) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: field '{field}' must be an object or null")
    if set(params) & set(LAYER_TYPES):  # per layer type
        field = f"{field}.{layer_type}"
        params = params.get(layer_type) or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{source}: field '{field}' must be an object or null")
    elif layer_type == "sliding_attention":  # v4 Gemma: a plain local base, no scaling
        params = {"rope_theta": raw.get("rope_local_base_freq", default_theta)}
    theta = params.get("rope_theta", raw.get("rope_theta", default_theta))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0 or not math.isfinite(theta):
        raise ConfigError(f"{source}: field 'rope_theta' must be a positive number, got {theta!r}")

    rope_type = spec.rope_type(params.get("rope_type", params.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: field '{field}.rope_type' is {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), RopeScaling()

    def num(key, default=None, optional=False):
        value = params.get(key, default)
        if value is None and optional:
            return None
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or not math.isfinite(value):
            raise ConfigError(f"{source}: field '{field}.{key}' must be a positive number, got {value!r}")
        return float(value)

    max_pos = raw.get("max_position_embeddings", 2048)
    if rope_type == "linear":
        return float(theta), RopeScaling("linear", factor=num("factor"))
    if rope_type == "dynamic":
        return float(theta), RopeScaling("dynamic", factor=num("factor"))
    # transformers takes a top-level original_max_position_embeddings first (Phi-3's config has one)
    original = raw.get("original_max_position_embeddings", spec.original_context)
    original = int(num("original_max_position_embeddings", original if original is not None else params.get("original_max_position_embeddings", max_pos)))
    if rope_type == "llama3":
        scaling = RopeScaling(
            "llama3",
            factor=num("factor"),
            low_freq_factor=num("low_freq_factor"),
            high_freq_factor=num("high_freq_factor"),
            original_max_position_embeddings=original,
        )
        if scaling.high_freq_factor == scaling.low_freq_factor:
            raise ConfigError(f"{source}: field '{field}.high_freq_factor' must differ from low_freq_factor")
        return float(theta), scaling
    factor = num("factor", optional=True)
    factor = max_pos / original if factor is None else factor
    if rope_type == "yarn":
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ConfigError(f"{source}: field '{field}.truncate' must be true or false")
        return float(theta), RopeScaling(
            "yarn", factor=factor, original_max_position_embeddings=original,
            attention_factor=num("attention_factor", optional=True),
            beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=num("mscale", optional=True), mscale_all_dim=num("mscale_all_dim", optional=True), truncate=truncate,
        )
    factors = {}
    for key in ("long_factor", "short_factor"):
        values = params.get(key)
        if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):
            raise ConfigError(f"{source}: field '{field}.{key}' must be a list of positive numbers")
        factors[key] = tuple(float(v) for v in values)
    return float(theta), RopeScaling(
        "longrope", factor=factor, original_max_position_embeddings=original,
        attention_factor=num("attention_factor", optional=True), **factors,
    )


def _experts(fields: Fields, spec: Architecture, layers: int) -> dict:
    """The ModelConfig fields of a mixture of experts, as transformers reads them; {} for a dense model."""
    if not spec.mixture_of_experts:
        return {}
    count_field = spec.expert_count_field if spec.expert_count_field in fields.raw else "num_local_experts"
    experts = fields.positive_int(count_field)
    top_k = fields.positive_int(spec.top_k_field, default=spec.default_top_k)
    if top_k > experts:
        raise ConfigError(f"{fields.source}: field '{spec.top_k_field}' ({top_k}) exceeds the {experts} experts")
    return dict(num_experts=experts, experts_per_token=top_k, expert_intermediate_size=fields.positive_int(spec.expert_width_field),
                **spec.experts(fields, layers, experts))


def _refuse_unsupported(fields: Fields, spec: Architecture) -> None:
    """Options that we do not implement: an error naming the field."""
    raw, source, arch = fields.raw, fields.source, spec.hf_names[0]
    if raw.get("use_bidirectional_attention"):
        raise ConfigError(f"{source}: field 'use_bidirectional_attention' is true; only causal attention is supported")
    if raw.get("vision_config"):
        raise ConfigError(f"{source}: field 'vision_config' is set; vision models are not supported")
    if not spec.mixture_of_experts:
        for field in ("num_experts", "num_local_experts"):
            if raw.get(field):
                raise ConfigError(f"{source}: field '{field}' is set, but {arch} is a dense architecture; mixtures of experts: {', '.join(MOE_ARCHITECTURES)}")
    quant = raw.get("quantization_config")
    if quant is not None:  # a format the family ships in and runs as stored (gpt-oss's MXFP4); no other scheme
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        if not spec.allows_quantization(method):
            raise ConfigError(f"{source}: field 'quantization_config.quant_method' is {method!r}; only gpt-oss's 'mxfp4' is supported "
                              "(or convert the checkpoint to float weights, or a GGUF file)")
    if raw.get("clip_qkv") is not None:  # OLMoE
        raise ConfigError(f"{source}: field 'clip_qkv' is set; clamping q, k and v is not supported")
    for field in ("moe_layer_freq", "n_shared_experts", "first_k_dense_replace", "topk_method", "n_group", "scoring_func"):
        if raw.get(field) is not None and field not in spec.router_fields:  # routers the family's spec does not read
            raise ConfigError(f"{source}: field '{field}' is set; this router is not supported")
    spec.refuse(fields)


def _layer_kinds(fields: Fields, spec: Architecture, layers: int) -> tuple[int | None, tuple[str, ...], tuple[bool, ...]]:
    """(sliding window, per-layer attention types, per-layer RoPE flags), as transformers derives
    them for each architecture when config.json does not list `layer_types`."""
    source = fields.source
    window = spec.window(fields)
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise ConfigError(f"{source}: field 'sliding_window' must be a positive integer or null, got {window!r}")
    rope_layers = spec.rope_layers(fields, layers)
    types = fields.raw.get("layer_types")
    if types is None:
        if window is None:
            return None, (), rope_layers
        types = spec.layer_types(fields, layers, rope_layers)
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(f"{source}: field 'layer_types' must list one of {', '.join(LAYER_TYPES)} for each of the {layers} layers")
    if "chunked_attention" in types and not spec.chunked_attention:
        raise ConfigError(f"{source}: field 'layer_types' has chunked_attention, which {spec.hf_names[0]} does not have")
    if window is None:  # transformers: a sliding layer without a window attends to everything
        return None, (), rope_layers
    return window, tuple(types), rope_layers
