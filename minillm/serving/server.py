"""An OpenAI-compatible HTTP server over the batching engine (FastAPI on uvicorn).

    python cli.py serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--ctx N] [--max-batch N]
                        [--max-queue N] [--api-key KEY]

GET / is a chat page (minillm/static/chat.html). POST /v1/completions, POST /v1/chat/completions (stream: true gives SSE chunks ending with
`data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus text).
Errors have OpenAI's shape {"error": {"message", "type", "param", "code"}}: 400 for any invalid
request (never 422), 401 for a wrong API key, 404 for an unknown route, 429 when the queue is full.
Request schemas and response shapes live in minillm.serving.openai_protocol.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..api import LLM
from ..core.detokenize import TextAssembler
from ..core.engine import QueueFullError, RequestHandle, TokenEvent
from ..core.structured import StructuredOutputError, response_format_constraint
from ..errors import ContextLengthError, MiniLLMError
from ..options import Options
from . import openai_protocol as oai
from .openai_protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    SamplingRequest,
    TokenizeRequest,
)
from .tools import call_grammar, check_tools, forced_names, parse_tool_calls, template_format, template_messages

MAX_PROMPT_CHARS_PER_TOKEN = 64
CHAT_PAGE = Path(__file__).parent / "static" / "chat.html"  # a prompt longer than ctx * this many characters cannot fit


class Generation:
    """One request running in the engine, read as text: pieces as they become final (cut at stop
    strings), the whole text, or server-sent events."""

    def __init__(self, handle: RequestHandle, assembler: TextAssembler, prompt_tokens: int, id_prefix: str, model: str):
        self.handle, self.assembler, self.prompt_tokens, self.model = handle, assembler, prompt_tokens, model
        self.id, self.created = f"{id_prefix}-{uuid.uuid4().hex}", int(time.time())

    async def pieces(self) -> AsyncIterator[tuple[str, list[TokenEvent], bool]]:
        """(text, the TokenEvents behind it, final?) as text becomes final; the last item carries
        the tail. Stops early (cancelling the request) at a stop string."""
        events: list[TokenEvent] = []
        async for event in self.handle.events():
            events.append(event)
            text = self.assembler.push(event.token)
            if text or self.assembler.stopped:
                yield text, events, False
                events = []
            if self.assembler.stopped:
                break
        yield self.assembler.finish(), events, True

    async def collect(self) -> tuple[str, list[TokenEvent]]:
        """The whole text and every TokenEvent, for a response that is not streamed."""
        text, events = [], []
        try:
            async for piece, piece_events, _ in self.pieces():
                text.append(piece)
                events += piece_events
        except MiniLLMError as e:
            raise APIError(500, str(e), type="server_error") from None
        return "".join(text), events

    def usage(self, completion_tokens: int) -> dict:
        return oai.usage(self.prompt_tokens, completion_tokens, self.handle.cached_tokens)

    def finish_reason(self) -> str:
        if self.assembler.stopped or self.handle.finish_reason == "stop":
            return "stop"
        return "length"  # max_tokens, or the context filled up


class Choices:
    """The generations of one request: n samples of one prompt (later ones reuse its cached blocks),
    under one id, as choices by index."""

    def __init__(self, gens: list[Generation]):
        self.gens = gens
        self.id, self.created, self.model = gens[0].id, gens[0].created, gens[0].model

    def response(self, kind: str, choices: list[dict]) -> dict:
        return oai.response_object(self.id, kind, self.created, self.model, choices)

    def usage(self, completion_tokens: int) -> dict:
        """The prompt counted once, as OpenAI counts it for n > 1."""
        return self.gens[0].usage(completion_tokens)

    async def collect(self) -> list[tuple[Generation, tuple[str, list[TokenEvent]]]]:
        results = await asyncio.gather(*(gen.collect() for gen in self.gens))
        return list(zip(self.gens, results))

    def sse_response(self, per_choice, kind: str, include_usage: bool) -> StreamingResponse:
        """Server-sent events from every choice's (choice, tokens in it) pairs as they come: a usage
        chunk if asked for, an engine error as an error event, and always `data: [DONE]` last."""

        async def events_out():
            generated = 0
            try:
                async for choice, n_tokens in _merged([per_choice(i, gen) for i, gen in enumerate(self.gens)]):
                    generated += n_tokens
                    yield oai.sse(self.response(kind, [choice]))
                if include_usage:
                    yield oai.sse(oai.usage_chunk(self.id, self.created, self.model, kind, self.usage(generated)))
            except MiniLLMError as e:
                yield oai.sse(APIError(500, str(e), type="server_error").body())
            yield oai.SSE_DONE

        return StreamingResponse(events_out(), media_type="text/event-stream")


async def _merged(streams: list[AsyncIterator]) -> AsyncIterator:
    """Items of several async iterators as each arrives; closing this closes them all (so a
    client that goes away cancels every choice's request)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async for item in stream:
                await queue.put(item)
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            await queue.put(e)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


class ChatTools:
    """A chat request's tools: what the template gets, the grammar a forced call follows, and
    reading calls back from the reply (minillm.serving.tools). A template without tools is a 400."""

    def __init__(self, service: "Service", body: ChatRequest):
        self.active = bool(body.tools) and body.tool_choice != "none"
        self.template_tools, self.grammar, self.functions = None, None, {}
        if not body.tools:
            if body.tool_choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice needs tools", param="tool_choice")
            return
        tokenizer = service.tokenizer
        if not tokenizer.supports_tools:
            raise APIError(400, "this model's chat template does not take tools", param="tools")
        try:
            self.functions = check_tools(body.tools)
            self.format = template_format(tokenizer.chat_template)
            forced = forced_names(self.functions, body.tool_choice)
        except StructuredOutputError as e:
            raise APIError(400, str(e), param=e.param) from None
        if self.active:
            self.template_tools = body.tools
            if forced is not None:
                self.grammar = call_grammar(self.functions, forced, self.format)

    def parse(self, text: str):
        return parse_tool_calls(text, self.format, self.functions)


class Service:
    """What the endpoints share: the model (None while it loads), the API key, counters, and
    starting a generation."""

    def __init__(self, llm: LLM | None, model_name: str, api_key: str | None):
        self.model_name, self.api_key = model_name, api_key
        self.llm: LLM | None = None
        self.created = int(time.time())
        self.errors = 0  # requests refused before they reached the engine
        if llm is not None:
            self.attach(llm)

    def attach(self, llm: LLM) -> None:
        """The model is loaded: start its engine and serve."""
        llm.engine  # noqa: B018 - starts the engine thread
        self.tokenizer = llm.tokenizer
        self.ctx = llm.model.ctx
        self.llm = llm

    def require_ready(self) -> None:
        if self.llm is None:
            raise APIError(503, "the model is still loading", type="service_unavailable", code="model_loading")

    def authorize(self, request: Request) -> None:
        """The API key if one is set, and a loaded model (503 before)."""
        self.require_ready()
        if self.api_key is not None and request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            raise APIError(401, "invalid API key", type="authentication_error", code="invalid_api_key")

    def check_prompt_text(self, text: str) -> None:
        """Refuse text that cannot fit before spending time on tokenizing it."""
        if len(text) > self.ctx * MAX_PROMPT_CHARS_PER_TOKEN:
            raise APIError(400, f"the prompt is far longer than this model's context of {self.ctx} tokens", param="prompt", code="context_length_exceeded")

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def start_choices(self, prompt_ids: list[int], body: SamplingRequest, id_prefix: str, tool_grammar: str | None = None) -> Choices:
        """body.n generations of the prompt (seeds seed, seed + 1, ..., when a seed is given)."""
        gens: list[Generation] = []
        try:
            for i in range(body.n):
                gens.append(self.start(prompt_ids, body, id_prefix, tool_grammar, seed_offset=i))
        except APIError:
            for gen in gens:
                gen.handle.cancel()
            raise
        return Choices(gens)

    def start(self, prompt_ids: list[int], body: SamplingRequest, id_prefix: str, tool_grammar: str | None = None,
              seed_offset: int = 0) -> Generation:
        """Submit to the engine, which checks the prompt; its errors become 400, 429 or the
        context_length_exceeded 400. tool_grammar: a Lark grammar forcing a tool call."""
        assembler = TextAssembler(self.tokenizer, body.stops())
        try:
            params = body.sampling()
            if seed_offset and params.seed is not None:
                params = dataclasses.replace(params, seed=params.seed + seed_offset)
            if tool_grammar is not None and (body.response_format or body.grammar):
                raise StructuredOutputError("a forced tool call cannot also follow response_format or grammar", "tool_choice")
            if tool_grammar is not None:
                constraint = self.llm.grammars.lark(tool_grammar, "tools")
            else:
                constraint = response_format_constraint(self.llm.grammars, body.response_format, body.grammar)
        except StructuredOutputError as e:
            raise APIError(400, str(e), param=e.param) from None
        except MiniLLMError as e:
            raise APIError(400, str(e)) from None
        try:
            handle = self.llm.engine.submit(
                prompt_ids, params, body.token_budget, () if body.ignore_eos else self.llm.eos_ids,
                body.engine_logprobs, loop=asyncio.get_running_loop(), fit_max_tokens=True, constraint=constraint,
            )
        except QueueFullError as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        except ContextLengthError as e:
            raise APIError(400, str(e), param=e.param, code="context_length_exceeded") from None
        except MiniLLMError as e:
            raise APIError(400, str(e), param="prompt") from None
        return Generation(handle, assembler, len(prompt_ids), id_prefix, self.model_name)

    def metrics_text(self) -> str:
        engine = self.llm.engine
        s = engine.stats
        lines = [
            ("minillm_requests_total", "counter", "Requests accepted by the engine", s.requests),
            ("minillm_requests_finished_total", "counter", "Requests that finished", s.finished),
            ("minillm_request_errors_total", "counter", "Requests rejected or failed", self.errors + s.errors),
            ("minillm_requests_rejected_queue_full_total", "counter", "Requests refused with 429", s.rejected),
            ("minillm_prompt_tokens_total", "counter", "Prompt tokens prefilled (computed)", s.prompt_tokens),
            ("minillm_cached_prompt_tokens_total", "counter", "Prompt tokens served from the prefix cache", s.cached_tokens),
            ("minillm_generated_tokens_total", "counter", "Tokens generated", s.generated_tokens),
            ("minillm_decode_steps_total", "counter", "Batched decode steps", s.steps),
            ("minillm_queue_depth", "gauge", "Requests waiting for a slot", engine.queue_depth),
            ("minillm_batch_size", "gauge", "Sequences in the running batch", engine.batch_size),
            ("minillm_time_to_first_token_seconds_sum", "counter", "Sum of times to first token", s.ttft_sum),
            ("minillm_time_to_first_token_seconds_count", "counter", "Requests with a first token", s.ttft_count),
            ("minillm_request_latency_seconds_sum", "counter", "Sum of request latencies", s.latency_sum),
            ("minillm_request_latency_seconds_count", "counter", "Requests finished", s.latency_count),
            # vLLM's names and meanings, for routers and autoscalers
            ("minillm:num_requests_waiting", "gauge", "Requests waiting for a batch slot", engine.queue_depth),
            ("minillm:num_requests_running", "gauge", "Requests in the running batch", engine.batch_size),
            ("minillm:kv_cache_usage_perc", "gauge", "Fraction of the batch slots' KV positions in use", engine.kv_cache_usage),
            ("minillm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache", engine.prefix.queries),
            ("minillm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache", engine.prefix.hits),
            ("minillm:prefix_cache_blocks", "gauge", "Blocks held by the prefix cache", engine.prefix.blocks_used),
        ]
        text = "".join(f"# HELP {n} {h}\n# TYPE {n} {t}\n{n} {v}\n" for n, t, h, v in lines)
        extra = getattr(engine, "extra_metrics", None)  # a cluster's routing and replicas
        return text + (extra() if extra is not None else "")


def create_app(llm: LLM | None, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app; with llm None it answers 503 until app.state.service.attach(llm)."""
    app = FastAPI(title="minillm", docs_url=None, redoc_url=None, openapi_url=None)
    service = app.state.service = Service(llm, model_name, api_key)
    _add_error_handlers(app, service)
    _add_service_routes(app, service)
    _add_completion_routes(app, service)
    _add_chat_route(app, service)
    return app


def _add_service_routes(app: FastAPI, service: Service) -> None:
    """Health, models, metrics, tokenize/detokenize and embeddings."""
    model_name = service.model_name

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        """The chat page: one static file from the package, nothing fetched from elsewhere."""
        return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health():
        if service.llm is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        report = await asyncio.to_thread(service.llm.health)  # a cluster's asks Ray for its replicas
        return JSONResponse(report, status_code=200 if report["status"] == "ok" else 503)

    @app.get("/v1/models")
    async def models(request: Request):
        service.authorize(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": service.created, "owned_by": "minillm"}]}

    @app.get("/metrics")
    async def metrics():
        service.require_ready()
        return PlainTextResponse(service.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        service.authorize(request)
        service.check_prompt_text(body.content)
        ids = service.tokenizer.encode(body.content, add_special_tokens=body.add_special)
        if body.with_pieces:
            return {"tokens": [{"id": t, "piece": service.token_text(t)} for t in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        service.authorize(request)
        vocab = service.llm.model.config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"content": service.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        service.authorize(request)
        items = body.input if isinstance(body.input, list) and body.input and not isinstance(body.input[0], int) else [body.input]
        if not items or any(isinstance(i, str) and not i for i in items):
            raise APIError(400, "input must be non-empty text or token ids", param="input")
        for item in items:
            if isinstance(item, str):
                service.check_prompt_text(item)
        try:  # the model's lock keeps this off the engine's parallel regions; a thread keeps the loop free
            vectors = await asyncio.to_thread(service.llm.embed, items)
        except ContextLengthError as e:
            raise APIError(400, str(e), param="input", code="context_length_exceeded") from None
        except MiniLLMError as e:
            raise APIError(400, str(e), param="input") from None
        tokens = sum(len(service.tokenizer.encode(i)) if isinstance(i, str) else len(i) for i in items)
        return oai.embedding_list(vectors, model_name, tokens, body.encoding_format)


def _add_completion_routes(app: FastAPI, service: Service) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        service.authorize(request)
        if isinstance(body.prompt, str):
            service.check_prompt_text(body.prompt)
        prompt_ids = service.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs would need the prompt's logprobs, which are not computed", param="echo")
        echoed = (body.prompt if isinstance(body.prompt, str) else service.tokenizer.decode(prompt_ids)) if body.echo else ""
        choices = service.start_choices(prompt_ids, body, "cmpl")

        def choice(i: int, text: str, reason: str | None, events: list[TokenEvent]) -> dict:
            logprobs = None if body.logprobs is None else oai.completion_logprobs(events, service.token_text)
            return oai.completion_choice(i, text, reason, logprobs)

        if body.stream:
            async def chunks(i: int, gen: Generation):
                if echoed:
                    yield choice(i, echoed, None, []), 0
                async for text, events, final in gen.pieces():
                    yield choice(i, text, gen.finish_reason() if final else None, events), len(events)

            return choices.sse_response(chunks, "text_completion", body.include_usage)
        results = await choices.collect()
        return dict(choices.response("text_completion", [choice(i, echoed + text, gen.finish_reason(), events)
                                                          for i, (gen, (text, events)) in enumerate(results)]),
                    usage=choices.usage(sum(len(events) for _, (_, events) in results)))


def _add_chat_route(app: FastAPI, service: Service) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        service.authorize(request)
        messages = body.chat_messages()
        service.check_prompt_text("".join(m["content"] or "" for m in messages))
        tools = ChatTools(service, body)
        try:
            prompt_ids = service.tokenizer.encode_chat(template_messages(messages), tools=tools.template_tools)
        except MiniLLMError as e:
            raise APIError(400, str(e), param="messages") from None
        choices = service.start_choices(prompt_ids, body, "chatcmpl", tools.grammar)
        logprobs = lambda events: None if not body.logprobs else oai.chat_logprobs(events, service.token_text)

        def reply(i: int, gen: Generation, text: str, events: list[TokenEvent], streamed: bool) -> dict:
            content, calls = tools.parse(text) if tools.active else (text, [])
            reason = "tool_calls" if calls else gen.finish_reason()
            if not streamed:
                return oai.chat_message_choice(i, content, reason, logprobs(events), [c.openai() for c in calls])
            delta = {"tool_calls": [c.openai(k) for k, c in enumerate(calls)]} if calls else {"content": content or ""}
            return oai.chat_delta_choice(i, delta, reason, logprobs(events))

        if body.stream:
            async def chunks(i: int, gen: Generation):
                yield oai.chat_delta_choice(i, {"role": "assistant", "content": ""}, None, logprobs([])), 0
                if tools.active:  # calls are read from the whole reply: it comes at the end
                    text, events = await gen.collect()
                    yield reply(i, gen, text, events, streamed=True), len(events)
                    return
                async for text, events, final in gen.pieces():
                    if text or final:
                        delta = {"content": text} if text else {}
                        yield oai.chat_delta_choice(i, delta, gen.finish_reason() if final else None, logprobs(events)), len(events)

            return choices.sse_response(chunks, "chat.completion.chunk", body.include_usage)
        results = await choices.collect()
        return dict(choices.response("chat.completion", [reply(i, gen, text, events, streamed=False)
                                                          for i, (gen, (text, events)) in enumerate(results)]),
                    usage=choices.usage(sum(len(events) for _, (_, events) in results)))


def _add_error_handlers(app: FastAPI, service: Service) -> None:
    """Every error leaves as OpenAI's error object: validation 400 (never FastAPI's 422), HTTP
    errors with their status, our APIErrors as raised, anything else 500."""

    def respond(error: APIError, counted: bool = True) -> JSONResponse:
        if counted:
            service.errors += 1
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return respond(APIError(400, "the request body is not valid JSON"))
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return respond(APIError(400, f"{loc + ': ' if loc else ''}{first.get('msg', 'invalid request')}", param=loc or None))

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return respond(APIError(exc.status_code, str(exc.detail), type=kind), counted=False)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return respond(exc)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        return respond(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))


def serve(load: Callable[[], LLM], options: Options, on_ready: Callable[[], None] | None = None) -> MiniLLMError | None:
    """Serve at once (options: host, port, api_key, model name, shutdown_timeout), answering 503
    (and /health "loading") while `load()` runs in a thread; on SIGTERM or Ctrl-C stop accepting
    and let running requests finish for up to options.shutdown_timeout seconds. Returns the error
    that stopped loading, if any."""
    import threading

    import uvicorn

    app = create_app(None, options.served_name, options.api_key)
    server = uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port, log_level="warning",
                                           timeout_graceful_shutdown=options.shutdown_timeout))
    failed: list[MiniLLMError] = []

    def load_model():
        try:
            app.state.service.attach(load())
            if on_ready is not None:
                on_ready()
        except MiniLLMError as e:
            failed.append(e)
            server.should_exit = True

    threading.Thread(target=load_model, name="minillm-load", daemon=True).start()
    server.run()
    return failed[0] if failed else None
