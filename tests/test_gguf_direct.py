"""GGUF files run as stored (`--model FILE.gguf`): every block format gives, bit for bit, the
logits of the same file imported (dequantized) and run at float32, but Q4_0, Q8_0, Q4_K and Q6_K
regrouped for integer products (kernels.integer_products), which come within 16-bit activations'
error; decode, batched decode and prefill agree; `--dtype q4_0` quantizes a checkpoint as
llama.cpp's Q4_0 does."""

import json
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf_tiny import write_gguf
from hf_tiny import VOCAB, make_checkpoint

from minillm import kernels as K
from minillm.core.model import Model
from minillm.loading.gguf_import import import_gguf

TOKENS = np.random.default_rng(5).integers(0, VOCAB, size=40)
SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
K_SHAPES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def mixture(name):
    """A Q4_K_M-like mixture: most matrices Q4_K, V and down Q6_K, the embedding Q8_0, one F16."""
    if name == "token_embd.weight":
        return QT.Q8_0
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        return QT.Q6_K
    if name == "blk.1.attn_output.weight":
        return QT.F16
    return QT.Q4_K


def v_at_q8_0(name):
    """As llama.cpp's Q4_K_M makes the default model (rows of 576 are not whole 256s): V in Q8_0
    (grouped: integer products) beside Q, K and the rest in Q5_0, so one input meets two kinds of
    products."""
    return QT.Q8_0 if name.endswith("attn_v.weight") else QT.Q5_0


def v_mixed_layers(name):
    """V in Q8_0 in one layer and Q5_0 in the other (llama.cpp's Q4_K_M does this): the decode
    kernel takes each kind of matrix at one dtype; both are block rows, one grouped, one not."""
    return QT.Q8_0 if name == "blk.0.attn_v.weight" else QT.Q5_0


CASES = {
    "q4_0": ("llama", SMALL, QT.Q4_0),
    "q4_1": ("llama", SMALL, QT.Q4_1),
    "q5_0": ("qwen3", dict(SMALL, head_dim=32), QT.Q5_0),
    "q5_1": ("llama", SMALL, QT.Q5_1),
    "q8_0": ("gemma3", dict(SMALL, head_dim=32, query_pre_attn_scalar=32, sliding_window=5), QT.Q8_0),
    "f16": ("phi3", SMALL, QT.F16),
    "bf16": ("olmo2", SMALL, QT.BF16),
    "q4_k": ("llama", K_SHAPES, QT.Q4_K),
    "q5_k": ("llama", K_SHAPES, QT.Q5_K),
    "q6_k": ("llama", K_SHAPES, QT.Q6_K),
    "mixture": ("llama", dict(K_SHAPES, tie_word_embeddings=False), mixture),
    "v_at_q8_0": ("llama", SMALL, v_at_q8_0),
    "v_mixed_layers": ("llama", SMALL, v_mixed_layers),
    # families of the architecture specs: Ernie's pairs put in halves on the stored rows, then regrouped; Granite's multipliers
    "ernie_q8_0": ("ernie4_5", dict(SMALL, head_dim=16), QT.Q8_0),
    "granite_q4_1": ("granite", dict(SMALL, embedding_multiplier=6.0, attention_multiplier=0.09, residual_multiplier=0.3, logits_scaling=2.5),
                     QT.Q4_1),
}


GROUPED_CASES = ("q4_0", "q5_0", "q8_0", "q4_k", "q6_k", "mixture", "v_at_q8_0", "v_mixed_layers", "ernie_q8_0")  # with Q4_0, Q5_0, Q8_0, Q4_K or Q6_K matrices in whole groups of 16 rows


@pytest.fixture(scope="module", params=list(CASES))
def gguf_case(request, tmp_path_factory):
    arch, shape, qtype = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    make_checkpoint(root / "hf", arch=arch, **shape)
    path = write_gguf(root / "hf", root / "model.gguf", qtype=qtype)
    import_gguf(path, root / "imported", progress=False)
    return request.param, path, root / "imported"


def test_stored_formats_give_the_dequantized_models_logits(gguf_case):
    case, path, imported = gguf_case
    direct = Model.load(path, activations=16)  # the default's 8 bits: test_each_format_runs_at_its_default_activations
    # an all-BF16 file runs on the bfloat16 kernels: what its import gives at bfloat16
    exact = Model.load(imported, dtype={"bf16": "bfloat16"}.get(case, "float32"))
    assert direct.dtype == exact.dtype if exact.dtype == "bfloat16" else direct.dtype == "gguf"
    ours = direct.forward(TOKENS, direct.new_cache(), all_logits=True)
    reference = exact.forward(TOKENS, exact.new_cache(), all_logits=True)
    # float32 sums and one int8 matrix, or Q4_0, Q5_0, Q8_0, Q4_K and Q6_K regrouped (kernels.integer_products: integer
    # products with activations quantized to 16 bits per block): close, not equal
    assert any(f.group_of for f in direct.weights.formats) == (case in GROUPED_CASES)
    if case in ("v_at_q8_0", *GROUPED_CASES):
        # each position within a small share of its largest logit: a block's 16-bit levels lose
        # its values far below its largest, and these random models have outliers (the q6_k
        # case's worst position: 0.3% of a logit of 121, the others under 0.05%)
        scale = np.abs(reference).max(axis=-1, keepdims=True)
        assert (np.abs(ours - reference) <= 5e-3 * scale).all()
        assert np.median(np.abs(ours - reference).max(-1) / scale[:, 0]) < 1e-3
        assert np.array_equal(ours.argmax(-1), reference.argmax(-1))
        return
    np.testing.assert_array_equal(ours, reference)
    assert direct.weights.nbytes < 0.75 * exact.weights.nbytes or case in ("f16", "bf16")


def test_stored_formats_decode_and_batch_as_they_prefill(gguf_case):
    decodes_and_batches_as_it_prefills(Model.load(gguf_case[1]))


@pytest.mark.parametrize("gguf_case", GROUPED_CASES, indirect=True)
def test_eight_bit_activations_decode_batch_and_stay_close(gguf_case):
    """`--activations 8` (llama.cpp's numerics against grouped layouts): the same bits however a
    row arrives, and close to 16 bits (8-bit levels: a block's error ~1/254 of its
    largest value instead of ~1/65000)."""
    model = Model.load(gguf_case[1], activations=8)
    assert any(f.name.endswith("_R16_A8") for f in model.formats) and not any(f.name.endswith("_R16") for f in model.formats)
    decodes_and_batches_as_it_prefills(model)
    sixteen = Model.load(gguf_case[1], activations=16)
    ours, theirs = (m.forward(TOKENS, m.new_cache(), all_logits=True) for m in (model, sixteen))
    # per position, the largest difference as a share of the largest logit: these random models'
    # outliers make the worst position's large (the q6_k case's 1.3), the typical one is not
    # (measured medians 1e-4 to 0.03, top-1 the same at 95-100% of positions)
    share = np.abs(ours - theirs).max(-1) / np.abs(theirs).max(-1)
    assert not np.array_equal(ours, theirs) and np.median(share) < 0.05
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("gguf_case", GROUPED_CASES, indirect=True)
def test_each_format_runs_at_its_default_activations(gguf_case):
    """Unless chosen, each grouped format meets activations of its own default width (8 where
    perplexity stays within llama.cpp's own + 0.5 points: docs/performance.md); a dict chooses
    per format, the rest keeping their default; the default runs exactly as those choices do."""
    default = Model.load(gguf_case[1])
    regrouped = sorted({f.group_of for f in default.formats if f.group_of})
    assert regrouped and all(f.activation_bits == K.BY_NAME[f.group_of].default_activations for f in default.formats if f.group_of)
    chosen = Model.load(gguf_case[1], activations={name: K.BY_NAME[name].default_activations for name in regrouped})
    flipped = Model.load(gguf_case[1], activations={regrouped[0]: {16: 8, 8: 16}[K.BY_NAME[regrouped[0]].default_activations]})
    assert chosen.formats == default.formats and flipped.formats != default.formats
    logits = [m.forward(TOKENS, m.new_cache(), all_logits=True) for m in (default, chosen, flipped)]
    np.testing.assert_array_equal(logits[0], logits[1])
    assert not np.array_equal(logits[0], logits[2])


def decodes_and_batches_as_it_prefills(model):
    """A prompt's logits prefilled at once equal it read in a chunk then decoded token by token,
    and five sequences decoded together equal each decoded alone, bit for bit."""
    from minillm.core.cache import KVPool

    full = model.forward(TOKENS, model.new_cache(), all_logits=True)
    cache = model.new_cache()
    steps = [model.forward(TOKENS[:7], cache).copy()] + [model.forward([t], cache).copy() for t in TOKENS[7:20]]
    np.testing.assert_array_equal(np.stack(steps), full[6:20])
    # five sequences decoded together (a tile of four and one alone) against each alone
    prompts = [TOKENS[:3 + i] for i in range(5)]
    pool = KVPool(model.config, model.ctx, 5)
    held = [pool.acquire() for _ in prompts]
    slots, caches = [s for s, _ in held], [c for _, c in held]
    for prompt, c in zip(prompts, caches):
        model.forward(prompt, c)
    together = [model.decode_batch(TOKENS[20 + 5 * i : 25 + 5 * i], caches, slots, pool).copy() for i in range(3)]
    for b, prompt in enumerate(prompts):
        alone = model.new_cache()
        model.forward(prompt, alone)
        mine = np.stack([model.forward([TOKENS[20 + 5 * i + b]], alone).copy() for i in range(3)])
        np.testing.assert_array_equal(np.stack([t[b] for t in together]), mine)


@pytest.mark.parametrize("tied", [True, False])
def test_q4_0_at_load_is_llama_cpps_q4_0(tmp_path, tied):
    """--dtype q4_0 on a checkpoint gives what the checkpoint converted to a Q4_0 GGUF gives: every
    matrix Q4_0 but the output one (the LM head, or the embeddings tied to it), Q8_0 as llama.cpp
    makes it where rows are not whole blocks of 256."""
    make_checkpoint(tmp_path / "hf", tie_word_embeddings=tied, **SMALL)
    output = "token_embd.weight" if tied else "output.weight"
    path = write_gguf(tmp_path / "hf", tmp_path / "q4.gguf", qtype=lambda name: QT.Q8_0 if name == output else QT.Q4_0)
    at_load = Model.load(tmp_path / "hf", dtype="q4_0")
    stored = Model.load(path)
    np.testing.assert_array_equal(
        at_load.forward(TOKENS, at_load.new_cache(), all_logits=True), stored.forward(TOKENS, stored.new_cache(), all_logits=True)
    )


def test_untied_embeddings_run_from_the_files_map(tmp_path):
    """Untied embeddings are read a row per token: they stay in the file's blocks, mapped (a page
    in memory once a token used it, as llama.cpp keeps them; an 8B's are 280-560 MB), not
    regrouped into this process's memory as the matrices it multiplies by are."""
    import mmap

    make_checkpoint(tmp_path / "hf", tie_word_embeddings=False, vocab_size=128, **SMALL)  # rows in whole groups of 16
    model = Model.load(write_gguf(tmp_path / "hf", tmp_path / "q4.gguf", qtype=QT.Q4_0))
    embed, head = model.weights.embed, model.weights.lm_head
    assert embed.format.name == "Q4_0" and head.format.group_of == "Q4_0"
    base = embed.w
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    assert isinstance(base, mmap.mmap)


def test_vectors_are_read_not_mapped(gguf_case):
    """Norms and biases are read from the file, not taken from its map: touching the map faults
    in the page cache's whole folio around a page, which held megabytes of matrices already
    copied into their grouped layout in this process's memory (gguf_file.GGUFModel._raw)."""
    from minillm.loading.gguf_file import GGUFModel, tensor_bytes

    _, path, _ = gguf_case
    model = GGUFModel(path)
    vectors = [t for t in model.entries.values() if len(t.shape) == 1]
    assert vectors
    for t in vectors:
        read, mapped = model._raw(t), tensor_bytes(model._maps[0], model.layout, t)
        np.testing.assert_array_equal(read, mapped)
        assert not np.shares_memory(read, model._maps[0]), t.name


def test_a_gguf_converts_to_other_precisions(gguf_case):
    _, path, imported = gguf_case
    converted = Model.load(path, dtype="float32")
    exact = Model.load(imported)
    np.testing.assert_array_equal(converted.forward(TOKENS, converted.new_cache(), all_logits=True),
                                  exact.forward(TOKENS, exact.new_cache(), all_logits=True))


def test_default_model_runs_from_its_gguf(default_gguf, default_model_dir):
    """The shipped Q4_1 file run as stored gives the logits of its float32 import at a fifth of
    the memory, and the same greedy text. Its Q4_1 matrices give the float32 sums exactly; its
    Q8_0 embedding, tied to the LM head, runs on integer products against 16-bit activations
    (measured max difference 0.0017 on logits up to 32) or, its default, 8-bit ones (llama.cpp's
    numerics: perplexity +0.13% on tests/data, llama.cpp's own +0.17%)."""
    import minillm

    tokens = np.random.default_rng(0).integers(0, 49152, size=24)
    direct, imported = Model.load(default_gguf, activations=16), Model.load(default_model_dir)
    ours = direct.forward(tokens, direct.new_cache(), all_logits=True)
    exact = imported.forward(tokens, imported.new_cache(), all_logits=True)
    np.testing.assert_allclose(ours, exact, rtol=0, atol=1e-2)
    assert np.array_equal(ours.argmax(-1), exact.argmax(-1))
    assert direct.weights.nbytes < imported.weights.nbytes / 5
    default = Model.load(default_gguf)
    eight = default.forward(tokens, default.new_cache(), all_logits=True)
    assert (eight.argmax(-1) == exact.argmax(-1)).mean() >= 0.9 and np.abs(eight - exact).max() < 1.0
    prompt = "The capital of France is"
    a = minillm.load(default_gguf, activations=16).generate(prompt, max_tokens=16, temperature=0)
    b = minillm.load(default_model_dir).generate(prompt, max_tokens=16, temperature=0)
    assert a == b and len(a) > 0


def test_cli_bench_and_generate_on_a_gguf(default_gguf):
    from pathlib import Path

    cli = Path(__file__).resolve().parent.parent / "cli.py"
    out = subprocess.run([sys.executable, str(cli), "bench", "--model", str(default_gguf), "--prompt-tokens", "16",
                          "--gen-tokens", "4", "--json", "--activations", "8"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["dtype"] == "gguf" and result["decode_tok_s"] > 0 and result["activations"] == 8
    assert set(result) >= {"prefill_tok_s", "decode_tok_s", "ttft_s", "load_s", "weight_mb", "peak_rss_mb"}
    out = subprocess.run([sys.executable, str(cli), "generate", "--model", str(default_gguf), "--prompt", "Hi",
                          "--max-tokens", "4", "--temperature", "0"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout, out.stderr


def test_a_type_minillm_cannot_run_as_stored_is_one_line(tmp_path):
    """A file with a tensor type minillm has no kernel for (IQ4_NL) is refused at load, naming
    the tensor; converting it at load works."""
    from minillm.errors import CheckpointError

    make_checkpoint(tmp_path / "hf", **SMALL)
    path = write_gguf(tmp_path / "hf", tmp_path / "iq.gguf", qtype=lambda name: QT.IQ4_NL if "ffn_up" in name else None)
    with pytest.raises(CheckpointError, match="ffn_up|up_proj.*cannot run as stored"):
        Model.load(path)
    Model.load(path, dtype="float32")
