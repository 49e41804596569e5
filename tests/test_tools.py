"""Tool calling through the server and the official openai client, on the default model's weights
with a Hermes-style (Qwen 2.5-like) chat template that takes tools."""

import json
import shutil

import jsonschema
import openai
import pytest
from conftest import running_server

import minillm
from minillm.serving.server import create_app
from minillm.core.structured import StructuredOutputError
from minillm.serving.tools import ToolCall, call_grammar, forced_names, parse_tool_calls, template_format

pytestmark = pytest.mark.slow  # the default model, servers or transformers: the full suite, not the quick tier

TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You are a helpful assistant.{% endif %}

# Tools
You may call one or more functions. Function signatures within <tools></tools>:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
For each call, return a JSON object with the function name and arguments within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}{% if message.role == 'system' %}{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "object", "required": ["city", "unit"], "properties": {
    "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
STOCK = {"type": "object", "required": ["symbol"], "properties": {"symbol": {"type": "string", "pattern": "^[A-Z]{1,5}$"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_stock_price", "description": "A stock's price", "parameters": STOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "get_stock_price": STOCK}


@pytest.fixture(scope="module")
def client(default_model_dir, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tool-model") / "model"
    shutil.copytree(default_model_dir, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    with minillm.load(model_dir, ctx=1024) as llm, running_server(create_app(llm, "tools")) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_required_tool_calls_always_validate(client):
    questions = ["What is the weather in Paris?", "How is Apple stock doing?", "Weather in Tokyo, in fahrenheit?",
                 "Price of MSFT?", "Is it raining in London?", "Tell me about NVDA.", "Oslo weather", "Quote for IBM",
                 "Do I need an umbrella in Rome?", "What does TSLA trade at?"]
    for i, question in enumerate(questions):
        reply = client.chat.completions.create(model="tools", messages=[{"role": "user", "content": question}], tools=TOOLS,
                                               tool_choice="required", max_tokens=80, temperature=0 if i % 2 else 0.8, seed=i)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_choice_tool_result_and_streaming(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_stock_price"}}
    reply = client.chat.completions.create(model="tools", messages=messages, tools=TOOLS, tool_choice=named, max_tokens=60, temperature=0)
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_stock_price"
    streamed = list(client.chat.completions.create(model="tools", messages=messages, tools=TOOLS, tool_choice=named,
                                                   max_tokens=60, temperature=0, stream=True))
    deltas = [tc for c in streamed if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [(call.function.name, call.function.arguments)]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    # the result goes back as a tool message, and the next turn completes
    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"price": 412.5})}]
    final = client.chat.completions.create(model="tools", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=30, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content


def test_a_template_without_tools_gets_the_generic_format(default_model_dir):
    """The tools go into a system message; the reply, constrained to a call, parses into tool_calls."""
    from fastapi.testclient import TestClient

    with minillm.load(default_model_dir, ctx=512) as llm, TestClient(create_app(llm, "plain"), base_url="http://localhost") as http:
        response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                                           "tool_choice": "required", "max_tokens": 80, "temperature": 0})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["function"]["name"] in {
            t["function"]["name"] for t in TOOLS}
        # the call and its result in the history, on a turn that offers no tools (or tool_choice none):
        # written in the same JSON, not handed to a template that cannot read them (a 400 before)
        call = choice["message"]["tool_calls"][0]
        history = [{"role": "user", "content": "hi"}, choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "42"}]
        for offer in ({}, {"tools": TOOLS, "tool_choice": "none"}):
            response = http.post("/v1/chat/completions", json={"messages": history, "max_tokens": 8, "temperature": 0, **offer})
            assert response.status_code == 200, response.text


def test_parallel_tool_calls_false_keeps_the_first_call():
    from types import SimpleNamespace

    from minillm.core.detokenize import Parts
    from minillm.serving.openai_protocol import ChatRequest
    from minillm.serving.server import ChatTools

    service = SimpleNamespace(tokenizer=SimpleNamespace(chat_template="{{ tools }} <tool_call>", supports_tools=True))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    reply = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "f", "arguments": {"a": 2}}\n</tool_call>'
    for parallel, expected in ((True, [{"a": 1}, {"a": 2}]), (False, [{"a": 1}])):
        body = ChatRequest(messages=[{"role": "user", "content": "hi"}], tools=tools, parallel_tool_calls=parallel)
        _, calls = ChatTools(service, body).parse(Parts(content=reply))
        assert [c.arguments for c in calls] == expected


def test_parsing_each_format():
    functions = {"f": {"type": "object"}}
    assert template_format("... <tool_call> ...") == "hermes" and template_format("[TOOL_CALLS]") == "mistral"
    content, calls = parse_tool_calls('Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "hermes", functions)
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [("f", {"a": 1})]
    _, calls = parse_tool_calls('[TOOL_CALLS] [{"name": "f", "arguments": {"b": 2}}, {"name": "f", "arguments": {}}]', "mistral", functions)
    assert [c.arguments for c in calls] == [{"b": 2}, {}]
    _, calls = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {"c": 3}}', "llama3", functions)
    assert calls[0].arguments == {"c": 3}
    assert parse_tool_calls('{"name": "unknown", "parameters": {}}', "llama3", functions) == ('{"name": "unknown", "parameters": {}}', [])
    assert json.loads(ToolCall("f", {"x": [1]}).openai()["function"]["arguments"]) == {"x": [1]}
    assert "%json" in call_grammar(functions, ["f"], "mistral")
    _, calls = parse_tool_calls('{"tool_call": {"name": "f", "arguments": {"d": 4}}}', "generic", functions)
    assert calls[0].arguments == {"d": 4}
    assert parse_tool_calls('{"response": "Hello."}', "generic", functions) == ("Hello.", [])
    assert '"response"' in call_grammar(functions, ["f"], "generic", may_answer=True)
    for choice in ({"function": "x"}, {"function": {"name": ["f"]}}, {"type": "function"}, "sometimes", 3):
        with pytest.raises(StructuredOutputError):  # a 400 naming tool_choice, never a crash (found by tests/test_fuzz.py)
            forced_names(functions, choice)


def test_the_deprecated_functions_form_reads_as_tools(client):
    """Older clients send functions and function_call and read message.function_call back: the same
    call as tools with a named tool_choice, one call a reply, its result as a role "function" message."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    functions = [t["function"] for t in TOOLS]
    as_tools = client.chat.completions.create(model="tools", messages=messages, tools=TOOLS, tool_choice=named, max_tokens=60, temperature=0)
    reply = client.chat.completions.create(model="tools", messages=messages, functions=functions, function_call={"name": "get_weather"},
                                           max_tokens=60, temperature=0)
    choice, call = reply.choices[0], as_tools.choices[0].message.tool_calls[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert (choice.message.function_call.name, choice.message.function_call.arguments) == (call.function.name, call.function.arguments)
    streamed = list(client.chat.completions.create(model="tools", messages=messages, functions=functions,
                                                   function_call={"name": "get_weather"}, max_tokens=60, temperature=0, stream=True))
    deltas = [c.choices[0].delta.function_call for c in streamed if c.choices and c.choices[0].delta.function_call]
    assert [(d.name, d.arguments) for d in deltas] == [(call.function.name, call.function.arguments)]
    assert streamed[-1].choices[0].finish_reason == "function_call"
    # the history in that form renders as the tools form's does, and the next turn completes
    legacy = messages + [choice.message.model_dump(exclude_none=True),
                         {"role": "function", "name": "get_weather", "content": json.dumps({"celsius": 21})}]
    final = client.chat.completions.create(model="tools", messages=legacy, functions=functions, function_call="none", max_tokens=30, temperature=0)
    modern = messages + [as_tools.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 21})}]
    expected = client.chat.completions.create(model="tools", messages=modern, tools=TOOLS, tool_choice="none", max_tokens=30, temperature=0)
    assert final.choices[0].message.content == expected.choices[0].message.content
    assert final.usage.prompt_tokens == expected.usage.prompt_tokens
    for bad, param in (({"tools": TOOLS, "functions": functions}, "functions"), ({"function_call": "auto"}, "function_call"),
                       ({"functions": functions, "function_call": {"name": "nope"}}, "function_call"),
                       ({"functions": [{"description": "no name"}]}, "functions[0]"),
                       ({"functions": [{"name": "f", "parameters": 3}]}, "functions[0].parameters")):
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="tools", messages=messages, max_tokens=5, **bad)
        assert error.value.body["param"] == param, error.value.body
