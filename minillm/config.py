"""The model configuration: one frozen dataclass built from HF `config.json` field names.

Anything we do not implement is an error naming the field, never a silent default.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_CONTEXT = 4096


@dataclass(frozen=True)
class RopeScaling:
    """HF `rope_scaling` / `rope_parameters`, reduced to what the supported types use."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    attention_bias: bool  # bias on q, k, v and o (Llama's `attention_bias`)
    qkv_bias: bool  # bias on q, k, v only (Qwen2)
    mlp_bias: bool
    sliding_window: int | None  # None: full attention in every layer
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

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

    def context_size(self, requested: int | None = None) -> int:
        """The KV-cache length to use: the user's setting, else min(max positions, 4096).

        A sliding window smaller than the context would change attention, which we do not
        implement, so it is an error naming the field.
        """
        ctx = min(self.max_position_embeddings, DEFAULT_CONTEXT) if requested is None else int(requested)
        if ctx <= 0:
            raise ConfigError(f"context size must be positive, got {ctx}")
        if self.sliding_window is not None and self.sliding_window < ctx:
            raise ConfigError(
                f"config.json: sliding_window={self.sliding_window} is smaller than the context "
                f"size {ctx}; sliding-window attention is not supported (use a context of at most "
                f"{self.sliding_window})"
            )
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
        fields = _Fields(raw, source)

        archs = raw.get("architectures")
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{source}: field 'architectures' is {archs!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]

        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: field 'hidden_act' is {act!r}; only 'silu' is supported")

        hidden = fields.positive_int("hidden_size")
        heads = fields.positive_int("num_attention_heads")
        kv_heads = fields.positive_int("num_key_value_heads", default=heads)
        head_dim = raw.get("head_dim")
        head_dim = hidden // heads if head_dim is None else fields.positive_int("head_dim")
        if heads % kv_heads:
            raise ConfigError(
                f"{source}: field 'num_key_value_heads' ({kv_heads}) must divide num_attention_heads ({heads})"
            )
        if head_dim % 2:
            raise ConfigError(f"{source}: field 'head_dim' ({head_dim}) must be even for RoPE")
        if raw.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(f"{source}: field 'partial_rotary_factor' other than 1.0 is not supported")

        eps = fields.number("rms_norm_eps", default=1e-6)
        if not eps > 0:
            raise ConfigError(f"{source}: field 'rms_norm_eps' must be > 0, got {eps}")

        rope_theta, scaling = _rope(raw, source)
        max_pos = fields.positive_int("max_position_embeddings", default=2048)

        sliding = None
        if arch == "MistralForCausalLM":
            sliding = raw.get("sliding_window")
        elif arch == "Qwen2ForCausalLM" and raw.get("use_sliding_window"):
            sliding = raw.get("sliding_window")
        if sliding is not None and (not isinstance(sliding, int) or isinstance(sliding, bool) or sliding <= 0):
            raise ConfigError(f"{source}: field 'sliding_window' must be a positive integer or null, got {sliding!r}")

        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos_ids):
            raise ConfigError(f"{source}: field 'eos_token_id' must be an integer or a list of integers")
        bos = raw.get("bos_token_id")
        if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool)):
            raise ConfigError(f"{source}: field 'bos_token_id' must be an integer")

        return cls(
            architecture=arch,
            vocab_size=fields.positive_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=fields.positive_int("intermediate_size"),
            num_hidden_layers=fields.positive_int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=eps,
            rope_theta=rope_theta,
            rope_scaling=scaling,
            tie_word_embeddings=fields.boolean("tie_word_embeddings", default=False),
            attention_bias=arch != "Qwen2ForCausalLM" and fields.boolean("attention_bias", default=False),
            qkv_bias=arch == "Qwen2ForCausalLM",
            mlp_bias=arch == "LlamaForCausalLM" and fields.boolean("mlp_bias", default=False),
            sliding_window=sliding,
            bos_token_id=bos,
            eos_token_id=eos_ids,
        )


class _Fields:
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

    def number(self, name: str, default: float) -> float:
        value = self.raw.get(name, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ConfigError(f"{self.source}: field '{name}' must be a finite number, got {value!r}")
        return float(value)

    def boolean(self, name: str, default: bool) -> bool:
        value = self.raw.get(name, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.source}: field '{name}' must be true or false, got {value!r}")
        return value


def _rope(raw: dict, source: str) -> tuple[float, RopeScaling]:
    """RoPE base and scaling from either spelling: v4's `rope_theta` + `rope_scaling`, or v5's `rope_parameters`."""
    field = "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"
    params = raw.get(field) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: field '{field}' must be an object or null")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0 or not math.isfinite(theta):
        raise ConfigError(f"{source}: field 'rope_theta' must be a positive number, got {theta!r}")

    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"{source}: field '{field}.rope_type' is {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), RopeScaling()

    def num(key, default=None):
        value = params.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ConfigError(f"{source}: field '{field}.{key}' must be a positive number, got {value!r}")
        return value

    if rope_type == "linear":
        return float(theta), RopeScaling("linear", factor=float(num("factor")))
    original = params.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
    scaling = RopeScaling(
        "llama3",
        factor=float(num("factor")),
        low_freq_factor=float(num("low_freq_factor")),
        high_freq_factor=float(num("high_freq_factor")),
        original_max_position_embeddings=int(num("original_max_position_embeddings", original)),
    )
    if scaling.high_freq_factor == scaling.low_freq_factor:
        raise ConfigError(f"{source}: field '{field}.high_freq_factor' must differ from low_freq_factor")
    return float(theta), scaling
