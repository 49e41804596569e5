"""LoRA adapters in the server: each one a model clients name, served beside the base in one batch."""

import threading

import numpy as np
import pytest
from conftest import httpx, running_server
from lora_tiny import make_adapter
from reasoning_tiny import make_reasoning_model

import minillm
from minillm.serving.server import create_app


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny Qwen3 model with a tokenizer, two adapters (`style`, all-linear; `task`, q/v), a
    third on disk for runtime loading, served with --allow-runtime-lora."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("lora_server")
    base_dir = make_reasoning_model(path / "base", "qwen3")
    for name, seed, options in (("style", 1, dict(r=8, target_modules="all-linear")), ("task", 2, dict(r=4, target_modules=["q_proj", "v_proj"])),
                                ("later", 3, dict(r=2, target_modules=["o_proj"]))):
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype="float32")
        make_adapter(path / name, base, seed=seed, **options)
    options = dict(lora=(f"style={path / 'style'}", str(path / "task")), allow_runtime_lora=True, cache_mb=0)
    llm = minillm.load(base_dir, **options)
    with running_server(create_app(llm, "tiny", options=llm.options)) as url:
        yield url, path, llm


def _completion(url, model, prompt, **fields):
    body = dict(model=model, prompt=prompt, temperature=0, **fields)
    reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_models_lists_adapters_with_their_parent(served):
    url, path, _ = served
    models = httpx.get(url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny", "style", "task"]
    assert all(m["parent"] == "tiny" for m in models[1:]) and "parent" not in models[0]
    assert httpx.get(url + "/v1/models/task").json()["root"] == str(path / "task")
    missing = httpx.post(url + "/v1/completions", json={"model": "stlye", "prompt": "hello", "max_tokens": 1})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_adapters_and_the_base_together_equal_each_alone(served):
    """Prompt log-probabilities (echo, logprobs, max_tokens 0) and greedy tokens of two adapters
    and the base, asked at once, are each request's alone; the adapters change them."""
    url, _, _ = served
    prompt = np.random.default_rng(3).integers(0, 30, size=60).tolist()
    models = ["style", "tiny", "task"]

    def ask(model):
        scored = _completion(url, model, prompt, echo=True, logprobs=1, max_tokens=0)["choices"][0]["logprobs"]
        greedy = _completion(url, model, prompt, logprobs=1, max_tokens=8)
        assert greedy["model"] == model
        return scored["token_logprobs"], greedy["choices"][0]["logprobs"]["token_logprobs"], greedy["choices"][0]["text"]

    alone = {m: ask(m) for m in models}
    assert len({str(v[0]) for v in alone.values()}) == 3  # each adapter changes the prompt's scores
    together: dict = {}
    threads = [threading.Thread(target=lambda m=m: together.__setitem__(m, ask(m))) for m in models * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert together == alone


def test_adapters_load_and_unload_at_run_time(served):
    url, path, llm = served
    loaded = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "later", "lora_path": str(path / "later")})
    assert loaded.status_code == 200 and "later" in loaded.text
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]][-1] == "later"
    with_it = _completion(url, "later", "hello the answer", max_tokens=4, logprobs=1)["choices"][0]["logprobs"]["token_logprobs"]
    base = _completion(url, "tiny", "hello the answer", max_tokens=4, logprobs=1)["choices"][0]["logprobs"]["token_logprobs"]
    assert with_it != base
    again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "later", "lora_path": str(path / "later")})
    assert again.status_code == 400
    bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(path / "nowhere")})
    assert bad.status_code == 400 and "nowhere" in bad.json()["error"]["message"]
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "later"}).status_code == 200
    assert httpx.post(url + "/v1/completions", json={"model": "later", "prompt": "hello", "max_tokens": 1}).status_code == 404
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "later"}).status_code == 404
    assert all(a.name != "later" for a in llm.model.adapters)


def test_runtime_loading_is_off_by_default(served):
    _, _, llm = served
    from fastapi.testclient import TestClient

    with TestClient(create_app(llm, "tiny"), base_url="http://localhost") as http:
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"}).status_code == 404
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny", "style", "task"]
