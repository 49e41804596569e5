"""The default model (SmolLM2-135M-Instruct, imported from its GGUF) against transformers reading
the very same GGUF: tokenizer ids, logits at every position, and greedy text."""

import numpy as np
import pytest
import torch

import minillm
from minillm.core.model import Model

pytestmark = pytest.mark.slow  # the default model, servers or transformers: the full suite, not the quick tier

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    "Pi is 3.14159265358979, and 2024-11-21 was a Thursday; 1,000,000 + 42 = 1000042",
    "Café, naïve, résumé, Ångström, über, façade, São Paulo",
    "日本語のテキストと中文文本,한국어",
    "Emoji: 😀🎉👍🏽 and 👨‍👩‍👧‍👦 family",
    " leading space",
    "   three leading spaces and    repeated     spaces",
    "line one\nline two\n\n\nthree newlines\r\nwindows\tand tabs",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "",
    "ﬁ ligature, ½ fraction, Ω math, ∑∫ symbols, — dash",
]


@pytest.fixture(scope="module")
def hf(default_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(default_gguf.parent), default_gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return tokenizer, model


@pytest.fixture(scope="module")
def llm(default_model_dir):
    with minillm.load(default_model_dir) as llm:
        yield llm


def test_import_wrote_an_hf_directory(default_model_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (default_model_dir / name).is_file(), name


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_ids_match_transformers(hf, llm, text):
    hf_tok, _ = hf
    assert llm.tokenizer.encode(text) == hf_tok.encode(text)


def test_tokenizer_round_trip(llm):
    for text in TEXTS:
        assert llm.tokenizer.decode(llm.tokenizer.encode(text), skip_special_tokens=False) == text


def test_chat_template_matches_transformers(hf, llm):
    hf_tok, _ = hf
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    ours = llm.tokenizer.apply_chat_template(messages)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert llm.tokenizer.encode_chat(messages) == hf_tok.encode(theirs, add_special_tokens=False)


def prompt_64(tokenizer):
    text = (
        "In the beginning of the twentieth century, the small coastal town was known for its fishing "
        "fleet and its lighthouse. Every summer, visitors arrived by train to walk along the cliffs, "
        "eat fresh bread from the bakery, and watch the boats return at dusk. The old keeper of the "
        "lighthouse kept a diary in which he wrote down the weather, the ships that passed, and the "
        "names of the children who climbed the stairs to see the great lamp."
    )
    ids = tokenizer.encode(text)
    assert len(ids) >= 64
    return ids[:64]


def test_logits_match_transformers(hf, llm):
    _, hf_model = hf
    ids = prompt_64(llm.tokenizer)
    ours = llm.logits(ids)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0].float().numpy()
    assert ours.shape == theirs.shape == (64, 49152)
    assert np.abs(ours - theirs).max() <= 2e-3
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_greedy_generation_matches_transformers(hf, llm):
    hf_tok, hf_model = hf
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": "Write a short poem about the sea."}])
    ours = llm.generate(ids, max_tokens=64, temperature=0)
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=64, do_sample=False, eos_token_id=list(llm.eos_ids), pad_token_id=2
        )
    theirs = hf_tok.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert ours == theirs
    assert len(ours) > 40


def test_prefill_then_decode_equals_full_forward(llm):
    model: Model = llm.model
    ids = prompt_64(llm.tokenizer)
    full = model.forward(ids, model.new_cache(), all_logits=True)
    cache = model.new_cache()
    steps = [model.forward(ids[:48], cache).copy()]
    steps += [model.forward([t], cache).copy() for t in ids[48:]]
    assert np.abs(np.stack(steps) - full[47:]).max() <= 1e-5


def test_seed_gives_same_text(llm):
    a = llm.generate("Once upon a time", max_tokens=24, seed=7, temperature=1.0)
    b = llm.generate("Once upon a time", max_tokens=24, seed=7, temperature=1.0)
    c = llm.generate("Once upon a time", max_tokens=24, seed=8, temperature=1.0)
    assert a == b
    assert a != c


def test_stop_string_cuts_text(llm):
    full = llm.generate("1, 2, 3, 4,", max_tokens=20, temperature=0)
    assert " 6," in full
    cut = llm.generate("1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 6,"])
    assert cut == full[: full.index(" 6,")]

