"""Reasoning models through the real server and the official clients: thinking apart from the
answer (<think>, a template-opened <think>, gpt-oss's Harmony channels and its tool calls), the
thinking budget, the template's switch, a continued reply, and --reasoning-format none.

The tiny random models of tests/reasoning_tiny.py write a chosen reply: the engine's sampler is
replaced by a script (minillm.core.engine.sample is what the engine calls for every token)."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import ExitStack

import anthropic
import numpy as np
import openai
import pytest
from conftest import ROOT, httpx, running_server
from reasoning_tiny import ScriptedSampler, ids, make_reasoning_model

import minillm
import minillm.core.engine as engine_module
from minillm.core.reasoning import ReplyReader, ThinkingControl, reasoning_format
from minillm.core.tokenizer import Tokenizer
from minillm.options import DEFAULTS
from minillm.serving.server import create_app

THINK = "<think> let me think about it </think> the answer is 42 <|im_end|>"
HARMONY_CALL = ("<|channel|> analysis <|message|> let me think <|end|> <|start|> assistant <|channel|> commentary to=functions.get_weather "
                '<|constrain|> json <|message|> {"city": "Oslo"} <|call|>')
HARMONY_ANSWER = "<|channel|> analysis <|message|> so it is sunny <|end|> <|start|> assistant <|channel|> final <|message|> the answer is sunny <|return|>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("reasoning")
    return {kind: make_reasoning_model(root / kind, kind) for kind in ("qwen3", "opened", "gpt_oss")}


@pytest.fixture(scope="module")
def servers(models):
    """A server per model (and one reading qwen3's replies raw): base URLs by name."""
    with ExitStack() as stack:
        urls = {}
        for name, (kind, options) in {"qwen3": ("qwen3", DEFAULTS), "opened": ("opened", DEFAULTS), "gpt_oss": ("gpt_oss", DEFAULTS),
                                      "raw": ("qwen3", DEFAULTS.replace(reasoning_format="none"))}.items():
            llm = stack.enter_context(minillm.load(str(models[kind]), ctx=256, progress=False))
            urls[name] = stack.enter_context(running_server(create_app(llm, name, None, options)))
        yield urls


def script(monkeypatch, models, kind, text):
    monkeypatch.setattr(engine_module, "sample", ScriptedSampler(ids(models[kind], text)))


def oai(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)


def chat_stream(client, **request):
    reasoning, content, usage, calls = "", "", None, []
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            assert not (getattr(choice.delta, "reasoning_content", None) and content), "the thinking comes before the answer"
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
    return reasoning, content, usage, calls


@pytest.mark.parametrize("kind, text", [("qwen3", THINK), ("opened", "let me think about it </think> the answer is 42 <|im_end|>")])
def test_a_think_reply_splits_in_every_api(kind, text, models, servers, monkeypatch):
    base = servers[kind]
    script(monkeypatch, models, kind, text)
    reply = oai(base).chat.completions.create(model=kind, messages=USER, max_tokens=40)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == ("let me think about it", "the answer is 42")
    assert reply.usage.completion_tokens_details.reasoning_tokens == 5  # let me think about it
    assert chat_stream(oai(base), model=kind, messages=USER, max_tokens=40)[:2] == ("let me think about it", "the answer is 42")

    client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
    message = client.messages.create(model=kind, max_tokens=40, messages=USER)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", "let me think about it"), ("text", "the answer is 42")]
    with client.messages.stream(model=kind, max_tokens=40, messages=USER) as stream:
        kinds = [event.delta.type for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", "let me think about it"), ("text", "the answer is 42")]
    assert kinds.index("text_delta") > kinds.index("thinking_delta")

    response = oai(base).responses.create(model=kind, input="hello", max_output_tokens=40)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "let me think about it" and response.output_text == "the answer is 42"
    assert response.usage.output_tokens_details.reasoning_tokens == 5
    for asked in ({"summary": "auto"}, {"generate_summary": "auto"}):  # the summary field, and its older name
        summed = oai(base).responses.create(model=kind, input="hello", max_output_tokens=40, reasoning=asked)
        assert [s.text for s in summed.output[0].summary] == ["let me think about it"]
    events = list(oai(base).responses.create(model=kind, input="hello", max_output_tokens=40, stream=True))
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thinking, answer) == ("let me think about it", "the answer is 42")
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]


def test_harmony_channels_and_tool_calls(models, servers, monkeypatch):
    base, client = servers["gpt_oss"], oai(servers["gpt_oss"])
    script(monkeypatch, models, "gpt_oss", HARMONY_CALL)
    reply = client.chat.completions.create(model="g", messages=USER, tools=TOOLS, max_tokens=40)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "let me think" and not choice.message.content
    call = choice.message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
    reasoning, content, _, calls = chat_stream(client, model="g", messages=USER, tools=TOOLS, max_tokens=40)
    assert reasoning == "let me think" and not content and calls[0].function.name == "get_weather"
    message = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0).messages.create(
        model="g", max_tokens=40, messages=USER, tools=[{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}])
    assert [b.type for b in message.content] == ["thinking", "tool_use"] and message.stop_reason == "tool_use"
    assert message.content[1].input == {"city": "Oslo"}

    # the call's result, and the final channel's answer (the tool result goes back as the template writes it)
    script(monkeypatch, models, "gpt_oss", HARMONY_ANSWER)
    history = USER + [{"role": "assistant", "content": None, "reasoning_content": "let me think", "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    reply = client.chat.completions.create(model="g", messages=history, tools=TOOLS, max_tokens=40)
    assert (reply.choices[0].message.reasoning_content, reply.choices[0].message.content) == ("so it is sunny", "the answer is sunny")
    assert reply.choices[0].finish_reason == "stop"


def test_a_reasoning_effort_reaches_the_template(servers):
    rendered = httpx.post(servers["gpt_oss"] + "/apply-template", json={"messages": USER, "reasoning_effort": "high"}).json()["prompt"]
    assert "Reasoning: high" in rendered and rendered.endswith("<|start|>assistant")


@pytest.mark.parametrize("kind, text, budget", [
    ("qwen3", "<think> let me think about it so ok </think> the answer is 42 <|im_end|>", 2),
    ("gpt_oss", "<|channel|> analysis <|message|> let me think about it so <|end|> <|start|> assistant <|channel|> final <|message|> "
                "the answer is 42 <|return|>", 3)])
def test_a_thinking_budget_ends_the_thinking(kind, text, budget, models, servers, monkeypatch):
    """After `budget` thinking tokens the engine writes the end of the thinking itself (Harmony:
    closes the analysis message and opens the final channel), and the answer follows."""
    script(monkeypatch, models, kind, text)
    reply = oai(servers[kind]).chat.completions.create(model=kind, messages=USER, max_tokens=40, extra_body={"thinking_token_budget": budget})
    assert reply.choices[0].message.reasoning_content == " ".join(["let", "me", "think"][:budget])
    assert reply.choices[0].message.content == "the answer is 42"
    assert reply.usage.completion_tokens_details.reasoning_tokens == budget
    script(monkeypatch, models, kind, text)
    message = anthropic.Anthropic(base_url=servers[kind], api_key="none", max_retries=0).messages.create(
        model=kind, max_tokens=40, messages=USER, thinking={"type": "enabled", "budget_tokens": budget})
    assert [b.type for b in message.content] == ["thinking", "text"] and message.content[1].text == "the answer is 42"


def test_enable_thinking_false_renders_the_switch_and_no_thinking_comes(models, servers, monkeypatch):
    base = servers["qwen3"]
    rendered = httpx.post(base + "/apply-template", json={"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert rendered["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        script(monkeypatch, models, "qwen3", "the answer is 42 <|im_end|>")
        reply = oai(base).chat.completions.create(model="q", messages=USER, max_tokens=20, extra_body=extra)
        assert (reply.choices[0].message.content, getattr(reply.choices[0].message, "reasoning_content", None)) == ("the answer is 42", None)
        assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    # a template with no switch (the thinking opened at the generation prompt) is made to answer at once
    script(monkeypatch, models, "opened", "let me think </think> the answer is 42 <|im_end|>")
    reply = oai(servers["opened"]).chat.completions.create(model="o", messages=USER, max_tokens=20, extra_body={"reasoning_effort": "none"})
    assert reply.choices[0].message.content.startswith("the answer")
    # Anthropic's disabled thinking is the same switch
    script(monkeypatch, models, "qwen3", "the answer is 42 <|im_end|>")
    message = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0).messages.create(
        model="q", max_tokens=20, messages=USER, thinking={"type": "disabled"})
    assert [b.type for b in message.content] == ["text"]


def test_a_final_assistant_message_is_continued(models, servers):
    """Its prompt is the rendered conversation cut at the end of that message, and the reply is
    what a completion of exactly that text gives (greedy, the real sampler)."""
    base, tokenizer = servers["qwen3"], Tokenizer(models["qwen3"])
    history = USER + [{"role": "assistant", "content": "the answer"}]
    whole = tokenizer.apply_chat_template(history, add_generation_prompt=False)
    expected = whole[: whole.rindex("the answer") + len("the answer")]
    for extra in ({}, {"continue_final_message": True, "add_generation_prompt": False}):
        assert httpx.post(base + "/apply-template", json={"messages": history, **extra}).json()["prompt"] == expected
    reply = oai(base).chat.completions.create(model="q", messages=history, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    plain = oai(servers["raw"]).completions.create(model="q", prompt=expected, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == plain.choices[0].text  # (a <think> past the first token is text)
    closed = httpx.post(base + "/apply-template", json={"messages": history, "continue_final_message": False}).json()["prompt"]
    assert closed == whole + "<|im_start|>assistant\n"
    message = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0).messages.create(
        model="q", max_tokens=8, messages=history, extra_body={"ignore_eos": True, "temperature": 0})
    assert [(b.type, b.text) for b in message.content] == [("text", plain.choices[0].text)]


def test_reasoning_format_none_gives_the_raw_text(models, servers, monkeypatch):
    script(monkeypatch, models, "qwen3", THINK)
    reply = oai(servers["raw"]).chat.completions.create(model="r", messages=USER, max_tokens=40)
    assert reply.choices[0].message.content == "<think> let me think about it </think> the answer is 42"
    assert getattr(reply.choices[0].message, "reasoning_content", None) is None and reply.usage.completion_tokens_details is None


def test_a_tool_result_for_no_call_is_refused(servers):
    base = servers["qwen3"]
    with pytest.raises(openai.BadRequestError, match="nope"):
        oai(base).chat.completions.create(model="q", max_tokens=4, messages=USER + [{"role": "tool", "tool_call_id": "nope", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="nope") as error:
        oai(base).responses.create(model="q", input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}])
    assert error.value.body["param"].startswith("input")
    with pytest.raises(anthropic.BadRequestError, match="nope"):
        anthropic.Anthropic(base_url=base, api_key="none", max_retries=0).messages.create(
            model="q", max_tokens=4, messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}])


def test_the_python_api_returns_the_thinking_apart(models, monkeypatch):
    script(monkeypatch, models, "qwen3", THINK)
    with minillm.load(str(models["qwen3"]), ctx=256, progress=False) as llm:
        reply = llm.chat(USER, max_tokens=40)
        assert (str(reply), reply.reasoning) == ("the answer is 42", "let me think about it")
        script(monkeypatch, models, "qwen3", THINK)
        stream = llm.chat_stream(USER, max_tokens=40, thinking_budget=1)
        parts = list(stream.parts())
        assert "".join(p.reasoning for p in parts) == stream.reasoning == "let" and "".join(p.content for p in parts) == "the answer is 42"


def test_reply_reader_by_hand(models):
    """Stop strings end the answer only; the thinking's whitespace at its edges is dropped."""
    tokenizer = Tokenizer(models["qwen3"])
    fmt = reasoning_format(tokenizer)
    assert fmt.kind == "think" and reasoning_format(Tokenizer(models["gpt_oss"])).kind == "harmony"
    reader = ReplyReader(tokenizer, fmt, [], stop=["is"])
    parts = [reader.push(t) for t in ids(models["qwen3"], "<think> the answer is </think> so the answer is 42")]
    assert "".join(p.reasoning for p in parts) == "the answer is" and "".join(p.content for p in parts) == "so the answer "
    assert reader.stopped and reader.stop_string == "is" and reader.thinking_tokens == 3


class AnswerGrammar:
    """Stands in for a grammar (minillm.core.structured.Constraint): records what it is asked."""

    grammar = "start: ..."

    def __init__(self):
        self.masked, self.consumed = 0, []

    def apply(self, logits):
        self.masked += 1

    def consume(self, token):
        self.consumed.append(token)

    @property
    def finished(self):
        return False


def test_a_grammar_constrains_the_answer_not_the_thinking(models):
    tokenizer = Tokenizer(models["qwen3"])
    grammar = AnswerGrammar()
    control = ThinkingControl(tokenizer, reasoning_format(tokenizer), [], None, grammar)
    tokens = ids(models["qwen3"], THINK)
    for token in tokens[:-1]:
        control.apply(np.zeros(tokenizer.vocab_size, np.float32))
        control.consume(token)
    # the first token may open the thinking, whatever the grammar allows; after </think> it rules
    assert grammar.consumed == ids(models["qwen3"], "the answer is 42") and grammar.masked == 5
    # a budget forces the end of the thinking, then hands over to the grammar
    forced = ThinkingControl(tokenizer, reasoning_format(tokenizer), ids(models["qwen3"], "<think>"), 1, AnswerGrammar())
    logits = np.zeros(tokenizer.vocab_size, np.float32)
    forced.apply(logits)
    forced.consume(tokens[1])
    logits = np.zeros(tokenizer.vocab_size, np.float32)
    forced.apply(logits)
    assert np.flatnonzero(np.isfinite(logits)).tolist() == ids(models["qwen3"], "</think>")


def test_a_chat_template_file_replaces_the_models(models, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    with minillm.load(str(models["qwen3"]), ctx=256, progress=False, chat_template=str(template)) as llm, \
            running_server(create_app(llm, "t")) as base:
        assert httpx.post(base + "/apply-template", json={"messages": USER}).json() == {"prompt": "user: hello\nassistant:"}
    with pytest.raises(minillm.UsageError, match="chat-template: cannot read"):
        minillm.load(str(models["qwen3"]), ctx=256, progress=False, chat_template=str(tmp_path / "missing.jinja"))


def test_the_chat_command_shows_the_thinking_apart(models):
    command = [sys.executable, str(ROOT / "cli.py"), "chat", "--model", str(models["opened"]), "--prompt", "hello", "--max-tokens", "6",
               "--temperature", "0", "--show-thinking", "--thinking-budget", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    # two thinking tokens on stderr, then the answer alone on stdout
    thinking = done.stderr.strip().splitlines()[-1]
    assert len(thinking.split()) == 2 and thinking not in done.stdout
    bad = subprocess.run(command + ["--no-thinking"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
