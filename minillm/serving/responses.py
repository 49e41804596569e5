"""OpenAI's Responses API (`POST /v1/responses`), read as a chat: the request's input items become
chat messages, its function tools and text format the chat's tools and response_format, and the
reply comes back as output items (a message, function calls) or, streamed, as Responses events.

What the API keeps between turns lives here too: responses made with `store` (OpenAI's default)
are kept in memory, bounded, so `previous_response_id` continues a conversation and
`GET /v1/responses/{id}` reads one back. Nothing here touches the engine; the server runs the chat.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import ClassVar, Literal, Union

from pydantic import Field

from ..core.detokenize import Parts
from ..errors import MiniLLMError
from .openai_protocol import APIError, ChatRequest, SamplingRequest, chat_logprobs, engine_error

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_STORED_RESPONSES = 1000
MAX_STORED_CHARS = 64 * 2**20  # the kept conversations' text, all together; the oldest go first
READ_ONLY_PARTS = ("input_text", "output_text", "text", "summary_text")
# chat fields whose names differ in the Responses API, for errors in the request's own terms
PARAM_NAMES = (("messages", "input"), ("max_tokens", "max_output_tokens"), ("response_format.json_schema", "text.format"),
               ("response_format", "text.format"), (".function.", "."))


class ResponsesRequest(SamplingRequest):
    """A Responses request. Beside its own fields it takes the chat's sampling extensions (seed,
    stop, top_k, penalties...), as vLLM's does."""

    CONTEXT_LISTS: ClassVar[tuple[str, ...]] = ("input",)  # items each at least a token: refused past the context unread
    input: Union[str, list[dict]] = Field(...)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    text: dict | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    background: bool = False
    truncation: Literal["disabled"] = "disabled"
    reasoning: dict | None = None  # {"effort": ..., "summary": ...}

    def check_supported(self) -> None:
        if self.background:
            raise APIError(400, "background: this server answers in the foreground", param="background")
        if self.n != 1:
            raise APIError(400, "n: a response has one output; send several requests", param="n")
        if (self.reasoning or {}).keys() - {"effort", "summary", "generate_summary"}:
            raise APIError(400, "reasoning: only effort and summary are read here", param="reasoning")

    @property
    def logprobs(self) -> bool:
        """Logprobs asked for: by include, or by asking for alternatives."""
        return LOGPROBS_INCLUDE in (self.include or ()) or self.top_logprobs is not None

    def chat_request(self, history: list[dict]) -> ChatRequest:
        """The chat this request asks for, after the stored conversation `history` (input items)."""
        self.check_supported()
        chat = dict(self.sampling_fields(), messages=input_messages(history + self.input_items(), self.instructions),
                    max_tokens=self.max_output_tokens or self.max_tokens, logprobs=self.logprobs, top_logprobs=self.top_logprobs or 0,
                    parallel_tool_calls=self.parallel_tool_calls,
                    response_format=response_format(self.text) if self.text is not None else self.response_format)
        if (self.reasoning or {}).get("effort") is not None:
            chat["reasoning_effort"] = self.reasoning["effort"]
        if self.tools:
            chat.update(tools=chat_tools(self.tools), tool_choice=chat_tool_choice(self.tool_choice))
        elif self.tool_choice not in (None, "auto", "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ChatRequest.model_validate(chat)

    def input_items(self) -> list[dict]:
        return [{"type": "message", "role": "user", "content": self.input}] if isinstance(self.input, str) else list(self.input)


def in_request_terms(error: APIError) -> APIError:
    """A 400 raised for the chat a request became, naming the Responses field instead."""
    for chat, theirs in PARAM_NAMES:
        if error.param:
            error.param = error.param.replace(chat, theirs)
        error.message = error.message.replace(chat, theirs)
    return error


def input_messages(items: list[dict], instructions: str | None) -> list[dict]:
    """Input items as chat messages: messages as they are, a function call as an assistant's tool
    call (joined to the assistant message before it), its output as a tool message, a reasoning
    item's text as the thinking of the assistant message after it."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    thinking = ""
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            if item.get("role") not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"input[{i}].role must be user, system, developer or assistant", param=f"input[{i}].role")
            messages.append({"role": item["role"], "content": _text(item.get("content"), f"input[{i}].content")})
            if item["role"] == "assistant" and thinking:
                messages[-1]["reasoning_content"], thinking = thinking, ""
        elif kind == "function_call":
            fields = [item.get(key) for key in ("call_id", "name", "arguments")]
            if not all(isinstance(field, str) for field in fields):
                raise APIError(400, f"input[{i}]: a function_call needs call_id, name and arguments (strings)", param=f"input[{i}]")
            call = {"id": fields[0], "type": "function", "function": {"name": fields[1], "arguments": fields[2]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if thinking:
                messages[-1]["reasoning_content"], thinking = thinking, ""
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"input[{i}].call_id must be a string", param=f"input[{i}].call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item.get("output"), f"input[{i}].output")})
        elif kind == "reasoning":  # its text (ours); another model's encrypted reasoning is left out
            thinking += "".join(part.get("text", "") for part in item.get("content") or () if isinstance(part, dict))
        else:
            raise APIError(400, f"input[{i}].type: {kind!r} items are not read by this server", param=f"input[{i}].type")
    return messages


def _text(content, where: str) -> str:
    """A message's content (a string or text parts) as text; images, files and audio are 400s."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in READ_ONLY_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind != "refusal":
            raise APIError(400, f"{where}[{j}]: this server reads text parts only (got {kind!r})", param=f"{where}[{j}]")
    return "".join(texts)


def chat_tools(tools: list[dict]) -> list[dict]:
    """Responses function tools ({"type": "function", "name", "parameters"...}) in the chat's form;
    OpenAI's built-in tools (web search, files, computer...) are 400s."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}].type: {tool.get('type')!r} is a hosted tool this server does not run; give function tools",
                           param=f"tools[{i}].type")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters") if k in tool}})
    return out


def chat_tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, 'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}', param="tool_choice")


def response_format(text: dict | None) -> dict | None:
    """text.format as the chat's response_format."""
    if (text or {}).get("verbosity", "medium") != "medium":
        raise APIError(400, "text.verbosity: only medium; how long a reply runs is max_output_tokens' here", param="text.verbosity")
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    raise APIError(400, "text.format.type must be text, json_object or json_schema", param="text.format.type")


# ---------------------------------------------------------------- what comes back

def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str, logprobs: list | None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def function_call_item(call) -> dict:
    """A tool call (minillm.serving.tools.ToolCall) as a function_call output item."""
    return {"type": "function_call", "id": new_id("fc"), "call_id": call.id, "name": call.name,
            "arguments": json.dumps(call.arguments), "status": "completed"}


def reasoning_item(item_id: str, text: str, summary: bool, status: str = "completed") -> dict:
    """A reasoning model's thinking: its text as reasoning_text (as gpt-oss's own server gives it),
    and as the summary when one is asked for (nothing here condenses it)."""
    return {"type": "reasoning", "id": item_id, "status": status, "content": [{"type": "reasoning_text", "text": text}],
            "summary": [{"type": "summary_text", "text": text}] if summary and text else []}


def usage(input_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def response_object(rid: str, model: str, body: ResponsesRequest, status: str, output: list[dict], usage_block: dict | None,
                    error: dict | None = None) -> dict:
    """The Response: its output items, status (completed, incomplete at max_output_tokens,
    in_progress while streaming, failed) and the request's settings, as OpenAI echoes them."""
    return {
        "id": rid, "object": "response", "created_at": int(time.time()), "status": status, "model": model, "output": output,
        "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
        "temperature": body.temperature, "top_p": body.top_p, "top_logprobs": body.top_logprobs or 0,
        "tools": body.tools or [], "tool_choice": body.tool_choice or "auto", "text": body.text or {"format": {"type": "text"}},
        "truncation": body.truncation, "store": body.store, "background": False, "usage": usage_block,
    }


class EventStream:
    """Server-sent Responses events: `event: <type>` lines and numbered data objects."""

    def __init__(self):
        self.sequence = 0

    def event(self, kind: str, **fields) -> str:
        data = dict(type=kind, sequence_number=self.sequence, **fields)
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class ResponseStore:
    """Stored responses, in memory, the oldest dropped past MAX_STORED_RESPONSES or MAX_STORED_CHARS:
    each with its conversation (the input items before it, its own, and its output) for
    previous_response_id."""

    def __init__(self):
        self.kept: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()
        self.chars = 0

    def keep(self, response: dict, conversation: list[dict]) -> None:
        size = len(json.dumps(conversation))
        self.kept[response["id"]] = (response, conversation, size)
        self.chars += size
        while len(self.kept) > MAX_STORED_RESPONSES or (self.chars > MAX_STORED_CHARS and len(self.kept) > 1):
            self.chars -= self.kept.popitem(last=False)[1][2]

    def get(self, rid: str) -> dict:
        if rid not in self.kept:
            raise APIError(404, f"no stored response with id {rid!r}", type="invalid_request_error", code="not_found")
        return self.kept[rid][0]

    def conversation(self, rid: str | None) -> list[dict]:
        """The input items a response continuing `rid` follows ([] for None)."""
        if rid is None:
            return []
        if rid not in self.kept:
            raise APIError(400, f"previous_response_id: no stored response with id {rid!r} (responses made with store "
                           "false are not kept, and a restart forgets them all)", param="previous_response_id")
        return list(self.kept[rid][1])

    def delete(self, rid: str) -> dict:
        self.get(rid)
        self.chars -= self.kept.pop(rid)[2]
        return {"id": rid, "object": "response.deleted", "deleted": True}


class ResponseRun:
    """One Responses request running as a chat generation (minillm.serving.server.Generation): its
    output items, whole or as events, and its storing."""

    def __init__(self, body: ResponsesRequest, gen, tools, history: list[dict], model: str, token_text, store: ResponseStore):
        self.body, self.gen, self.tools, self.history = body, gen, tools, history
        self.model, self.token_text, self.store = model, token_text, store
        self.id, self.message_id, self.reasoning_id = new_id("resp"), new_id("msg"), new_id("rs")
        reasoning = body.reasoning or {}
        self.summary = (reasoning.get("summary") or reasoning.get("generate_summary")) is not None  # generate_summary: the older name
        self.response: dict | None = None  # once finished

    def logprobs(self, events) -> list | None:
        return chat_logprobs(events, self.token_text)["content"] if self.body.logprobs else None

    def finish(self, reply, events: list) -> dict:
        """The finished Response (stored if asked): the thinking of a reasoning model, then a
        message, unless the reply is only calls, then its calls."""
        content, calls = self.tools.parse(reply)
        status = "completed" if calls or self.gen.finish_reason() == "stop" else "incomplete"
        output = [reasoning_item(self.reasoning_id, reply.reasoning, self.summary)] if reply.reasoning else []
        output += [message_item(self.message_id, content or "", status, self.logprobs(events))] if content or not calls else []
        output += [function_call_item(call) for call in calls]
        response = self.snapshot(status, output, usage(self.gen.prompt_tokens, self.gen.handle.cached_tokens, len(events),
                                                       self.gen.reasoning_tokens or 0))
        if self.body.store:
            self.store.keep(response, self.history + self.body.input_items() + output)
        return response

    def snapshot(self, status: str, output: list[dict], usage_block: dict | None = None, error: dict | None = None) -> dict:
        return response_object(self.id, self.model, self.body, status, output, usage_block, error)

    async def events(self):
        """The Responses event stream: created, the output items (text deltas as they come; calls,
        read from the whole reply, at its end), then completed, incomplete, or error and failed."""
        stream = EventStream()
        yield stream.event("response.created", response=self.snapshot("in_progress", []))
        yield stream.event("response.in_progress", response=self.snapshot("in_progress", []))
        try:
            if self.tools.active:
                response = self.finish(*await self.gen.collect())
                for index, item in enumerate(response["output"]):
                    for event in item_events(stream, index, item):
                        yield event
            else:
                async for event in self.text_events(stream):
                    yield event
                response = self.response
        except (MiniLLMError, APIError) as e:
            error = engine_error(e)
            yield stream.event("error", code=error.code or error.type, message=error.message, param=error.param)
            failed = {"code": error.code or error.type, "message": error.message}
            yield stream.event("response.failed", response=self.snapshot("failed", [], None, failed))
            return
        yield stream.event("response.completed" if response["status"] == "completed" else "response.incomplete", response=response)

    async def text_events(self, stream: EventStream):
        """A reasoning item whose text is streamed as it becomes final, when the model thinks, then a
        message item likewise; self.response set at the end."""
        reply, all_events, message_at = Parts(), [], None
        if self.gen.reasoning_tokens is None:  # a model that does not think: its message opens at once
            message_at = 0
            for event in self.message_added(stream, 0):
                yield event
        async for parts, events, _ in self.gen.pieces():
            all_events += events
            if parts.reasoning:
                if not reply.reasoning:
                    item = reasoning_item(self.reasoning_id, "", False, "in_progress")
                    yield stream.event("response.output_item.added", output_index=0, item=dict(item, content=[]))
                    yield stream.event("response.content_part.added", part=item["content"][0], **self.place(self.reasoning_id, 0))
                yield stream.event("response.reasoning_text.delta", delta=parts.reasoning, **self.place(self.reasoning_id, 0))
            reply.add(parts)
            if parts.content:
                if message_at is None:
                    message_at = 1 if reply.reasoning else 0
                    for event in self.message_added(stream, message_at):
                        yield event
                yield stream.event("response.output_text.delta", delta=parts.content, logprobs=self.logprobs(events) or [],
                                   **self.place(self.message_id, message_at))
        self.response = self.finish(reply, all_events)
        for index, item in enumerate(self.response["output"]):
            if item["type"] == "reasoning":
                place, part = self.place(self.reasoning_id, index), item["content"][0]
                yield stream.event("response.reasoning_text.done", text=part["text"], **place)
            elif item["type"] == "message":
                if message_at is None:  # nothing but thinking came: the message opens now, empty
                    for event in self.message_added(stream, index):
                        yield event
                place, part = self.place(self.message_id, index), item["content"][0]
                yield stream.event("response.output_text.done", text=part["text"], logprobs=part.get("logprobs", []), **place)
            else:
                continue
            yield stream.event("response.content_part.done", part=part, **place)
            yield stream.event("response.output_item.done", output_index=index, item=item)

    def message_added(self, stream: EventStream, index: int):
        item = message_item(self.message_id, "", "in_progress", None)
        yield stream.event("response.output_item.added", output_index=index, item=dict(item, content=[]))
        yield stream.event("response.content_part.added", part=item["content"][0], **self.place(self.message_id, index))

    @staticmethod
    def place(item_id: str, index: int) -> dict:
        return {"item_id": item_id, "output_index": index, "content_index": 0}


def item_events(stream: EventStream, index: int, item: dict):
    """The events of a finished output item, from added to done."""
    if item["type"] == "message":
        yield stream.event("response.output_item.added", output_index=index, item=dict(item, content=[], status="in_progress"))
        part, place = item["content"][0], {"item_id": item["id"], "output_index": index, "content_index": 0}
        yield stream.event("response.content_part.added", part=dict(part, text=""), **place)
        yield stream.event("response.output_text.delta", delta=part["text"], logprobs=part.get("logprobs", []), **place)
        yield stream.event("response.output_text.done", text=part["text"], logprobs=part.get("logprobs", []), **place)
        yield stream.event("response.content_part.done", part=part, **place)
    elif item["type"] == "reasoning":
        yield stream.event("response.output_item.added", output_index=index, item=dict(item, content=[], status="in_progress"))
        part, place = item["content"][0], {"item_id": item["id"], "output_index": index, "content_index": 0}
        yield stream.event("response.content_part.added", part=dict(part, text=""), **place)
        yield stream.event("response.reasoning_text.delta", delta=part["text"], **place)
        yield stream.event("response.reasoning_text.done", text=part["text"], **place)
        yield stream.event("response.content_part.done", part=part, **place)
    else:
        yield stream.event("response.output_item.added", output_index=index, item=dict(item, arguments="", status="in_progress"))
        place = {"item_id": item["id"], "output_index": index}
        yield stream.event("response.function_call_arguments.delta", delta=item["arguments"], **place)
        yield stream.event("response.function_call_arguments.done", arguments=item["arguments"], name=item["name"], **place)
    yield stream.event("response.output_item.done", output_index=index, item=item)
