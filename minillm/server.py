"""An OpenAI-compatible HTTP server over the batching engine (FastAPI on uvicorn).

    python cli.py serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--ctx N] [--max-batch N]
                        [--max-queue N] [--api-key KEY]

POST /v1/completions, POST /v1/chat/completions (stream: true gives SSE chunks ending with
`data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus text).
Errors have OpenAI's shape {"error": {"message", "type", "param", "code"}}: 400 for any invalid
request (never 422), 401 for a wrong API key, 404 for an unknown route, 429 when the queue is full.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Literal, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from .api import LLM
from .engine import QueueFullError, TokenEvent
from .errors import MiniLLMError
from .generate import TextAssembler
from .sampling import SamplingParams

MAX_PROMPT_CHARS_PER_TOKEN = 64  # a prompt longer than ctx * this many characters cannot fit


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


# ------------------------------------------------------------------ request schemas


class _Strict(BaseModel):
    # NaN and Infinity are rejected; unknown OpenAI fields are accepted and ignored.
    model_config = ConfigDict(allow_inf_nan=False, extra="allow")


class _Sampling(_Strict):
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
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (benchmarks)
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None

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
        )

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 16:
            raise APIError(400, "at most 16 stop strings", param="stop")
        return stops


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int]] = Field(...)
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


# ------------------------------------------------------------------ the app


def create_app(llm: LLM, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="minillm", docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer = llm.tokenizer
    ctx = llm.model.ctx
    created = int(time.time())
    counters = {"requests": 0, "errors": 0}

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        counters["errors"] += 1
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        return error_response(APIError(400, f"{'.'.join(loc) + ': ' if loc else ''}{message}", param=".".join(loc) or None))

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, exc: HTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        counters["errors"] += 1
        return error_response(exc)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        counters["errors"] += 1
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {api_key}":
            raise APIError(401, "invalid API key", type="authentication_error", code="invalid_api_key")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "minillm"}]}

    @app.get("/metrics")
    async def metrics():
        s = llm.engine.stats
        lines = [
            ("minillm_requests_total", "counter", "Requests accepted by the engine", s.requests),
            ("minillm_requests_finished_total", "counter", "Requests that finished", s.finished),
            ("minillm_request_errors_total", "counter", "Requests rejected or failed", counters["errors"] + s.errors),
            ("minillm_requests_rejected_queue_full_total", "counter", "Requests refused with 429", s.rejected),
            ("minillm_prompt_tokens_total", "counter", "Prompt tokens prefilled", s.prompt_tokens),
            ("minillm_generated_tokens_total", "counter", "Tokens generated", s.generated_tokens),
            ("minillm_decode_steps_total", "counter", "Batched decode steps", s.steps),
            ("minillm_queue_depth", "gauge", "Requests waiting for a slot", llm.engine.queue_depth),
            ("minillm_batch_size", "gauge", "Sequences in the running batch", llm.engine.batch_size),
            ("minillm_time_to_first_token_seconds_sum", "counter", "Sum of times to first token", s.ttft_sum),
            ("minillm_time_to_first_token_seconds_count", "counter", "Requests with a first token", s.ttft_count),
            ("minillm_request_latency_seconds_sum", "counter", "Sum of request latencies", s.latency_sum),
            ("minillm_request_latency_seconds_count", "counter", "Requests finished", s.latency_count),
        ]
        text = "".join(f"# HELP {n} {h}\n# TYPE {n} {t}\n{n} {v}\n" for n, t, h, v in lines)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # -------------------------------------------------------------- shared request path

    def start(prompt_ids: list[int], body: _Sampling, max_tokens: int | None, logprobs: int | None, loop):
        """Validate, then submit to the engine with a sink that feeds an asyncio queue."""
        if any(not 0 <= t < llm.model.config.vocab_size for t in prompt_ids):
            raise APIError(400, "the prompt contains token ids outside the vocabulary", param="prompt")
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if max_tokens is None:
            max_tokens = ctx - len(prompt_ids)
        if len(prompt_ids) + max_tokens > ctx:
            raise APIError(
                400,
                f"this model's context is {ctx} tokens; the prompt has {len(prompt_ids)} and max_tokens asks for {max_tokens}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        try:
            params = body.sampling()
        except MiniLLMError as e:
            raise APIError(400, str(e)) from None
        events: asyncio.Queue = asyncio.Queue()
        try:
            handle = llm.engine.submit(
                prompt_ids, params, max_tokens, () if body.ignore_eos else llm.eos_ids, logprobs,
                sink=lambda item: loop.call_soon_threadsafe(events.put_nowait, item),
            )
        except QueueFullError as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        except MiniLLMError as e:
            raise APIError(400, str(e)) from None
        counters["requests"] += 1
        return handle, events, max_tokens

    async def token_events(handle, events):
        """TokenEvents until the engine ends the request; cancels it if the client goes away."""
        from .engine import _END

        finished = False
        try:
            while True:
                item = await events.get()
                if item is _END:
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:
                handle.cancel()  # the client disconnected, or a stop string ended it early

    async def pieces(handle, events, assembler):
        """(text, the TokenEvents behind it, final?) as text becomes final; the last item carries
        the tail. Stops early (cancelling the request) at a stop string."""
        evs = []
        async for ev in token_events(handle, events):
            evs.append(ev)
            text = assembler.push(ev.token)
            if text or assembler.stopped:
                yield text, evs, False
                evs = []
            if assembler.stopped:
                break
        yield assembler.finish(), evs, True

    async def collect(handle, events, assembler):
        """The whole text and every TokenEvent, for a non-streaming response."""
        text, evs = [], []
        try:
            async for piece, piece_events, _ in pieces(handle, events, assembler):
                text.append(piece)
                evs += piece_events
        except MiniLLMError as e:
            raise APIError(500, str(e), type="server_error") from None
        return "".join(text), evs

    def sse_response(chunks, body, rid, now, kind, prompt_tokens) -> StreamingResponse:
        """Server-sent events from (chunk, tokens in it) pairs: a usage chunk if asked for, an engine
        error as an error event, and always `data: [DONE]` last."""
        include_usage = bool((body.stream_options or {}).get("include_usage"))

        async def events_out():
            generated = 0
            try:
                async for obj, n_tokens in chunks:
                    generated += n_tokens
                    yield _sse(obj)
                if include_usage:
                    yield _sse({"id": rid, "object": kind, "created": now, "model": model_name,
                                "choices": [], "usage": _usage(prompt_tokens, generated)})
            except MiniLLMError as e:
                yield _sse(APIError(500, str(e), type="server_error").body())
            yield "data: [DONE]\n\n"

        return StreamingResponse(events_out(), media_type="text/event-stream")

    def finish_reason(handle, assembler) -> str:
        if assembler.stopped or handle.finish_reason == "stop":
            return "stop"
        return "length"  # max_tokens, or the context filled up

    def token_text(token: int) -> str:
        return tokenizer.decode([token], skip_special_tokens=False)

    def check_prompt_size(text: str) -> None:
        if len(text) > ctx * MAX_PROMPT_CHARS_PER_TOKEN:
            raise APIError(400, f"the prompt is far longer than this model's context of {ctx} tokens", param="prompt", code="context_length_exceeded")

    # -------------------------------------------------------------- completions

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        authorize(request)
        if isinstance(body.prompt, str):
            check_prompt_size(body.prompt)
            prompt_ids = tokenizer.encode(body.prompt)
        else:
            prompt_ids = list(body.prompt)
        stops = body.stops()
        handle, events, _ = start(prompt_ids, body, body.max_tokens, body.logprobs, asyncio.get_running_loop())
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def logprob_block(evs: list[TokenEvent]):
            if body.logprobs is None:
                return None
            return {
                "tokens": [token_text(e.token) for e in evs],
                "token_logprobs": [e.logprob for e in evs],
                "top_logprobs": [{token_text(t): lp for t, lp in e.top_logprobs} for e in evs],
                "text_offset": [],
            }

        def chunk(text, reason, evs):
            return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                    "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": logprob_block(evs)}]}

        assembler = TextAssembler(tokenizer, stops)
        if body.stream:
            async def chunks():
                async for text, evs, final in pieces(handle, events, assembler):
                    yield chunk(text, finish_reason(handle, assembler) if final else None, evs), len(evs)

            return sse_response(chunks(), body, rid, now, "text_completion", len(prompt_ids))

        text, all_events = await collect(handle, events, assembler)
        result = chunk(text, finish_reason(handle, assembler), all_events)
        result["usage"] = _usage(len(prompt_ids), len(all_events))
        return result

    # -------------------------------------------------------------- chat

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        authorize(request)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        check_prompt_size("".join(m["content"] for m in messages))
        try:
            prompt_ids = tokenizer.encode_chat(messages)
        except MiniLLMError as e:
            raise APIError(400, str(e), param="messages") from None
        stops = body.stops()
        top = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        handle, events, _ = start(prompt_ids, body, max_tokens, top, asyncio.get_running_loop())
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def logprob_block(evs: list[TokenEvent]):
            if top is None:
                return None
            def entry(t, lp):
                s = token_text(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
            return {"content": [dict(entry(e.token, e.logprob), top_logprobs=[entry(t, lp) for t, lp in e.top_logprobs]) for e in evs]}

        def chunk(delta, reason, evs):
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": logprob_block(evs)}]}

        assembler = TextAssembler(tokenizer, stops)
        if body.stream:
            async def chunks():
                yield chunk({"role": "assistant", "content": ""}, None, []), 0
                async for text, evs, final in pieces(handle, events, assembler):
                    if final:
                        yield chunk({"content": text} if text else {}, finish_reason(handle, assembler), evs), len(evs)
                    elif text:
                        yield chunk({"content": text}, None, evs), len(evs)

            return sse_response(chunks(), body, rid, now, "chat.completion.chunk", len(prompt_ids))

        text, all_events = await collect(handle, events, assembler)
        return {
            "id": rid, "object": "chat.completion", "created": now, "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish_reason(handle, assembler), "logprobs": logprob_block(all_events)}],
            "usage": _usage(len(prompt_ids), len(all_events)),
        }

    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, allow_nan=False)}\n\n"


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def serve(llm: LLM, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None) -> None:
    import uvicorn

    llm.engine  # start the engine thread before the first request
    uvicorn.run(create_app(llm, model_name, api_key), host=host, port=port, log_level="warning")
