"""The OpenAI-compatible server, driven by the official `openai` client over loopback."""

import json
import logging
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

try:  # the openai package brings httpx2 (same API) or httpx, depending on its version
    import httpx2 as httpx
except ImportError:
    import httpx
import openai
import pytest
from conftest import running_server, wait_until_healthy

import minillm
from minillm.serving.server import create_app

pytestmark = pytest.mark.slow  # the default model, servers or transformers: the full suite, not the quick tier

API_KEY = "test-key"


@pytest.fixture(scope="module")
def llm(default_model_dir):
    with minillm.load(default_model_dir, ctx=1024, max_batch=8, max_queue=256) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    with running_server(create_app(llm, "smollm2", API_KEY)) as base:
        wait_until_healthy(base, 30)
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


# ------------------------------------------------------------------ happy paths


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    text = httpx.get(server + "/metrics").text
    for name in ("minillm_requests_total", "minillm_generated_tokens_total", "minillm_queue_depth", "minillm_batch_size",
                 "minillm_time_to_first_token_seconds_sum", "minillm_request_latency_seconds_count"):
        assert f"\n{name} " in "\n" + text


def test_completion_matches_the_python_api(client, llm):
    prompt = "The capital of France is"
    result = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0)
    assert result.choices[0].text == llm.generate(prompt, max_tokens=12, temperature=0)
    assert result.choices[0].finish_reason in ("length", "stop")
    assert result.usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
    assert result.usage.completion_tokens == 12 or result.choices[0].finish_reason == "stop"


def test_completion_streaming_equals_non_streaming(client):
    kwargs = dict(model="smollm2", prompt="Once upon a time", max_tokens=20, temperature=0.9, seed=3)
    whole = client.completions.create(**kwargs).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs)]
    assert "".join(pieces) == whole and len(pieces) > 2


def test_chat_streaming_and_not(client, llm):
    messages = [{"role": "user", "content": "Name three colors."}]
    result = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=30, temperature=0)
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == llm.chat(messages, max_tokens=30, temperature=0)
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=30, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == result.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == result.usage.completion_tokens


def test_stop_strings(client):
    full = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0).choices[0]
    cut = client.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"]).choices[0]
    assert cut.text == full.text[: full.text.index(" 7")]
    assert cut.finish_reason == "stop"


def test_logprobs(client):
    result = client.completions.create(model="smollm2", prompt="Hello", max_tokens=5, temperature=0, logprobs=3)
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) == 3 and max(top.values()) <= 0 for top in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(abs(lp.token_logprobs[i] - max(lp.top_logprobs[i].values())) < 1e-9 for i in range(5))
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) >= 1 and all(len(c.top_logprobs) == 2 for c in content)


def test_penalties_are_accepted(client):
    result = client.completions.create(model="smollm2", prompt="The the the the", max_tokens=8, temperature=0,
                                       presence_penalty=1.5, frequency_penalty=1.0)
    assert result.choices[0].text


# ------------------------------------------------------------------ errors through the SDK


def test_context_length_exceeded(client):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            result = client.completions.create(model="smollm2", prompt="hello", max_tokens=5000, stream=stream)
            list(result) if stream else None
        assert info.value.code == "context_length_exceeded"


def test_wrong_api_key(server):
    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_queue_full(client, llm):
    llm.engine.max_queue, saved = -llm.engine.max_batch, llm.engine.max_queue  # no free slot, no waiting room
    try:
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="smollm2", prompt="hi", max_tokens=2)
    finally:
        llm.engine.max_queue = saved


def test_unknown_route(server, client):
    response = httpx.get(server + "/v1/nothing-here", headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 404
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        client.get("/nothing-here", cast_to=object)


def test_error_during_a_stream(client, monkeypatch):
    import minillm.core.engine as engine_module
    from minillm.errors import GenerationError

    real = engine_module.sample

    def failing(logits, params, *args):
        if params.seed == 999:
            raise GenerationError("the model produced NaN logits; refusing to sample")
        return real(logits, params, *args)

    monkeypatch.setattr(engine_module, "sample", failing)
    with pytest.raises(openai.APIError):
        list(client.completions.create(model="smollm2", prompt="hi", max_tokens=5, seed=999, stream=True))
    assert client.completions.create(model="smollm2", prompt="hi", max_tokens=2, seed=1).choices[0].text is not None


MALFORMED = {
    "bad JSON": '{"model": "smollm2", "prompt": "hi",',
    "prompt of wrong type": {"prompt": {"text": "hi"}},
    "max_tokens a string": {"prompt": "hi", "max_tokens": "ten"},
    "negative max_tokens": {"prompt": "hi", "max_tokens": -5},
    "huge max_tokens": {"prompt": "hi", "max_tokens": 10**12},
    "NaN temperature": '{"prompt": "hi", "temperature": NaN}',
    "negative temperature": {"prompt": "hi", "temperature": -0.5},
    "top_p zero": {"prompt": "hi", "top_p": 0},
    "top_p above one": {"prompt": "hi", "top_p": 1.5},
    "n above sixteen": {"prompt": "hi", "n": 17},
    "token ids outside the vocabulary": {"prompt": [1, 2, 10**9]},
    "negative token id": {"prompt": [1, -2]},
    "empty prompt": {"prompt": ""},
    "1 MB prompt": {"prompt": "a" * 1_000_000},
}
MALFORMED_CHAT = {
    "empty messages": {"messages": []},
    "role-less message": {"messages": [{"content": "hi"}]},
    "unknown role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "messages not a list": {"messages": "hi"},
    "top_logprobs too many": {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 99},
}


@pytest.mark.parametrize("case", list(MALFORMED) + [f"chat: {c}" for c in MALFORMED_CHAT])
def test_malformed_requests_get_400(server, client, case):
    if case.startswith("chat: "):
        url, body = "/v1/chat/completions", MALFORMED_CHAT[case[6:]]
    else:
        url, body = "/v1/completions", MALFORMED[case]
    data = body if isinstance(body, str) else json.dumps({"model": "smollm2", **body})
    response = httpx.post(server + url, content=data, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    # and the server keeps serving
    assert client.completions.create(model="smollm2", prompt="ok", max_tokens=1).choices


# ------------------------------------------------------------------ concurrency


def test_eight_concurrent_streaming_clients_get_what_they_would_alone(client):
    """8 clients x 10 streaming requests at once: every output equals the request served alone."""
    requests = [
        dict(prompt=f"Story {i}: once upon a time in the land of {word}", max_tokens=12,
             temperature=0 if i % 2 else 0.9, seed=None if i % 2 else i)
        for i, word in enumerate(["oak", "sand", "ice", "fire", "rain", "glass", "salt", "iron", "moss", "silk"])
    ]

    def run(req):
        stream = client.completions.create(model="smollm2", stream=True, **req)
        return "".join(c.choices[0].text for c in stream)

    alone = [run(r) for r in requests]
    started = time.time()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda job: (job[1], run(requests[job[1]])), [(c, i) for c in range(8) for i in range(10)]))
    assert time.time() - started < 300
    assert len(results) == 80
    for i, text in results:
        assert text == alone[i], f"request {i} differed when batched"


def test_disconnect_frees_the_slot(server, llm):
    before = llm.engine.stats.generated_tokens
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                         json={"model": "smollm2", "prompt": "Count to a thousand: 1, 2,", "max_tokens": 900, "stream": True}) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i > 6:
                    break  # leaving the block closes the connection mid-stream
    deadline = time.time() + 5
    while llm.engine.batch_size and time.time() < deadline:
        time.sleep(0.01)
    assert llm.engine.batch_size == 0
    assert llm.engine.stats.generated_tokens - before < 200  # stopped long before 900


def test_two_python_threads_do_not_mix(llm):
    prompts = ["The sun is", "My favourite food is"]
    alone = [llm.generate(p, max_tokens=16, temperature=0) for p in prompts]
    results = {}

    def worker(i):
        results[i] = [llm.generate(prompts[i], max_tokens=16, temperature=0) for _ in range(3)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == {0: [alone[0]] * 3, 1: [alone[1]] * 3}


# ------------------------------------------------------------------ prefix cache


def _metric(server, name: str) -> float:
    for line in httpx.get(server + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def test_chat_turns_reuse_the_history_and_report_cached_tokens(server, client):
    """Each turn resends the conversation: the later turns find it in the prefix cache, say so in
    usage (streamed too), and answer exactly as the engine without a cache would."""
    system = "You are a terse assistant. " + " ".join(f"Rule {i}: answer in plain words." for i in range(40))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Name a color."}]
    first = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0 or first.usage.prompt_tokens > 300
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And another?"}]
    hits_before = _metric(server, "minillm:prefix_cache_hits_total")
    second = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 32 and cached < second.usage.prompt_tokens
    assert _metric(server, "minillm:prefix_cache_hits_total") - hits_before == cached
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == second.choices[0].message.content
    for gauge in ("minillm:num_requests_waiting", "minillm:num_requests_running", "minillm:kv_cache_usage_perc"):
        assert _metric(server, gauge) >= 0


# ------------------------------------------------------------------ loading and shutdown


def test_loading_answers_503_then_serves(llm):
    """Before the model is attached: /health and every endpoint say 503; after, they serve."""
    from fastapi.testclient import TestClient

    app = create_app(None, "smollm2", API_KEY)
    with TestClient(app, base_url="http://localhost") as http:
        assert http.get("/health").status_code == 503 and http.get("/health").json() == {"status": "loading"}
        refused = http.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_loading"
        app.state.service.attach(llm)
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def _sigterm_mid_stream(default_model_dir, max_tokens: int, *flags: str) -> tuple[list[str], int]:
    """`cli.py serve` streaming a completion of max_tokens; SIGTERM after the third event. The
    events' data and the process's exit code."""
    import signal
    import subprocess
    import sys

    from conftest import ROOT, free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "serve", "--model", str(default_model_dir),
                             "--port", str(port), *flags], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until_healthy(base, 120)
        body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0}
        events = []
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        assert "Traceback" not in proc.stderr.read()
        return events, code
    finally:
        proc.kill()
        proc.wait()


def test_sigterm_lets_a_running_stream_finish(default_model_dir):
    """`cli.py serve` on SIGTERM stops accepting but finishes the stream in flight, then exits."""
    import signal

    events, code = _sigterm_mid_stream(default_model_dir, 48, "--ctx", "512")
    assert events[-1] == "[DONE]"
    assert sum(len(json.loads(e)["choices"]) for e in events[:-1]) >= 40  # every piece arrived
    assert code in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it is done


def test_sigterm_ends_an_unfinished_stream_with_an_error_and_done(default_model_dir):
    """A stream still running when --shutdown-timeout ends gets an error event, then [DONE]."""
    import signal

    events, code = _sigterm_mid_stream(default_model_dir, 2000, "--ctx", "2048", "--shutdown-timeout", "2")
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down" and "shutting down" in error["message"]
    assert code in (0, -signal.SIGTERM)


# ------------------------------------------------------------------ structured output and more endpoints

SCHEMAS = {
    "nested": {"type": "object", "required": ["name", "address"], "properties": {
        "name": {"type": "string", "maxLength": 30},
        "address": {"type": "object", "required": ["city", "zip"], "properties": {
            "city": {"type": "string", "maxLength": 30}, "zip": {"type": "integer", "minimum": 0, "maximum": 99999}}}}},
    "enums": {"type": "object", "required": ["color", "size"], "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]}}},
    "numbers": {"type": "object", "required": ["values"], "properties": {
        "values": {"type": "array", "minItems": 1, "maxItems": 5, "items": {"type": "number", "minimum": 0, "maximum": 100}}}},
}


def test_json_schema_replies_always_validate(client):
    """20 requests over 3 schemas, greedy and sampled, streamed and not: every reply parses and
    validates."""
    import jsonschema

    names = list(SCHEMAS)
    for i in range(20):
        schema = SCHEMAS[names[i % 3]]
        kwargs = dict(model="smollm2", max_tokens=160, temperature=0 if i % 2 else 0.9, seed=i,
                      messages=[{"role": "user", "content": f"Give me example {i} as JSON."}],
                      response_format={"type": "json_schema", "json_schema": {"name": names[i % 3], "schema": schema, "strict": True}})
        if i % 4 < 2:
            text = client.chat.completions.create(**kwargs).choices[0].message.content
        else:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs) if c.choices)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_grammar_extension(client):
    reply = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true}.'}],
                                           max_tokens=200, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    regex = client.completions.create(model="smollm2", prompt="My phone number is", max_tokens=20, temperature=0,
                                      extra_body={"grammar": {"type": "regex", "grammar": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", regex.choices[0].text)
    gbnf = client.completions.create(model="smollm2", prompt="Answer yes or no:", max_tokens=5, temperature=0,
                                     extra_body={"grammar": 'root ::= " yes" | " no"'})
    assert gbnf.choices[0].text in (" yes", " no")


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}}, "response_format.json_schema.schema"),
    ({"grammar": {"type": "lark", "grammar": "start: (("}}, "grammar.grammar"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]}, "tools[0].function.parameters"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"n": 17}, "n"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
])
def test_fields_that_cannot_be_honoured_are_400(server, body, param):
    payload = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    response = httpx.post(server + "/v1/chat/completions", json=payload, headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_fields_outside_the_schema_are_accepted_and_named_in_the_log_once(client, caplog):
    """OpenAI's store and metadata, or a misspelt field: accepted (as vLLM does), and named once."""
    with caplog.at_level(logging.WARNING, logger="minillm.server"):
        for _ in range(2):
            reply = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                                   store=True, metadata={"team": "a"}, extra_body={"tempreture_x": 0.5})
            assert reply.choices[0].finish_reason == "length"
    named = [r.getMessage() for r in caplog.records if r.name == "minillm.server" and "tempreture_x" in r.getMessage()]
    assert len(named) == 1 and "accepted, ignored" in named[0]


def test_suffix_fills_in_the_middle_where_the_tokenizer_has_the_markers(default_model_dir, tmp_path, llm):
    """completions' suffix: <fim_prefix> prompt <fim_suffix> suffix <fim_middle>, then the model's
    continuation (here the default model's weights with three added tokens renamed to the markers,
    so the prompt's tokens can be checked; the model itself was not trained to fill in)."""
    from fastapi.testclient import TestClient

    assert llm.tokenizer.fill_in_middle is None  # SmolLM2's tokenizer has no markers: suffix stays a 400 there
    model_dir = tmp_path / "fim"
    shutil.copytree(default_model_dir, model_dir)
    text = (model_dir / "tokenizer.json").read_text()
    for old, new in (("<jupyter_start>", "<fim_prefix>"), ("<jupyter_text>", "<fim_suffix>"), ("<jupyter_code>", "<fim_middle>")):
        text = text.replace(f'"{old}"', f'"{new}"')
    (model_dir / "tokenizer.json").write_text(text)
    fim = minillm.load(model_dir, ctx=512)
    pre, suf, mid = fim.tokenizer.fill_in_middle
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    ids = [pre] + fim.tokenizer.encode(prefix, add_special_tokens=False) + [suf] + fim.tokenizer.encode(suffix, add_special_tokens=False) + [mid]
    with fim, TestClient(create_app(fim, "fim"), base_url="http://localhost") as http:
        reply = http.post("/v1/completions", json={"prompt": prefix, "suffix": suffix, "max_tokens": 8, "temperature": 0}).json()
        assert reply["usage"]["prompt_tokens"] == len(ids)
        assert reply["choices"][0]["text"] == fim.generate(ids, max_tokens=8, temperature=0)
        refused = http.post("/v1/completions", json={"prompt": prefix, "suffix": suffix, "echo": True, "max_tokens": 2})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "suffix"


def test_logit_bias_and_echo(client, llm):
    banned = llm.tokenizer.encode(" Paris")[0]
    plain = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=3, temperature=0)
    biased = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=3, temperature=0,
                                       logit_bias={str(banned): -100})
    assert plain.choices[0].text.startswith(" Paris") and not biased.choices[0].text.startswith(" Paris")
    echoed = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + plain.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(server, client, llm):
    """echo + logprobs (how lm-evaluation-harness scores a continuation): the prompt's tokens come
    first, the first without a logprob, each later one with the logprob generation gives it there;
    max_tokens 0 scores only; a list of token-id prompts gives choices prompt by prompt; streamed,
    the first chunk carries the same."""
    from minillm.core.sampling import SamplingParams

    prompt = "The capital of France is"
    ids = llm.tokenizer.encode(prompt)
    greedy = client.completions.create(model="smollm2", prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    continuation = [e.token for e in llm.engine.submit(ids, SamplingParams(temperature=0.0), 6)]
    whole = ids + continuation
    scored = client.completions.create(model="smollm2", prompt=whole, max_tokens=0, echo=True, logprobs=2)
    choice, lp = scored.choices[0], scored.choices[0].logprobs
    assert choice.finish_reason == "length" and scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(whole)
    assert choice.text == llm.tokenizer.decode(whole) and len(lp.tokens) == len(whole)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[len(ids):] == greedy.choices[0].logprobs.token_logprobs
    assert lp.top_logprobs[len(ids):] == greedy.choices[0].logprobs.top_logprobs
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    cases = [(ids, continuation), (ids, llm.tokenizer.encode(" London is"))]
    batch = client.completions.create(model="smollm2", prompt=[c + k for c, k in cases], max_tokens=1, echo=True, logprobs=1,
                                      temperature=0, seed=1234)
    assert [c.index for c in batch.choices] == [0, 1] and batch.usage.prompt_tokens == sum(len(c + k) for c, k in cases)
    results = []
    for (context, following), c in zip(cases, batch.choices):  # as lm-evaluation-harness reads them
        logprobs, tops = c.logprobs.token_logprobs[len(context) : -1], c.logprobs.top_logprobs[len(context) : -1]
        assert len(logprobs) == len(following)
        results.append((sum(logprobs), all(lp == max(top.values()) for lp, top in zip(logprobs, tops))))
    assert results[0][1] and not results[1][1] and results[0][0] > results[1][0]

    kwargs = dict(model="smollm2", prompt=prompt, max_tokens=3, temperature=0)
    chunks = list(client.completions.create(echo=True, logprobs=2, stream=True, **kwargs))
    first = chunks[0].choices[0]
    assert first.text == prompt and first.logprobs.token_logprobs == lp.token_logprobs[: len(ids)]
    assert "".join(c.choices[0].text for c in chunks) == prompt + client.completions.create(**kwargs).choices[0].text
    two = client.completions.create(model="smollm2", prompt=["One", "Two"], max_tokens=2, n=2, seed=5)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    for body, param in (({"prompt": "x", "max_tokens": 0}, "max_tokens"), ({"prompt": ["x"] * 65, "max_tokens": 1}, "prompt")):
        response = httpx.post(server + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_best_of_returns_the_likeliest_of_its_samples(server, client):
    """best_of = 4, n = 2, seed 3: the candidates are the seeded requests 3..6, and the two with the
    highest summed logprob come back, in candidate order; suffix and streamed best_of are 400s."""
    kwargs = dict(model="smollm2", prompt="Once upon a time", max_tokens=6, temperature=1.0)
    alone = [client.completions.create(seed=3 + i, logprobs=0, **kwargs).choices[0] for i in range(4)]
    likeliest = sorted(sorted(range(4), key=lambda i: -sum(alone[i].logprobs.token_logprobs))[:2])
    best = client.completions.create(seed=3, n=2, best_of=4, **kwargs)
    assert [c.index for c in best.choices] == [0, 1] and [c.logprobs for c in best.choices] == [None, None]
    assert [c.text for c in best.choices] == [alone[i].text for i in likeliest]
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in alone)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for body, param in (({"suffix": "The end."}, "suffix"), ({"best_of": 2, "stream": True}, "best_of"), ({"best_of": 1, "n": 2}, "best_of")):
        response = httpx.post(server + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **body}, headers=headers)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_tokenize_detokenize_round_trip(server):
    import random

    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz ABCDEFG0123456789.,;:!?'\"\n\té€日本😀-_()[]{}<>/"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for _ in range(100):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        tokens = httpx.post(server + "/tokenize", json={"content": text}, headers=headers).json()["tokens"]
        assert httpx.post(server + "/detokenize", json={"tokens": tokens}, headers=headers).json() == {"content": text, "prompt": text}
    pieces = httpx.post(server + "/tokenize", json={"content": "Hello world", "with_pieces": True}, headers=headers).json()
    assert "".join(p["piece"] for p in pieces["tokens"]) == "Hello world"
    # vLLM's shapes, which lm-evaluation-harness's remote tokenizer uses
    vllm = httpx.post(server + "/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}, headers=headers).json()
    assert vllm["tokens"] == [p["id"] for p in pieces["tokens"]] and vllm["count"] == len(vllm["tokens"])
    info = httpx.get(server + "/tokenizer_info", headers=headers).json()
    assert info["eos_token"] and info["chat_template"] and info["model_max_length"] == 1024
    both = httpx.post(server + "/tokenize", json={"prompt": "a", "content": "b"}, headers=headers)
    assert both.status_code == 400 and both.json()["error"]["param"] == "content"


def test_embeddings_of_a_batch_equal_each_alone(client):
    import base64

    import numpy as np

    texts = ["The lighthouse keeper", "A storm at sea", "Bread and butter"]
    batch = client.embeddings.create(model="smollm2", input=texts).data
    for text, item in zip(texts, batch):
        alone = client.embeddings.create(model="smollm2", input=text).data[0].embedding
        assert item.embedding == alone
        assert abs(np.linalg.norm(alone) - 1) < 1e-5
    raw = client.embeddings.create(model="smollm2", input=texts[:1], encoding_format="base64")
    vector = raw.data[0].embedding
    if isinstance(vector, str):  # the client may hand base64 through or decode it
        vector = np.frombuffer(base64.b64decode(vector), "<f4").tolist()
    assert np.allclose(vector, batch[0].embedding, atol=0)


def test_n_choices_are_the_seeded_samples_and_share_the_prompt(server, client):
    """n = 3 with a seed: choice i is the request with seed + i; streamed the same; the later
    choices reuse the prompt's cached blocks."""
    prompt = "Once upon a time, in a land far away, " * 12
    alone = [client.completions.create(model="smollm2", prompt=prompt, max_tokens=10, temperature=0.9, seed=7 + i).choices[0].text
             for i in range(3)]
    hits = _metric(server, "minillm:prefix_cache_hits_total")
    both = client.completions.create(model="smollm2", prompt=prompt, max_tokens=10, temperature=0.9, seed=7, n=3)
    assert [c.index for c in both.choices] == [0, 1, 2] and [c.text for c in both.choices] == alone
    assert 3 <= both.usage.completion_tokens <= 30 and both.usage.prompt_tokens < 150  # the prompt counted once
    assert _metric(server, "minillm:prefix_cache_hits_total") > hits
    pieces = ["", "", ""]
    for chunk in client.completions.create(model="smollm2", prompt=prompt, max_tokens=10, temperature=0.9, seed=7, n=3, stream=True):
        for c in chunk.choices:
            pieces[c.index] += c.text
    assert pieces == alone
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi."}], max_tokens=6,
                                          temperature=0.9, seed=3, n=2)
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.content for c in chat.choices)


def test_a_restart_with_a_cache_dir_reuses_an_earlier_conversation(default_model_dir, tmp_path):
    """`serve --cache-dir`: the prefix cache written at shutdown is read at the next start, so an
    earlier conversation's next request reads its prefix from the cache, with the same reply."""
    import signal
    import subprocess
    import sys

    from conftest import ROOT, free_port

    history = [{"role": "system", "content": "You are a helpful assistant who knows lighthouses. " * 12},
               {"role": "user", "content": "Why do lighthouses have different light patterns?"}]
    body = {"messages": history, "max_tokens": 24, "temperature": 0}

    def session() -> list[dict]:
        port = free_port()
        proc = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "serve", "--model", str(default_model_dir), "--port", str(port),
                                 "--ctx", "1024", "--cache-dir", str(tmp_path / "kv")], cwd=ROOT, stderr=subprocess.PIPE, text=True)
        base = f"http://127.0.0.1:{port}"
        try:
            assert wait_until_healthy(base, 120)
            replies = [httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()]
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
            assert "Traceback" not in proc.stderr.read()
            return replies
        finally:
            proc.kill()
            proc.wait()

    first = session()[0]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert list((tmp_path / "kv").glob("prefix-*.kv"))
    again = session()[0]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 32
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
