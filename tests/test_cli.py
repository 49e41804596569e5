"""The command line: errors are one line and exit code 2; generation needs no torch."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hf_tiny import VOCAB, hf_logits, make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, str(ROOT / "cli.py")]


def run(*args, env=None, timeout=300):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    oracle = make_checkpoint(path, tie_word_embeddings=False)
    return path, oracle


@pytest.fixture
def broken(tiny, tmp_path):
    """A fresh copy of the tiny checkpoint to damage."""
    dest = tmp_path / "model"
    shutil.copytree(tiny[0], dest)
    return dest


def test_logits_command_writes_every_position(tiny, tmp_path):
    path, oracle = tiny
    out = tmp_path / "logits.npy"
    result = run("logits", "--model", str(path), "--tokens", "3,1,4,1,5,9,2,6", "--out", str(out))
    assert result.returncode == 0, result.stderr
    logits = np.load(out)
    assert logits.dtype == np.float32 and logits.shape == (8, VOCAB)
    assert np.abs(logits - hf_logits(oracle, [3, 1, 4, 1, 5, 9, 2, 6])).max() <= 1e-4


@pytest.mark.parametrize("tokens", ["1,2,x", "", "1,,2", "1.5", "99999"])
def test_malformed_tokens(tiny, tmp_path, tokens):
    result = run("logits", "--model", str(tiny[0]), "--tokens", tokens, "--out", str(tmp_path / "x.npy"))
    assert_one_line_error(result)
    assert not (tmp_path / "x.npy").exists()


def test_missing_config(broken, tmp_path):
    (broken / "config.json").unlink()
    assert_one_line_error(run("logits", "--model", str(broken), "--tokens", "1,2", "--out", str(tmp_path / "x.npy")), "config.json")


def test_missing_model_dir(tmp_path):
    assert_one_line_error(run("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"), "nope")


def _rewrite(path: Path, drop: str | None = None, reshape: str | None = None):
    """Re-save model.safetensors without one tensor, or with one tensor's shape wrong."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_tensor(broken, tmp_path):
    _rewrite(broken, drop="model.layers.1.mlp.up_proj.weight")
    result = run("logits", "--model", str(broken), "--tokens", "1,2", "--out", str(tmp_path / "x.npy"))
    assert_one_line_error(result, "model.layers.1.mlp.up_proj.weight", "missing")


def test_wrong_shape(broken, tmp_path):
    _rewrite(broken, reshape="model.layers.0.self_attn.k_proj.weight")
    result = run("logits", "--model", str(broken), "--tokens", "1,2", "--out", str(tmp_path / "x.npy"))
    assert_one_line_error(result, "model.layers.0.self_attn.k_proj.weight", "shape")


def test_unsupported_architecture(broken, tmp_path):
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    result = run("logits", "--model", str(broken), "--tokens", "1,2", "--out", str(tmp_path / "x.npy"))
    assert_one_line_error(result, "architectures", "GPTNeoXForCausalLM")


def test_unsupported_activation(broken, tmp_path):
    config = json.loads((broken / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (broken / "config.json").write_text(json.dumps(config))
    result = run("logits", "--model", str(broken), "--tokens", "1,2", "--out", str(tmp_path / "x.npy"))
    assert_one_line_error(result, "hidden_act")


def test_truncated_safetensors(broken, tmp_path):
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    result = run("logits", "--model", str(broken), "--tokens", "1,2", "--out", str(tmp_path / "x.npy"))
    assert_one_line_error(result, "model.safetensors")


def test_bad_flag_is_one_line():
    assert_one_line_error(run("generate", "--prompt", "hi", "--max-tokens", "many"))
    assert_one_line_error(run("frobnicate"))


@pytest.mark.slow
def test_bad_sampling_value_is_one_line(default_model_dir):
    assert_one_line_error(run("generate", "--prompt", "hi", "--top-p", "0"), "top_p")
    assert_one_line_error(run("generate", "--prompt", "hi", "--temperature", "nan"), "temperature")


@pytest.mark.slow
def test_generate_without_torch(default_model_dir, tmp_path):
    """Generation runs in a process where importing torch or transformers fails."""
    for name in ("torch", "transformers"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} is blocked in this test')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    probe = subprocess.run(
        [sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert probe.returncode != 0 and "blocked" in probe.stderr
    result = run("generate", "--prompt", "The capital of France is", "--max-tokens", "12", "--temperature", "0", env=env)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.slow
def test_chat_one_turn(default_model_dir):
    result = run("chat", "--prompt", "Name three colors.", "--temperature", "0", "--max-tokens", "40")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_engine_imports_no_torch():
    code = "import sys, cli, minillm, kernels, minillm.loading.gguf_import; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_serve_with_a_broken_model_is_one_line(broken):
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    result = run("serve", "--model", str(broken), "--port", "0", timeout=120)
    assert_one_line_error(result, "architectures")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_bench_reports_speculation(default_model_dir, tmp_path, mode):
    """`bench --speculative ngram --json` after a text that repeats: the engine's decode with and
    without it (the same tokens, or bench fails), and the tokens proposed and accepted."""
    text = tmp_path / "prompt.txt"
    text.write_text("one two three four five six seven eight " * 20)
    result = run("bench", "--model", str(default_model_dir), "--prompt-file", str(text), "--gen-tokens", "24",
                 "--speculative", mode, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["spec_draft_tokens"] >= report["spec_accepted_tokens"] >= 0
    assert report["spec_decode_tok_s"] > 0 and report["engine_decode_tok_s"] > 0


def test_speculative_flags_only_where_they_act():
    assert_one_line_error(run("logits", "--tokens", "1,2", "--out", "x.npy", "--speculative", "ngram"), "unrecognized arguments")


@pytest.mark.slow
def test_generate_reads_the_prompt_from_a_file_or_stdin(default_model_dir, tmp_path):
    """--prompt-file takes the text as it is (newlines and all), '-' reads standard input; the
    same text as --prompt; an unreadable file is one line naming the flag."""
    prompt = "Line one.\nThe capital of France is"
    (tmp_path / "p.txt").write_text(prompt)
    flags = ("--model", str(default_model_dir), "--max-tokens", "8", "--temperature", "0")
    direct = run("generate", "--prompt", prompt, *flags)
    assert direct.returncode == 0, direct.stderr
    assert run("generate", "--prompt-file", str(tmp_path / "p.txt"), *flags).stdout == direct.stdout
    piped = subprocess.run([*CLI, "generate", "--prompt-file", "-", *flags], input=prompt, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert piped.stdout == direct.stdout
    assert_one_line_error(run("generate", "--prompt-file", str(tmp_path / "missing.txt"), *flags), "--prompt-file", "missing.txt")


def test_logits_with_lora_adapters(tiny, tmp_path):
    """--lora PATH[:SCALE], repeatable: the adapters' updates summed, as llama.cpp applies them;
    a bad adapter is one line."""
    from lora_tiny import make_adapter

    path, oracle = tiny
    peft_model = make_adapter(tmp_path / "adapter", oracle, r=4, target_modules=["q_proj", "v_proj", "down_proj"])
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = hf_logits(peft_model, tokens)
    peft_model.unload()
    for lora, out in (([str(tmp_path / "adapter")], "one.npy"), ([f"{tmp_path / 'adapter'}:0.5"] * 2, "halves.npy")):
        result = run("logits", "--model", str(path), *[arg for spec in lora for arg in ("--lora", spec)], "--tokens", ",".join(map(str, tokens)),
                     "--out", str(tmp_path / out))
        assert result.returncode == 0, result.stderr
        assert np.abs(np.load(tmp_path / out) - expected).max() <= 2e-4
    assert_one_line_error(run("logits", "--model", str(path), "--lora", str(tmp_path / "nowhere"), "--tokens", "1,2", "--out", str(tmp_path / "x.npy")),
                          "nowhere")
