"""Tool calling: tools go into the model's chat template as transformers passes them, and the reply
is read back as OpenAI tool calls in the format that template teaches the model.

Formats, chosen from the template's own text:
    hermes   <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one or more (Hermes, Qwen 2.5/3, SmolLM3)
    mistral  [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
    llama3   {"name": ..., "parameters": {...}}, the whole reply (Llama 3.1+, optionally after <|python_tag|>)
    generic  {"tool_call": {"name": ..., "arguments": {...}}} or {"response": "..."}, for templates
             that take no tools (as llama.cpp's server does): the tools are described in a system
             message and every reply is constrained to one of those two objects
tool_choice "required" or a named function constrains the reply to one such call whose arguments
follow the function's JSON schema (a Lark grammar with an embedded JSON schema, minillm.core.structured),
so they always parse.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..core.structured import StructuredOutputError, strict_schema

FORMATS = ("hermes", "mistral", "llama3", "generic")


def template_format(template: str) -> str:
    """The tool-call format a chat template teaches."""
    if "<|channel|>" in template:  # gpt-oss: calls are messages addressed to=functions.NAME (minillm.core.reasoning)
        return "harmony"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    return "llama3"


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": self.function_call()}
        return call if index is None else dict(call, index=index)

    def function_call(self) -> dict:
        """The call in OpenAI's deprecated functions form."""
        return {"name": self.name, "arguments": json.dumps(self.arguments)}


def check_tools(tools: list[dict]) -> dict[str, dict]:
    """{name: parameters schema} of OpenAI `tools`; StructuredOutputError naming the field if malformed."""
    functions = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise StructuredOutputError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", f"tools[{i}]")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise StructuredOutputError(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}].function.parameters")
        functions[fn["name"]] = params
    return functions


def forced_names(functions: dict[str, dict], tool_choice) -> list[str] | None:
    """The functions a reply must call (tool_choice "required" or a named one); None: free ("auto")."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return list(functions)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or name not in functions:
        raise StructuredOutputError(f"tool_choice names no function of tools: {tool_choice!r}", "tool_choice")
    return [name]


def call_grammar(functions: dict[str, dict], names: list[str], fmt: str, may_answer: bool = False) -> str:
    """A Lark grammar (llguidance) for exactly one call of one of `names`, in the format `fmt`
    (generic's with may_answer: or an answer in words)."""
    key = "parameters" if fmt == "llama3" else "arguments"
    # arguments as OpenAI's strict mode reads a schema (no unlisted properties), so the call ends
    options = [{"type": "object", "additionalProperties": False, "required": ["name", key],
                "properties": {"name": {"const": name}, key: strict_schema(functions[name])}} for name in names]
    if fmt == "generic":
        options = [{"type": "object", "additionalProperties": False, "required": ["tool_call"], "properties": {"tool_call": o}}
                   for o in options]
        if may_answer:
            options.append({"type": "object", "additionalProperties": False, "required": ["response"],
                            "properties": {"response": {"type": "string"}}})
    call = "%json " + json.dumps({"anyOf": options, "x-guidance": {"whitespace_flexible": False}})
    start = {"hermes": '"<tool_call>\\n" call "\\n</tool_call>"', "mistral": '"[TOOL_CALLS] [" call "]"', "llama3": "call",
             "generic": "call"}[fmt]
    return f"start: {start}\ncall: {call}\n"


def parse_tool_calls(text: str, fmt: str, functions: dict[str, dict]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a reply: the calls it makes in `fmt`, and the text outside them (None
    when there is none). Text that does not parse as calls of known functions stays content."""
    calls: list[ToolCall] = []
    if fmt == "generic":
        data = _json(text.strip())
        if isinstance(data, dict) and "tool_call" in data:
            call = _call(data["tool_call"], "arguments", functions)
            return (None, [call]) if call is not None else (text.strip() or None, [])
        if isinstance(data, dict) and isinstance(data.get("response"), str):
            return data["response"] or None, []
        cut = re.match(r'\s*\{\s*"response"\s*:\s*"(.*)', text, re.S)  # an answer cut by max_tokens
        if cut:
            partial = _json('"' + cut.group(1).rstrip("\\") + '"')
            if isinstance(partial, str):
                return partial or None, []
        return text.strip() or None, []
    if fmt == "hermes":
        rest = text
        for match in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S):
            call = _call(match.group(1), "arguments", functions)
            if call is not None:
                calls.append(call)
                rest = rest.replace(match.group(0), "", 1)
        content = rest.strip()
    elif fmt == "mistral":
        head, marker, tail = text.partition("[TOOL_CALLS]")
        items = _json(tail) if marker else None
        for item in items if isinstance(items, list) else []:
            call = _call(item, "arguments", functions)
            if call is not None:
                calls.append(call)
        content = head.strip() if calls else text.strip()
    else:
        body = text.split("<|python_tag|>", 1)[-1].strip()
        call = _call(body, "parameters", functions)
        calls = [call] if call is not None else []
        content = "" if calls else text.strip()
    return (content or None), calls


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def harmony_calls(calls, functions: dict[str, dict]) -> list[ToolCall]:
    """A Harmony reply's calls (minillm.core.reasoning.HarmonyCall) of known functions whose
    arguments are a JSON object."""
    return [call for call in (_call({"name": c.name, "arguments": c.arguments}, "arguments", functions) for c in calls) if call is not None]


def _call(item, key: str, functions: dict[str, dict]) -> ToolCall | None:
    data = _json(item) if isinstance(item, str) else item
    if not isinstance(data, dict) or data.get("name") not in functions:
        return None
    arguments = data.get(key, data.get("arguments", data.get("parameters", {})))
    if isinstance(arguments, str):
        arguments = _json(arguments)
    return ToolCall(data["name"], arguments) if isinstance(arguments, dict) else None


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages as chat templates read them: assistant tool calls with their arguments
    as objects (transformers' convention), tool results with their call id."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function", {}))
                if isinstance(fn.get("arguments"), str):
                    fn["arguments"] = _json(fn["arguments"]) or {}
                calls.append(dict(c, function=fn))
            m["tool_calls"] = calls
        out.append(m)
    return out


def generic_system_text(tools: list[dict], forced: list[str] | None) -> str:
    """The system message that teaches the generic format to a model whose template takes no tools
    (worded as measured best on SmolLM2-135M: it then calls the right tool for each question asked)."""
    specs = json.dumps([t["function"] for t in tools], ensure_ascii=False, indent=1)
    if forced:
        how = 'Call a tool with {"tool_call": {"name": <tool name>, "arguments": <arguments>}}.'
    else:
        how = ('When the user asks for something a tool provides, call the tool with {"tool_call": {"name": <tool name>, '
               '"arguments": <arguments>}}. Otherwise reply with {"response": <your answer>}.')
    return f"You are a helpful assistant with access to these tools:\n{specs}\n{how} Reply with the JSON object only."


def generic_messages(messages: list[dict], system: str | None) -> list[dict]:
    """Chat messages for a template that takes no tools: the generic format's system text first
    (when this turn offers tools), earlier calls and their results written as the JSON the format uses."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [{"name": c.get("function", {}).get("name"), "arguments": c.get("function", {}).get("arguments")}
                     for c in m["tool_calls"]]
            m = {"role": "assistant", "content": json.dumps({"tool_call": calls[0]} if len(calls) == 1 else {"tool_calls": calls})}
        elif m.get("role") == "tool":
            m = {"role": "user", "content": json.dumps({"tool_response": {"tool_call_id": m.get("tool_call_id"), "content": m.get("content")}})}
        out.append(m)
    if system is None:
        return out
    if out and out[0].get("role") == "system":
        out[0] = dict(out[0], content=f"{out[0].get('content') or ''}\n\n{system}".strip())
    else:
        out.insert(0, {"role": "system", "content": system})
    return out
