"""Several models in one server and Ollama's API, through the official `ollama` client: two
models (the default model's checkpoint and its Q4_1 GGUF) routed by name, loaded on first use,
unloaded by keep_alive 0, an idle timeout or --max-loaded; Ollama's replies equal the OpenAI
endpoints' for the same request."""

import json
import time

import numpy as np
import ollama
import openai
import pytest
from conftest import running_server

import minillm
from minillm.options import Options
from minillm.serving.ollama_protocol import OllamaError, chat_messages, keep_alive_seconds, sampling
from minillm.serving.server import server_app

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 24}


@pytest.fixture
def two_models(default_model_dir, default_gguf):
    """A server holding the default model as "smol" (float32 checkpoint) and "smol-q4" (its GGUF),
    neither loaded yet: yields (base URL, its ModelSet)."""
    made = []

    def start(**settings):
        app, models = server_app(lambda opts: minillm.load(options=opts, progress=False), Options(**settings),
                                 [f"smol={default_model_dir}", f"smol-q4={default_gguf}"])
        made.append(models)
        return app, models

    yield start
    for models in made:
        models.close_all()


@pytest.mark.slow  # the default model, twice
def test_two_models_by_name_through_the_ollama_client(two_models):
    app, models = two_models()
    with running_server(app) as base:
        client = ollama.Client(host=base)
        assert [m.model for m in client.list().models] == ["smol", "smol-q4"]
        assert client.ps().models == []  # nothing is loaded before it is asked for

        reply = client.chat(model="smol", messages=QUESTION, options=GREEDY)
        oai = openai.OpenAI(base_url=base + "/v1", api_key="none")
        same = oai.chat.completions.create(model="smol", messages=QUESTION, temperature=0, max_tokens=24)
        assert reply.message.content == same.choices[0].message.content and "Paris" in reply.message.content
        assert reply.done and reply.eval_count == same.usage.completion_tokens and reply.prompt_eval_count == same.usage.prompt_tokens

        streamed = list(client.chat(model="smol", messages=QUESTION, options=GREEDY, stream=True))
        assert "".join(p.message.content for p in streamed) == reply.message.content
        assert [p.done for p in streamed][-1] and not any(p.done for p in streamed[:-1])

        other = client.chat(model="smol-q4", messages=QUESTION, options=GREEDY)
        assert other.message.content == oai.chat.completions.create(model="smol-q4", messages=QUESTION, temperature=0,
                                                                     max_tokens=24).choices[0].message.content
        assert sorted(m.model for m in client.ps().models) == ["smol", "smol-q4"]
        assert {m["id"]: m["loaded"] for m in oai.models.list().model_dump()["data"]} == {"smol": True, "smol-q4": True}

        generated = client.generate(model="smol", prompt="What is the capital of France?", options=GREEDY)
        assert generated.response == reply.message.content  # the prompt through the chat template, as Ollama does
        raw = client.generate(model="smol", prompt="The capital of France is", raw=True, options=GREEDY)
        assert raw.response == oai.completions.create(model="smol", prompt="The capital of France is", temperature=0, max_tokens=24).choices[0].text

        embedded = client.embed(model="smol", input=["a lighthouse", "the sea"])
        assert np.array(embedded.embeddings).shape == (2, 576)
        reference = np.array(oai.embeddings.create(model="smol", input=["a lighthouse", "the sea"]).data[0].embedding)
        np.testing.assert_allclose(embedded.embeddings[0], reference / np.linalg.norm(reference), rtol=1e-6, atol=1e-7)

        shown = client.show("smol-q4")
        assert shown.details.family == "llama" and shown.details.format == "gguf" and shown.details.quantization_level == "Q4_1"
        assert "completion" in shown.capabilities and "im_start" in shown.template

        unloaded = client.generate(model="smol", keep_alive=0)
        assert unloaded.done_reason == "unload" and [m.model for m in client.ps().models] == ["smol-q4"]
        assert client.chat(model="smol", messages=QUESTION, options=GREEDY).message.content == reply.message.content  # loaded again
        assert "smol" in [m.model for m in client.ps().models]

        for call in (lambda: client.chat(model="llama3.2", messages=QUESTION), lambda: client.show("llama3.2")):
            with pytest.raises(ollama.ResponseError) as missing:
                call()
            assert missing.value.status_code == 404 and "not found" in missing.value.error
        with pytest.raises(openai.NotFoundError):
            oai.chat.completions.create(model="llama3.2", messages=QUESTION)
        with pytest.raises(ollama.ResponseError) as thinking:
            client.chat(model="smol", messages=QUESTION, think=True)
        assert thinking.value.status_code == 400 and "does not support thinking" in thinking.value.error


@pytest.mark.slow  # the default model, twice
def test_a_tool_conversation_and_a_schema_through_ollama(two_models):
    app, _ = two_models()
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    history = [{"role": "user", "content": "What is the weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
               {"role": "tool", "content": "sunny, 20 C", "tool_name": "get_weather"}]
    with running_server(app) as base:
        client = ollama.Client(host=base)
        reply = client.chat(model="smol", messages=history, tools=tools, options={"temperature": 0, "num_predict": 40})
        assert reply.done and (reply.message.content or reply.message.tool_calls)
        for call in reply.message.tool_calls or ():
            assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
        answer = client.chat(model="smol", messages=[{"role": "user", "content": "Name a city as JSON."}], format=schema,
                             options={"temperature": 0, "num_predict": 60})
        assert set(json.loads(answer.message.content)) == {"city"}


@pytest.mark.slow  # the default model, twice
def test_room_is_made_for_a_model_and_idle_ones_unload(two_models):
    app, models = two_models(max_loaded=1, idle_unload=1.5)
    with running_server(app) as base:
        client = ollama.Client(host=base)
        client.chat(model="smol", messages=QUESTION, options=GREEDY)
        client.chat(model="smol-q4", messages=QUESTION, options=GREEDY)
        assert [m.model for m in client.ps().models] == ["smol-q4"]  # --max-loaded 1: smol made room
        deadline = time.monotonic() + 10
        while client.ps().models and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.ps().models == []  # idle 1.5 s: unloaded
        client.chat(model="smol", messages=QUESTION, options=GREEDY, keep_alive=-1)
        time.sleep(2.5)
        assert [m.model for m in client.ps().models] == ["smol"]  # keep_alive -1: kept past the idle timeout
    app, models = two_models(max_loaded_mb=600)  # the float32 checkpoint's 515 MB and the Q4_1 file's 98 do not fit together
    with running_server(app) as base:
        client = ollama.Client(host=base)
        client.chat(model="smol", messages=QUESTION, options=GREEDY)
        client.chat(model="smol-q4", messages=QUESTION, options=GREEDY)
        assert [m.model for m in client.ps().models] == ["smol-q4"]


# Ollama's fields as OpenAI's, without a model

def test_ollama_fields_read_as_the_openai_request_means_them():
    assert keep_alive_seconds("5m") == 300 and keep_alive_seconds("1h30m") == 5400 and keep_alive_seconds(0) == 0
    assert keep_alive_seconds(-1) == -1 and keep_alive_seconds("-1m") == -1 and keep_alive_seconds(None) is None
    with pytest.raises(OllamaError, match="not a duration"):
        keep_alive_seconds("soon")
    assert sampling({"num_predict": 12, "repeat_penalty": 1.1, "seed": 3, "num_gpu": 99}) == dict(
        temperature=0.8, top_k=40, top_p=0.9, max_tokens=12, repetition_penalty=1.1, seed=3)
    with pytest.raises(OllamaError, match="options.mirostat_mode is not supported"):
        sampling({"mirostat_mode": 2})
    assert sampling({"mirostat": 0, "typical_p": 1.0, "tfs_z": 1}) == dict(temperature=0.8, top_k=40, top_p=0.9)  # their off values
    for name, value in (("mirostat", 2), ("typical_p", 0.9), ("tfs_z", 0.95), ("repeat_last_n", 64), ("penalize_newline", True)):
        with pytest.raises(OllamaError, match=f"options.{name} is not supported"):
            sampling({name: value})
    messages = chat_messages([{"role": "user", "content": "hi"},
                              {"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": {"x": 1}}},
                                                                   {"function": {"name": "b", "arguments": {}}}]},
                              {"role": "tool", "content": "B", "tool_name": "b"}, {"role": "tool", "content": "A"}])
    assert messages[1]["tool_calls"][0] == {"id": "call_0", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}}
    assert [m.get("tool_call_id") for m in messages[2:]] == ["call_1", "call_0"]
    with pytest.raises(OllamaError, match="images are not supported"):
        chat_messages([{"role": "user", "content": "what is this?", "images": ["aGk="]}])


@pytest.mark.slow
def test_serve_takes_a_models_directory_and_names_each_model(tmp_path, default_gguf):
    import subprocess
    import sys

    from conftest import ROOT, free_port, httpx, wait_until_healthy

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "smol-q4.gguf").symlink_to(default_gguf)
    (tmp_path / "models" / "mmproj-smol.gguf").symlink_to(default_gguf)  # a vision projector: not a model
    (tmp_path / "models" / "notes.txt").write_text("not a model")
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "serve", "--models-dir", str(tmp_path / "models"), "--model",
                             f"copy={default_gguf}", "--port", str(port)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_until_healthy(base, 60)
        assert [(m["id"], m["loaded"]) for m in httpx.get(base + "/v1/models").json()["data"]] == [("copy", False), ("smol-q4", False)]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert "minillm serving copy, smol-q4 (each loaded on first use)" in proc.stderr.read()
    missing = subprocess.run([sys.executable, str(ROOT / "cli.py"), "serve", "--model", "a=weights/none.gguf", "--model", f"b={default_gguf}"],
                             capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert missing.returncode == 2 and missing.stderr.strip() == ("error: --model a=weights/none.gguf: no such file or directory, "
                                                                   "nor a Hub name (ORG/NAME)")
