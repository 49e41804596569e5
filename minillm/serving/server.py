"""An OpenAI-compatible HTTP server over the batching engine (FastAPI on uvicorn).

    python cli.py serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--ctx N] [--max-batch N]
                        [--max-queue N] [--api-key KEY] [--max-body-mb MB] [--allowed-hosts NAMES]

GET / is a chat page (minillm/static/chat.html). POST /v1/completions, POST /v1/chat/completions (stream: true gives SSE chunks ending with
`data: [DONE]`), GET /v1/models, GET /health, GET /metrics (Prometheus text).
Errors have OpenAI's shape {"error": {"message", "type", "param", "code"}}: 400 for any invalid
request (never 422), 401 for a wrong API key, 404 for an unknown route or model, 413 for a body past
--max-body-mb, 429 (with Retry-After) when the queue is full.
Request schemas and response shapes live in minillm.serving.openai_protocol.

The event loop only does I/O: the Host, the key and the body's size are checked before its first
byte is read (minillm.serving.gate); parsing, validating, templating, tokenizing and compiling
grammars run on worker threads. A client that goes away cancels its request, streamed or not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import re
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from ..api import LLM
from ..core.detokenize import Parts, PlainReader
from ..core.engine import INTER_TOKEN_BUCKETS, QueueFullError, RequestHandle, ShutdownError, TokenEvent
from ..core.reasoning import ReplyReader, reasoning_format, reply_constraint
from ..core.structured import StructuredOutputError, response_format_constraint
from ..errors import ContextLengthError, MiniLLMError
from ..options import DEFAULTS, Options
from . import openai_protocol as oai
from .openai_protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoraRequest,
    SamplingRequest,
    TokenizeRequest,
    UnloadLoraRequest,
    engine_error,
)
from .anthropic import MessageRun, MessagesRequest, TokenCountRequest, error_body
from .responses import ResponseRun, ResponseStore, ResponsesRequest, in_request_terms
from .gate import Gate, too_large
from .tools import (call_grammar, check_tools, forced_names, generic_messages, generic_system_text, harmony_calls, parse_tool_calls,
                    template_format, template_messages)

MAX_PROMPT_CHARS_PER_TOKEN = 64  # a prompt longer than ctx * this many characters cannot fit
CHAT_PAGE = Path(__file__).parent / "static" / "chat.html"
RETRY_AFTER_SECONDS = 1  # what a 429 tells the client to wait
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # JSON's way to write half of a UTF-16 pair
T = TypeVar("T")
MAX_NAMED_IGNORED = 100  # field names the log names once each; past that, no more (a client sending random names)
log = logging.getLogger("minillm.server")


def parse_body(raw: bytes, schema: type[T], ctx: int | None = None) -> T:
    """A request body as `schema`, or a 400 naming what is wrong: not JSON, not UTF-8, text that
    is not Unicode (a lone UTF-16 surrogate), or a field the schema refuses. Runs off the loop,
    but parsing holds the GIL, so a chat of more messages than the context (`ctx`) has tokens
    is refused before it is validated, templated and tokenized (seconds at 100,000 messages)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise APIError(400, "the request body is not valid JSON (UTF-8)") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    for field in getattr(schema, "CONTEXT_LISTS", ("messages", "prompt")):
        if ctx is not None and isinstance(data.get(field), list) and len(data[field]) > ctx:
            raise APIError(400, f"{field}: {len(data[field])} items cannot fit this model's context of {ctx} tokens",
                           param=field, code="context_length_exceeded")
    if _SURROGATE_ESCAPE.search(raw):
        _check_unicode(data, "")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def _check_unicode(value, where: str) -> None:
    """Every string in `value` encodes as UTF-8 (no lone surrogates); a 400 naming the field."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"{where or 'body'}: the text contains an unpaired UTF-16 surrogate, which is not Unicode",
                           param=where or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k, where)
            _check_unicode(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_unicode(v, f"{where}[{i}]")


def validation_error(errors: list) -> APIError:
    """pydantic's first complaint as OpenAI's 400, naming the field."""
    first = errors[0] if errors else {}
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = str(first.get("msg", "invalid request")).splitlines()[0][:300]
    return APIError(400, f"{loc + ': ' if loc else ''}{message}", param=loc or None)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """`work`'s result, or, if the client goes away first, `work` cancelled (its requests leave
    the engine at the next step) and an empty response nobody reads."""
    task = asyncio.ensure_future(work)

    async def disconnect():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)
    finally:
        watcher.cancel()


class Generation:
    """One request running in the engine, read as a reply (minillm.core.reasoning: its thinking,
    answer and Harmony calls apart, or plain text): parts as they become final (the answer cut at
    stop strings), the whole reply, or server-sent events."""

    def __init__(self, handle: RequestHandle, reader: PlainReader | ReplyReader, prompt_tokens: int, id_prefix: str, model: str):
        self.handle, self.reader, self.prompt_tokens, self.model = handle, reader, prompt_tokens, model
        self.id, self.created = f"{id_prefix}-{uuid.uuid4().hex}", int(time.time())

    async def pieces(self) -> AsyncIterator[tuple[Parts, list[TokenEvent], bool]]:
        """(parts, the TokenEvents behind them, final?) as text becomes final; the last item carries
        the tail. Stops early (cancelling the request) at a stop string."""
        events: list[TokenEvent] = []
        async for event in self.handle.events():
            events.append(event)
            parts = self.reader.push(event.token)
            if parts or self.reader.stopped:
                yield parts, events, False
                events = []
            if self.reader.stopped:
                break
        yield self.reader.finish(), events, True

    async def collect(self) -> tuple[Parts, list[TokenEvent]]:
        """The whole reply and every TokenEvent, for a response that is not streamed."""
        reply, events = Parts(), []
        try:
            async for parts, piece_events, _ in self.pieces():
                reply.add(parts)
                events += piece_events
        except MiniLLMError as e:
            raise engine_error(e) from None
        return reply, events

    @property
    def reasoning_tokens(self) -> int | None:
        """Tokens of the thinking; None for a reply read as plain text."""
        return self.reader.thinking_tokens if isinstance(self.reader, ReplyReader) else None

    def finish_reason(self) -> str:
        if self.reader.stopped or self.handle.finish_reason == "stop":
            return "stop"
        return "length"  # max_tokens, or the context filled up


class Choices:
    """The generations of one request: n samples of each of its prompts (later ones reuse their
    prompt's cached blocks), under one id, as choices by index (prompt by prompt)."""

    def __init__(self, gens: list[Generation], firsts: list[Generation] | None = None, predicted: bool = False):
        self.gens = gens
        self.firsts = firsts or gens[:1]  # each prompt's first choice
        self.predicted = predicted
        self.id, self.created, self.model = gens[0].id, gens[0].created, gens[0].model

    def response(self, kind: str, choices: list[dict]) -> dict:
        return oai.response_object(self.id, kind, self.created, self.model, choices)

    def usage(self, completion_tokens: int) -> dict:
        """Each prompt counted once, as OpenAI counts them for n > 1; with a prediction, what
        became of its proposed tokens."""
        prediction = None
        if self.predicted:
            prediction = (sum(g.handle.proposed_tokens for g in self.gens), sum(g.handle.accepted_tokens for g in self.gens))
        return oai.usage(sum(g.prompt_tokens for g in self.firsts), completion_tokens, sum(g.handle.cached_tokens for g in self.firsts),
                         prediction, self.reasoning_tokens)

    @property
    def reasoning_tokens(self) -> int | None:
        counts = [g.reasoning_tokens for g in self.gens]
        return None if None in counts else sum(counts)

    async def collect(self) -> list[tuple[Generation, tuple[Parts, list[TokenEvent]]]]:
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
                yield oai.sse(engine_error(e).body())
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
    """A chat request's tools: what the template gets, the grammar a reply follows, and reading
    calls back from the reply (minillm.serving.tools). A template that takes no tools gets them in
    the generic format: described in a system message, every reply constrained to a call or an answer."""

    def __init__(self, service: "Service", body: ChatRequest):
        tools, tool_choice, parallel = body.tool_request()
        self.legacy = body.legacy_functions  # replies carry function_call, not tool_calls
        self.active = bool(tools) and tool_choice != "none"
        self.most = None if parallel else 1  # calls a reply may make (OpenAI's parallel_tool_calls)
        self.template_tools, self.grammar, self.functions, self.system = None, None, {}, None
        # a template that takes no tools reads earlier calls and results as the generic format's JSON,
        # whether or not this turn offers tools
        self.generic_history = not service.tokenizer.supports_tools
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice needs tools", param="tool_choice")
            return
        tokenizer = service.tokenizer
        try:
            self.functions = check_tools(tools)
            self.format = template_format(tokenizer.chat_template) if tokenizer.supports_tools else "generic"
            forced = forced_names(self.functions, tool_choice)
        except StructuredOutputError as e:
            raise self._error(str(e), e.param) from None
        if not self.active:
            return
        if self.format == "harmony" and forced is not None:
            raise self._error("tool_choice: a Harmony model (gpt-oss) decides when to call; use auto or none", "tool_choice")
        if self.format == "generic":
            self.system = generic_system_text(tools, forced)
            self.grammar = call_grammar(self.functions, forced or list(self.functions), "generic", may_answer=forced is None)
        else:
            self.template_tools = tools
            if forced is not None:
                self.grammar = call_grammar(self.functions, forced, self.format)

    def _error(self, message: str, param: str | None) -> APIError:
        """A 400 in the request's own terms (functions and function_call for the deprecated form)."""
        if self.legacy:
            for ours, theirs in (("tools[", "functions["), (".function.", "."), ("tool_choice", "function_call"), ("of tools", "of functions")):
                message, param = message.replace(ours, theirs), param and param.replace(ours, theirs)
        return APIError(400, message, param=param)

    def reply_fields(self, calls: list, streamed: bool) -> tuple[dict, str]:
        """A reply's calls as its message (or delta) fields, and its finish_reason."""
        if self.legacy:
            return {"function_call": calls[0].function_call()}, "function_call"
        return {"tool_calls": [c.openai(k if streamed else None) for k, c in enumerate(calls)]}, "tool_calls"

    def messages(self, messages: list[dict]) -> list[dict]:
        """The chat as the template reads it."""
        if self.generic_history:
            return generic_messages(messages, self.system)
        return template_messages(messages)

    def parse(self, reply: Parts):
        """The reply's content and its calls (none when no tools are offered): with
        parallel_tool_calls false, the first call only. A Harmony reply's calls were read apart."""
        if not self.active:
            return reply.content, []
        if self.format == "harmony":
            content, calls = reply.content or None, harmony_calls(reply.calls, self.functions)
        else:
            content, calls = parse_tool_calls(reply.content, self.format, self.functions)
        return content, calls[: self.most]


class Prepared:
    """A request made ready off the event loop: its prompt's tokens and each choice's sampling
    settings and grammar (compiled, its first mask computed)."""

    def __init__(self, prompt_ids: list[int], plans: list[tuple], tools: ChatTools | None = None, reasoning: bool = False):
        self.prompt_ids, self.plans, self.tools = prompt_ids, plans, tools
        self.reasoning = reasoning  # the reply is read as thinking and answer (minillm.core.reasoning)
        self.prediction: list[int] | None = None  # the tokens of the request's predicted output
        self.echo = ""  # completions' echo: the prompt's text, which the choices' text starts with


class Service:
    """What the endpoints share: the model (None while it loads), the API key, counters, and
    starting a generation."""

    def __init__(self, llm: LLM | None, model_name: str, api_key: str | None, options: Options = DEFAULTS):
        self.model_name, self.api_key = model_name, api_key
        self.max_body_bytes = int(options.max_body_mb * 2**20)
        self.read_reasoning = options.reasoning_format == "auto"
        self.template_defaults = options.template_variables  # --chat-template-kwargs
        self.reasoning = None  # the model's reasoning format, once loaded
        self.llm: LLM | None = None
        self.created = int(time.time())
        self.errors = 0  # requests refused before they reached the engine
        self.ignored_fields: set[str] = set()
        self.responses = ResponseStore()  # the Responses API's stored responses (previous_response_id)
        if llm is not None:
            self.attach(llm)

    def attach(self, llm: LLM) -> None:
        """The model is loaded: start its engine and serve."""
        llm.engine  # noqa: B018 - starts the engine thread
        # Everything alive now (the model, the libraries) lives as long as the server: frozen, it is
        # no longer walked by the full collections that parsing a large request triggers, which
        # hold the GIL and so pause every stream (0.7 s once in CI for a 100,000-message body).
        gc.freeze()
        self.tokenizer = llm.tokenizer
        self.ctx = llm.model.ctx
        self.reasoning = reasoning_format(self.tokenizer) if self.read_reasoning else None
        self.llm = llm

    def require_ready(self) -> None:
        if self.llm is None:
            raise APIError(503, "the model is still loading", type="service_unavailable", code="model_loading")

    def model_object(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "minillm"}

    def model_objects(self) -> list[dict]:
        """/v1/models: the model, then each LoRA adapter with the model as its parent (vLLM's way)."""
        adapters = [{"id": name, "object": "model", "created": self.created, "owned_by": "minillm", "parent": self.model_name,
                     "root": str(adapter.path)} for name, adapter in self.adapters.items()]
        return [self.model_object(), *adapters]

    @property
    def adapters(self) -> dict:
        return getattr(self.llm, "adapters", None) or {}  # a cluster's replicas hold none

    def adapter_for(self, name: str | None):
        """The LoRA adapter a request's `model` names (vLLM's convention), or None for the model
        itself. With adapters loaded, a name that is neither is a 404 rather than the base model's
        answer to a misspelt adapter."""
        adapters = self.adapters
        if not name or name == self.model_name or not adapters:
            return None
        if name not in adapters:
            raise APIError(404, f"the model {name!r} does not exist; this server runs {self.model_name!r} and the LoRA adapters "
                           f"{', '.join(adapters)}", type="not_found_error", param="model", code="model_not_found")
        return adapters[name]

    def served_name(self, name: str | None) -> str:
        """The model id a reply names: the adapter's when the request chose one."""
        adapter = self.adapter_for(name)
        return self.model_name if adapter is None else adapter.name

    async def parse(self, request: Request, schema: type[T]) -> T:
        """The body as `schema` (a 400 naming the field otherwise), read here, parsed off the loop;
        503 while the model loads (the Gate has checked the key and the declared size)."""
        self.require_ready()
        size, chunks = 0, []
        async for chunk in request.stream():  # a body sent without Content-Length is counted as it comes
            size += len(chunk)
            if size > self.max_body_bytes:
                raise APIError(413, too_large(self.max_body_bytes), code="body_too_large")
            chunks.append(chunk)
        body = await asyncio.to_thread(parse_body, b"".join(chunks), schema, self.ctx)
        self.note_ignored(body)
        return body

    def note_ignored(self, body) -> None:
        """Fields outside the schema (OpenAI's store, metadata, user, service_tier; other servers'
        extensions) are accepted, as vLLM accepts them, and named in the log once each, so a
        misspelt field is seen rather than silently without effect."""
        new = sorted(set(body.model_extra or ()) - self.ignored_fields)
        if new and len(self.ignored_fields) < MAX_NAMED_IGNORED:
            self.ignored_fields.update(new)
            log.warning("request fields without effect on this server (accepted, ignored): %s", ", ".join(new))

    def check_prompt_text(self, text: str, param: str = "prompt") -> None:
        """Refuse text that cannot fit before spending time on tokenizing it."""
        if len(text) > self.ctx * MAX_PROMPT_CHARS_PER_TOKEN:
            raise APIError(400, f"the prompt is far longer than this model's context of {self.ctx} tokens", param=param, code="context_length_exceeded")

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def encode(self, text: str, param: str, **kwargs) -> list[int]:
        self.check_prompt_text(text, param)
        try:
            return self.tokenizer.encode(text, **kwargs)
        except MiniLLMError as e:
            raise APIError(400, str(e), param=param) from None

    def infill(self, prompt: str | list[int], suffix: str) -> list[int]:
        """The prompt that fills in between `prompt` and `suffix` (completions' suffix), for a model
        whose tokenizer has fill-in-the-middle markers; a 400 naming suffix otherwise."""
        if self.tokenizer.fill_in_middle is None:
            raise APIError(400, "suffix: this model's tokenizer has no fill-in-the-middle markers (<fim_prefix>, <|fim_prefix|>, <PRE>...), "
                           "so it was not trained to fill in the middle", param="suffix")
        prefix = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=False)
        self.check_prompt_text(prefix + suffix, "prompt")
        try:
            return self.tokenizer.encode_infill(prefix, suffix)
        except MiniLLMError as e:
            raise APIError(400, str(e), param="prompt") from None

    # ---------------------------------------------------------------- off the loop

    def prepare_completion(self, body: CompletionRequest) -> list[Prepared]:
        """One Prepared per prompt; with echo, each keeps the text it echoes."""
        body.check_supported()
        batch, prediction = [], self.prediction(body)
        for prompt in body.prompts():
            if body.suffix is not None:
                prompt_ids = self.infill(prompt, body.suffix)
            else:
                prompt_ids = self.encode(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
            prepared = Prepared(prompt_ids, self.plans(body))
            prepared.prediction = prediction
            if body.echo:
                prepared.echo = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids)
            batch.append(prepared)
        return batch

    def render_chat(self, body: ChatRequest) -> tuple[str, ChatTools, dict]:
        """The chat's prompt text (a new turn for the model, or its final message continued), its
        tools, and the template's variables."""
        body.check_supported()
        self.check_reasoning_fields(body)
        messages = body.chat_messages()
        self.check_prompt_text("".join(m["content"] or "" for m in messages), "messages")
        tools = ChatTools(self, body)
        variables = body.template_variables(self.template_defaults)
        continued = body.continues_reply
        try:
            text = self.tokenizer.apply_chat_template(tools.messages(messages), body.add_generation_prompt and not continued,
                                                      tools.template_tools, variables, continued)
        except MiniLLMError as e:
            raise APIError(400, str(e), param="messages") from None
        return text, tools, variables

    def check_reasoning_fields(self, body: ChatRequest) -> None:
        """A budget or an effort asked of a model that does not think apart from its answer is a
        400, not a field without effect (its template may still read reasoning_effort)."""
        if self.reasoning is not None:
            return
        why = "this model's replies are not read as thinking and answer (no <think> or Harmony markers, or --reasoning-format none)"
        if body.thinking_token_budget is not None:
            raise APIError(400, f"thinking_token_budget: {why}", param="thinking_token_budget")
        if body.reasoning_effort not in (None, "none", "minimal") and "reasoning_effort" not in (self.tokenizer.chat_template or ""):
            raise APIError(400, f"reasoning_effort: {why}, and its chat template does not read it", param="reasoning_effort")

    def prepare_chat(self, body: ChatRequest) -> Prepared:
        text, tools, variables = self.render_chat(body)
        prompt_ids = self.encode(text, "messages", add_special_tokens=False)  # the template writes any BOS itself
        plans = self.plans(body, tools.grammar)
        if self.reasoning is not None:  # the thinking's budget, and a grammar for the answer alone
            budget = body.thinking_budget(variables)
            plans = [(params, reply_constraint(self.tokenizer, self.reasoning, prompt_ids, budget, constraint)) for params, constraint in plans]
        prepared = Prepared(prompt_ids, plans, tools, reasoning=self.reasoning is not None)
        prepared.prediction = self.prediction(body)
        return prepared

    def prepare_converted(self, build: Callable[[], ChatRequest]) -> tuple[ChatRequest, Prepared]:
        """A request of another API (OpenAI's Responses, Anthropic's Messages) prepared as the chat
        `build` makes of it."""
        try:
            chat = build()
        except ValidationError as e:
            raise validation_error(e.errors()) from None
        return chat, self.prepare_chat(chat)

    def prediction(self, body: SamplingRequest) -> list[int] | None:
        text = body.predicted_text()
        return None if text is None else self.encode(text, "prediction", add_special_tokens=False)

    def plans(self, body: SamplingRequest, tool_grammar: str | None = None) -> list[tuple]:
        """(sampling settings, constraint) of each of the body.candidates choices (seeds seed, seed +
        1, .., when a seed is given); every field checked, every grammar compiled, here."""
        vocab = self.llm.model.config.vocab_size
        try:
            params = body.sampling()
            bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab})", param="logit_bias")
            if any(not -100 <= b <= 100 for _, b in params.logit_bias):
                raise APIError(400, "logit_bias: values must be between -100 and 100", param="logit_bias")
            if tool_grammar is not None and (body.response_format or body.grammar):
                raise StructuredOutputError("a forced tool call cannot also follow response_format or grammar", "tool_choice")
            plans = []
            for i in range(body.candidates):
                seeded = dataclasses.replace(params, seed=params.seed + i) if i and params.seed is not None else params
                if tool_grammar is not None:
                    constraint = self.llm.grammars.lark(tool_grammar, "tools")
                else:
                    constraint = response_format_constraint(self.llm.grammars, body.response_format, body.grammar)
                plans.append((seeded, constraint))
            return plans
        except StructuredOutputError as e:
            raise APIError(400, str(e), param=e.param) from None
        except MiniLLMError as e:
            raise APIError(400, str(e)) from None

    # ---------------------------------------------------------------- on the loop

    def start_choices(self, prepared: Prepared | list[Prepared], body: SamplingRequest, id_prefix: str) -> Choices:
        """The prepared choices (of one prompt or several) submitted to the engine, which checks
        each prompt; its errors become 400, 429 or the context_length_exceeded 400, and cancel
        the choices already submitted."""
        gens: list[Generation] = []
        firsts: list[Generation] = []
        try:
            for one in prepared if isinstance(prepared, list) else [prepared]:
                for k, (params, constraint) in enumerate(one.plans):
                    gens.append(self.start(one.prompt_ids, body, id_prefix, params, constraint, one.prediction or (), one.reasoning))
                    if k == 0:
                        firsts.append(gens[-1])
        except APIError:
            for gen in gens:
                gen.handle.cancel()
            raise
        return Choices(gens, firsts, predicted=body.prediction is not None)

    def start(self, prompt_ids: list[int], body: SamplingRequest, id_prefix: str, params, constraint, prediction=(),
              reasoning: bool = False) -> Generation:
        if reasoning:
            reader = ReplyReader(self.tokenizer, self.reasoning, prompt_ids, body.stops())
        else:
            reader = PlainReader(self.tokenizer, body.stops())
        adapter = self.adapter_for(body.model)
        chosen = {} if adapter is None else {"adapter": adapter}  # a cluster's engines take no adapter
        try:
            handle = self.llm.engine.submit(
                prompt_ids, params, body.token_budget, () if body.ignore_eos else self.llm.eos_ids,
                body.engine_logprobs, loop=asyncio.get_running_loop(), fit_max_tokens=True, constraint=constraint,
                prompt_logprobs=body.prompt_logprobs, prediction=prediction, **chosen,
            )
        except QueueFullError as e:
            raise queue_full(e) from None
        except ContextLengthError as e:
            raise APIError(400, str(e), param=e.param, code="context_length_exceeded") from None
        except MiniLLMError as e:
            raise APIError(400, str(e), param="prompt") from None
        return Generation(handle, reader, len(prompt_ids), id_prefix, self.model_name if adapter is None else adapter.name)

    def metrics_text(self) -> str:
        engine = self.llm.engine
        s = engine.stats
        lines = [
            ("minillm_requests_total", "counter", "Requests accepted by the engine", s.requests),
            ("minillm_requests_finished_total", "counter", "Requests that finished", s.finished),
            ("minillm_requests_cancelled_total", "counter", "Requests cancelled by their client, queued or running", s.cancelled),
            ("minillm_request_errors_total", "counter", "Requests rejected or failed", self.errors + s.errors),
            ("minillm_requests_rejected_queue_full_total", "counter", "Requests refused with 429", s.rejected),
            ("minillm_prompt_tokens_total", "counter", "Prompt tokens prefilled (computed)", s.prompt_tokens),
            ("minillm_cached_prompt_tokens_total", "counter", "Prompt tokens served from the prefix cache", s.cached_tokens),
            ("minillm_generated_tokens_total", "counter", "Tokens generated", s.generated_tokens),
            ("minillm_decode_steps_total", "counter", "Batched steps", s.steps),
            ("minillm_prefill_steps_total", "counter", "Batched steps that read prompt tokens (chunked prefill)", s.prefill_steps),
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
            ("minillm:spec_decode_num_draft_tokens_total", "counter", "Tokens proposed by speculative decoding", s.spec_draft_tokens),
            ("minillm:spec_decode_num_accepted_tokens_total", "counter", "Proposed tokens that plain decoding chose too", s.spec_accepted_tokens),
        ]
        text = "".join(f"# HELP {n} {h}\n# TYPE {n} {t}\n{n} {v}\n" for n, t, h, v in lines)
        text += _histogram("minillm:inter_token_latency_seconds", "Time between a stream's tokens",
                           s.inter_token_counts, s.inter_token_sum)
        extra = getattr(engine, "extra_metrics", None)  # a cluster's routing and replicas
        return text + (extra() if extra is not None else "")

    def shut_down(self) -> None:
        """End every running and queued request now, with an error its client sees."""
        engine = getattr(self.llm, "engine", None) if self.llm is not None else None
        if engine is not None and hasattr(engine, "shut_down"):
            engine.shut_down(ShutdownError("the server is shutting down; the request did not finish"))


def _histogram(name: str, help: str, counts: list[int], total: float) -> str:
    """A Prometheus histogram over INTER_TOKEN_BUCKETS (cumulative buckets, +Inf, sum, count)."""
    out, running = [f"# HELP {name} {help}\n# TYPE {name} histogram\n"], 0
    for bound, n in zip((*INTER_TOKEN_BUCKETS, "+Inf"), counts):
        running += n
        out.append(f'{name}_bucket{{le="{bound}"}} {running}\n')
    out.append(f"{name}_sum {total}\n{name}_count {running}\n")
    return "".join(out)


def queue_full(e: QueueFullError) -> APIError:
    return APIError(429, str(e), type="rate_limit_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def create_app(llm: LLM | None, model_name: str, api_key: str | None = None, options: Options = DEFAULTS) -> FastAPI:
    """The app; with llm None it answers 503 until app.state.service.attach(llm). options: the
    HTTP server's (host, max_body_mb, allowed_hosts, allowed_origins)."""
    app = FastAPI(title="minillm", docs_url=None, redoc_url=None, openapi_url=None)
    service = app.state.service = Service(llm, model_name, api_key, options)
    app.add_middleware(Gate, service=service, bind=options.host, allowed_hosts=options.allowed_hosts,
                       allowed_origins=options.allowed_origins, max_body_bytes=service.max_body_bytes)
    _add_error_handlers(app, service)
    _add_service_routes(app, service)
    _add_completion_routes(app, service)
    _add_chat_route(app, service)
    _add_responses_routes(app, service)
    _add_messages_routes(app, service)
    if options.allow_runtime_lora:
        _add_lora_routes(app, service)
    return app


def _add_lora_routes(app: FastAPI, service: Service) -> None:
    """vLLM's runtime LoRA endpoints (--allow-runtime-lora: a client names a path on this
    machine): an adapter loaded is a model clients can name at once; unloaded, requests running
    with it end with an error, others go on."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await service.parse(request, LoadLoraRequest)
        if body.lora_name == service.model_name or body.lora_name in service.adapters:
            raise APIError(400, f"the LoRA adapter {body.lora_name!r} has already been loaded", param="lora_name")
        try:
            await asyncio.to_thread(service.llm.load_adapter, body.lora_path, body.lora_name)
        except MiniLLMError as e:
            raise APIError(400, str(e), param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await service.parse(request, UnloadLoraRequest)
        if body.lora_name not in service.adapters:
            raise APIError(404, f"the LoRA adapter {body.lora_name!r} cannot be found", type="not_found_error", param="lora_name")
        await asyncio.to_thread(service.llm.unload_adapter, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


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
    async def models():
        service.require_ready()
        return {"object": "list", "data": service.model_objects()}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        service.require_ready()
        for entry in service.model_objects():
            if entry["id"] == model_id:
                return entry
        raise APIError(404, f"the model {model_id!r} does not exist; this server runs {model_name!r}",
                       type="not_found_error", param="model", code="model_not_found")

    @app.get("/metrics")
    async def metrics():
        service.require_ready()
        return PlainTextResponse(service.metrics_text(), media_type="text/plain; version=0.0.4")

    _add_tokenizer_routes(app, service)
    _add_embeddings_route(app, service)


def _add_tokenizer_routes(app: FastAPI, service: Service) -> None:
    """llama.cpp's /tokenize, /detokenize (which take vLLM's shapes too) and /apply-template, vLLM's /tokenizer_info."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await service.parse(request, TokenizeRequest)

        def run():
            text, field, special = body.text()
            ids = service.encode(text, field, add_special_tokens=special)
            if body.with_pieces:
                return {"tokens": [{"id": t, "piece": service.token_text(t)} for t in ids]}
            return {"tokens": ids, "count": len(ids), "max_model_len": service.ctx}

        return await asyncio.to_thread(run)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await service.parse(request, DetokenizeRequest)
        vocab = service.llm.model.config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        text = await asyncio.to_thread(service.tokenizer.decode, body.tokens, skip_special_tokens=False)
        return {"content": text, "prompt": text}  # llama.cpp's name, vLLM's

    @app.post("/apply-template")
    async def apply_template(request: Request):
        """llama.cpp's: a chat request's prompt as the model would read it, rendered, not run."""
        body = await service.parse(request, ChatRequest)
        text, _, _ = await asyncio.to_thread(service.render_chat, body)
        return {"prompt": text}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's: what a client needs to tokenize as the server does (lm-evaluation-harness's
        remote tokenizer reads it)."""
        service.require_ready()
        t = service.tokenizer
        return {"bos_token": t.bos_token, "eos_token": t.eos_token, "pad_token": None, "chat_template": t.chat_template,
                "model_max_length": service.ctx, "add_bos_token": t.add_bos}


def _add_embeddings_route(app: FastAPI, service: Service) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await service.parse(request, EmbeddingRequest)
        items = body.input if isinstance(body.input, list) and body.input and not isinstance(body.input[0], int) else [body.input]
        if not items or any(not i for i in items):
            raise APIError(400, "input must be non-empty text or token ids", param="input")
        hidden = service.llm.model.config.hidden_size
        if body.dimensions is not None and body.dimensions != hidden:
            raise APIError(400, f"dimensions: this model's embeddings have {hidden} dimensions and cannot be shortened", param="dimensions")

        def tokenize_all():
            prompts = [service.encode(i, "input") if isinstance(i, str) else list(i) for i in items]
            for ids in prompts:
                try:
                    service.llm.check_prompt(ids)
                except ContextLengthError as e:
                    raise APIError(400, str(e), param="input", code="context_length_exceeded") from None
                except MiniLLMError as e:
                    raise APIError(400, str(e), param="input") from None
            return prompts

        adapter = service.adapter_for(body.model)
        prompts = await asyncio.to_thread(tokenize_all)
        vectors = await until_disconnected(request, _embed(service, prompts, adapter))
        if isinstance(vectors, Response):
            return vectors
        return oai.embedding_list(vectors, service.served_name(body.model), sum(map(len, prompts)), body.encoding_format)


async def _embed(service: Service, prompts: list[list[int]], adapter=None):
    """Each prompt's embedding, read by the engine beside the running streams; cancelled, every
    unfinished one leaves the engine."""
    engine = service.llm.engine
    if not hasattr(engine, "submit_embedding"):  # a cluster's replicas embed in their own engines
        return await asyncio.to_thread(service.llm.embed, prompts)
    loop = asyncio.get_running_loop()

    async def one(ids):
        try:
            handle = engine.submit_embedding(ids, loop=loop, **({} if adapter is None else {"adapter": adapter}))
        except QueueFullError as e:
            raise queue_full(e) from None
        try:
            return [v async for v in handle.events()][0]
        except MiniLLMError as e:
            raise engine_error(e) from None

    results, window = [], max(1, engine.max_batch)
    for start in range(0, len(prompts), window):  # more at once would only wait in the queue
        results += await asyncio.gather(*(one(ids) for ids in prompts[start : start + window]))
    return results


def _add_completion_routes(app: FastAPI, service: Service) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await service.parse(request, CompletionRequest)
        batch = await asyncio.to_thread(service.prepare_completion, body)
        choices = service.start_choices(batch, body, "cmpl")
        prompt_of = lambda i: batch[i // body.candidates]

        def logprobs(i: int, gen: Generation, events: list[TokenEvent], offset: int, echoed: bool) -> dict | None:
            """Choice i's logprobs, None unless asked for: its generated `events`, whose text starts at
            character `offset`; echoed: after the scored prompt's (its first token has none)."""
            if body.logprobs is None:
                return None
            if not echoed:
                return oai.completion_logprobs(events, service.token_text, offset)
            prompt = oai.completion_logprobs(gen.handle.prompt_logprobs or [], service.token_text, first=prompt_of(i).prompt_ids[0])
            return oai.joined_logprobs(prompt, oai.completion_logprobs(events, service.token_text, len(prompt_of(i).echo)))

        if body.stream:
            async def chunks(i: int, gen: Generation):
                echo, offset = body.echo, 0
                async for parts, events, final in gen.pieces():
                    text = parts.content
                    if echo:  # the prompt's logprobs are known with the first event
                        yield oai.completion_choice(i, prompt_of(i).echo, None, logprobs(i, gen, [], 0, echoed=True)), 0
                        echo, offset = False, len(prompt_of(i).echo)
                    reason = gen.finish_reason() if final else None
                    yield oai.completion_choice(i, text, reason, logprobs(i, gen, events, offset, echoed=False)), len(events)
                    offset += len(text)

            return choices.sse_response(chunks, "text_completion", body.include_usage)
        results = await until_disconnected(request, choices.collect())
        if isinstance(results, Response):
            return results
        kept = _best_of(results, body.candidates, body.n)
        return dict(choices.response("text_completion", [
            oai.completion_choice(k, prompt_of(i).echo + reply.content, gen.finish_reason(), logprobs(i, gen, events, 0, echoed=body.echo))
            for k, (i, (gen, (reply, events))) in enumerate(kept)]),
            usage=choices.usage(sum(len(events) for _, (_, events) in results)))


def _best_of(results: list, candidates: int, n: int) -> list[tuple[int, tuple]]:
    """(index, result) of the choices returned: each prompt's n likeliest of its candidates (the
    highest sum of their tokens' logprobs, as vLLM ranks best_of; ties by index), in index order."""
    if candidates == n:
        return list(enumerate(results))

    def rank(item):
        index, (_, (_, events)) = item
        return -sum(e.logprob for e in events), index

    indexed, kept = list(enumerate(results)), []
    for start in range(0, len(results), candidates):
        kept += sorted(sorted(indexed[start : start + candidates], key=rank)[:n])
    return kept


def _add_chat_route(app: FastAPI, service: Service) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await service.parse(request, ChatRequest)
        prepared = await asyncio.to_thread(service.prepare_chat, body)
        tools = prepared.tools
        choices = service.start_choices(prepared, body, "chatcmpl")
        logprobs = lambda events: None if not body.logprobs else oai.chat_logprobs(events, service.token_text)

        def reply(i: int, gen: Generation, parts: Parts, events: list[TokenEvent], streamed: bool) -> dict:
            content, calls = tools.parse(parts)
            fields, reason = tools.reply_fields(calls, streamed) if calls else ({}, gen.finish_reason())
            if not streamed:
                return oai.chat_message_choice(i, content, reason, logprobs(events), fields, parts.reasoning)
            return oai.chat_delta_choice(i, fields or {"content": content or ""}, reason, logprobs(events))

        if body.stream:
            async def chunks(i: int, gen: Generation):
                yield oai.chat_delta_choice(i, {"role": "assistant", "content": ""}, None, logprobs([])), 0
                if tools.active:  # calls are read from the whole reply: it comes at the end, after its thinking
                    parts, events = await gen.collect()
                    if parts.reasoning:
                        yield oai.chat_delta_choice(i, {"reasoning_content": parts.reasoning}, None, None), 0
                    yield reply(i, gen, parts, events, streamed=True), len(events)
                    return
                async for parts, events, final in gen.pieces():
                    answered = bool(parts.content) or final
                    if parts.reasoning:  # the thinking's deltas come before the answer's, and carry its tokens
                        delta, events_here = {"reasoning_content": parts.reasoning}, [] if answered else events
                        yield oai.chat_delta_choice(i, delta, None, logprobs(events_here) if events_here else None), len(events_here)
                    if answered:
                        delta = {"content": parts.content} if parts.content else {}
                        yield oai.chat_delta_choice(i, delta, gen.finish_reason() if final else None, logprobs(events)), len(events)

            return choices.sse_response(chunks, "chat.completion.chunk", body.include_usage)
        results = await until_disconnected(request, choices.collect())
        if isinstance(results, Response):
            return results
        return dict(choices.response("chat.completion", [reply(i, gen, parts, events, streamed=False)
                                                          for i, (gen, (parts, events)) in enumerate(results)]),
                    usage=choices.usage(sum(len(events) for _, (_, events) in results)))


async def _run_reply(request: Request, stream: bool, run):
    """The reply of a request another API's run makes of a chat (ResponseRun, MessageRun): its
    events streamed, or its whole answer once the generation is done."""
    if stream:
        return StreamingResponse(run.events(), media_type="text/event-stream")
    result = await until_disconnected(request, run.gen.collect())
    return result if isinstance(result, Response) else run.finish(*result)


def _add_responses_routes(app: FastAPI, service: Service) -> None:
    """OpenAI's Responses API, run as a chat (minillm.serving.responses)."""

    @app.post("/v1/responses")
    async def create_response(request: Request):
        body = await service.parse(request, ResponsesRequest)
        history = service.responses.conversation(body.previous_response_id)

        try:
            chat, prepared = await asyncio.to_thread(service.prepare_converted, lambda: body.chat_request(history))
            run = ResponseRun(body, service.start_choices(prepared, chat, "resp").gens[0], prepared.tools, history,
                              service.served_name(body.model), service.token_text, service.responses)
        except APIError as e:
            raise in_request_terms(e) from None
        return await _run_reply(request, body.stream, run)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        service.require_ready()
        return service.responses.get(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        service.require_ready()
        return service.responses.delete(response_id)


def _add_messages_routes(app: FastAPI, service: Service) -> None:
    """Anthropic's Messages API, run as a chat (minillm.serving.anthropic); its errors in its own
    shape (the error handlers)."""

    @app.post("/v1/messages")
    async def messages(request: Request):
        body = await service.parse(request, MessagesRequest)
        chat, prepared = await asyncio.to_thread(service.prepare_converted, body.chat_request)
        run = MessageRun(service.start_choices(prepared, chat, "msg").gens[0], prepared.tools, service.served_name(body.model))
        return await _run_reply(request, body.stream, run)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        body = await service.parse(request, TokenCountRequest)
        _, prepared = await asyncio.to_thread(service.prepare_converted, body.chat_request)
        return {"input_tokens": len(prepared.prompt_ids)}


def _add_error_handlers(app: FastAPI, service: Service) -> None:
    """Every error leaves as OpenAI's error object: validation 400 (never FastAPI's 422), HTTP
    errors with their status, our APIErrors as raised, anything else 500."""

    def respond(request: Request, error: APIError, counted: bool = True) -> JSONResponse:
        if counted:
            service.errors += 1
        anthropic = request.url.path.startswith("/v1/messages")  # Anthropic's API answers errors in its shape
        return JSONResponse(error_body(error) if anthropic else error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        return respond(request, validation_error(exc.errors()))

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return respond(request, APIError(exc.status_code, str(exc.detail), type=kind), counted=False)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return respond(request, exc)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        return respond(request, APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))


def serve(load: Callable[[Options], LLM], options: Options, on_ready: Callable[[list[str]], None] | None = None,
          specs: list[str] | None = None, models_dir: str | None = None) -> MiniLLMError | None:
    """Serve at once (options: host, port, api_key, shutdown_timeout, the Gate's, and the model
    set's: idle_unload, max_loaded). One model given plainly (specs: one path or name, or none) is
    loaded at start, answering 503 (and /health "loading") while `load(options)` runs in a thread;
    several (NAME=SOURCE specs, or models_dir) are loaded on first use (minillm.serving.models).
    On SIGTERM or Ctrl-C stop accepting and let running requests finish for up to
    options.shutdown_timeout seconds, then end the rest with an error event (streams) or a 503.
    Returns the error that stopped loading, if any."""
    import threading

    import uvicorn

    from .models import start_loading

    app, models = server_app(load, options, specs, models_dir)
    failed: list[MiniLLMError] = []

    def end_unfinished():
        for entry in list(models.entries.values()):
            if entry.app is not None:
                entry.app.state.service.shut_down()

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:  # the first signal: unfinished requests end just before uvicorn's deadline
                grace = options.shutdown_timeout
                timer = threading.Timer(max(grace - min(1.0, grace / 2), 0.0), end_unfinished)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None):
            await super().shutdown(sockets)
            # before uvicorn re-raises the signal that ends the process: each engine's last act
            # writes its prefix cache (--cache-dir)
            await asyncio.to_thread(models.close_all)

    server = Server(uvicorn.Config(app, host=options.host, port=options.port, log_level="warning",
                                   timeout_graceful_shutdown=options.shutdown_timeout))

    def stop(error: MiniLLMError) -> None:
        failed.append(error)
        server.should_exit = True

    if models.routed:
        if on_ready is not None:
            on_ready(list(models.entries))
    else:
        entry = models.default
        start_loading(entry, load, lambda: on_ready([entry.name]) if on_ready else None, stop)
    server.run()
    return failed[0] if failed else None


def server_app(load: Callable[[Options], LLM], options: Options, specs: list[str] | None = None, models_dir: str | None = None):
    """The server's ASGI app (the Gate, the router, and each model's app: serve's) and its ModelSet.
    One model given plainly gets its app at once, answering 503 until something attaches its LLM
    (serve: start_loading)."""
    from types import SimpleNamespace

    from .models import ModelSet, Router, model_entries

    entries, routed = model_entries(specs, models_dir, options)
    models = ModelSet(entries, routed, options, lambda llm, name: create_app(llm, name, None, options), load)
    if not routed:
        models.default.app = create_app(None, models.default.name, None, options)
    max_body = int(options.max_body_mb * 2**20)
    app = Gate(Router(models, router_app(models, options), max_body), service=SimpleNamespace(api_key=options.api_key), bind=options.host,
               allowed_hosts=options.allowed_hosts, allowed_origins=options.allowed_origins, max_body_bytes=max_body)
    return app, models


def router_app(models, options: Options) -> FastAPI:
    """The routes the router answers itself: the Ollama API, and with several models /health and
    /v1/models (one model's own app answers them otherwise)."""
    from .ollama import add_ollama_routes

    app = FastAPI(title="minillm", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health():
        return {"status": "ok", "models": {e.name: "loaded" if e.loaded else "unloaded" for e in models.entries.values()}}

    @app.get("/v1/models")
    async def listed():
        return {"object": "list", "data": models.model_objects()}

    @app.get("/v1/models/{model_id:path}")
    async def one(model_id: str):
        found = [m for m in models.model_objects() if m["id"] == model_id]
        if not found:
            return JSONResponse({"error": {"message": f"the model {model_id!r} does not exist; this server runs: {', '.join(models.entries)}",
                                           "type": "not_found_error", "param": "model", "code": "model_not_found"}}, status_code=404)
        return found[0]

    add_ollama_routes(app, models, options)
    return app
