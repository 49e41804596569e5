"""The engine's scheduling on a tiny random model (quick tier): chunked prefill beside running
decodes gives the tokens and logprobs of a whole prefill, embeddings go through the same steps,
cancelled requests leave, a burst fills the free slots and the queue."""

import gc
import threading
import warnings
import weakref

import numpy as np
import pytest
from hf_tiny import VOCAB, make_checkpoint
from reasoning_tiny import make_reasoning_model

import minillm

from minillm.core.engine import Engine, QueueFullError, ShutdownError, token_logprobs
from minillm.core.model import Model
from minillm.core.prefix_cache import PrefixCache
from minillm.core.sampling import SamplingParams
from minillm.errors import GenerationError
from minillm.options import Options

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine")
    make_checkpoint(path, max_position_embeddings=1024, num_hidden_layers=3)
    return Model.load(path)


def events(engine: Engine, prompt, max_tokens=6, params=GREEDY):
    return [(e.token, e.logprob, e.top_logprobs) for e in engine.submit(prompt, params, max_tokens, logprobs=2)]


@pytest.mark.parametrize("chunk", [1, 7, 64, None])
def test_prompts_read_in_chunks_beside_decodes_equal_whole_prefills(model, chunk):
    """Streams decode while long prompts are read `chunk` rows a step (None: sized by measured
    costs): every request's tokens and logprobs equal its run alone with the prompt read whole."""
    rng = np.random.default_rng(0)
    requests = [(rng.integers(0, VOCAB, size=int(n)).tolist(), int(m), GREEDY if i % 2 else SamplingParams(temperature=0.8, seed=i))
                for i, (n, m) in enumerate([(5, 40), (300, 6), (9, 30), (700, 5), (130, 12), (3, 20)])]
    whole = Engine(model, Options(max_batch=1, cache_mb=0, prefill_chunk=1024))
    expected = [events(whole, p, m, params) for p, m, params in requests]
    chunked = Engine(model, Options(max_batch=4, cache_mb=0, prefill_chunk=chunk))
    results = [None] * len(requests)

    def client(i):
        results[i] = events(chunked, *requests[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results == expected
    assert chunked.stats.prompt_tokens == sum(len(p) for p, _, _ in requests)


def test_embeddings_go_through_the_steps(model):
    """An embedding read in chunks beside a decode equals the mean of a whole forward's final norm."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, VOCAB, size=200).tolist()
    cfg = model.config
    hidden = np.zeros((cfg.num_hidden_layers + 2, len(prompt), cfg.hidden_size), np.float32)
    model.forward(prompt, model.new_cache(), hidden=hidden)
    mean = hidden[-1].astype(np.float64).mean(axis=0)
    expected = (mean / np.linalg.norm(mean)).astype(np.float32)
    engine = Engine(model, Options(max_batch=2, cache_mb=0, prefill_chunk=16))
    stream = engine.submit([1, 2, 3], GREEDY, 60)
    vector = list(engine.submit_embedding(prompt))
    list(stream)
    assert len(vector) == 1 and np.array_equal(vector[0], expected)
    assert engine.stats.embeddings == 1 and engine.stats.prefill_steps >= 200 // 16


def test_token_logprobs_against_a_sort():
    """The top alternatives are the likeliest by value, ties by index (-inf ones last), each with
    its float64 log-softmax; the token's own the same."""
    rng = np.random.default_rng(3)
    for size, top in ((49152, 1), (49152, 5), (1000, 20), (7, 7), (5, 9)):
        logits = rng.choice(np.linspace(-4, 4, 50), size).astype(np.float32)  # many ties
        logits[rng.integers(0, size, 2)] = -np.inf
        x = logits.astype(np.float64) - logits.max()
        reference = x - np.log(np.exp(x).sum())
        order = np.lexsort((np.arange(size), -reference))[:top]
        token = int(rng.integers(0, size))
        logprob, best = token_logprobs(logits, token, top)
        assert logprob == reference[token] and best == tuple((int(i), float(reference[i])) for i in order)
    assert token_logprobs(logits, 0, 0)[1] == ()


def test_a_scored_prompt_gets_the_logprobs_generation_would(model):
    """prompt_logprobs (completions' echo): read in chunks beside a decode, with the prefix cache
    holding the prompt, every prompt token after the first gets the logprob and alternatives that
    generating it at that position gives, bit for bit; max_tokens 0 scores only."""
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, VOCAB, size=40).tolist()
    alone = Engine(model, Options(max_batch=1, cache_mb=0))
    generated = alone.submit(prompt, GREEDY, 30, logprobs=3)
    tokens = [(e.token, e.logprob, e.top_logprobs) for e in generated]
    text = prompt + [t for t, _, _ in tokens]
    engine = Engine(model, Options(max_batch=3, cache_mb=64, prefill_chunk=16))
    list(engine.submit(text, GREEDY, 1))  # the prefix cache now holds it: a scored prompt is computed anyway
    stream = engine.submit([1, 2, 3], GREEDY, 60)
    scored = engine.submit(text, GREEDY, 0, prompt_logprobs=3)
    assert list(scored) == [] and scored.finish_reason == "length"
    got = [(e.token, e.logprob, e.top_logprobs) for e in scored.prompt_logprobs]
    assert len(got) == len(text) - 1 and [t for t, _, _ in got] == text[1:]
    assert got[len(prompt) - 1 :] == tokens
    logits = model.forward(text, model.new_cache(), all_logits=True).astype(np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    expected = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    assert np.allclose([lp for _, lp, _ in got], expected[np.arange(len(text) - 1), text[1:]], rtol=0, atol=1e-9)
    then = engine.submit(prompt, GREEDY, 5, logprobs=3, prompt_logprobs=0)
    assert [(e.token, e.logprob, e.top_logprobs) for e in then] == tokens[:5]
    assert [e.top_logprobs for e in then.prompt_logprobs] == [()] * (len(prompt) - 1)
    list(stream)
    with pytest.raises(Exception, match="max_tokens must be >= 1"):
        engine.submit(prompt, GREEDY, 0)


def test_cancelled_requests_leave_queued_or_running(model):
    engine = Engine(model, Options(max_batch=1, max_queue=4, cache_mb=0))
    running = engine.submit([1, 2, 3], GREEDY, 500)
    reader = iter(running)
    next(reader)
    queued = engine.submit([4, 5, 6], GREEDY, 5)
    queued.cancel()
    running.cancel()
    assert list(queued) == [] and queued.finish_reason == "cancelled"
    list(reader)
    assert running.finish_reason == "cancelled"
    assert (engine.stats.requests, engine.stats.cancelled, engine.stats.finished) == (2, 2, 0)


def test_a_burst_fills_the_free_slots_and_the_queue(model):
    engine = Engine(model, Options(max_batch=3, max_queue=2, cache_mb=0))
    accepted, refused = [], 0
    for _ in range(8):
        try:
            accepted.append(engine.submit([1, 2, 3], GREEDY, 500))
        except QueueFullError:
            refused += 1
    assert (len(accepted), refused) == (5, 3)
    for h in accepted:
        h.cancel()
        list(h)


def test_shut_down_ends_every_request_with_its_error(model):
    engine = Engine(model, Options(max_batch=1, max_queue=2, cache_mb=0))
    running = engine.submit([1, 2, 3], GREEDY, 1000)
    queued = engine.submit([4, 5], GREEDY, 10)
    reader = iter(running)
    next(reader)
    engine.shut_down(ShutdownError("stopping"))
    for events_left in (reader, iter(queued)):
        with pytest.raises(ShutdownError):
            list(events_left)
    with pytest.raises(ShutdownError):
        engine.submit([1], GREEDY, 1)


def test_a_closed_llm_lets_go_of_its_weights_and_thread(tmp_path):
    """close() ends the engine thread and frees the weights even while something still holds the
    LLM (as a web framework's caches hold a server's routes); a dropped LLM ends its thread too."""
    make_reasoning_model(tmp_path, "qwen3")  # a tiny model with a tokenizer
    held = minillm.load(str(tmp_path), progress=False)
    held.generate([1, 2, 3], max_tokens=2, temperature=0)
    weights, thread = weakref.ref(held.model), held.engine._thread
    held.close()
    gc.collect()
    assert weights() is None and not thread.is_alive()
    with pytest.raises(GenerationError, match="closed"):
        held.generate([1, 2], max_tokens=1)
    dropped = minillm.load(str(tmp_path), progress=False)
    dropped.generate([1, 2, 3], max_tokens=2, temperature=0)
    thread = dropped.engine._thread
    del dropped
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_a_cache_smaller_than_a_block_warns(model):
    block_mb = PrefixCache(model.config, 0).block_bytes / 2**20
    with pytest.warns(UserWarning, match="less than one"):
        assert PrefixCache(model.config, block_mb / 2).capacity == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PrefixCache(model.config, 0)
        PrefixCache(model.config, block_mb)


@pytest.mark.parametrize("row_ms,expected", [(5.0, 6), (15.0, 2), (100.0, 1)])
def test_prompt_rows_beside_decodes_follow_the_measured_step_times(model, row_ms, expected):
    """The prompt rows read beside decodes are sized from step times (a step: 40 ms of decode
    plus row_ms a prompt row): they settle where the step costs about twice the decode alone (at
    most: from below, as the rows are whole), at least one row whatever a row costs, and one slow
    decode step (a busy neighbour) does not move them. No count is tuned on one CPU."""
    engine = Engine(model, Options(max_batch=2, cache_mb=0))
    try:
        for seconds in [0.040] * 8 + [0.400]:  # decode-only steps, one of them slow
            engine._note_cost(seconds, 2, 0, 0)
        for _ in range(30):
            n = engine._prefill_rows(2)
            engine._note_cost(0.040 + n * row_ms / 1000, 2, n, n)
        settled = engine._prefill_rows(2)
        assert settled == expected
        assert 0.040 + settled * row_ms / 1000 <= max(0.080, 0.040 + row_ms / 1000) + 1e-9
        engine._note_cost(0.040 + 3 * row_ms / 1000, 2, 3, 8)  # a prompt's last chunk, short of its budget: no evidence
        assert engine._prefill_rows(2) == expected
    finally:
        engine.close()
