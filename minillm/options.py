"""The settings of loading and serving a model, with their defaults in one place.

The CLI's flags take their defaults from here, `minillm.load` and the engine read an `Options`,
the server and the cluster pass one on; a value out of range is a UsageError that names the
option. Nothing here imports the kernels: the CLI reads it before parsing arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from .errors import UsageError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the bundled model (minillm.loading.default_model)
DEFAULT_SPEC_TOKENS = 8  # speculative decoding's longest proposal
DEFAULT_SPEC_NGRAM = 3  # and prompt lookup's longest n-gram


@dataclass(frozen=True)
class Options:
    # the model
    model: str | None = field(default=None, metadata={"help": "an HF checkpoint directory, a GGUF file, or a Hugging Face Hub name ORG/NAME "
                              "(ORG/NAME:QUANT picks a GGUF repository's file, e.g. :Q4_K_M), downloaded once into the Hub's cache "
                              "(default: the bundled model)"})
    revision: str | None = field(default=None, metadata={"help": "with a Hub name, its branch, tag or commit (default: main)"})
    ctx: int | None = field(default=None, metadata={"help": "context size (default: min(max positions, 4096))"})
    dtype: str | None = field(default=None, metadata={"help": "weight precision (kernels.formats.DTYPE_CHOICES)"})
    activations: int | None = field(default=None, metadata={"help": "bits activations are quantized to per block of 32 against GGUF blocks "
                                    "run on integer products (Q4_0, Q5_0, Q8_0, Q4_K, Q6_K, MXFP4): 16 (within about 1/65000 of float32) or 8 "
                                    "(llama.cpp's own numerics: half the products, faster prefill); default: each format's own, "
                                    "chosen by perplexity (docs/performance.md)"})
    check_weights: bool = field(default=False, metadata={"help": "reject weights containing NaN or Inf"})
    threads: int | None = field(default=None, metadata={"help": "the most threads a step uses (default: every CPU; with replicas, 1 per replica)"})
    kv_dtype: str = field(default="float32", metadata={"help": "how the KV cache keeps keys and values: float32 (exact, the default), "
                          "float16 or bfloat16 (half the memory), q8_0 (0.27 of it; llama.cpp's -ctk/-ctv q8_0)"})
    lora: tuple[str, ...] = field(default=(), metadata={"help": "a LoRA adapter directory as PEFT saves it, [NAME=]PATH[:SCALE], repeatable: "
                                  "generate, chat, logits and bench apply every one given (their updates summed); serve offers each as a model "
                                  "named NAME (default: its directory's name) beside the base model"})
    chat_template: str | None = field(default=None, metadata={"help": "a Jinja file to use instead of the model's chat template"})
    # reasoning models (minillm.core.reasoning)
    reasoning_format: str = field(default="auto", metadata={"help": "auto: a reasoning model's thinking apart from its answer (<think> or "
                                  "gpt-oss's Harmony channels, found from the tokenizer); none: the reply's raw text"})
    chat_template_kwargs: str | None = field(default=None, metadata={"help": "a JSON object of chat template variables every request "
                                             "starts from (e.g. '{\"enable_thinking\": false}')"})
    # the engine
    max_batch: int = field(default=8, metadata={"help": "sequences decoded together"})
    max_queue: int = field(default=64, metadata={"help": "requests allowed to wait (then 429)"})
    cache_mb: float | None = field(default=None, metadata={"help": "prefix cache memory (default: a fifth of free memory, at most 2048; 0: off)"})
    cache_dir: str | None = field(default=None, metadata={"help": "keep the prefix cache in this directory between runs: written when idle "
                                  "and at exit, read back when the same weights start with the same KV format"})
    speculative: str | None = field(default=None, metadata={"help": "propose tokens and keep those plain decoding would choose (the same text, faster): ngram (prompt lookup; when output repeats input) or draft (a cheaper model)"})
    draft_model: str | None = field(default=None, metadata={"help": "with --speculative draft, the model that proposes (same tokenizer; default: the model itself)"})
    draft_dtype: str | None = field(default=None, metadata={"help": "with --speculative draft, the draft's weight precision (default: int8 for a checkpoint, q4_0 for a GGUF)"})
    spec_tokens: int | None = field(default=None, metadata={"help": f"with --speculative, the most tokens proposed per step (default {DEFAULT_SPEC_TOKENS})"})
    spec_ngram: int | None = field(default=None, metadata={"help": f"with --speculative ngram, the longest n-gram looked up (2 at least; default {DEFAULT_SPEC_NGRAM})"})
    prefill_chunk: int | None = field(default=None, metadata={"help": "prompt tokens read per step beside running streams (default: sized so their tokens keep coming)"})
    # the HTTP server
    model_name: str | None = field(default=None, metadata={"help": "the model id clients send (default: the model's file or directory name)"})
    api_key: str | None = field(default=None, metadata={"help": "require `Authorization: Bearer KEY` on /v1/*"})
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_mb: float = field(default=8.0, metadata={"help": "refuse request bodies larger than this (413)"})
    allowed_hosts: str | None = field(default=None, metadata={"help": "Host names served, comma-separated, * for any (default: localhost names and --host)"})
    allowed_origins: str | None = field(default=None, metadata={"help": "web origins that may call the API from a browser, comma-separated, * for any (default: none)"})
    allow_runtime_lora: bool = field(default=False, metadata={"help": "POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                                     "(vLLM's): clients load adapters from paths on this machine"})
    shutdown_timeout: float = field(default=30.0, metadata={"help": "on SIGTERM, seconds running requests may take to finish"})
    # several models in one server (minillm.serving.models)
    idle_unload: float | None = field(default=None, metadata={"help": "unload a model idle this many seconds (default: never; "
                                      "Ollama's keep_alive sets it per request)"})
    max_loaded: int | None = field(default=None, metadata={"help": "the most models loaded at once: loading another unloads the least "
                                   "recently used idle one (default: no limit)"})
    max_loaded_mb: float | None = field(default=None, metadata={"help": "the most memory the loaded models' weights may take (a model not "
                                        "loaded yet estimated by its files' size): loading another unloads the least recently used idle ones"})
    # many engine replicas on Ray Serve (minillm.serving.cluster)
    replicas: int | None = field(default=None, metadata={"help": "N engine replicas on Ray Serve behind one endpoint (minillm[cluster])"})
    autoscale: tuple[int, int] | None = field(default=None, metadata={"help": "scale replicas between MIN and MAX on ongoing requests"})
    ingress_replicas: int = field(default=1, metadata={"help": "replicas of the HTTP ingress, which relays every token (about one per machine)"})
    ray_address: str | None = field(default=None, metadata={"help": "join this Ray cluster (default: start a local Ray)"})

    def __post_init__(self):
        def at_least(name, low):
            value = getattr(self, name)
            if value is not None and not value >= low:
                raise UsageError(f"{name.replace('_', '-')} must be >= {low}, got {value}")

        for name, low in (("ctx", 1), ("threads", 1), ("max_batch", 1), ("max_queue", 0), ("cache_mb", 0), ("prefill_chunk", 1), ("spec_tokens", 1), ("spec_ngram", 2), ("port", 0), ("max_body_mb", 0.001),
                          ("shutdown_timeout", 0), ("replicas", 1), ("ingress_replicas", 1), ("idle_unload", 0), ("max_loaded", 1), ("max_loaded_mb", 1)):
            at_least(name, low)
        if self.autoscale is not None and not (len(self.autoscale) == 2 and 1 <= self.autoscale[0] <= self.autoscale[1]):
            raise UsageError(f"autoscale needs 1 <= MIN <= MAX, got {self.autoscale}")
        if self.speculative not in (None, "ngram", "draft"):
            raise UsageError(f"speculative must be ngram (prompt lookup) or draft (a draft model), got {self.speculative!r}")
        if self.speculative != "draft" and (self.draft_model is not None or self.draft_dtype is not None):
            raise UsageError("--draft-model and --draft-dtype need --speculative draft")
        if self.speculative is None and (self.spec_tokens is not None or self.spec_ngram is not None):
            raise UsageError("--spec-tokens and --spec-ngram need --speculative")
        if self.speculative == "draft" and self.spec_ngram is not None:
            raise UsageError("--spec-ngram is for --speculative ngram (prompt lookup), not draft")
        if self.activations not in (None, 16, 8):
            raise UsageError(f"activations must be 16 or 8 (bits), got {self.activations!r}")
        if self.reasoning_format not in ("auto", "none"):
            raise UsageError(f"reasoning-format must be auto or none, got {self.reasoning_format!r}")
        self.template_variables  # noqa: B018 - checks the JSON
        if self.revision is not None:
            from .loading.hub import names_a_model

            if not names_a_model(self.model):
                raise UsageError("--revision is for a Hugging Face Hub name (--model ORG/NAME), not a local path or the bundled model")
        if self.replicas is not None and self.autoscale is not None:
            raise UsageError("--replicas and --autoscale: give one (a fixed count, or MIN:MAX)")

    def replace(self, **changes) -> "Options":
        return replace(self, **changes)

    @property
    def served_name(self) -> str:
        """The model id the server answers to: model_name, or the model's file or directory name."""
        if self.model_name:
            return self.model_name
        if self.model is None:
            return DEFAULT_MODEL_NAME
        from .loading.hub import names_a_model

        if names_a_model(self.model):  # as vLLM and Ollama answer to the name they were given
            return self.model
        path = Path(self.model)
        return path.stem if path.suffix == ".gguf" else path.resolve().name

    @property
    def template_variables(self) -> dict:
        """chat_template_kwargs read: the variables every chat starts from."""
        if self.chat_template_kwargs is None:
            return {}
        try:
            variables = json.loads(self.chat_template_kwargs)
        except ValueError as e:
            raise UsageError(f"chat-template-kwargs: not JSON: {e}") from None
        if not isinstance(variables, dict):
            raise UsageError("chat-template-kwargs must be a JSON object")
        return variables

    @property
    def clustered(self) -> bool:
        """Whether the server runs engine replicas on Ray Serve."""
        return self.replicas is not None or self.autoscale is not None or self.ray_address is not None

    @property
    def replica_threads(self) -> int:
        """CPUs and Numba threads of each engine replica."""
        return self.threads or 1

    @property
    def replica_count(self) -> int:
        """Replicas to start with: the fixed count, the autoscaler's minimum, or 1."""
        return self.replicas if self.replicas is not None else (self.autoscale[0] if self.autoscale else 1)

    @classmethod
    def from_strings(cls, values: dict, where: str = "options") -> "Options":
        """Options from names and strings (or values), as Ray's `serve run ... key=value` gives
        them; an unknown name is an error that names it."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise UsageError(f"{where}: unknown argument {unknown[0]!r}; known: {', '.join(sorted(known))}")
        parsed = {}
        for name, value in values.items():
            if value in (None, ""):
                continue
            kind = known[name].type
            try:
                if name == "lora":
                    parsed[name] = tuple(v for v in str(value).split(",") if v) if isinstance(value, str) else tuple(value)
                elif name == "autoscale":
                    parsed[name] = tuple(int(v) for v in str(value).split(":")) if isinstance(value, str) else tuple(value)
                elif "bool" in kind:
                    parsed[name] = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
                elif "int" in kind:
                    parsed[name] = int(value)
                elif "float" in kind:
                    parsed[name] = float(value)
                else:
                    parsed[name] = str(value)
            except ValueError:
                raise UsageError(f"{where}: {name} must be {kind.split(' ')[0]}, got {value!r}") from None
        return cls(**parsed)

    @classmethod
    def help(cls, name: str) -> str:
        return next(f.metadata.get("help", "") for f in fields(cls) if f.name == name)


DEFAULTS = Options()
