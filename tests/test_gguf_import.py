"""GGUF files of every architecture, written by gguf-py's writer as llama.cpp's converter writes
them, imported into HF directories: the same logits as the checkpoint they came from, and the
tokenizer transformers builds from the same file."""

import numpy as np
import pytest
from gguf_tiny import make_vocab, write_gguf
from hf_tiny import VOCAB, hf_logits, make_checkpoint

from minillm.core.model import Model
from minillm.loading.gguf_import import import_gguf

TOKENS = np.random.default_rng(3).integers(0, VOCAB, size=30)

CASES = {
    "llama": dict(arch="llama", tie_word_embeddings=False),  # Q/K rows permuted in the file
    "llama-tied-mqa": dict(arch="llama", num_key_value_heads=1),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3", head_dim=16, tie_word_embeddings=False),
    "olmo2": dict(arch="olmo2", num_key_value_heads=3),
    "phi3": dict(arch="phi3"),
    "phi3-longrope": dict(arch="phi3", max_position_embeddings=64, original_max_position_embeddings=16, ctx=40,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "long_factor": [1.0, 1.5, 2.0, 3.0], "short_factor": [1.0, 1.1, 1.2, 1.3]}),
    "gemma2": dict(arch="gemma2", head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
                   attn_logit_softcapping=0.5, final_logit_softcapping=2.0),
    # Gemma 3's usual 5 sliding : 1 full layers (no pattern key in the file), local and global bases
    "gemma3": dict(arch="gemma3", num_hidden_layers=7, head_dim=16, query_pre_attn_scalar=16, sliding_window=5),
    # another pattern, written as a key; linear scaling on the global layers
    "gemma3-pattern-linear": dict(
        arch="gemma3", head_dim=8, query_pre_attn_scalar=8, sliding_window=4, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], final_logit_softcapping=3.0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}},
    ),
    # the families of the architecture specs (minillm.architectures)
    "granite": dict(arch="granite", embedding_multiplier=6.0, attention_multiplier=0.09, residual_multiplier=0.3, logits_scaling=2.5),
    "olmo3": dict(arch="olmo3", num_hidden_layers=4, sliding_window=7),  # "olmo2" with a window
    "exaone4": dict(arch="exaone4", num_hidden_layers=4, sliding_window=6, sliding_window_pattern=2, head_dim=16),
    "seed_oss": dict(arch="seed_oss", head_dim=8, attention_bias=True, attention_out_bias=True),
    "ernie4_5": dict(arch="ernie4_5", head_dim=8, use_bias=True, tie_word_embeddings=False),  # pairs rotated, as stored
    "glm4": dict(arch="glm4", head_dim=16, tie_word_embeddings=False),  # and RoPE on half of each head
    "phi3-partial": dict(arch="phi3", partial_rotary_factor=0.5),
    "cohere2": dict(arch="cohere2", num_hidden_layers=4, sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2,
                    logit_scale=0.25),
    # xIELU's parameters as llama.cpp's metadata arrays
    "apertus": dict(arch="apertus", head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 12000000.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_imported_gguf_gives_the_checkpoints_logits(tmp_path, case):
    options = dict(CASES[case])
    ctx = options.pop("ctx", None)
    oracle = make_checkpoint(tmp_path / "hf", **options)
    import_gguf(write_gguf(tmp_path / "hf", tmp_path / "model.gguf"), tmp_path / "imported", progress=False)

    model = Model.load(tmp_path / "imported", ctx=ctx)
    ours = model.forward(TOKENS, model.new_cache(), all_logits=True)
    theirs = hf_logits(oracle, TOKENS)
    assert np.abs(ours - theirs).max() <= 1e-4
    assert ((ours - theirs) ** 2).mean() / theirs.var() <= 1e-8
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    # and the same as minillm running the checkpoint itself (Gemma's 1 + w round trip may move an ulp)
    direct = Model.load(tmp_path / "hf", ctx=ctx)
    np.testing.assert_allclose(ours, direct.forward(TOKENS, direct.new_cache(), all_logits=True), rtol=0, atol=2e-5)


def test_unsupported_gguf_architecture_names_the_key(tmp_path):
    from gguf import GGUFWriter

    from minillm.errors import GGUFError

    w = GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="'general.architecture' is 'mamba'"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


TEXTS = ["the cat", " and then", "Hello World!", "in the  thin  air", "  leading spaces", "ünïcödé ✓", "x" * 40, ""]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "phi3", "qwen3"])
def test_tokenizer_is_the_one_transformers_builds_from_the_file(tmp_path, arch):
    """Our tokenizer.json from GGUF metadata against transformers' tokenizer from the same GGUF."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from minillm.architectures import spec_of_gguf
    from minillm.loading.gguf_check import check_gguf
    from minillm.loading.gguf_file import Metadata
    from minillm.loading.gguf_tokenizer import build_tokenizer_json

    kind = "bpe" if arch == "qwen3" else "spm"
    vocab = make_vocab(400, kind)
    options = dict(arch=arch, vocab_size=400, head_dim=8)
    if arch == "gemma3":
        options.update(query_pre_attn_scalar=8, sliding_window=4)
    make_checkpoint(tmp_path / "hf", **options)
    path = write_gguf(tmp_path / "hf", tmp_path / "model.gguf", vocab=vocab)
    spelling = spec_of_gguf(arch, experts=False).gguf_tokenizer
    ours = Tokenizer.from_str(build_tokenizer_json(Metadata(check_gguf(path).metadata, path), spelling))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="model.gguf")
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
