"""Sliding-window layers give back the memory of positions no later token can attend to: a long
sequence holds about window + RELEASE_STEP of their positions, the logits stay bit for bit those of
a cache that keeps everything, and the prefix cache never hands out a block whose window is gone."""

import numpy as np
import pytest
from hf_tiny import VOCAB, make_checkpoint

from minillm.core.engine import Engine
from minillm.core.model import RELEASE_STEP, Model
from minillm.core.sampling import SamplingParams
from minillm.options import Options

GREEDY = SamplingParams(temperature=0.0)
WINDOW = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("sliding")
    make_checkpoint(path, arch="gemma3", head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1024)
    return Model.load(path, ctx=1024)


def test_released_positions_are_gone_and_logits_unchanged(model):
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=400)
    keep, drop = model.new_cache(), model.new_cache()
    np.testing.assert_array_equal(model.forward(tokens[:150], keep), model.forward(tokens[:150], drop))
    model.release_outside_windows(drop)
    for t in tokens[150:]:
        expected = model.forward([t], keep).copy()
        np.testing.assert_array_equal(model.forward([t], drop), expected)
        model.release_outside_windows(drop)
    sliding, full = model.sliding_layers[0], 1
    assert drop.length - WINDOW - RELEASE_STEP <= drop.released <= drop.length - WINDOW
    gone, kept = slice(0, drop.released), slice(drop.released, drop.length)
    assert keep.k[sliding, :, gone].any() and not drop.k[sliding, :, gone].any() and not drop.v[sliding, :, gone].any()
    np.testing.assert_array_equal(drop.k[sliding, :, kept], keep.k[sliding, :, kept])  # the window is still there
    np.testing.assert_array_equal(drop.k[full, :, : drop.length], keep.k[full, :, : drop.length])
    with pytest.raises(Exception, match="sliding-window"):
        drop.truncate(10)


def run(engine, prompt, max_tokens):
    handle = engine.submit(prompt, GREEDY, max_tokens, stop_ids=())
    return [e.token for e in handle], handle.cached_tokens


def test_engine_generation_and_prefix_reuse_past_the_window(model):
    """Long generations (batched) release their old sliding positions; later prompts that reuse
    them get only prefixes whose last window is intact, and the no-cache engine's tokens."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, size=40).tolist() for _ in range(2)]
    cached, cold = Engine(model, Options(max_batch=2, cache_mb=64)), Engine(model, Options(max_batch=2, cache_mb=0))
    first = [run(cold, p, 200)[0] for p in prompts]
    handles = [cached.submit(p, GREEDY, 200, stop_ids=()) for p in prompts]  # decoded together
    assert [[e.token for e in h] for h in handles] == first
    for prompt, generated in zip(prompts, first):  # what a cache that keeps everything gives
        logits = model.forward(prompt + generated[:-1], model.new_cache(), all_logits=True)
        assert logits[len(prompt) - 1 :].argmax(axis=1).tolist() == generated
    history = prompts[0] + first[0]
    # diverges long before the end: only the prompt's block (stored before any release) is usable
    early = history[:140] + [1, 2, 3]
    tokens, hit = run(cached, early, 20)
    assert hit == 32 and tokens == run(cold, early, 20)[0]
    # the whole history and more: the blocks near its end are whole, so most of it is reused
    late = history + [4, 5, 6]
    tokens, hit = run(cached, late, 20)
    assert hit >= len(history) - 32 - RELEASE_STEP and tokens == run(cold, late, 20)[0]
