"""Ollama's API as minillm reads it: request fields as the OpenAI request they mean (sampling
options, `format`, tool calls, `keep_alive`), the OpenAI endpoint's events read back into a reply,
and a model's details as Ollama describes them. minillm.serving.ollama serves it."""

from __future__ import annotations

import json
import re
import time
from datetime import datetime, timezone

from fastapi.responses import JSONResponse

from .models import ModelEntry

VERSION = "0.12.0"  # the Ollama API version these endpoints follow (clients check for features by it)
NDJSON = "application/x-ndjson"
# Ollama's sampling defaults where a request gives none (the OpenAI endpoints keep OpenAI's)
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
OPTION_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
                 "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty"}
# accepted and without effect on the reply: where Ollama places a model (GPUs, threads, memory
# mapping) and what it keeps of the prompt when it overflows
NO_EFFECT = {"num_gpu", "main_gpu", "low_vram", "numa", "num_thread", "num_batch", "use_mmap", "use_mlock", "num_keep", "vocab_only",
             "logits_all", "embedding_only"}
# samplers minillm does not have: accepted only at the value that switches them off, else a 400
SWITCHED_OFF = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}


class OllamaError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def keep_alive_seconds(value) -> float | None:
    """Ollama's keep_alive: seconds as a number, or a Go duration ("5m", "1h30m", "0"); negative:
    for ever (-1 here); None: the server's default."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise OllamaError(400, f"keep_alive: not a duration: {value!r}")
    if isinstance(value, (int, float)):
        return -1.0 if value < 0 else float(value)
    text = str(value).strip()
    try:
        return -1.0 if float(text) < 0 else float(text)
    except ValueError:
        pass
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise OllamaError(400, f"keep_alive: not a duration: {value!r} (e.g. 300, \"5m\", \"1h\", 0 to unload, -1 to keep)")
    seconds = sum(float(n) * units[u] for n, u in parts)
    return -1.0 if seconds < 0 else seconds


def sampling(options: dict | None) -> dict:
    """OpenAI request fields from Ollama's `options`."""
    options = dict(options or {})
    if not isinstance(options, dict):
        raise OllamaError(400, "options must be an object")
    fields = dict(DEFAULTS)
    for name, value in options.items():
        if name in OPTION_FIELDS:
            fields[OPTION_FIELDS[name]] = value
        elif name == "num_predict":
            if not isinstance(value, int) or isinstance(value, bool) or value == 0 or value < -2:
                raise OllamaError(400, "options.num_predict must be a positive number of tokens, -1 (no limit) or -2 (fill the context)")
            if value > 0:
                fields["max_tokens"] = value
        elif name == "num_ctx":
            if not isinstance(value, int) or value < 1:
                raise OllamaError(400, "options.num_ctx must be a positive integer")
        elif name in SWITCHED_OFF:
            if value != SWITCHED_OFF[name]:
                raise OllamaError(400, f"options.{name} is not supported (only {SWITCHED_OFF[name]}: off)")
        elif name not in NO_EFFECT:
            raise OllamaError(400, f"options.{name} is not supported")
    if fields.get("top_k") is not None and fields["top_k"] <= 0:
        fields["top_k"] = 0
    return fields


def response_format(format_) -> dict | None:
    if format_ in (None, ""):
        return None
    if format_ == "json":
        return {"type": "json_object"}
    if isinstance(format_, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": format_}}
    raise OllamaError(400, "format must be \"json\" or a JSON schema object")


def chat_messages(messages) -> list[dict]:
    """OpenAI messages from Ollama's: tool calls get ids and string arguments, and each tool result
    answers the earliest unanswered call of its tool_name (or the earliest unanswered one)."""
    if not isinstance(messages, list):
        raise OllamaError(400, "messages must be a list")
    out, unanswered, counter = [], [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise OllamaError(400, f"messages[{i}] must be an object with a role")
        if m.get("images"):
            raise OllamaError(400, "images are not supported: minillm runs text models")
        message = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("thinking") and m["role"] == "assistant":
            message["reasoning_content"] = m["thinking"]
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                function = (call or {}).get("function") or {}
                args = function.get("arguments", {})
                call_id = f"call_{counter}"
                counter += 1
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": function.get("name", ""), "arguments": args if isinstance(args, str) else json.dumps(args)}})
                unanswered.append((call_id, function.get("name")))
            message["tool_calls"] = calls
        if m["role"] == "tool":
            wanted = m.get("tool_name") or m.get("name")
            match = next((c for c in unanswered if c[1] == wanted), unanswered[0] if unanswered else None)
            if match is None:
                raise OllamaError(400, f"messages[{i}]: a tool result with no earlier tool call to answer")
            unanswered.remove(match)
            message["tool_call_id"] = match[0]
        out.append(message)
    return out


class Reply:
    """A reply read from the OpenAI endpoint's events: its text, thinking, tool calls and usage."""

    def __init__(self):
        self.content, self.thinking, self.calls = [], [], {}
        self.finish, self.usage, self.error = None, {}, None
        self.first_token_at: float | None = None

    def read(self, event: dict, key: str = "delta") -> tuple[str, str]:
        """Take one event (a chunk of a stream, or a whole response); the new (text, thinking)."""
        if "error" in event:
            self.error = (event["error"] or {}).get("message", "error")
            return "", ""
        self.usage = event.get("usage") or self.usage
        text = thinking = ""
        for choice in event.get("choices") or ():
            part = choice.get(key) or {}
            if key == "text":  # a completion's choice
                text += choice.get("text") or ""
            else:
                text += part.get("content") or ""
                thinking += part.get("reasoning_content") or ""
                for call in part.get("tool_calls") or ():
                    held = self.calls.setdefault(call.get("index", len(self.calls)), {"name": "", "arguments": ""})
                    function = call.get("function") or {}
                    held["name"] += function.get("name") or ""
                    held["arguments"] += function.get("arguments") or ""
            self.finish = choice.get("finish_reason") or self.finish
        if (text or thinking or self.calls) and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.content.append(text)
        self.thinking.append(thinking)
        return text, thinking

    def tool_calls(self) -> list[dict]:
        calls = []
        for _, call in sorted(self.calls.items()):
            try:
                arguments = json.loads(call["arguments"] or "{}")
            except ValueError:
                arguments = call["arguments"]
            calls.append({"function": {"name": call["name"], "arguments": arguments}})
        return calls

    @property
    def done_reason(self) -> str:
        return {"length": "length", "tool_calls": "stop"}.get(self.finish or "stop", "stop")


def details(entry: ModelEntry) -> dict:
    """Ollama's model details: the format, family and size as far as they are known (all of them
    once the model is loaded)."""
    source = str(entry.options.model or "")
    found = {"parent_model": "", "format": "gguf" if source.lower().endswith(".gguf") or ":" in source else "safetensors",
             "family": "", "families": None, "parameter_size": "", "quantization_level": (entry.options.dtype or "").upper()}
    if entry.llm is not None:
        model = entry.llm.model
        found["family"] = family(model.config)
        found["families"] = [found["family"]]
        found["parameter_size"] = _count(parameter_count(model.config))
        found["format"] = "gguf" if entry.llm.source.suffix == ".gguf" else "safetensors"
        from ..loading.hub import quant_of

        stored = quant_of(entry.llm.source.name) if model.dtype == "gguf" else None  # a GGUF's mixture by its file's name
        found["quantization_level"] = stored or "+".join(sorted({f.group_of or f.name for f in model.formats})).upper()
    return found


def family(config) -> str:
    """Ollama's family name: "llama" for LlamaForCausalLM, "qwen3moe" for Qwen3MoeForCausalLM."""
    return config.architecture.removesuffix("ForCausalLM").lower()


def parameter_count(config) -> int:
    """About how many parameters a model has, from its config (its matrices: what its size says)."""
    H, layers = config.hidden_size, config.num_hidden_layers
    attention = H * config.head_dim * 2 * (config.num_attention_heads + config.num_key_value_heads)
    if config.num_experts:
        mlp = 3 * H * (config.num_experts * config.expert_intermediate_size + config.shared_expert_intermediate_size)
    else:
        mlp = (3 if config.gated_mlp else 2) * H * config.intermediate_size
    return config.vocab_size * H * (1 if config.tie_word_embeddings else 2) + layers * (attention + mlp)


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
