"""The OpenAI-compatible server, driven by the official `openai` client over loopback."""

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

try:  # the openai package brings httpx2 (same API) or httpx, depending on its version
    import httpx2 as httpx
except ImportError:
    import httpx
import openai
import pytest

import minillm
from minillm.server import create_app

API_KEY = "test-key"


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return minillm.load(default_model_dir, ctx=1024, max_batch=8, max_queue=256)


@pytest.fixture(scope="module")
def server(llm):
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(create_app(llm, "smollm2", API_KEY), host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield base
    srv.should_exit = True
    thread.join(timeout=10)


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
    llm.engine.max_queue, saved = 0, llm.engine.max_queue
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
    import minillm.engine as engine_module
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
    "n above one": {"prompt": "hi", "n": 3},
    "token ids outside the vocabulary": {"prompt": [1, 2, 10**9]},
    "negative token id": {"prompt": [1, -2]},
    "empty prompt": {"prompt": ""},
    "10 MB prompt": {"prompt": "a" * 10_000_000},
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
