"""The prefix KV cache: reused prefixes give exactly what a cold prefill gives, alone and in a batch,
and eviction under a tiny budget never disturbs a running sequence."""

import threading

import numpy as np
import pytest
from hf_tiny import VOCAB, make_checkpoint

from minillm.core.cache import KVCache
from minillm.core.engine import Engine
from minillm.core.model import Model
from minillm.core.prefix_cache import BLOCK_TOKENS, PrefixCache, PrefixFile
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


# ---------------------------------------------------------------- kept on disk (--cache-dir)

def _stored(model, chains, budget_mb=64):
    """A prefix cache holding `chains` (token lists), stored in that order."""
    prefix = PrefixCache(model.config, budget_mb=budget_mb)
    for tokens in chains:
        cache = model.new_cache()
        model.forward(tokens, cache)
        prefix.store(tokens, cache)
    return prefix


def test_a_saved_prefix_cache_reads_back_bit_for_bit(model, tmp_path):
    rng = np.random.default_rng(7)
    shared = rng.integers(0, VOCAB, size=70).tolist()
    chains = [shared + rng.integers(0, VOCAB, size=40).tolist() for _ in range(3)]
    saved = _stored(model, chains)
    file = PrefixFile(tmp_path / "prefix.kv", {"weights": "tiny", "kv": "float32"})
    assert saved.save(file) == saved.blocks_used == 2 + 3 * 1  # the shared two blocks once, then each chain's third
    restored = PrefixCache(model.config, budget_mb=64)
    assert restored.restore(file) == saved.blocks_used
    assert list(restored._lru.keys()) != [] and len(restored._lru) == len(saved._lru)
    for tokens in chains:
        cold = model.forward(tokens, model.new_cache(), all_logits=True)
        cache = model.new_cache()
        got = restored.load(tokens, cache)
        assert got == 96
        np.testing.assert_array_equal(model.forward(tokens[got:], cache, all_logits=True), cold[got:])


def test_a_smaller_budget_reads_back_the_most_recent_chains_whole(model, tmp_path):
    rng = np.random.default_rng(8)
    chains = [rng.integers(0, VOCAB, size=65).tolist() for _ in range(3)]  # two blocks each, no sharing
    file = PrefixFile(tmp_path / "prefix.kv", {"weights": "tiny"})
    _stored(model, chains).save(file)
    two_blocks_mb = 2 * PrefixCache(model.config, budget_mb=1).block_bytes / 2**20
    small = PrefixCache(model.config, budget_mb=two_blocks_mb * 1.01)
    assert small.restore(file) == 2
    assert small.load(chains[2], model.new_cache()) == 64  # the newest chain, root and leaf
    assert small.load(chains[0], model.new_cache()) == 0


def test_a_foreign_or_damaged_file_is_ignored_with_a_warning(model, tmp_path):
    rng = np.random.default_rng(9)
    tokens = rng.integers(0, VOCAB, size=70).tolist()
    file = PrefixFile(tmp_path / "prefix.kv", {"weights": "tiny", "kv": "float32"})
    _stored(model, [tokens]).save(file)
    damaged = file.path.read_bytes()
    cases = {
        "written for other weights": PrefixFile(file.path, {"weights": "other", "kv": "float32"}),
        "its size is not what its header says": file,
        "not a minillm prefix cache file": file,
    }
    for expected, reader in cases.items():
        if expected.startswith("its size"):
            file.path.write_bytes(damaged[:-100])
        elif expected.startswith("not a"):
            file.path.write_bytes(b"\x00" * 200)
        with pytest.warns(UserWarning, match=expected):
            fresh = PrefixCache(model.config, budget_mb=64)
            assert fresh.restore(reader) == 0
        assert fresh.blocks_used == 0 and fresh.load(tokens, model.new_cache()) == 0
    assert PrefixCache(model.config, budget_mb=64).restore(PrefixFile(tmp_path / "none.kv", {})) == 0  # no file: silence


def test_an_engine_keeps_its_prefix_cache_across_a_restart(model, tmp_path):
    """The engine writes its blocks when it ends and reads them at the next start of the same
    model: the first request after a restart reuses its prefix, with the same tokens and logprobs."""
    rng = np.random.default_rng(10)
    prompt = rng.integers(0, VOCAB, size=120).tolist()
    file = PrefixFile(tmp_path / "prefix.kv", {"weights": "tiny"})
    first = Engine(model, Options(cache_mb=64), prefix_file=file)
    before, hit = run(first, prompt)
    assert hit == 0
    first.close()
    assert file.path.is_file()
    again = Engine(model, Options(cache_mb=64), prefix_file=file)
    after, hit = run(again, prompt)
    again.close()
    assert hit == 96 and after == before


def test_an_idle_engine_writes_what_changed(model, tmp_path, monkeypatch):
    """A server killed without a shutdown keeps what the last idle write held."""
    import time

    import minillm.core.engine as engine_module

    monkeypatch.setattr(engine_module, "PREFIX_SAVE_INTERVAL", 0.2)
    file = PrefixFile(tmp_path / "prefix.kv", {"weights": "tiny"})
    engine = Engine(model, Options(cache_mb=64), prefix_file=file)
    try:
        run(engine, np.random.default_rng(11).integers(0, VOCAB, size=80).tolist())
        deadline = time.monotonic() + 10
        while not file.path.is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert file.path.is_file() and engine.alive
        assert PrefixCache(model.config, budget_mb=64).restore(file) == 2
    finally:
        engine.close()
