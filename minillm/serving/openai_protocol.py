"""The OpenAI wire format: request schemas (pydantic) and pure builders of response objects.

Nothing here touches the engine or the network: the server (minillm.serving.server) validates a request
with these schemas, runs it, and shapes what comes back with these builders, so completions and
chat build their chunks, logprobs, usage and server-sent events the same way.
"""

from __future__ import annotations

import json
from typing import Callable, Literal, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field

from ..core.engine import ShutdownError, TokenEvent
from ..core.structured import StructuredOutputError
from ..errors import MiniLLMError
from ..core.sampling import SamplingParams

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # n: samples of one prompt
MAX_PROMPTS = 64  # prompts in one completions request (each with its n choices)
SSE_DONE = "data: [DONE]\n\n"


class APIError(Exception):
    """An error response: HTTP status and OpenAI's {"error": {...}} body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers  # e.g. Retry-After

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def engine_error(e: MiniLLMError | APIError) -> APIError:
    """An error the engine raised for a running request, as the client sees it (an APIError, as
    a generation's collect() raises them, as it is)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ShutdownError):
        return APIError(503, str(e), type="service_unavailable", code="shutting_down")
    if isinstance(e, StructuredOutputError):  # the request's grammar, not the server, failed
        return APIError(400, str(e), param=e.param, code="grammar_failed")
    return APIError(500, str(e).splitlines()[0] if str(e) else type(e).__name__, type="server_error")


def joined_text(content) -> str | None:
    """A string, or a list of {"type": "text", "text": ...} parts joined; None for anything else."""
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                                         for part in content):
        return "".join(part["text"] for part in content)
    return content if isinstance(content, str) else None


# ------------------------------------------------------------------ request schemas


# what the server hands every chat template itself (minillm.core.tokenizer.Tokenizer.apply_chat_template)
RENDERER_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class StrictModel(BaseModel):
    # NaN and Infinity are rejected; unknown OpenAI fields are accepted and ignored.
    model_config = ConfigDict(allow_inf_nan=False, extra="allow")


class SamplingRequest(StrictModel):
    """The fields completions and chat share."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # 0 or -1: off (vLLM's extension)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (benchmarks)
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    prediction: dict | None = None  # OpenAI's predicted outputs: {"type": "content", "content": text or text parts}
    grammar: str | dict | None = None  # extension: GBNF, or {"type": "lark" | "gbnf" | "regex", "grammar": str}

    def sampling_fields(self, *left_out: str) -> dict:
        """The sampling fields this request set (but `left_out`), for the chat a request of another
        API becomes."""
        return self.model_dump(exclude_unset=True, include=set(SamplingRequest.model_fields) - {"stream", "n", *left_out})

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=max(self.top_k, 0),
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            logit_bias=self.token_biases(),
        )

    def token_biases(self) -> tuple[tuple[int, float], ...]:
        biases = []
        for key, value in (self.logit_bias or {}).items():
            try:
                biases.append((int(key), float(value)))
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        return tuple(biases)

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
        return stops

    @property
    def prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token when the prompt is scored too (completions' echo)."""
        return None

    def check_supported(self) -> None:
        """A 400 naming the field for an OpenAI field whose value minillm cannot honour."""

    def predicted_text(self) -> str | None:
        """prediction's text, checked."""
        p = self.prediction
        if p is None:
            return None
        content = joined_text(p.get("content"))
        if p.get("type") != "content" or content is None:
            raise APIError(400, 'prediction must be {"type": "content", "content": text or a list of text parts}', param="prediction")
        return content

    @property
    def candidates(self) -> int:
        """Choices sampled per prompt."""
        return self.n

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]] = Field(...)
    max_tokens: int | None = Field(default=16, ge=0)  # 0: only with echo (score the prompt)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)  # sample this many, return the n likeliest
    suffix: str | None = None  # fill in the middle: the text the completion comes before

    def check_supported(self) -> None:
        if self.suffix is not None and self.echo:
            raise APIError(400, "suffix: echo cannot be combined with filling in the middle", param="suffix")
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(400, f"best_of must be at least n ({self.n}), got {self.best_of}", param="best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise APIError(400, "best_of cannot be streamed: the best choices are known only at the end", param="best_of")

    @property
    def candidates(self) -> int:
        """Choices sampled per prompt: best_of, of which the n likeliest are returned."""
        return self.best_of or self.n

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts, one per list item when a list of texts or of token lists is sent."""
        p = self.prompt
        many = isinstance(p, list) and p and not isinstance(p[0], int)
        prompts = list(p) if many else [p]
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"prompt: send 1 to {MAX_PROMPTS} prompts", param="prompt")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens must be at least 1 unless echo is set (0 scores the prompt only)", param="max_tokens")
        if len(prompts) * self.candidates > MAX_PROMPTS:
            raise APIError(400, f"prompts x n (or best_of) must be at most {MAX_PROMPTS}, got {len(prompts)} x {self.candidates}", param="n")
        return prompts

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens

    @property
    def prompt_logprobs(self) -> int | None:
        """echo with logprobs: the prompt's tokens are scored too."""
        return self.logprobs if self.echo else None

    @property
    def engine_logprobs(self) -> int | None:
        """Alternatives per token the engine reports; None: no logprobs at all (best_of ranks by them)."""
        return self.logprobs if self.logprobs is not None or self.candidates == self.n else 0


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class Message(StrictModel):
    role: Literal["system", "user", "assistant", "developer", "tool", "function"]
    content: Union[str, list[TextPart], None] = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call
    name: str | None = None
    function_call: dict | None = None  # an earlier call in the deprecated functions form (its result: role "function")
    reasoning_content: str | None = None  # an earlier reply's thinking, for templates that keep it

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(SamplingRequest):
    messages: list[Message] = Field(..., min_length=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    parallel_tool_calls: bool = True
    # OpenAI's deprecated form of tools, still sent by older clients: read as tools, one call a reply
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    # reasoning models (minillm.core.reasoning) and the template
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    thinking_token_budget: int | None = Field(default=None, ge=0)  # vLLM's: thinking tokens before the answer is made to start
    chat_template_kwargs: dict | None = None  # variables for the chat template (Qwen3's enable_thinking...)
    continue_final_message: bool | None = None  # None: a final assistant message is continued (llama.cpp's prefill)
    add_generation_prompt: bool = True

    def check_supported(self) -> None:
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError(400, "continue_final_message: the last message must be the assistant's", param="continue_final_message")
        if self.continue_final_message and self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true", param="add_generation_prompt")
        if self.audio is not None or any(m != "text" for m in self.modalities or ()):
            raise APIError(400, "modalities: this server answers in text only", param="modalities" if self.modalities else "audio")
        if self.functions is not None and self.tools is not None:
            raise APIError(400, "functions: give tools or functions (deprecated), not both", param="functions")
        if self.function_call is not None and self.functions is None:
            raise APIError(400, "function_call needs functions", param="function_call")
        for i, function in enumerate(self.functions or ()):
            if not isinstance(function.get("name"), str):
                raise APIError(400, f"functions[{i}] must be {{\"name\": ..., \"parameters\": {{...}}}}", param=f"functions[{i}]")
        if isinstance(self.function_call, dict) and not isinstance(self.function_call.get("name"), str):
            raise APIError(400, 'function_call must be "none", "auto" or {"name": ...}', param="function_call")

    @property
    def legacy_functions(self) -> bool:
        return self.functions is not None

    def tool_request(self) -> tuple[list[dict] | None, str | dict | None, bool]:
        """(tools, tool_choice, parallel_tool_calls), the deprecated functions and function_call read as them."""
        if not self.legacy_functions:
            return self.tools, self.tool_choice, self.parallel_tool_calls
        choice = {"type": "function", "function": self.function_call} if isinstance(self.function_call, dict) else self.function_call
        return [{"type": "function", "function": f} for f in self.functions], choice, False

    def chat_messages(self) -> list[dict]:
        """Messages as chat templates take them (tool calls and results kept; the deprecated
        function_call and role "function" as a tool call and its result)."""
        out, last_call, calls = [], None, set()
        for i, m in enumerate(self.messages):
            message = {"role": m.role, "content": None if (m.tool_calls or m.function_call) and m.content is None else m.text()}
            for key in ("tool_calls", "tool_call_id", "name"):
                if getattr(m, key) is not None:
                    message[key] = getattr(m, key)
            if m.reasoning_content and m.role == "assistant":  # Qwen3's templates read reasoning_content, gpt-oss's thinking
                message.update(reasoning_content=m.reasoning_content, thinking=m.reasoning_content)
            if m.function_call is not None:
                last_call = f"call_{len(out)}"
                message["tool_calls"] = [{"id": last_call, "type": "function", "function": m.function_call}]
            if m.role == "function":
                message.update(role="tool", tool_call_id=last_call)
            calls.update(c.get("id") for c in message.get("tool_calls") or () if isinstance(c, dict))
            if message["role"] == "tool" and message.get("tool_call_id") is not None and message["tool_call_id"] not in calls:
                raise APIError(400, f"messages[{i}]: the tool result for call id {message['tool_call_id']!r} answers no earlier tool call",
                               param=f"messages[{i}].tool_call_id")
            out.append(message)
        return out

    @property
    def continues_reply(self) -> bool:
        """The final message is an assistant's to continue, not a turn to answer: asked for, or by
        default (as llama.cpp prefills), or with add_generation_prompt false."""
        last = self.messages[-1]
        if last.role != "assistant" or last.tool_calls or last.function_call or self.continue_final_message is False:
            return False
        return bool(self.continue_final_message or not self.add_generation_prompt or last.text())

    def template_variables(self, defaults: dict) -> dict:
        """Variables for the chat template: the server's defaults, chat_template_kwargs over them, and
        reasoning_effort (gpt-oss's templates read it; none and minimal switch thinking off
        where a template has the switch, enable_thinking)."""
        variables = dict(defaults, **(self.chat_template_kwargs or {}))
        taken = sorted(set(variables) & RENDERER_VARIABLES)
        if taken:
            raise APIError(400, f"chat_template_kwargs: {taken[0]!r} is set by the server", param="chat_template_kwargs")
        if self.reasoning_effort is not None:
            variables["reasoning_effort"] = self.reasoning_effort
            if self.reasoning_effort in ("none", "minimal"):
                variables["enable_thinking"] = False
        return variables

    def thinking_budget(self, variables: dict) -> int | None:
        """Thinking tokens allowed before the engine ends the thinking: none at all when thinking is
        switched off (so a model whose template has no switch answers at once too)."""
        if variables.get("enable_thinking") is False:
            return 0
        return self.thinking_token_budget

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        """Alternatives per token the engine reports; None: no logprobs at all."""
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(StrictModel):
    """llama.cpp's /tokenize ({"content", "add_special"}), or vLLM's ({"prompt", "add_special_tokens"},
    whose special tokens are added unless asked not to)."""

    content: str | None = None
    add_special: bool = False
    with_pieces: bool = False
    prompt: str | None = None
    add_special_tokens: bool = True

    def text(self) -> tuple[str, str, bool]:
        """(the text, its field, add special tokens?)"""
        if (self.content is None) == (self.prompt is None):
            raise APIError(400, "send the text as either content (llama.cpp) or prompt (vLLM)", param="content")
        if self.content is not None:
            return self.content, "content", self.add_special
        return self.prompt, "prompt", self.add_special_tokens


class DetokenizeRequest(StrictModel):
    """llama.cpp's /detokenize (and vLLM's: the same body)."""

    tokens: list[int]


class LoadLoraRequest(StrictModel):
    """vLLM's /v1/load_lora_adapter."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraRequest(StrictModel):
    lora_name: str = Field(min_length=1)


class EmbeddingRequest(StrictModel):
    model: str | None = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    dimensions: int | None = None


# ------------------------------------------------------------------ response builders

TokenText = Callable[[int], str]  # a token id as the text it stands for


def completion_logprobs(events: Sequence[TokenEvent], token_text: TokenText, offset: int = 0, first: int | None = None) -> dict:
    """OpenAI's legacy logprobs of `events`, whose text starts at character `offset` of the
    choice's text. first: an echoed prompt's first token, which has no logprob (nothing before it)."""
    tokens = [token_text(e.token) for e in events]
    logprobs = {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in events],
        "top_logprobs": [{token_text(t): lp for t, lp in e.top_logprobs} for e in events],
        "text_offset": [],
    }
    if first is not None:
        text = token_text(first)
        tokens.insert(0, text)
        logprobs["token_logprobs"].insert(0, None)
        logprobs["top_logprobs"].insert(0, None)
    for text in tokens:
        logprobs["text_offset"].append(offset)
        offset += len(text)
    return logprobs


def joined_logprobs(first: dict, then: dict) -> dict:
    """Two completion_logprobs, one after the other (an echoed prompt's, then the generated)."""
    return {key: first[key] + then[key] for key in first}


def chat_logprobs(events: Sequence[TokenEvent], token_text: TokenText) -> dict:
    def entry(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [dict(entry(e.token, e.logprob), top_logprobs=[entry(t, lp) for t, lp in e.top_logprobs]) for e in events]}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def chat_delta_choice(index: int, delta: dict, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}


def chat_message_choice(index: int, text: str | None, finish_reason: str, logprobs: dict | None, calls: dict | None = None,
                        reasoning: str = "") -> dict:
    """`calls`: the message's tool_calls (or deprecated function_call) field, if it makes any;
    `reasoning`: a reasoning model's thinking (reasoning_content, as llama.cpp and vLLM name it)."""
    message = dict({"role": "assistant", "content": text}, **(calls or {}))
    if reasoning:
        message["reasoning_content"] = reasoning
    return {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}


def response_object(rid: str, kind: str, created: int, model: str, choices: list[dict]) -> dict:
    """A completion ("text_completion"), chat completion ("chat.completion") or one chunk of a
    stream ("chat.completion.chunk"; a streamed completion's chunks are "text_completion")."""
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}


def usage_chunk(rid: str, created: int, model: str, kind: str, usage_block: dict) -> dict:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, only usage."""
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [], "usage": usage_block}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, prediction: tuple[int, int] | None = None,
          reasoning_tokens: int | None = None) -> dict:
    """Token counts; cached_tokens: prompt tokens served from the prefix cache; prediction: the
    predicted tokens proposed and accepted, when a prediction was given; reasoning_tokens: those
    of the thinking, for a reasoning model."""
    counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens,
              "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    details = {} if reasoning_tokens is None else {"reasoning_tokens": reasoning_tokens}
    if prediction is not None:
        proposed, accepted = prediction
        details.update(accepted_prediction_tokens=accepted, rejected_prediction_tokens=proposed - accepted)
    if details:
        counts["completion_tokens_details"] = details
    return counts


def embedding_list(vectors, model: str, prompt_tokens: int, encoding_format: str) -> dict:
    """OpenAI's embeddings response; base64: the float32 bytes, little-endian, as OpenAI sends them."""
    import base64

    def encode(v):
        return base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding_format == "base64" else [float(x) for x in v]

    return {"object": "list", "model": model, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)]}


def sse(obj: dict) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(obj, allow_nan=False)}\n\n"
