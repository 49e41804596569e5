"""The prefix KV cache: reused prefixes give exactly what a cold prefill gives, alone and in a batch,
and eviction under a tiny budget never disturbs a running sequence."""

import threading

import numpy as np
import pytest
from hf_tiny import VOCAB, make_checkpoint

from minillm.core.cache import KVCache
from minillm.core.engine import Engine
from minillm.core.model import Model
from minillm.core.prefix_cache import BLOCK_TOKENS, PrefixCache
from minillm.core.sampling import SamplingParams
from minillm.options import Options

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefix")
    make_checkpoint(path, max_position_embeddings=512, num_hidden_layers=3)
    return Model.load(path)


def run(engine: Engine, prompt, max_tokens=6, params=GREEDY):
    handle = engine.submit(prompt, params, max_tokens, logprobs=2)
    events = list(handle)
    return [(e.token, e.logprob, e.top_logprobs) for e in events], handle.cached_tokens


def test_cached_logits_equal_a_cold_prefill(model):
    """Prefix blocks copied from the cache, then the rest prefilled: the logits of a cold prefill,
    bit for bit, at every split (block boundaries, one token left, mid-block)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=150).tolist()
    cold = model.forward(tokens, model.new_cache(), all_logits=True)
    prefix = PrefixCache(model.config, budget_mb=64)
    source = model.new_cache()
    model.forward(tokens[:100], source)
    prefix.store(tokens[:100], source)
    for n in (BLOCK_TOKENS, 97, 100, 101, 150):
        cache = model.new_cache()
        got = prefix.load(tokens[:n], cache)
        assert got == min(100, n - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        logits = model.forward(tokens[got:n], cache, all_logits=True)
        np.testing.assert_array_equal(logits, cold[got:n])


def test_a_later_request_reuses_the_shared_prefix(model):
    """Turn 2 of a chat resends turn 1 and its reply: only the new tokens are prefilled, and the
    tokens and logprobs are the no-cache engine's."""
    rng = np.random.default_rng(1)
    system = rng.integers(0, VOCAB, size=130).tolist()
    cached, cold = Engine(model, Options(cache_mb=64)), Engine(model, Options(cache_mb=0))
    first, hit = run(cached, system)
    assert hit == 0 and first == run(cold, system)[0]
    turn2 = system + [t for t, _, _ in first] + rng.integers(0, VOCAB, size=9).tolist()
    second, hit = run(cached, turn2)
    assert hit >= len(turn2) - 9 - BLOCK_TOKENS
    assert second == run(cold, turn2)[0]
    assert cached.prefix.hits == hit and cached.stats.cached_tokens == hit
    assert cached.stats.prompt_tokens == len(system) + len(turn2) - hit


def test_random_interleaving_with_eviction_matches_the_no_cache_engine(model):
    """Many requests sharing prefixes, from several threads at once (so they batch), greedy and
    seeded, against a budget of a few blocks (evicting all the time): every request gives exactly
    what the engine without a prefix cache gives."""
    rng = np.random.default_rng(2)
    stems = [rng.integers(0, VOCAB, size=int(n)).tolist() for n in (70, 100, 45)]
    requests = []
    for i in range(24):
        stem = stems[rng.integers(len(stems))]
        cut = int(rng.integers(len(stem) // 2, len(stem) + 1))
        prompt = stem[:cut] + rng.integers(0, VOCAB, size=int(rng.integers(1, 20))).tolist()
        params = GREEDY if i % 2 else SamplingParams(temperature=0.9, seed=i)
        requests.append((prompt, int(rng.integers(1, 12)), params))
    block_mb = PrefixCache(model.config, 0).block_bytes / 2**20
    tiny = Engine(model, Options(max_batch=4, cache_mb=block_mb * 5))
    reference = Engine(model, Options(max_batch=4, cache_mb=0))
    expected = [run(reference, p, n, params)[0] for p, n, params in requests]

    results = [None] * len(requests)

    def client(indices):
        for i in indices:
            prompt, n, params = requests[i]
            results[i] = run(tiny, prompt, n, params)

    threads = [threading.Thread(target=client, args=(range(k, len(requests), 4),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert [r[0] for r in results] == expected
    assert tiny.prefix.blocks_used <= 5 and tiny.prefix.hits > 0


def test_store_and_lookup_follow_whole_prefixes():
    """A block matches only after the same earlier blocks; least recently used leaves go first."""
    from minillm.loading.config import ModelConfig

    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 50, "hidden_size": 8,
                                 "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2})
    prefix = PrefixCache(cfg, budget_mb=PrefixCache(cfg, 0).block_bytes * 3 / 2**20)
    assert prefix.capacity == 3
    cache = KVCache(cfg, 256)
    a = list(range(3 * BLOCK_TOKENS))
    cache.k[:] = np.arange(cache.k.size, dtype=np.float32).reshape(cache.k.shape)
    cache.length = len(a)
    prefix.store(a, cache)
    other = KVCache(cfg, 256)
    assert prefix.load(a + [1], other) == 3 * BLOCK_TOKENS
    np.testing.assert_array_equal(other.k[:, :, : 3 * BLOCK_TOKENS], cache.k[:, :, : 3 * BLOCK_TOKENS])
    shifted = [7] + a[1:]  # the same second and third blocks after another first: no match
    assert prefix.load(shifted + [1], KVCache(cfg, 256)) == 0
    prefix.store(shifted, cache)  # three new blocks evict a's, leaf first
    assert prefix.load(a + [1], KVCache(cfg, 256)) == 0
    assert prefix.load(shifted + [1], KVCache(cfg, 256)) == 3 * BLOCK_TOKENS
