"""`cli.py serve --replicas 2` on a local Ray Serve, driven with the official openai client:
concurrent requests of every kind give the single server's greedy text, a system prompt shared by
two chats stays on the replica that cached it, and a replica killed mid-stream ends only its own
streams, with an error event, while Ray starts a new one."""

import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the default model, servers or transformers: the full suite, not the quick tier

pytest.importorskip("ray.serve", reason="the cluster extra (pip install 'minillm[cluster]') is not installed")

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 300


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url, timeout=10):
    try:  # the openai package brings httpx2 (same API) or httpx, depending on its version
        import httpx2 as httpx
    except ImportError:
        import httpx
    return httpx.get(url, timeout=timeout)


@pytest.fixture(scope="module")
def cluster(default_model_dir, tmp_path_factory):
    port = _port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("cluster") / "serve.log"  # Ray logs a lot: a pipe nobody reads would fill
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "cli.py"), "serve", "--replicas", "2", "--threads-per-replica", "1", "--port", str(port),
             "--ctx", "1024", "--max-batch", "4", "--model-name", "m"],
            stdout=subprocess.DEVNULL, stderr=out, start_new_session=True,
        )
    try:
        deadline = time.time() + START_TIMEOUT
        while time.time() < deadline:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            try:
                health = _get(base + "/health")
                if health.status_code == 200 and health.json()["replicas"]["running"] == 2:
                    break
            except Exception:
                pass
            time.sleep(1)
        else:
            raise AssertionError("the cluster did not start in time: " + log.read_text(errors="replace")[-3000:])
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the command stops the app and its local Ray
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def client(cluster):
    from openai import OpenAI

    return OpenAI(base_url=cluster + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(default_model_dir):
    """The single server's engine: the Python API on the same model (tests/test_server.py shows
    the two agree)."""
    import minillm

    with minillm.load(default_model_dir, ctx=1024) as llm:
        yield llm


def _metrics(base) -> str:
    return _get(base + "/metrics").text


def _value(text: str, name: str) -> float:
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def test_sixteen_concurrent_requests_of_every_kind_give_the_single_servers_text(cluster, client, reference):
    health = _get(cluster + "/health").json()
    assert health["status"] == "ok" and health["replicas"]["running"] == 2
    jobs = []
    for i in range(16):
        prompt = f"Write a sentence about the number {i}."
        stream = i % 2 == 0
        if i % 4 < 2:
            jobs.append(("chat", stream, [{"role": "user", "content": prompt}]))
        else:
            jobs.append(("completion", stream, f"Fact {i}: the sky is"))

    def run(job):
        kind, stream, arg = job
        if kind == "chat":
            r = client.chat.completions.create(model="m", messages=arg, max_tokens=24, temperature=0, stream=stream)
            return "".join(c.choices[0].delta.content or "" for c in r) if stream else r.choices[0].message.content
        r = client.completions.create(model="m", prompt=arg, max_tokens=24, temperature=0, stream=stream)
        return "".join(c.choices[0].text for c in r) if stream else r.choices[0].text

    # one of each kind first: the openai client builds its response models' pydantic schemas on
    # first use, and two threads doing that at once can fail inside pydantic (model_rebuild is not
    # thread-safe: "ChoiceDelta has no attribute __pydantic_core_schema__", seen once in CI)
    warm = [run(job) for job in jobs[:4]]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(run, jobs))
    assert warm == got[:4]
    for (kind, _, arg), text in zip(jobs, got):
        want = reference.chat(arg, max_tokens=24, temperature=0) if kind == "chat" else reference.generate(arg, max_tokens=24, temperature=0)
        assert text == want
    routed = _metrics(cluster)
    assert _value(routed, "minillm_router_requests_total") >= 16
    assert len(re.findall(r"^minillm_router_requests_total\{", routed, re.M)) == 2  # both replicas served


def test_several_prompts_and_choices_in_one_request_reach_the_replicas(cluster, client, reference):
    """Several prompts (echo + logprobs: the prompt's logprobs as the single engine gives them) and
    n choices in one request: each is its own call to the replicas, and each comes back."""
    from minillm.core.sampling import SamplingParams

    ids = reference.tokenizer.encode("The lighthouse keeper climbed the stairs")
    result = client.completions.create(model="m", prompt=[ids, ids[:3]], max_tokens=0, echo=True, logprobs=2)
    handle = reference.engine.submit(ids, SamplingParams(temperature=0.0), 0, prompt_logprobs=2)
    assert list(handle) == []
    lp = result.choices[0].logprobs
    assert lp.token_logprobs == [None] + [e.logprob for e in handle.prompt_logprobs]
    assert lp.top_logprobs[1:] == [{reference.tokenizer.decode([t], skip_special_tokens=False): v for t, v in e.top_logprobs}
                                   for e in handle.prompt_logprobs]
    assert result.choices[1].logprobs.token_logprobs == lp.token_logprobs[:3]
    # n choices are calls made while serving one HTTP request: each must reach a replica
    kwargs = dict(model="m", prompt="The lighthouse", max_tokens=4, temperature=0.9)
    both = client.completions.create(n=3, seed=2, **kwargs)
    assert [c.index for c in both.choices] == [0, 1, 2]
    assert [c.text for c in both.choices] == [client.completions.create(seed=2 + i, **kwargs).choices[0].text for i in range(3)]
    # a predicted output: the same reply, and the replica's counts of its proposals come back
    plain = client.completions.create(model="m", prompt="The lighthouse keeper", max_tokens=12, temperature=0)
    predicted = client.completions.create(model="m", prompt="The lighthouse keeper", max_tokens=12, temperature=0,
                                          extra_body={"prediction": {"type": "content", "content": plain.choices[0].text}})
    assert predicted.choices[0].text == plain.choices[0].text
    assert predicted.usage.completion_tokens_details.accepted_prediction_tokens > 0
    # the Responses API: the chat it reads as, through the replicas, and its store in the ingress
    first = client.responses.create(model="m", input="Name a colour.", max_output_tokens=12, temperature=0)
    assert first.output_text == reference.chat([{"role": "user", "content": "Name a colour."}], max_tokens=12, temperature=0)
    second = client.responses.create(model="m", input="Another?", previous_response_id=first.id, max_output_tokens=12, temperature=0)
    assert second.output_text == reference.chat([{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": first.output_text},
                                                 {"role": "user", "content": "Another?"}], max_tokens=12, temperature=0)
    # and Anthropic's Messages API
    import anthropic

    message = anthropic.Anthropic(base_url=cluster, api_key="unused", max_retries=0, timeout=300).messages.create(
        model="m", max_tokens=12, messages=[{"role": "user", "content": "Name a colour."}], extra_body={"temperature": 0})
    assert message.content[0].text == first.output_text


def test_chats_sharing_a_system_prompt_stay_with_the_replica_that_cached_it(cluster, client):
    system = "You are a meticulous assistant for a lighthouse keeper. " * 40  # ~500 tokens
    before = _metrics(cluster)
    for i in range(10):
        for question in ("How bright is the lamp?", "When is the next storm?"):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": f"{question} ({i})"}]
            client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
    after = _metrics(cluster)
    queries = _value(after, "minillm:prefix_cache_queries_total") - _value(before, "minillm:prefix_cache_queries_total")
    hits = _value(after, "minillm:prefix_cache_hits_total") - _value(before, "minillm:prefix_cache_hits_total")
    assert hits / queries >= 0.9, (hits, queries)
    affinity = _value(after, "minillm_router_prefix_affinity_total") - _value(before, "minillm_router_prefix_affinity_total")
    assert affinity >= 20


def test_a_replica_killed_mid_stream_ends_only_its_streams_and_comes_back(cluster, client, reference):
    from minillm.serving.cluster_router import preferred_replica, prefix_key

    pids = dict(re.findall(r'^minillm_replica_running\{replica="([^"]+)",pid="(\d+)"\}', _metrics(cluster), re.M))
    assert len(pids) == 2
    # a prompt for each replica, as the router will send them
    by_replica = {}
    for i in range(200):
        prompt = f"Tell a long story number {i} about"
        by_replica.setdefault(preferred_replica(prefix_key(reference.tokenizer.encode(prompt)), sorted(pids)), prompt)
        if len(by_replica) == 2:
            break
    (doomed, doomed_prompt), (kept, kept_prompt) = sorted(by_replica.items())

    def stream(prompt):
        text, errors = [], []
        try:
            for chunk in client.completions.create(model="m", prompt=prompt, max_tokens=300, temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True}):
                text.append(chunk.choices[0].text if chunk.choices else "")
        except Exception as e:  # the openai client raises on an SSE error event
            errors.append(e)
        return "".join(text), errors

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        lost = pool.submit(stream, doomed_prompt)
        survivor = pool.submit(stream, kept_prompt)
        time.sleep(3)  # both are streaming
        os.kill(int(pids[doomed]), signal.SIGKILL)
        lost_text, lost_errors = lost.result(timeout=300)
        kept_text, kept_errors = survivor.result(timeout=300)
    assert lost_errors and "replica failed" in str(lost_errors[0])
    assert not kept_errors and len(kept_text) > 300  # all 300 tokens (exact text: the first test)
    # new requests go to the live replica meanwhile, and Ray brings the dead one back
    assert client.completions.create(model="m", prompt=doomed_prompt, max_tokens=4, temperature=0).choices[0].text
    deadline = time.time() + 60
    while time.time() < deadline:
        health = _get(cluster + "/health").json()
        if health.get("replicas", {}).get("running") == 2 and health["status"] == "ok":
            break
        time.sleep(1)
    else:
        raise AssertionError(f"not two healthy replicas 60 s after the kill: {health}")
    assert _value(_metrics(cluster), "minillm_replica_failures_total") >= 1


def test_replicas_without_ray_is_one_line(tmp_path):
    code = ("import sys; sys.modules['ray'] = None; sys.modules['ray.serve'] = None; sys.path.insert(0, %r); import cli; "
            "sys.exit(cli.main(['serve', '--replicas', '2']))" % str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "minillm[cluster]" in out.stderr


def test_deployment_app_takes_serves_options_by_name(monkeypatch, default_model_dir):
    """`serve run minillm.serving.cluster:deployment_app model=... replicas=...` and KubeRay's serveConfigV2
    args arrive as strings: each becomes the option `serve` gives build_app."""
    from ray import serve

    from minillm.serving import cluster

    app = cluster.deployment_app({"model": str(default_model_dir), "replicas": "2", "threads": "1"})
    assert isinstance(app, serve.Application)
    seen = []
    monkeypatch.setattr(cluster, "build_app", seen.append)
    cluster.deployment_app({"model": "/models/q.gguf", "autoscale": "1:8", "threads": "4", "max_batch": "16",
                            "ctx": "4096", "cache_mb": "512", "api_key": "k", "dtype": "", "ingress_replicas": "3",
                            "check_weights": "true", "shutdown_timeout": "5"})
    from minillm.options import Options

    assert seen == [Options(model="/models/q.gguf", api_key="k", threads=4, autoscale=(1, 8), ingress_replicas=3, max_batch=16,
                            ctx=4096, cache_mb=512.0, check_weights=True, shutdown_timeout=5.0)]
    assert seen[0].served_name == "q" and seen[0].replica_count == 1 and seen[0].replica_threads == 4
    with pytest.raises(Exception, match="unknown argument 'replica'"):  # a misspelt option is not ignored
        cluster.deployment_app({"model": "/models/q.gguf", "replica": "4"})


def test_cluster_flags_are_errors_where_they_would_be_ignored():
    for args, fragment in ((["--threads-per-replica", "2"], "--threads-per-replica needs --replicas"),
                           (["--ingress-replicas", "2"], "--ingress-replicas needs --replicas"),
                           (["--replicas", "2", "--autoscale", "1:3"], "--replicas and --autoscale")):
        out = subprocess.run([sys.executable, str(ROOT / "cli.py"), "serve", *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and fragment in out.stderr, out.stderr
