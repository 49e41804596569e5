"""Anthropic's Messages API through the official anthropic client (what Claude Code and Anthropic's
SDKs send): each message is the chat it reads as (same text and tokens), streamed events add up to
it, tools come back as tool_use blocks, errors come in Anthropic's shape, and the key may come as
x-api-key."""

import json

import anthropic
import jsonschema
import openai
import pytest
from conftest import running_server

import minillm
from minillm.serving.anthropic import chat_messages
from minillm.serving.openai_protocol import APIError
from minillm.serving.server import create_app

KEY = "test-key"
WEATHER = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 30}}}
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}}]
QUESTION = {"role": "user", "content": "What is the capital of France?"}


@pytest.fixture(scope="module")
def base(default_model_dir):
    with minillm.load(default_model_dir, ctx=1024) as llm, running_server(create_app(llm, "m", KEY)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.mark.slow
def test_a_message_is_the_chat_it_reads_as(client, oai):
    for sampling, max_tokens in (({"temperature": 0}, 40), ({"temperature": 0.8, "seed": 3}, 40), ({"temperature": 0}, 4)):
        m = client.messages.create(model="m", max_tokens=max_tokens, system="Answer briefly.", messages=[QUESTION], extra_body=sampling)
        chat = oai.chat.completions.create(model="m", max_tokens=max_tokens, messages=[{"role": "system", "content": "Answer briefly."}, QUESTION],
                                           **sampling)
        assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat.choices[0].message.content
        assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason] and m.stop_sequence is None
        assert (m.usage.input_tokens, m.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert client.messages.count_tokens(model="m", system="Answer briefly.", messages=[QUESTION]).input_tokens == chat.usage.prompt_tokens


@pytest.mark.slow
def test_stop_sequences_and_streaming(client):
    kw = dict(model="m", max_tokens=60, messages=[{"role": "user", "content": "Write the numbers from 1 to 5 in words."}],
              extra_body={"temperature": 0})
    whole = client.messages.create(**kw)
    word = whole.content[0].text.split()[2]
    cut = client.messages.create(stop_sequences=[word, "zzz"], **kw)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == whole.content[0].text[: whole.content[0].text.index(word)]
    with client.messages.stream(**kw) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == whole.content[0].text == final.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    events = [e.type for e in client.messages.create(stream=True, **kw)]
    assert events[:2] == ["message_start", "content_block_start"] and events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


@pytest.mark.slow
def test_tool_use_and_tool_results(client, oai):
    question = {"role": "user", "content": "What is the weather in Oslo?"}
    m = client.messages.create(model="m", max_tokens=60, tools=TOOLS, tool_choice={"type": "any"}, messages=[question],
                               extra_body={"temperature": 0})
    use = m.content[-1]
    assert m.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    with client.messages.stream(model="m", max_tokens=60, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[question], extra_body={"temperature": 0}) as stream:
        assert stream.get_final_message().content[-1].input == use.input
    history = [question, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C, sunny"}]}]
    after = client.messages.create(model="m", max_tokens=30, tools=TOOLS, tool_choice={"type": "none"}, messages=history,
                                   extra_body={"temperature": 0})
    chat = oai.chat.completions.create(model="m", max_tokens=30, tools=CHAT_TOOLS, tool_choice="none", temperature=0, messages=[
        question, {"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "21 C, sunny"}])
    assert after.content[0].text == chat.choices[0].message.content


@pytest.mark.slow
def test_structured_output_errors_and_keys(client, base):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
    m = client.messages.create(model="m", max_tokens=40, messages=[QUESTION], output_config={"format": {"type": "json_schema", "schema": schema}},
                               extra_body={"temperature": 0})
    assert m.stop_reason == "max_tokens" or jsonschema.validate(json.loads(m.content[0].text), schema) is None
    for bad in ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                {"messages": [{"role": "system", "content": "x"}]},
                {"messages": [QUESTION], "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
                {"messages": [QUESTION], "tool_choice": {"type": "sometimes"}},
                {"messages": [QUESTION], "thinking": {"type": "enabled", "budget_tokens": 1024}},
                {"messages": [QUESTION], "output_config": {"effort": "high"}}):
        with pytest.raises(anthropic.BadRequestError) as error:
            client.messages.create(model="m", max_tokens=5, **bad)
        assert error.value.body["type"] == "error" and error.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(model="m", max_tokens=5, messages=[QUESTION])


def test_content_blocks_as_chat_messages():
    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Oslo?"}]},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "..."}, {"type": "text", "text": "Checking."},
                                                  {"type": "tool_use", "id": "t1", "name": "w", "input": {"a": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]},
                                             {"type": "tool_result", "tool_use_id": "t2", "content": "timed out", "is_error": True},
                                             {"type": "text", "text": "Thanks."}]}]
    assert chat_messages([{"type": "text", "text": "Be brief."}], messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "...",  # the thinking, for templates that keep it
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "w", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: timed out"},
        {"role": "user", "content": "Thanks."}]
    with pytest.raises(APIError) as error:
        chat_messages(None, [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "w"}]}])
    assert error.value.param == "messages.0.content.0"
