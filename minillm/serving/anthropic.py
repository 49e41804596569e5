"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), read as a chat, as
llama.cpp's and vLLM's servers offer it (Claude Code and Anthropic's SDKs talk to it): system and
content blocks become chat messages, tools and tool_choice the chat's, and the reply comes back as
content blocks (text, tool_use) with Anthropic's stop reasons, or streamed as its events.
Nothing here touches the engine; the server runs the chat.
"""

from __future__ import annotations

import json
import uuid

from pydantic import Field

from ..errors import MiniLLMError
from .openai_protocol import APIError, ChatRequest, SamplingRequest, engine_error, joined_text

# our errors' OpenAI types as Anthropic names them
ERROR_TYPES = {"invalid_request_error": "invalid_request_error", "authentication_error": "authentication_error",
               "not_found_error": "not_found_error", "rate_limit_error": "rate_limit_error", "service_unavailable": "overloaded_error"}


class MessagesRequest(SamplingRequest):
    """A Messages request. Beside its own fields it takes the chat's sampling extensions (seed,
    min_p, penalties...)."""

    max_tokens: int = Field(..., ge=1)
    messages: list[dict] = Field(..., min_length=1)
    system: str | list[dict] | None = None
    stop_sequences: list[str] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    output_config: dict | None = None  # {"format": {"type": "json_schema", "schema": ...}, "effort": ...}
    thinking: dict | None = None  # {"type": "enabled", "budget_tokens": N}, adaptive, or disabled
    # metadata (user_id) has nothing to act on here: outside the schema, the server's log names it

    def chat_request(self) -> ChatRequest:
        if (self.output_config or {}).keys() - {"format", "effort"}:
            raise APIError(400, "output_config: only format (a JSON schema) and effort are honoured here", param="output_config")
        chat = dict(self.sampling_fields("stop"), messages=chat_messages(self.system, self.messages), stop=(self.stop_sequences or []) + self.stops())
        chat.update(self.reasoning_fields())
        fmt = (self.output_config or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise APIError(400, 'output_config.format must be {"type": "json_schema", "schema": {...}}', param="output_config.format")
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
        if self.tools:
            chat.update(tools=chat_tools(self.tools))
        if self.tool_choice is not None:
            choice, parallel = chat_tool_choice(self.tool_choice)
            chat.update(tool_choice=choice, parallel_tool_calls=parallel)
        return ChatRequest.model_validate(chat)

    def reasoning_fields(self) -> dict:
        """thinking and output_config.effort as the chat's: a budget of thinking tokens, thinking
        switched off, or an effort (a final assistant message is continued, as the chat does by default)."""
        fields, kind = {}, (self.thinking or {}).get("type")
        if kind == "enabled":
            budget = self.thinking.get("budget_tokens")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                raise APIError(400, "thinking.budget_tokens must be a whole number of tokens", param="thinking.budget_tokens")
            fields["thinking_token_budget"] = budget
        elif kind == "disabled":
            fields["chat_template_kwargs"] = {"enable_thinking": False}
        elif kind not in (None, "adaptive"):
            raise APIError(400, "thinking.type must be enabled, adaptive or disabled", param="thinking.type")
        effort = (self.output_config or {}).get("effort")
        if effort is not None:
            if effort not in ("low", "medium", "high", "max"):
                raise APIError(400, "output_config.effort must be low, medium, high or max", param="output_config.effort")
            fields["reasoning_effort"] = {"max": "high"}.get(effort, effort)
        return fields


class TokenCountRequest(MessagesRequest):
    """count_tokens: a Messages request without max_tokens."""

    max_tokens: int = 1


def error_body(error: APIError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(error.type, "api_error"), "message": error.message}}


def chat_messages(system, messages: list[dict]) -> list[dict]:
    """System and messages as chat messages: text blocks joined, an assistant's tool_use blocks as
    its tool calls, a user's tool_result blocks as tool messages (before the user's own text)."""
    out = [{"role": "system", "content": _text(system, "system")}] if system else []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise APIError(400, f"messages.{i}.role must be user or assistant", param=f"messages.{i}.role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(400, f"messages.{i}.content must be a string or a list of content blocks", param=f"messages.{i}.content")
        texts, calls, thinking = [], [], []
        for j, block in enumerate(content):
            kind, where = block.get("type") if isinstance(block, dict) else None, f"messages.{i}.content.{j}"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
                thinking.append(block["thinking"])
            elif kind == "tool_use" and role == "assistant" and isinstance(block.get("id"), str) and isinstance(block.get("name"), str):
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and role == "user" and isinstance(block.get("tool_use_id"), str):
                result = _text(block.get("content", ""), where)  # a failed call's result says so, as Anthropic shows it the model
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": f"Error: {result}" if block.get("is_error") else result})
            elif kind != "redacted_thinking":  # another model's encrypted thinking: left out
                raise APIError(400, f"{where}: this server reads text, thinking, tool_use and tool_result blocks (got {kind!r})", param=where)
        if texts or calls or not content:
            message = {"role": role, "content": "".join(texts) if texts or not calls else None}
            if thinking:
                message["reasoning_content"] = "".join(thinking)  # for templates that keep it
            out.append(dict(message, tool_calls=calls) if calls else message)
    return out


def _text(content, where: str) -> str:
    text = joined_text(content)
    if text is None:
        raise APIError(400, f"{where} must be text or a list of text blocks", param=where)
    return text


def chat_tools(tools: list[dict]) -> list[dict]:
    """Anthropic's client tools ({"name", "description", "input_schema"}) in the chat's form; its
    server tools (web search, code execution, bash...) are 400s."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom" or not isinstance(tool.get("name"), str):
            raise APIError(400, f"tools.{i}: only client tools ({{\"name\", \"input_schema\"}}) run here, got type {tool.get('type')!r}",
                           param=f"tools.{i}")
        function = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object", "properties": {}})}
        if "description" in tool:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict) -> tuple:
    """(the chat's tool_choice, parallel_tool_calls) for Anthropic's {"type": auto | any | tool | none}."""
    kind, parallel = choice.get("type"), not choice.get("disable_parallel_tool_use", False)
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel
    raise APIError(400, 'tool_choice.type must be auto, any, tool (with a name) or none', param="tool_choice")


def usage(input_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "cache_read_input_tokens": cached_tokens,
            "cache_creation_input_tokens": 0}


class MessageRun:
    """One Messages request running as a chat generation (minillm.serving.server.Generation): the
    message whole, or its events as they come."""

    def __init__(self, gen, tools, model: str):
        self.gen, self.tools, self.model = gen, tools, model
        self.id = f"msg_{uuid.uuid4().hex}"

    def stop(self, calls: list) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        if calls:
            return "tool_use", None
        stop_string = self.gen.reader.stop_string
        if stop_string is not None:
            return "stop_sequence", stop_string
        return ("end_turn" if self.gen.finish_reason() == "stop" else "max_tokens"), None

    def blocks(self, reply) -> tuple[list[dict], list]:
        """The reply's content blocks: its thinking, its text, its tool calls."""
        content, calls = self.tools.parse(reply)
        blocks = [thinking_block(reply.reasoning)] if reply.reasoning else []
        blocks += [{"type": "text", "text": content or ""}] if content or not calls else []
        return blocks + [{"type": "tool_use", "id": f"toolu_{c.id.removeprefix('call_')}", "name": c.name, "input": c.arguments}
                         for c in calls], calls

    def message(self, content: list[dict], stop: tuple, output_tokens: int) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": usage(self.gen.prompt_tokens, self.gen.handle.cached_tokens, output_tokens)}

    def finish(self, reply, events: list) -> dict:
        content, calls = self.blocks(reply)
        return self.message(content, self.stop(calls), len(events))

    async def events(self):
        """message_start, content blocks (thinking and text deltas as they come; tool calls, read
        from the whole reply, at its end), message_delta with the stop reason and usage,
        message_stop; an engine error is an error event."""
        yield sse("message_start", message=self.message([], (None, None), 0))
        try:
            if self.tools.active:
                reply, events = await self.gen.collect()
                content, calls = self.blocks(reply)
                for index, block in enumerate(content):
                    for event in block_events(index, block):
                        yield event
            else:
                events, calls, blocks = [], [], StreamedBlocks()
                if self.gen.reasoning_tokens is None:  # a reply of text alone: its block opens at once
                    for event in blocks.open("text"):
                        yield event
                yield sse("ping")
                async for parts, piece_events, _ in self.gen.pieces():
                    events += piece_events
                    for kind, text in (("thinking", parts.reasoning), ("text", parts.content)):
                        if text:
                            for event in blocks.delta(kind, text):
                                yield event
                for event in blocks.close(final=True):
                    yield event
        except (MiniLLMError, APIError) as e:
            yield sse("error", error=error_body(engine_error(e))["error"])
            return
        stop = self.stop(calls)
        yield sse("message_delta", delta={"stop_reason": stop[0], "stop_sequence": stop[1]}, usage={"output_tokens": len(events)})
        yield sse("message_stop")


def thinking_block(text: str) -> dict:
    """A thinking block; its signature empty (nothing here is signed, and a replayed one is read as text)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


class StreamedBlocks:
    """The content blocks of a streamed reply, opened and closed as its parts change (thinking,
    then text): start, deltas, stop."""

    DELTAS = {"thinking": "thinking_delta", "text": "text_delta"}

    def __init__(self):
        self.index, self.kind = -1, None

    def open(self, kind: str):
        yield from self.close()
        self.index, self.kind = self.index + 1, kind
        yield sse("content_block_start", index=self.index, content_block=thinking_block("") if kind == "thinking" else {"type": "text", "text": ""})

    def delta(self, kind: str, text: str):
        if kind != self.kind:
            yield from self.open(kind)
        yield sse("content_block_delta", index=self.index, delta={"type": self.DELTAS[kind], kind: text})

    def close(self, final: bool = False):
        """Stop the open block; at the end, a reply without text still gets its (empty) text block."""
        if final and self.kind != "text":
            yield from self.open("text")
        if self.kind == "thinking":
            yield sse("content_block_delta", index=self.index, delta={"type": "signature_delta", "signature": ""})
        if self.kind is not None:
            yield sse("content_block_stop", index=self.index)
            self.kind = None


def block_events(index: int, block: dict):
    """A finished content block's start, delta and stop events."""
    if block["type"] == "thinking":
        yield sse("content_block_start", index=index, content_block=thinking_block(""))
        yield sse("content_block_delta", index=index, delta={"type": "thinking_delta", "thinking": block["thinking"]})
        yield sse("content_block_delta", index=index, delta={"type": "signature_delta", "signature": ""})
    elif block["type"] == "text":
        yield sse("content_block_start", index=index, content_block={"type": "text", "text": ""})
        yield sse("content_block_delta", index=index, delta={"type": "text_delta", "text": block["text"]})
    else:
        yield sse("content_block_start", index=index, content_block=dict(block, input={}))
        yield sse("content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
    yield sse("content_block_stop", index=index)


def sse(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps(dict(type=kind, **fields), ensure_ascii=False)}\n\n"
