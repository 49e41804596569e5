"""Speculative decoding by prompt lookup never changes a token (quick tier, tiny random model):
greedy and seeded, with penalties, logit bias, logprobs, grammars, stop tokens and max_tokens,
batched beside plain sequences; and it does propose and accept on text that repeats."""

import threading

import numpy as np
import pytest
from hf_tiny import VOCAB, make_checkpoint

from minillm.core.engine import Engine
from minillm.core.model import Model
from minillm.core.sampling import SamplingParams
from minillm.core.speculative import BACKOFF_STEPS, PromptLookup
from minillm.options import Options


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("speculative")
    make_checkpoint(path, max_position_embeddings=1024, num_hidden_layers=2)
    return Model.load(path)


def run(engine: Engine, prompt, max_tokens, params, stop_ids=()):
    handle = engine.submit(prompt, params, max_tokens, stop_ids, logprobs=2)
    return [(e.token, e.logprob, e.top_logprobs) for e in handle], handle.finish_reason


def repetitive(rng, length=400):
    """A prompt that repeats a phrase (as code, documents and edits do), so lookups match."""
    phrase = rng.integers(0, VOCAB, size=12).tolist()
    return (phrase * (length // 12 + 1))[:length]


CASES = [
    ("greedy", SamplingParams(temperature=0), ()),
    ("seeded", SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=3), ()),
    ("sampled with filters", SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=11), ()),
    ("penalties", SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3), ()),
    ("logit bias", SamplingParams(temperature=0, logit_bias=((5, 8.0), (7, -100.0))), ()),
    ("stop token", SamplingParams(temperature=0), "first generated"),
]


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_speculation_never_changes_a_token(model, name):
    params, stop = next((p, s) for n, p, s in CASES if n == name)
    rng = np.random.default_rng(0)
    prompts = [repetitive(rng) for _ in range(3)] + [rng.integers(0, VOCAB, size=50).tolist()]
    plain = Engine(model, Options(max_batch=4, cache_mb=0))
    spec = Engine(model, Options(max_batch=4, cache_mb=0, speculative="ngram", spec_tokens=6))
    expected = [run(plain, p, 60, params) for p in prompts]
    stops = [(e[0][5][0],) if stop else () for e in expected]  # a token the reply produces, to stop at
    if stop:
        expected = [run(plain, p, 60, params, s) for p, s in zip(prompts, stops)]
    results = [None] * len(prompts)

    def client(i):
        results[i] = run(spec, prompts[i], 60, params, stops[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == expected
    assert spec.stats.spec_draft_tokens > 0 or stop  # (replies that stop within a few tokens propose nothing)


def test_repeated_text_is_accepted(model):
    """Greedy continuation of a repeated phrase repeats it: most proposals are taken, and the
    sequence needs fewer steps than tokens."""
    engine = Engine(model, Options(max_batch=1, cache_mb=0, speculative="ngram", spec_tokens=8))
    prompt = repetitive(np.random.default_rng(5), 240)
    plain = Engine(model, Options(max_batch=1, cache_mb=0))
    expected = run(plain, prompt, 100, SamplingParams(temperature=0))
    assert run(engine, prompt, 100, SamplingParams(temperature=0)) == expected
    stats = engine.stats
    if stats.spec_accepted_tokens == 0:
        pytest.skip("this random model does not continue the phrase; acceptance is covered by the lookup tests")
    assert stats.steps < stats.generated_tokens


def test_max_tokens_and_context_bound_the_proposals(model):
    engine = Engine(model, Options(max_batch=1, cache_mb=0, speculative="ngram", spec_tokens=8))
    prompt = repetitive(np.random.default_rng(6), model.ctx - 5)
    events, reason = run(engine, prompt, None, SamplingParams(temperature=0))
    assert len(events) == 5 and reason in ("length", "context")  # max_tokens None: what the context leaves
    events, reason = run(engine, prompt[:100], 3, SamplingParams(temperature=0))
    assert len(events) == 3 and reason == "length"


def test_lookup_proposes_what_followed_the_latest_occurrence():
    lookup = PromptLookup([1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3], most=8, ngram=3)
    assert lookup.propose(10) == [5, 6, 7, 1]  # after the latest "1 2 3", the first proposal is 4 long
    lookup.update(4, 4)
    lookup.extend([5, 6, 7, 1, 2, 3])
    assert lookup.propose(10) == [5, 6, 7, 1, 2, 3]  # doubled to 8, 6 available
    assert lookup.propose(2) == [5, 6]  # no more than the room left
    assert PromptLookup([1, 2, 3, 4], most=8, ngram=3).propose(8) == []  # nothing repeats


def test_lookup_backs_off_when_refused():
    lookup = PromptLookup([1, 2, 3, 1, 2], most=8, ngram=3)
    for length in (4, 2, 1):
        assert lookup.length == length
        lookup.update(length, 0)
    assert lookup.propose(8) == []  # resting
    for _ in range(BACKOFF_STEPS - 2):
        assert lookup.propose(8) == []
    assert lookup.propose(8) == [] and lookup.length == 1
    assert lookup.propose(8) == [3]
    lookup.update(1, 0)  # refused again: a rest twice as long
    assert sum(lookup.propose(8) == [] for _ in range(2 * BACKOFF_STEPS)) == 2 * BACKOFF_STEPS
    assert lookup.propose(8) == [3]


COPY = ("Here is a sentence: the quick brown fox jumps over the lazy dog near the river bank at dawn.\n"
        "Here is the same sentence again, word for word: the quick brown fox")


@pytest.mark.slow
def test_the_default_model_gives_the_same_text_faster_in_steps(default_model_dir):
    """On the real model, through the Python API: greedy and seeded text, JSON-schema output and
    logprobs are the same with speculation, and a copying task takes fewer steps than tokens."""
    import minillm

    plain = minillm.load(default_model_dir, ctx=1024, cache_mb=0)
    spec = minillm.load(default_model_dir, ctx=1024, cache_mb=0, speculative="ngram")
    for kwargs in ({"temperature": 0}, {"temperature": 0.8, "seed": 5}, {"temperature": 0, "stop": ["dawn"]}):
        assert spec.generate(COPY, max_tokens=40, **kwargs) == plain.generate(COPY, max_tokens=40, **kwargs)
    schema = {"type": "object", "properties": {"animal": {"type": "string"}, "count": {"type": "integer"}}, "required": ["animal", "count"]}
    chat = [{"role": "user", "content": "Describe a fox as JSON with the fields animal and count."}]
    assert spec.chat(chat, json_schema=schema, max_tokens=40, temperature=0) == plain.chat(chat, json_schema=schema, max_tokens=40, temperature=0)
    stats = spec.engine.stats
    assert stats.spec_accepted_tokens > 0 and stats.steps < stats.generated_tokens
