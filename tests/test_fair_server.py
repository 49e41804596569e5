"""A server that stays fair under real traffic: chunked prefill beside running streams, work that
stops when its client leaves, the Gate before the body, and no 500s from any input."""

import json
import threading
import time

try:  # the openai package brings httpx2 (same API) or httpx, depending on its version
    import httpx2 as httpx
except ImportError:
    import httpx
import numpy as np
import openai
import pytest
from conftest import running_server, wait_until_healthy

import minillm
from minillm.core.sampling import SamplingParams
from minillm.options import DEFAULTS
from minillm.serving.server import create_app

pytestmark = pytest.mark.slow  # the default model and servers

API_KEY = "fair-key"
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def llm(default_model_dir):
    with minillm.load(default_model_dir, ctx=4096, max_batch=4, max_queue=8, cache_mb=0) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    with running_server(create_app(llm, "smollm2", API_KEY, DEFAULTS.replace(max_body_mb=4))) as base:
        assert wait_until_healthy(base, 30)
        yield base


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


# ------------------------------------------------------------------ chunked prefill


def _stream(llm, prompt, n):
    handle = llm.engine.submit(prompt, GREEDY, n, ())
    times, tokens = [], []
    for event in handle:
        times.append(time.perf_counter())
        tokens.append(event.token)
    return tokens, np.diff(times)


def _long_prompt(llm, n=3990):
    return (llm.tokenizer.encode("The history of the sea is long and full of stories about ships. ") * 400)[:n]


@pytest.mark.parametrize("kind", ["prompt", "embedding"])
def test_a_long_prompt_does_not_stall_running_streams(llm, kind):
    """Two streams run; a ~4,000-token prompt (or embeddings input) arrives: the longest gap
    between the streams' tokens stays within 3x their median, and every output equals its run
    alone (the chunked prompt's too)."""
    shorts = [llm.tokenizer.encode("Once upon a time"), llm.tokenizer.encode("My favourite food is")]
    long_ids = _long_prompt(llm)
    alone = [_stream(llm, p, 120)[0] for p in shorts]
    long_alone = _stream(llm, long_ids, 4)[0] if kind == "prompt" else llm.embed([long_ids])[0]
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _stream(llm, shorts[i], 120))) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # both streams decoding
    steps_before = llm.engine.stats.prefill_steps
    long_out = _stream(llm, long_ids, 4)[0] if kind == "prompt" else llm.embed([long_ids])[0]
    for t in threads:
        t.join(timeout=300)
    if kind == "prompt":
        assert long_out == long_alone
    else:
        assert np.array_equal(long_out, long_alone)
    assert llm.engine.stats.prefill_steps - steps_before > 4  # read in chunks beside the decodes
    for i in range(2):
        tokens, gaps = results[i]
        assert tokens == alone[i]
        assert gaps.max() <= 3 * np.median(gaps), f"stream {i}: longest gap {gaps.max():.3f} s, median {np.median(gaps):.3f} s"


def test_prompts_read_in_chunks_equal_prompts_read_whole(llm):
    """A fixed small chunk (several steps per prompt) gives the tokens a whole prefill gives."""
    prompt = _long_prompt(llm, 700)
    whole = llm.generate(prompt, max_tokens=8, temperature=0)
    saved = llm.engine.prefill_chunk
    llm.engine.prefill_chunk = 37
    try:
        assert llm.generate(prompt, max_tokens=8, temperature=0) == whole
    finally:
        llm.engine.prefill_chunk = saved


def test_inter_token_latency_is_a_histogram(server, llm):
    text = httpx.get(server + "/metrics").text
    assert "# TYPE minillm:inter_token_latency_seconds histogram" in text
    assert 'minillm:inter_token_latency_seconds_bucket{le="+Inf"}' in text


# ------------------------------------------------------------------ cancellation


def test_a_non_streamed_request_stops_when_its_client_leaves(server, llm):
    cancelled = _metric(server, "minillm_requests_cancelled_total")
    body = {"model": "smollm2", "prompt": "Count to a thousand: 1, 2,", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server + "/v1/completions", json=body, headers=AUTH, timeout=1.5)
    deadline = time.time() + 5
    while llm.engine.batch_size and time.time() < deadline:
        time.sleep(0.02)
    assert llm.engine.batch_size == 0
    generated = _metric(server, "minillm_generated_tokens_total")
    time.sleep(0.5)
    assert _metric(server, "minillm_generated_tokens_total") == generated  # stopped rising
    assert _metric(server, "minillm_requests_cancelled_total") == cancelled + 1


def test_an_embeddings_job_stops_when_its_client_leaves(server, llm):
    before = llm.engine.stats.prompt_tokens
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server + "/v1/embeddings", json={"input": [_long_prompt(llm, 4000)] * 4}, headers=AUTH, timeout=1.0)
    deadline = time.time() + 5
    while llm.engine.batch_size and time.time() < deadline:
        time.sleep(0.02)
    assert llm.engine.batch_size == 0
    assert llm.engine.stats.prompt_tokens - before < 4000  # not one of the inputs was read whole


def test_a_request_cancelled_while_queued_counts_as_cancelled(llm):
    stats = llm.engine.stats
    before = (stats.requests, stats.finished, stats.cancelled)
    running = [llm.engine.submit([1, 2, 3], GREEDY, 200, ()) for _ in range(llm.engine.max_batch)]
    queued = llm.engine.submit([1, 2, 3], GREEDY, 5, ())
    queued.cancel()
    for h in running:
        h.cancel()
    assert list(queued) == [] and queued.finish_reason == "cancelled"
    for h in running:
        list(h)
    assert stats.requests - before[0] == len(running) + 1
    assert stats.cancelled - before[2] == len(running) + 1
    assert stats.finished == before[1]


def test_a_burst_fills_every_free_slot_and_the_queue(llm):
    """All at once, max_batch free slots plus max_queue waiting places are accepted."""
    from minillm.core.engine import QueueFullError

    engine = llm.engine
    accepted, refused = [], 0
    for _ in range(engine.max_batch + engine.max_queue + 5):
        try:
            accepted.append(engine.submit([1, 2, 3], GREEDY, 500, ()))
        except QueueFullError:
            refused += 1
    for h in accepted:
        h.cancel()
    for h in accepted:
        list(h)
    assert len(accepted) == engine.max_batch + engine.max_queue and refused == 5


# ------------------------------------------------------------------ the Gate


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _huge_body(total: int):
    chunk = b"x" * 2**20
    for _ in range(total // len(chunk)):
        yield chunk


@pytest.mark.parametrize("authorized", [False, True])
def test_a_250_mb_body_is_refused_at_once(server, authorized):
    """Unauthorized: 401; authorized: 413 (past --max-body-mb); either before the body is read,
    in well under half a second, and without the server's memory growing."""
    rss = _rss_mb()
    headers = {"Content-Type": "application/json", "Content-Length": str(250 * 2**20), **(AUTH if authorized else {})}
    started = time.perf_counter()
    try:
        response = httpx.post(server + "/v1/chat/completions", content=_huge_body(250 * 2**20), headers=headers, timeout=10)
        status = response.status_code
    except httpx.HTTPError:  # the server answered and closed while the client was still sending
        status = None
    elapsed = time.perf_counter() - started
    assert status in (413 if authorized else 401, None)
    assert elapsed < 0.5, elapsed
    assert _rss_mb() - rss < 20


def test_a_body_without_length_is_cut_at_the_limit(server):
    headers = {"Content-Type": "application/json", **AUTH}
    response = httpx.post(server + "/v1/completions", content=_huge_body(6 * 2**20), headers=headers, timeout=30)
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"


def test_a_large_authorized_body_does_not_pause_streams(server, llm):
    """A 3.5 MB body of 100,000 messages is parsed off the event loop: a running stream's tokens
    keep arriving meanwhile."""
    body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}] * 100_000, "max_tokens": 1})
    arrivals = []
    done = threading.Event()

    def stream():
        with httpx.stream("POST", server + "/v1/completions", headers=AUTH, timeout=60,
                          json={"prompt": "Once", "max_tokens": 300, "ignore_eos": True, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.perf_counter())
        done.set()

    t = threading.Thread(target=stream)
    t.start()
    while len(arrivals) < 20:
        time.sleep(0.01)
    sent = time.perf_counter()
    response = httpx.post(server + "/v1/chat/completions", content=body, headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    answered = time.perf_counter()
    t.join(timeout=120)
    assert response.status_code == 400  # far longer than the context
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if a >= sent - 0.5 and b <= answered + 0.5]
    assert during and max(during) < 0.5, max(during)


def test_a_million_messages_are_refused_at_once(server):
    """An authorized chat of 1,000,000 messages (28 MB) is past the body limit: a 413 in well under
    half a second, before a byte is parsed."""
    body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "a"}] * 1_000_000}).encode()
    started = time.perf_counter()
    response = httpx.post(server + "/v1/chat/completions", content=body, headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 413 and time.perf_counter() - started < 0.5


def test_host_header_must_name_the_server(server):
    assert httpx.get(server + "/health", headers={"Host": "evil.example"}).status_code == 400
    assert httpx.get(server + "/health", headers={"Host": "localhost"}).status_code == 200


def test_allowed_hosts_and_origins(llm):
    from fastapi.testclient import TestClient

    app = create_app(llm, "smollm2", None, DEFAULTS.replace(allowed_hosts="minillm.internal", allowed_origins="https://app.example"))
    with TestClient(app, base_url="http://minillm.internal") as http:
        assert http.get("/health").status_code == 200
        assert http.get("/health", headers={"Host": "evil.example"}).status_code == 400
        preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
        ok = http.options("/v1/completions", headers=preflight)
        assert ok.status_code == 204 and ok.headers["access-control-allow-origin"] == "https://app.example"
        assert http.options("/v1/completions", headers=dict(preflight, Origin="https://evil.example")).status_code == 403
        assert "access-control-allow-origin" not in http.get("/health", headers={"Origin": "https://evil.example"}).headers


def test_the_page_carries_a_content_security_policy(server):
    response = httpx.get(server + "/")
    assert "connect-src 'self'" in response.headers["content-security-policy"]
    assert response.headers["x-content-type-options"] == "nosniff"


# ------------------------------------------------------------------ no 500s


FIVE = {
    "surrogate in a completions prompt": ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    "surrogate in /tokenize": ("/tokenize", '{"content": "a\\ud800b"}', "content"),
    "surrogate in a regex grammar": ("/v1/completions", '{"prompt": "x", "grammar": {"type": "regex", "grammar": "\\ud800"}}', "grammar.grammar"),
    "self-referencing schema": ("/v1/completions", json.dumps({"prompt": "x", "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}}), "response_format.json_schema.schema"),
    "exploding pattern": ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 4, "grammar": {
        "type": "regex", "grammar": "^(a{1000}){1000}$"}}), "grammar.grammar"),
    "exploding schema pattern": ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "^(a{1000}){1000}$"}}}}),
        "response_format.json_schema.schema"),
    "out-of-vocabulary logit_bias": ("/v1/completions", '{"prompt": "x", "logit_bias": {"99999999": 5}}', "logit_bias"),
    "embeddings dimensions": ("/v1/embeddings", '{"input": "x", "dimensions": 8}', "dimensions"),
}


@pytest.mark.parametrize("case", list(FIVE))
def test_inputs_that_gave_500s_are_400s(server, case):
    url, body, param = FIVE[case]
    response = httpx.post(server + url, content=body, headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "<state>" not in error["message"] and "\n" not in error["message"]


def test_429_says_when_to_retry(server, llm):
    saved, llm.engine.max_queue = llm.engine.max_queue, -llm.engine.max_batch  # no room at all
    try:
        response = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=AUTH)
    finally:
        llm.engine.max_queue = saved
    assert response.status_code == 429 and response.headers["retry-after"] == "1"


def test_models_retrieve(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0)
    assert client.models.retrieve("smollm2").id == "smollm2"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


# ------------------------------------------------------------------ tools on every model

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The current time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


@pytest.mark.parametrize("choice", ["required", "named", "auto"])
def test_tools_on_a_template_without_tools(server, choice):
    """The default model's template takes no tools: the generic format gives valid tool_calls."""
    client = openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    tool_choice = {"type": "function", "function": {"name": "get_time"}} if choice == "named" else choice
    messages = [{"role": "user", "content": "What time is it in Tokyo?" if choice == "named" else "What's the weather like in Paris today?"}]
    reply = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER, TIME], tool_choice=tool_choice,
                                           max_tokens=80, temperature=0)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.tool_calls
    call = message.tool_calls[0]
    assert call.function.name == ("get_time" if choice == "named" else "get_weather")
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    # the conversation goes on with the tool's result
    follow = client.chat.completions.create(model="smollm2", max_tokens=20, temperature=0, tools=[WEATHER, TIME], messages=messages + [
        {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"}])
    assert follow.choices[0].message.content or follow.choices[0].message.tool_calls
