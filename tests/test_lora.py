"""LoRA adapters: the update kernel against NumPy, whole models against transformers + peft, rows
of different adapters in one step against each alone, the engine, bad adapters."""

import json
import threading

import numpy as np
import pytest
from hf_tiny import VOCAB, hf_logits, make_checkpoint
from lora_tiny import make_adapter, with_adapters

from minillm.core.cache import KVPool
from minillm.core.engine import Engine
from minillm.core.model import Model
from minillm.core.sampling import SamplingParams
from minillm.errors import CheckpointError
from minillm.kernels.lora import lora_rows
from minillm.loading.lora import combined, load_adapter, parse_lora_spec
from minillm.options import Options

TOKENS = np.random.default_rng(1).integers(0, VOCAB, size=40)
GREEDY = SamplingParams(temperature=0)


def lora_row_reference(out, x, a, b, scale):
    """NumPy: out + scale * b @ (a @ x), a (r, K) and b (N, r) as PEFT stores them."""
    return out + np.float32(scale) * (b.astype(np.float64) @ (a.astype(np.float64) @ x)).astype(np.float32)


@pytest.mark.parametrize("stored", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("rank,K,N,rows,scratch", [(8, 48, 16, 1, 64), (16, 72, 300, 3, 400), (1, 5, 3, 2, 130), (37, 100, 20, 8, 1000),
                                                 (64, 576, 1536, 8, 12288)])
def test_lora_rows_match_numpy(rank, K, N, rows, scratch, stored):
    """Including columns wider than a chunk (an LM head's update), in column parts as threads
    share a decode row's, and in groups of rows: each row's bits whatever its company; A and B
    as float32 or as 16-bit values (the kernel reads float16 bits as int16, bfloat16 as uint16)."""
    from minillm.loading.lora import widened

    rng = np.random.default_rng(rank)
    a, b = rng.standard_normal((rank, K)).astype(np.float32), rng.standard_normal((N, rank)).astype(np.float32)
    x, out = rng.standard_normal((rows, K)).astype(np.float32), rng.standard_normal((rows, N)).astype(np.float32)
    data = np.concatenate([a.ravel(), b.T.ravel()]).astype(np.float32)
    if stored == "float16":
        data = data.astype(np.float16)
    elif stored == "bfloat16":
        data = (data.view(np.uint32) >> 16).astype(np.uint16)  # truncated: any bfloat16 values do
    a, b = widened(data[: a.size]).reshape(a.shape), widened(data[a.size :]).reshape(b.shape[::-1]).T
    data = data.view(np.int16) if stored == "float16" else data
    got = out.copy()
    lora_rows(got, x, data, 0, a.size, rank, N, np.float32(0.5), np.zeros(scratch, np.float32))
    for g in range(rows):
        bound = 1e-6 * (np.abs(b) @ (np.abs(a) @ np.abs(x[g])))  # float32 rounding, relative to the terms summed
        assert (np.abs(got[g] - lora_row_reference(out[g], x[g], a, b, 0.5)) <= bound + 1e-6).all()
        alone = out[g : g + 1].copy()
        split = N // 3 // 16 * 16  # parts start on 16-column boundaries, as the LoRA step cuts them
        for c0, c1 in ((0, split), (split, N)):
            lora_rows(alone[:, c0:c1], x[g : g + 1], data, 0, a.size + c0, rank, N, np.float32(0.5), np.zeros(scratch, np.float32))
        np.testing.assert_array_equal(alone[0], got[g])


# family -> (checkpoint overrides, LoraConfig options)
CASES = {
    "llama-all-linear-r8": (dict(arch="llama", tie_word_embeddings=False), dict(r=8, lora_alpha=16, target_modules="all-linear")),
    "llama-lm-head": (dict(arch="llama", tie_word_embeddings=False), dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj", "lm_head"])),
    "qwen3-qv-r4-rslora": (dict(arch="qwen3"), dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True)),
    "qwen3-all-linear-r8": (dict(arch="qwen3"), dict(r=8, lora_alpha=16, target_modules="all-linear")),
    "qwen2_moe-rank-pattern": (dict(arch="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=40),
                               dict(r=8, lora_alpha=16, target_modules="all-linear", rank_pattern={"o_proj": 2, r"shared_expert\.up_proj": 12},
                                    alpha_pattern={"k_proj": 3})),
    "phi3-fused": (dict(arch="phi3"), dict(r=8, lora_alpha=16, target_modules="all-linear")),
    # all-linear on experts held as parameters: peft's target_parameters (router, gate_up_proj at twice the rank, down_proj)
    "qwen3_moe-experts": (dict(arch="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32), dict(r=4, target_modules="all-linear")),
    "mixtral-experts": (dict(arch="mixtral", num_local_experts=4, num_experts_per_tok=2), dict(r=8, target_modules="all-linear", use_rslora=True)),
    "ernie4_5-pairs-rope": (dict(arch="ernie4_5"), dict(r=8, lora_alpha=16, target_modules="all-linear")),
    # a sigmoid router with a selection bias, shared experts without a gate, a dense layer first (peft's all-linear
    # leaves the shared experts out, as it converts MLP names to the experts' parameters)
    "glm4_moe-all-linear": (dict(arch="glm4_moe", num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                 head_dim=16), dict(r=4, target_modules="all-linear")),
    # a softmax router choosing by a selection bias (peft's all-linear takes the router and experts here)
    "ernie4_5_moe-all-linear": (dict(arch="ernie4_5_moe", num_hidden_layers=3, moe_num_experts=8, moe_k=2, moe_intermediate_size=32,
                                     moe_num_shared_experts=1), dict(r=4, target_modules="all-linear")),
}


@pytest.fixture(scope="module", params=list(CASES))
def adapted(request, tmp_path_factory):
    base_options, lora_options = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    base = make_checkpoint(path / "base", **base_options)
    expected_base = hf_logits(base, TOKENS)
    peft_model = make_adapter(path / "adapter", base, **lora_options)
    expected = hf_logits(peft_model, TOKENS)
    return request.param, path, expected_base, expected


def test_logits_match_peft(adapted):
    """Every position within 2e-4 of transformers + peft at float32; rows without the adapter
    are the base model's, as before it was loaded."""
    name, path, expected_base, expected = adapted
    model = Model.load(path / "base")
    adapter = load_adapter(path / "adapter", model.config)
    before = model.forward(TOKENS, model.new_cache(), all_logits=True)
    model.set_adapters([adapter])
    got = model.forward(TOKENS, model.new_cache(), all_logits=True, adapter=adapter)
    assert np.abs(expected - expected_base).max() > 0.05, "the adapter changes nothing: the test would not see it skipped"
    assert np.abs(got - expected).max() <= 2e-4, name
    np.testing.assert_array_equal(model.forward(TOKENS, model.new_cache(), all_logits=True), before)
    assert np.abs(before - expected_base).max() <= 1e-4


def test_prefill_then_decode_with_an_adapter_equals_one_pass(adapted):
    name, path, _, _ = adapted
    model = Model.load(path / "base")
    adapter = load_adapter(path / "adapter", model.config)
    model.set_adapters([adapter])
    whole = model.forward(TOKENS, model.new_cache(), all_logits=True, adapter=adapter)
    cache = model.new_cache()
    model.forward(TOKENS[:20], cache, adapter=adapter)
    for t in range(20, len(TOKENS)):
        np.testing.assert_array_equal(model.forward(TOKENS[t : t + 1], cache, adapter=adapter), whole[t])


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def two_adapters(request, tmp_path_factory):
    """Two adapters on one base: a Llama, or a mixture of experts whose `style` adapter updates
    its experts too (a step's expert rows then mix adapters and the base)."""
    path = tmp_path_factory.mktemp("two")
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if request.param == "qwen3_moe" else {}
    base = make_checkpoint(path / "base", arch=request.param, tie_word_embeddings=False, **moe)
    expected = {None: hf_logits(base, TOKENS)}
    for name, seed, options in (("style", 1, dict(r=8, target_modules="all-linear")), ("task", 2, dict(r=4, target_modules=["q_proj", "v_proj"]))):
        peft_model = make_adapter(path / name, base, seed=seed, **options)
        expected[name] = hf_logits(peft_model, TOKENS)
        base = peft_model.unload()
    expected["style+task"] = hf_logits(with_adapters(path / "base", [path / "style", path / "task"]), TOKENS)
    return path, expected


def test_rows_of_different_adapters_in_one_step_equal_each_alone(two_adapters):
    """Three sequences, two adapters and the base, decoded together: each row's logits are what
    that sequence gives decoded alone, bit for bit."""
    path, _ = two_adapters
    model = Model.load(path / "base")
    adapters = [load_adapter(path / name, model.config) for name in ("style", "task")]
    model.set_adapters(adapters)
    choice = [adapters[0], None, adapters[1]]
    prompts = [TOKENS[:5], TOKENS[3:20], TOKENS[10:11]]
    steps = [TOKENS[20:26], TOKENS[26:32], TOKENS[32:38]]
    alone = []
    for prompt, step, adapter in zip(prompts, steps, choice):
        cache = model.new_cache()
        model.forward(prompt, cache, adapter=adapter)
        alone.append(np.stack([model.forward([t], cache, adapter=adapter).copy() for t in step]))
    pool = KVPool(model.config, model.ctx, 4, model.kv_format)
    held = [pool.acquire() for _ in prompts]
    for (slot, cache), prompt, adapter in zip(held, prompts, choice):
        model.forward(prompt, cache, adapter=adapter)
    rows = [model.adapter_index(a) for a in choice]
    for i in range(len(steps[0])):
        positions = [cache.length for _, cache in held]
        logits = model.step([s[i] for s in steps], positions, [slot for slot, _ in held], pool, adapters=rows).copy()
        for _, cache in held:
            cache.length += 1
        for b in range(len(prompts)):
            np.testing.assert_array_equal(logits[b], alone[b][i])


def test_the_engine_serves_adapters_and_the_base_together(two_adapters):
    """Requests for two adapters and the base at once: each one's tokens and log-probabilities
    (prompt and generated) are what it gets alone; the prefix cache serves a prompt again only
    to the adapter that computed it."""
    path, expected = two_adapters
    model = Model.load(path / "base")
    adapters = {name: load_adapter(path / name, model.config) for name in ("style", "task")}
    model.set_adapters(adapters.values())
    prompt = np.random.default_rng(5).integers(0, VOCAB, size=70).tolist()

    def run(engine, name, out):
        handle = engine.submit(prompt, GREEDY, 8, logprobs=2, prompt_logprobs=1, adapter=adapters.get(name))
        out[name] = [(e.token, e.logprob, e.top_logprobs) for e in handle], [(e.token, e.logprob) for e in handle.prompt_logprobs]

    alone: dict = {}
    for name in ("style", None, "task"):
        run(Engine(model, Options(max_batch=1, cache_mb=0)), name, alone)
    assert len({str(v) for v in alone.values()}) == 3
    engine = Engine(model, Options(max_batch=4, cache_mb=64))
    together: dict = {}
    threads = [threading.Thread(target=run, args=(engine, name, together)) for name in ("style", None, "task")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert together == alone
    # the same prompt again: from the prefix cache for its own adapter, computed anew for another
    first = engine.submit(prompt, GREEDY, 1, adapter=adapters["style"])
    tokens = [e.token for e in first]
    assert first.cached_tokens > 0 and tokens == [alone["style"][0][0][0]]
    fresh = Engine(model, Options(max_batch=1, cache_mb=64))
    list(fresh.submit(prompt, GREEDY, 1, adapter=adapters["style"]))
    other = fresh.submit(prompt, GREEDY, 1, adapter=adapters["task"])
    assert [e.token for e in other] == [alone["task"][0][0][0]] and other.cached_tokens == 0
    base = fresh.submit(prompt, GREEDY, 1)
    assert [e.token for e in base] == [alone[None][0][0][0]] and base.cached_tokens == 0


def test_adapters_combined_sum_their_updates(two_adapters):
    path, expected = two_adapters
    model = Model.load(path / "base")
    style, task = (load_adapter(path / name, model.config) for name in ("style", "task"))
    both = combined([style, task])
    half = style.scaled(0.5)
    model.set_adapters([both, half, style])
    base = model.forward(TOKENS, model.new_cache(), all_logits=True)
    one = model.forward(TOKENS, model.new_cache(), all_logits=True, adapter=style)
    assert np.abs(one - expected["style"]).max() <= 2e-4
    together = model.forward(TOKENS, model.new_cache(), all_logits=True, adapter=both)
    assert np.abs(together - one).max() > 1e-3  # task's update is in it too
    assert np.abs(together - expected["style+task"]).max() <= 2e-4  # peft's model with both active
    cache = model.new_cache()  # two updates on one matrix: one thread adds both, so every pass sums alike
    model.forward(TOKENS[:20], cache, adapter=both)
    for t in range(20, len(TOKENS)):
        np.testing.assert_array_equal(model.forward(TOKENS[t : t + 1], cache, adapter=both), together[t])
    for _ in range(3):
        np.testing.assert_array_equal(model.forward(TOKENS, model.new_cache(), all_logits=True, adapter=both), together)
    halfway = model.forward(TOKENS, model.new_cache(), all_logits=True, adapter=half)
    assert [u.scale / 2 for u in style.updates] == [u.scale for u in half.updates]
    assert np.abs(halfway - base).max() > 1e-3 and np.abs(halfway - one).max() > 1e-3


def _adapter_dir(tmp_path, config: dict, tensors: dict):
    from minillm.loading.safetensors_io import write_safetensors

    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    write_safetensors(tmp_path / "adapter_model.safetensors", tensors)
    return tmp_path


@pytest.mark.parametrize("case,config,tensors,message", [
    ("unknown-module", {}, {"base_model.model.model.layers.0.self_attn.x_proj.lora_A.weight": (4, 48),
                            "base_model.model.model.layers.0.self_attn.x_proj.lora_B.weight": (48, 4)}, "is not a linear layer"),
    ("layer-out-of-range", {}, {"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": (4, 48),
                                "base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight": (48, 4)}, "is not a linear layer"),
    ("shape", {}, {"base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight": (4, 48),
                   "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight": (48, 4)}, "the base matrix [16, 48]"),
    ("rank", {"r": 8}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 48),
                        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": (48, 4)}, "rank 8"),
    ("half-pair", {}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 48)}, "lora_B missing"),
    ("dora", {"use_dora": True}, {}, "DoRA"),
    ("embedding", {}, {"base_model.model.model.embed_tokens.lora_embedding_A": (4, 97)}, "an embedding's LoRA"),
    ("alpha", {"lora_alpha": "x"}, {}, "'lora_alpha'"),
    ("pattern", {"rank_pattern": {"q_proj(": 2}}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 48),
                                                   "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": (48, 4)}, "not a regular expression"),
    ("experts-on-dense", {"target_parameters": ["gate_up_proj"]}, {"base_model.model.model.layers.0.mlp.experts.lora_A.weight": (4, 48),
                                                               "base_model.model.model.layers.0.mlp.experts.lora_B.weight": (144, 4)},
     "not a mixture of experts' layer"),
])
def test_bad_adapters_are_one_clear_error(tmp_path, case, config, tensors, message):
    base = tmp_path / "base"
    make_checkpoint(base)
    model_config = Model.load(base).config
    settings = dict(peft_type="LORA", r=4, lora_alpha=8, target_modules=["q_proj"])
    settings.update(config)
    path = _adapter_dir(tmp_path / case, settings, {k: np.zeros(shape, np.float32) for k, shape in tensors.items()})
    with pytest.raises(CheckpointError) as error:
        load_adapter(path, model_config)
    assert message in str(error.value) and str(path) in str(error.value)


def test_a_missing_adapter_is_one_clear_error(tmp_path):
    base = tmp_path / "base"
    make_checkpoint(base)
    config = Model.load(base).config
    with pytest.raises(CheckpointError, match="a LoRA adapter is a directory"):
        load_adapter(tmp_path / "nowhere", config)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="adapter_config.json: missing"):
        load_adapter(tmp_path / "empty", config)


def test_lora_specs():
    assert parse_lora_spec("dir") == (None, "dir", 1.0)
    assert parse_lora_spec("a=dir:0.5") == ("a", "dir", 0.5)
    assert parse_lora_spec("/x/y:z") == (None, "/x/y:z", 1.0)
    with pytest.raises(CheckpointError):
        parse_lora_spec("=dir")



@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_gguf_adapter_gives_its_safetensors_logits(tmp_path, arch):
    """The same adapter written as llama.cpp's converter writes it runs the same as PEFT's files."""
    from lora_tiny import write_gguf_adapter

    base = make_checkpoint(tmp_path / "base", arch=arch, tie_word_embeddings=False)
    make_adapter(tmp_path / "adapter", base, r=8, lora_alpha=16, target_modules="all-linear")
    model = Model.load(tmp_path / "base")
    cfg = model.config
    path = write_gguf_adapter(tmp_path / "adapter", tmp_path / "adapter.gguf", arch, cfg.num_hidden_layers, cfg.num_attention_heads,
                              cfg.num_key_value_heads)
    from_peft, from_gguf = load_adapter(tmp_path / "adapter", cfg), load_adapter(path, cfg)
    assert from_gguf.name == "adapter" and len(from_gguf.updates) == len(from_peft.updates)
    model.set_adapters([from_peft, from_gguf])
    expected = model.forward(TOKENS, model.new_cache(), all_logits=True, adapter=from_peft)
    np.testing.assert_array_equal(model.forward(TOKENS, model.new_cache(), all_logits=True, adapter=from_gguf), expected)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_adapter_runs_as_stored(tmp_path, dtype):
    """An adapter saved in bfloat16 or float16 is kept so (half the bytes read per step) and
    widened exactly: peft's logits with the same values in float32; its GGUF (the converter's
    --outtype f16) runs the same bits."""
    import torch
    from lora_tiny import rounded_to, stored_as, write_gguf_adapter

    torch_dtype = getattr(torch, dtype)
    base = make_checkpoint(tmp_path / "base", tie_word_embeddings=False)
    peft_model = make_adapter(tmp_path / "adapter", base, r=8, target_modules="all-linear")
    rounded_to(peft_model, torch_dtype)
    expected = hf_logits(peft_model, TOKENS)
    stored_as(tmp_path / "adapter", torch_dtype)
    model = Model.load(tmp_path / "base")
    adapter = load_adapter(tmp_path / "adapter", model.config)
    assert {u.a.dtype.str for u in adapter.updates} == {"<u2" if dtype == "bfloat16" else "<f2"}
    model.set_adapters([adapter])
    got = model.forward(TOKENS, model.new_cache(), all_logits=True, adapter=adapter)
    assert np.abs(got - expected).max() <= 2e-4
    if dtype == "float16":
        cfg = model.config
        path = write_gguf_adapter(tmp_path / "adapter", tmp_path / "adapter.gguf", "llama", cfg.num_hidden_layers, cfg.num_attention_heads,
                                  cfg.num_key_value_heads, dtype="float16")
        from_gguf = load_adapter(path, cfg)
        model.set_adapters([adapter, from_gguf])
        np.testing.assert_array_equal(model.forward(TOKENS, model.new_cache(), all_logits=True, adapter=from_gguf), got)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_merge_lora_equals_peft_merge_and_unload(tmp_path, arch):
    """`minillm merge-lora` (through the CLI's function): every tensor within 1e-5 of what peft's
    merge_and_unload gives (a dense model; a mixture of experts' experts and router, whose
    checkpoint stores them per expert, by its logits), and the merged checkpoint runs the
    adapter's logits."""
    import argparse

    from safetensors.numpy import load_file

    from minillm.cli import cmd_merge_lora

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if arch == "qwen3_moe" else {}
    base = make_checkpoint(tmp_path / "base", arch=arch, tie_word_embeddings=False, **moe)
    peft_model = make_adapter(tmp_path / "adapter", base, r=8, lora_alpha=16, target_modules="all-linear", rank_pattern={"v_proj": 3})
    expected_logits = hf_logits(peft_model, TOKENS)
    merged = {name: t.detach().numpy() for name, t in peft_model.merge_and_unload().state_dict().items()}
    cmd_merge_lora(argparse.Namespace(model=str(tmp_path / "base"), lora=[str(tmp_path / "adapter")], out=str(tmp_path / "merged")))
    ours = load_file(str(tmp_path / "merged" / "model.safetensors"))
    if not moe:
        assert set(ours) == set(merged)
        for name, w in ours.items():
            np.testing.assert_allclose(w, merged[name], rtol=0, atol=1e-5, err_msg=name)
    model = Model.load(tmp_path / "merged")
    assert np.abs(model.forward(TOKENS, model.new_cache(), all_logits=True) - expected_logits).max() <= 2e-4
    assert (tmp_path / "merged" / "config.json").is_file() and not list(tmp_path.glob(".merged*"))
    with pytest.raises(Exception, match="already exists"):
        cmd_merge_lora(argparse.Namespace(model=str(tmp_path / "base"), lora=[str(tmp_path / "adapter")], out=str(tmp_path / "merged")))


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])  # q4_0 needs rows of whole 32-blocks: the benchmark runs it
def test_adapters_on_a_lower_precision_base(two_adapters, dtype):
    """The base in another weight format, the update beside it unchanged: rows of two adapters
    and the base in one step equal each alone, bit for bit, and the adapter moves the logits as
    it does at float32 (to the base format's own error)."""
    path, _ = two_adapters
    exact = Model.load(path / "base")
    model = Model.load(path / "base", dtype=dtype)
    for m in (exact, model):
        m.set_adapters([load_adapter(path / name, m.config) for name in ("style", "task")])
    shift = exact.forward(TOKENS, exact.new_cache(), all_logits=True, adapter=exact.adapters[0]) - exact.forward(TOKENS, exact.new_cache(), all_logits=True)
    ours = model.forward(TOKENS, model.new_cache(), all_logits=True, adapter=model.adapters[0]) - model.forward(TOKENS, model.new_cache(), all_logits=True)
    assert np.abs(ours - shift).mean() < 0.25 * np.abs(shift).mean()  # a mean: int8 may flip a MoE's routing at a position
    pool = KVPool(model.config, model.ctx, 4, model.kv_format)
    choice = [model.adapters[0], None, model.adapters[1]]
    held = [pool.acquire() for _ in choice]
    prompts = [TOKENS[:7], TOKENS[5:20], TOKENS[9:10]]
    for (slot, cache), prompt, adapter in zip(held, prompts, choice):
        model.forward(prompt, cache, adapter=adapter)
    logits = model.step([1, 2, 3], [c.length for _, c in held], [s for s, _ in held], pool, adapters=[model.adapter_index(a) for a in choice]).copy()
    for b, (prompt, adapter) in enumerate(zip(prompts, choice)):
        cache = model.new_cache()
        model.forward(prompt, cache, adapter=adapter)
        np.testing.assert_array_equal(model.forward([b + 1], cache, adapter=adapter), logits[b])
