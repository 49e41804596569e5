"""OpenAI's Responses API through the official openai client: each response is the chat it reads as
(same text, tokens and logprobs), streamed events add up to it, stored responses continue a
conversation, and what cannot be honoured is a 400 naming the field."""

import json

import jsonschema
import openai
import pytest
from conftest import running_server
from pydantic import BaseModel

import minillm
from minillm.serving.openai_protocol import APIError
from minillm.serving.responses import MAX_STORED_RESPONSES, ResponseStore, input_messages
from minillm.serving.server import create_app

WEATHER = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 30}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def client(default_model_dir):
    with minillm.load(default_model_dir, ctx=1024) as llm, running_server(create_app(llm, "m")) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat_text(client, messages, **kw):
    reply = client.chat.completions.create(model="m", messages=messages, **kw)
    return reply.choices[0].message.content, reply


@pytest.mark.slow
def test_a_response_is_the_chat_it_reads_as(client):
    """Greedy and seeded: the same text, token counts and logprobs as the chat of instructions + input."""
    for settings in ({"temperature": 0}, {"temperature": 0.8, "extra_body": {"seed": 3}}):
        r = client.responses.create(model="m", instructions="Answer briefly.", input="What is the capital of France?",
                                    max_output_tokens=40, include=["message.output_text.logprobs"], top_logprobs=2, **settings)
        text, chat = chat_text(client, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital of France?"}],
                               max_tokens=40, logprobs=True, top_logprobs=2, **settings)
        assert r.object == "response" and r.id.startswith("resp_") and r.output_text == text
        assert r.status == {"stop": "completed", "length": "incomplete"}[chat.choices[0].finish_reason]
        message = r.output[0]
        assert message.type == "message" and message.role == "assistant" and message.status == r.status
        assert [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in message.content[0].logprobs] == [
            (lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in chat.choices[0].logprobs.content]
        assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
        assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens and r.instructions == "Answer briefly."
    # top_logprobs alone asks for logprobs too
    alone = client.responses.create(model="m", input="Hi", max_output_tokens=3, temperature=0, top_logprobs=1)
    assert len(alone.output[0].content[0].logprobs) == alone.usage.output_tokens


@pytest.mark.slow
def test_streamed_events_add_up_to_the_response(client):
    kw = dict(model="m", input="What is the capital of France?", temperature=0)
    whole = client.responses.create(max_output_tokens=200, **kw)
    events = list(client.responses.create(max_output_tokens=200, stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text == events[-1].response.output_text
    with client.responses.stream(max_output_tokens=200, **kw) as stream:  # the SDK's own accumulation
        assert stream.get_final_response().output_text == whole.output_text
    # stopped by max_output_tokens: incomplete, as OpenAI says it
    cut = client.responses.create(max_output_tokens=5, **kw)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens" and cut.usage.output_tokens == 5
    events = list(client.responses.create(max_output_tokens=5, stream=True, **kw))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == cut.output_text


@pytest.mark.slow
def test_stored_responses_continue_a_conversation(client):
    first = client.responses.create(model="m", input="What is the capital of France?", max_output_tokens=30, temperature=0)
    second = client.responses.create(model="m", input="And of Italy?", previous_response_id=first.id, max_output_tokens=30, temperature=0)
    text, chat = chat_text(client, [{"role": "user", "content": "What is the capital of France?"},
                                    {"role": "assistant", "content": first.output_text},
                                    {"role": "user", "content": "And of Italy?"}], max_tokens=30, temperature=0)
    assert second.output_text == text and second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id and client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model="m", input="Hi", previous_response_id=first.id, max_output_tokens=5)
    assert error.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model="m", input="Hi", store=False, max_output_tokens=5)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.slow
def test_function_calls_and_their_outputs(client):
    """Calls come back as function_call items whose arguments follow the schema; a call and its
    output given back as input render as the chat's tool call and tool message do."""
    question = {"role": "user", "content": "What is the weather in Oslo?"}
    r = client.responses.create(model="m", input=[question], tools=TOOLS, tool_choice="required", max_output_tokens=60, temperature=0)
    call = r.output[0]
    assert r.status == "completed" and call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    chat = client.chat.completions.create(model="m", messages=[question], tools=CHAT_TOOLS, tool_choice="required", max_tokens=60, temperature=0)
    assert chat.choices[0].message.tool_calls[0].function.arguments == call.arguments
    streamed = list(client.responses.create(model="m", input=[question], tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                                            max_output_tokens=60, temperature=0, stream=True))
    assert [e.arguments for e in streamed if e.type == "response.function_call_arguments.done"] == [call.arguments]
    following = client.responses.create(model="m", input=[question, call.model_dump(exclude_none=True),
                                                          {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}],
                                        tools=TOOLS, tool_choice="none", max_output_tokens=30, temperature=0)
    text, _ = chat_text(client, [question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "21 C, sunny"}], tools=CHAT_TOOLS, tool_choice="none", max_tokens=30, temperature=0)
    assert following.output_text == text


@pytest.mark.slow
def test_text_format_json_schema(client):
    class City(BaseModel):
        name: str
        country: str

    parsed = client.responses.parse(model="m", input="Paris is a city in France. Give it as JSON.", text_format=City,
                                    max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, City)
    obj = client.responses.create(model="m", input="Give me a JSON object.", text={"format": {"type": "json_object"}},
                                  max_output_tokens=60, temperature=0)
    assert obj.status == "incomplete" or isinstance(json.loads(obj.output_text), dict)


@pytest.mark.slow
@pytest.mark.parametrize("body,param", [
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": 3}]}, "tools[0].parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objec"}}}}, "text.format.schema"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"verbosity": "high"}}, "text.verbosity"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(**{"model": "m", "input": "Hi", "max_output_tokens": 5, **body})
    assert error.value.body["param"] == param, error.value.body


def test_input_items_as_chat_messages():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Oslo?"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
             {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{\"a\": 1}"},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    assert input_messages(items, "Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "w", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    with pytest.raises(APIError) as error:
        input_messages([{"role": "tool", "content": "x"}], None)
    assert error.value.param == "input[0].role"


def test_the_store_keeps_the_newest_and_answers_unknown_ids():
    store = ResponseStore()
    for i in range(MAX_STORED_RESPONSES + 5):
        store.keep({"id": f"resp_{i}"}, [{"role": "user", "content": str(i)}])
    assert len(store.kept) == MAX_STORED_RESPONSES and store.conversation(f"resp_{MAX_STORED_RESPONSES + 4}") == [{"role": "user", "content": str(MAX_STORED_RESPONSES + 4)}]
    for missing in ("resp_0", "resp_4"):
        with pytest.raises(APIError):
            store.conversation(missing)
    assert store.delete("resp_5")["deleted"] and store.conversation(None) == []
    with pytest.raises(APIError) as error:
        store.get("resp_5")
    assert error.value.status == 404
