"""Config, sampling, streaming detokenization, stop strings and chat templates."""

import numpy as np
import pytest

from minillm.core.model import rope_inv_freq
from minillm.core.sampling import SamplingParams, draw, top_p_keep, apply_repetition_penalty, sample
from minillm.errors import ConfigError, GenerationError, TokenizerError
from minillm.loading.config import ModelConfig

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def cfg(**changes):
    raw = dict(BASE)
    raw.update(changes)
    return ModelConfig.from_dict(raw)


# ---------------------------------------------------------------- config


def test_config_derived_values():
    c = cfg()
    assert (c.head_dim, c.n_rep, c.q_dim, c.kv_dim) == (16, 2, 64, 32)
    assert cfg(head_dim=24).q_dim == 96


def test_v4_and_v5_rope_spellings_agree():
    v4 = cfg(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    v5 = cfg(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192, "rope_theta": 500000.0})
    assert v4 == v5
    assert cfg(rope_scaling={"type": "linear", "factor": 2.0}).rope_scaling.rope_type == "linear"


def test_rope_inv_freq_matches_transformers():
    pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    hf = LlamaConfig(**{k: v for k, v in BASE.items() if k != "architectures"}, rope_parameters=params)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = rope_inv_freq(cfg(rope_parameters=params))
    np.testing.assert_allclose(ours, expected.numpy(), rtol=2e-7)


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"architectures": None}, "architectures"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "proportional", "factor": 4.0}}, "rope_type"),
        ({"rope_parameters": {"rope_type": "mrope", "factor": 2.0}}, "rope_type"),
        ({"rope_parameters": {"rope_type": "longrope", "long_factor": [1.0], "short_factor": "x"}}, "short_factor"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": -2.0}}, "factor"),
        ({"rope_parameters": {"rope_type": "dynamic"}}, "factor"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": -64}, "hidden_size"),
        ({"vocab_size": "100"}, "vocab_size"),
        ({"rms_norm_eps": 0}, "rms_norm_eps"),
        ({"head_dim": 15}, "head_dim"),
        ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),  # Llama's transformers code has none
        ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 1.5}, "partial_rotary_factor"),
        ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.01}, "partial_rotary_factor"),
        ({"architectures": ["Qwen3ForCausalLM"], "num_experts": 8}, "num_experts"),
        ({"architectures": ["Gemma3ForCausalLM"], "vision_config": {"hidden_size": 8}}, "vision_config"),
        ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"architectures": ["Gemma3ForCausalLM"], "hidden_activation": "relu"}, "hidden_activation"),
        ({"architectures": ["SmolLM3ForCausalLM"], "no_rope_layers": [1]}, "no_rope_layers"),
        ({"architectures": ["Gemma2ForCausalLM"], "final_logit_softcapping": -1.0}, "final_logit_softcapping"),
    ],
)
def test_config_errors_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        cfg(**changes)


def test_sliding_windows_per_layer_as_transformers_derives_them():
    c = cfg(architectures=["MistralForCausalLM"], sliding_window=1024, max_position_embeddings=32768)
    assert c.context_size() == 4096 and [c.layer_window(i) for i in range(2)] == [1024, 1024]
    assert cfg(architectures=["MistralForCausalLM"]).layer_window(0) == 4096  # MistralConfig's default
    assert cfg(architectures=["MistralForCausalLM"], sliding_window=None).layer_window(0) == 0
    qwen = dict(architectures=["Qwen3ForCausalLM"], sliding_window=64, max_window_layers=1, head_dim=8)
    assert [cfg(**qwen).layer_window(i) for i in range(2)] == [0, 0]  # use_sliding_window false
    assert [cfg(**qwen, use_sliding_window=True).layer_window(i) for i in range(2)] == [0, 64]
    gemma = cfg(architectures=["Gemma3ForCausalLM"], num_hidden_layers=7, sliding_window=32, head_dim=8)
    assert [gemma.layer_window(i) for i in range(7)] == [32] * 5 + [0, 32]  # every 6th layer full
    assert gemma.layer_rope(0) != gemma.layer_rope(5)  # local and global bases
    smol = cfg(architectures=["SmolLM3ForCausalLM"], num_hidden_layers=4)
    assert [smol.layer_rope(i) is not None for i in range(4)] == [True, True, True, False]
    with pytest.raises(ConfigError, match="layer_types"):
        cfg(architectures=["MistralForCausalLM"], layer_types=["full_attention"])  # 1 of 2 layers


def test_default_context_is_capped():
    assert cfg(max_position_embeddings=131072).context_size() == 4096
    assert cfg(max_position_embeddings=512).context_size() == 512
    assert cfg(max_position_embeddings=131072).context_size(9000) == 9000


# ---------------------------------------------------------------- sampling


def test_greedy_is_argmax():
    logits = np.array([0.1, 3.0, -1.0, 2.9], np.float32)
    assert sample(logits, SamplingParams(temperature=0), np.random.default_rng(0)) == 1


@pytest.mark.parametrize("top_k", [0, 40])
@pytest.mark.parametrize("temperature", [1e-45, 1e-60])  # float32 overflows; rounds to 0
def test_a_vanishing_temperature_is_greedy(top_k, temperature):
    logits = np.random.default_rng(4).standard_normal(1000).astype(np.float32) * 10
    logits[0] = 0.0
    assert sample(logits, SamplingParams(temperature=temperature, top_k=top_k), np.random.default_rng(0)) == int(logits.argmax())


def test_top_k_one_is_greedy():
    logits = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    rng = np.random.default_rng(0)
    for _ in range(20):
        assert sample(logits, SamplingParams(temperature=2.0, top_k=1, min_p=0), rng) == int(logits.argmax())


def test_top_p_and_min_p_restrict_support():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    rng = np.random.default_rng(0)
    top_p = {sample(logits, SamplingParams(temperature=1, top_k=0, top_p=0.75, min_p=0), rng) for _ in range(300)}
    assert top_p == {0, 1}
    min_p = {sample(logits, SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0.25), rng) for _ in range(300)}
    assert min_p == {0, 1, 2}


def test_sampling_follows_the_distribution():
    probs = np.array([0.6, 0.3, 0.1])
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0)
    draws = [sample(np.log(probs).astype(np.float32), params, rng) for _ in range(4000)]
    np.testing.assert_allclose(np.bincount(draws, minlength=3) / 4000, probs, atol=0.03)


def test_top_p_on_flat_logits_keeps_every_tied_token():
    """Flat logits: every token ties with the least probable of those top_p needs, so all stay."""
    logits = np.zeros(5000, np.float32)
    rng = np.random.default_rng(0)
    draws = {sample(logits, SamplingParams(temperature=1, top_k=0, top_p=0.9, min_p=0), rng) for _ in range(200)}
    assert max(draws) > 4000 and len(draws) > 150


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
def test_top_p_keeps_the_shortest_best_first_prefix(top_p):
    """Against the plain definition: sort best first, keep up to the token whose cumulative mass
    reaches top_p."""
    logits = (np.random.default_rng(9).standard_normal(49152) * 2).astype(np.float32)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    n = int(np.searchsorted(np.cumsum(probs[order], dtype=np.float64), top_p, side="left")) + 1
    assert set(np.flatnonzero(top_p_keep(probs, top_p))) == set(order[:n].tolist())


def test_draw_is_the_inverse_of_the_cumulative_sum():
    """Block sums then one block's cumulative sum pick what one cumulative sum over all weights
    picks. Small integer weights make every sum exact, so even u on a boundary must agree; zero
    weights (a grammar's masked tokens) are never drawn, not even at u just below 1."""
    weights = np.random.default_rng(5).integers(0, 4, 1000).astype(np.float32)  # 3 blocks and a tail
    weights[255] = weights[-1] = 0.0
    cumulative = np.cumsum(weights, dtype=np.float64)
    total = cumulative[-1]
    us = np.concatenate([np.arange(int(total)) / total, np.random.default_rng(6).random(500), [1 - 2**-53]])
    for u in us:
        expected = int(np.searchsorted(cumulative, u * total, side="right"))
        assert draw(weights, u) == expected and weights[expected] > 0


def test_repetition_penalty():
    logits = np.array([2.0, -2.0, 1.0], np.float32)
    out = apply_repetition_penalty(logits, [0, 1, 1], 2.0)
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0])
    assert logits[0] == 2.0  # input untouched


def test_logits_that_allow_no_token_raise():
    with pytest.raises(GenerationError, match="-inf"):
        sample(np.full(300, -np.inf, np.float32), SamplingParams(top_k=0), np.random.default_rng(0))


def test_nan_logits_raise():
    with pytest.raises(GenerationError, match="NaN"):
        sample(np.array([0.0, np.nan], np.float32), SamplingParams(), np.random.default_rng(0))


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-1), dict(temperature=float("nan")), dict(top_p=0), dict(top_p=1.5),
               dict(top_k=-1), dict(min_p=2), dict(repetition_penalty=0), dict(seed=-3)]
)
def test_bad_sampling_params(kwargs):
    with pytest.raises(GenerationError):
        SamplingParams(**kwargs)


# ---------------------------------------------------------------- text


class FakeTokenizer:
    """Byte-level: each id is one UTF-8 byte."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_stream_decoder_keeps_multibyte_characters_whole():
    from minillm.core.detokenize import StreamDecoder

    text = "a€b😀c日本"
    decoder = StreamDecoder(FakeTokenizer())
    pieces = [decoder.push(b) for b in text.encode("utf-8")] + [decoder.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "😀" in pieces  # emitted whole, once its four bytes are in


def test_text_stream_stop_strings():
    from minillm.core.detokenize import TextStream

    class Tokens:
        finish_reason = "length"
        cancelled = False

        def __init__(self, text):
            self.tokens = list(text.encode())

        def __iter__(self):
            from minillm.core.engine import TokenEvent

            return (TokenEvent(t) for t in self.tokens)

        def cancel(self):
            self.cancelled = True

    def run(text, stop):
        stream = TextStream(Tokens(text), FakeTokenizer(), stop)
        return "".join(stream), stream.finish_reason

    assert run("hello world. bye", ["."]) == ("hello world", "stop")
    assert run("hello world", ["xyz"]) == ("hello world", "length")
    assert run("abcabd", ["abd"]) == ("abc", "stop")
    assert run("ending with ab", ["abd"]) == ("ending with ab", "length")
    assert run("xx<|end|>yy", ["<|end|>", "yy"]) == ("xx", "stop")


def test_chat_template_sandbox(tmp_path, default_model_dir):
    import json
    import shutil

    from minillm.core.tokenizer import Tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="sandbox"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_raise_exception_and_bad_messages(default_model_dir, tmp_path):
    import json
    import shutil

    from minillm.core.tokenizer import Tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "ok"
    with pytest.raises(TokenizerError, match="user first"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    with pytest.raises(TokenizerError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])


@pytest.mark.parametrize("preset, expected", [
    ({}, ("ACTIVE", "300000")),  # set by kernels: libgomp's default spin, also once a second thread runs kernels
    ({"OMP_WAIT_POLICY": "PASSIVE"}, ("PASSIVE", None)),  # a user's own choice wins
    ({"GOMP_SPINCOUNT": "1000"}, (None, "1000")),
])
def test_kernels_keep_openmp_spinning_unless_the_user_chose(preset, expected):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | preset
    code = "import os; from minillm import kernels; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert tuple(None if v == "None" else v for v in out) == (expected if sys.platform.startswith("linux") else (preset.get("OMP_WAIT_POLICY"), preset.get("GOMP_SPINCOUNT")))


def test_kernel_caches_go_stale_with_any_file_of_the_package(tmp_path, monkeypatch):
    """Kernels inline intrinsics and helpers from the package's other files, so each kernel's
    on-disk cache is stamped with all of them: Numba's own stamp (the defining file only) kept
    the old decode kernel's machine code after a change to integer_products.py. The formats'
    compiled kernels (numba cfuncs) are stamped so too."""
    from minillm.kernels import jit
    from minillm.kernels.forward import forward

    from minillm import kernels

    for dispatcher in (forward, kernels.top_k, kernels.kernels_for(kernels.BY_NAME["Q4_0_R16"]).linear):
        assert isinstance(dispatcher._cache._impl.locator, jit.PackageCacheLocator)
        assert dispatcher._cache._cache_file._source_stamp == jit.PackageCacheLocator.STAMP == jit._package_stamp()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    monkeypatch.setattr(jit, "PACKAGE_DIR", tmp_path)
    stamp = jit._package_stamp()
    (tmp_path / "b.py").write_text("y = 3\n")
    assert jit._package_stamp() != stamp


def test_kernel_caches_stay_where_numba_puts_them(tmp_path):
    import os
    import subprocess
    import sys

    code = "from minillm import kernels; print(kernels.top_k._cache.cache_path)"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out.startswith(str(tmp_path))


def test_written_safetensors_put_tensors_on_cache_lines(tmp_path):
    """write_safetensors (GGUF imports) pads the header so tensor data start on 64-byte lines:
    a 64-byte vector load of a row then reads one line, not two. The safetensors library reads
    the file back unchanged."""
    from safetensors.numpy import load_file

    from minillm.loading.safetensors_io import SafetensorsFile, write_safetensors

    rng = np.random.default_rng(0)
    tensors = {
        "odd": rng.standard_normal(7).astype(np.float32),  # 28 bytes: written after the whole lines
        "matrix": rng.standard_normal((48, 16)).astype(np.float32),
        "ids": np.arange(16, dtype=np.int64),
        "half": rng.standard_normal((4, 32)).astype(np.float16),
    }
    path = tmp_path / "model.safetensors"
    write_safetensors(path, tensors, metadata={"format": "pt"})
    back = load_file(str(path))
    assert all(np.array_equal(back[name], arr) and back[name].dtype == arr.dtype for name, arr in tensors.items())
    mapped = SafetensorsFile(path)
    for name in ("matrix", "ids", "half"):
        assert mapped.raw(name).ctypes.data % 64 == 0, name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "q4_0"])
def test_weights_start_on_cache_lines(tmp_path, dtype):
    """Every weight matrix starts on a cache line, whatever the file's offsets: transformers'
    files (padded to 8 bytes) are copied where they are not, converted weights are allocated so."""
    from hf_tiny import make_checkpoint

    from minillm.core.model import Model
    from minillm.loading.safetensors_io import SafetensorsFile

    make_checkpoint(tmp_path / "hf", hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path / "hf" / "model.safetensors"
    raw = path.read_bytes()  # the header padded so that every tensor sits 8 bytes past a line
    n = int.from_bytes(raw[:8], "little")
    header = raw[8 : 8 + n].rstrip(b" ")
    header += b" " * (-len(header) % 64)  # data start 8 + len(header): 8 past a line
    path.write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + n :])
    model = Model.load(tmp_path / "hf", dtype=dtype)
    layers = model.weights.layers
    matrices = [getattr(layer, name).w for layer in layers for name in ("q", "k", "v", "o", "gate", "up", "down")]
    assert all(w.ctypes.data % 64 == 0 for w in matrices + [model.weights.embed.w, model.weights.lm_head.w])
    if dtype == "float32":  # the same values as the file's
        stored = SafetensorsFile(path).raw("model.layers.0.mlp.gate_proj.weight")
        assert stored.ctypes.data % 64 == 8
        np.testing.assert_array_equal(layers[0].gate.w, stored)


def test_each_spec_s_default_rope_base_is_its_config_class_s():
    """Where config.json names no RoPE base, each family takes its transformers config class's
    default_theta (Mixtral 1e6, SmolLM3 2e6, gpt-oss 150000, Ernie 4.5 and OLMo 3 500000, ...)."""
    import transformers

    from minillm.architectures import SPECS

    for spec in SPECS:
        config_class = getattr(transformers, spec.hf_names[0].replace("ForCausalLM", "Config"), None)
        if spec.hf_names[0] in ("Gemma3ForCausalLM", "Llama4ForCausalLM"):  # the text models' own config classes
            config_class = getattr(transformers, spec.hf_names[0].replace("ForCausalLM", "TextConfig"))
        theirs = getattr(config_class, "default_theta", 10_000.0)
        theirs = theirs["global"] if isinstance(theirs, dict) else theirs
        assert spec.rope_theta == theirs, spec.hf_names[0]


def test_the_format_table_agrees_with_gguf_py():
    """Each GGUF format's block (weights, bytes) is gguf-py's GGML_QUANT_SIZES for its ggml type (or
    whole ggml blocks of it: F16 runs in blocks of 32), and a regrouped layout keeps the blocks of
    the format it regroups."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from minillm.kernels.formats import BY_NAME, FORMATS, layouts_of, with_activations

    for fmt in FORMATS:
        if fmt.ggml_type is not None and fmt.is_gguf_blocks:
            weights, size = GGML_QUANT_SIZES[GGMLQuantizationType(fmt.ggml_type)]
            assert fmt.block % weights == 0 and fmt.block_bytes == fmt.block // weights * size, fmt.name
        if fmt.group_of:
            source = BY_NAME[fmt.group_of]
            assert (fmt.block, fmt.block_bytes) == (source.block, source.block_bytes) and fmt.name.startswith(source.grouped)
            assert fmt.name in layouts_of(source.name) and with_activations(fmt, 16).name == source.grouped
            assert with_activations(fmt).activation_bits == source.default_activations in (16, 8)
            assert with_activations(fmt, {source.name: 16}).name == source.grouped and with_activations(fmt, {"F32": 16}) == with_activations(fmt)
        elif not fmt.groupable:
            assert with_activations(fmt, 8) == with_activations(fmt) == fmt  # nothing to choose


def test_every_format_names_its_kernels_once():
    """The table is the dispatch: each GGUF format run as stored has its block reader, each grouped
    layout its regrouping, row reader and tile, registered under the format's code, and nothing is
    registered for a format that cannot use it (a stale kernel, or a job a row does not have)."""
    import minillm.kernels  # noqa: F401 - every kernel module registers its functions as it is imported
    from minillm.kernels.formats import FORMATS, registered_jobs

    needs = {}
    for fmt in FORMATS:
        if fmt.group_of:
            needs[fmt.name] = {"regroup", "row", "tile"}
        elif fmt.ggml_type is not None:
            needs[fmt.name] = {"chunks"}
    assert registered_jobs() == needs


def test_activations_are_16_or_8_bits():
    from minillm.errors import UsageError
    from minillm.options import Options

    assert Options().activations is None and Options(activations=8).activations == 8  # None: each format's default
    with pytest.raises(UsageError, match="activations must be 16 or 8"):
        Options(activations=12)
    assert Options.from_strings({"activations": "8"}).activations == 8  # as Ray Serve's key=value gives it


def test_warmup_compiles_the_grouped_layouts_for_the_activations_chosen(capsys):
    """`warmup --activations 8` warms the 8-bit layouts a GGUF's matrices will run as (and the flag
    exists on warmup, as on the commands that load a model)."""
    from minillm.cli import main
    from minillm.warmup import formats_for

    assert {f.name for f in formats_for(names=["Q4_0"], activations=8)} == {"Q4_0", "Q4_0_R16_A8"}
    assert {f.name for f in formats_for(names=["Q4_0"], activations=16)} == {"Q4_0", "Q4_0_R16"}
    assert {f.name for f in formats_for(names=["Q4_0", "MXFP4"])} == {"Q4_0", "Q4_0_R16_A8", "MXFP4", "MXFP4_R16"}  # their defaults
    assert main(["warmup", "--formats", "Q4_0", "--activations", "8"]) == 0
    assert "Q4_0_R16_A8" in capsys.readouterr().err
