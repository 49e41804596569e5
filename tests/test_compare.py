"""compare and perplexity: minillm against transformers, as user features."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT
from hf_tiny import make_checkpoint

from minillm.compare import compare, hf_window_scorer, load_oracle, model_window_scorer, perplexity, windows
from minillm.core.model import Model

pytestmark = pytest.mark.slow  # the default model, servers or transformers: the full suite, not the quick tier

CLI = [sys.executable, str(ROOT / "cli.py")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-compare")
    make_checkpoint(path, num_hidden_layers=4)
    return path


ARCHS = {"llama": {}, "qwen3": dict(arch="qwen3", head_dim=16),
         "gemma3": dict(arch="gemma3", head_dim=16, sliding_window=6, query_pre_attn_scalar=20)}


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny_arch(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-compare-{request.param}")
    make_checkpoint(path, num_hidden_layers=4, **ARCHS[request.param])
    return path


def test_compare_on_tiny_model_is_exact_enough(tiny):
    model, oracle = Model.load(tiny), load_oracle(tiny)
    result = compare(model, oracle, list(range(3, 40)), per_layer=True)
    assert result["overall"]["nmse"] < 1e-10 and result["overall"]["top1"] == 1.0
    assert result["overall"]["kl_mean"] < 1e-8
    assert len(result["positions"]) == 37
    assert [s["stage"] for s in result["layers"]["stages"]] == ["embedding", "layer 0", "layer 1", "layer 2", "layer 3", "final norm"]
    assert result["layers"]["first_divergence"] is None


def test_per_layer_names_the_perturbed_layer(tiny_arch):
    """Weights changed in minillm only, in layer 2: the first divergence is layer 2 (Llama, Qwen3
    with its q/k norms, Gemma 3 with its sandwich norms and sliding layers)."""
    tiny = tiny_arch
    model, oracle = Model.load(tiny), load_oracle(tiny)
    assert compare(model, oracle, list(range(3, 30)), per_layer=True)["layers"]["first_divergence"] is None
    layer = model.weights.layers[2]
    layer.gate.w[...] = layer.gate.w * 1.01  # the weights map the file copy-on-write: disk untouched
    result = compare(model, oracle, list(range(3, 30)), per_layer=True)
    assert result["layers"]["first_divergence"] == "layer 2"
    stages = {s["stage"]: s["rel_l2"] for s in result["layers"]["stages"]}
    assert stages["layer 1"] < 1e-5 < stages["layer 2"]
    # and the file on disk is untouched: a fresh load agrees again
    assert compare(Model.load(tiny), oracle, [1, 2, 3], per_layer=True)["layers"]["first_divergence"] is None


def test_windows_cover_every_token_once():
    for n, ctx, stride in [(10, 4, 2), (100, 32, 16), (7, 10, 5), (33, 8, 8)]:
        plan = list(windows(n, ctx, stride))
        assert sum(t for _, _, t in plan) == n
        assert all(end - begin <= ctx for begin, end, _ in plan)


def test_perplexity_equals_transformers(default_model_dir):
    text = (ROOT / "tests" / "data" / "lighthouse.txt").read_text()[:1500]
    model = Model.load(default_model_dir, ctx=128)
    from minillm.core.tokenizer import Tokenizer

    ids = Tokenizer(default_model_dir).encode(text)
    ours = perplexity(model_window_scorer(model), ids, 128, 64)
    theirs = perplexity(hf_window_scorer(load_oracle(default_model_dir)), ids, 128, 64)
    assert ours["tokens_scored"] == theirs["tokens_scored"] == len(ids) - 1
    assert abs(ours["perplexity"] / theirs["perplexity"] - 1) < 1e-3
    assert 1 < ours["perplexity"] < 100


def test_compare_cli_default_model_json(default_model_dir):
    result = subprocess.run(CLI + ["compare", "--per-layer", "--json"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["overall"]["nmse"] < 1e-6
    assert report["overall"]["top1"] == 1.0
    assert len(report["layers"]["stages"]) == 32  # embedding, 30 layers, final norm
    assert report["layers"]["first_divergence"] is None


def test_compare_without_transformers_is_one_line(tmp_path, tiny):
    for name in ("torch", "transformers"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('blocked')\n")
    import os

    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    result = subprocess.run(CLI + ["compare", "--model", str(tiny), "--tokens", "1,2,3"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: compare needs transformers and torch: pip install 'minillm[compare]'"]


def test_per_layer_plot_marks_where_the_json_says(tiny_arch, tmp_path):
    """The picture marks the stage the JSON names as the first divergence (a perturbed layer 2)."""
    from minillm.plots import plot_layers

    model, oracle = Model.load(tiny_arch), load_oracle(tiny_arch)
    layer = model.weights.layers[2]
    layer.up.w[...] = layer.up.w * 1.02
    result = compare(model, oracle, list(range(3, 30)), per_layer=True)
    stages = [s["stage"] for s in result["layers"]["stages"]]
    for name in ("layers.png", "layers.svg"):
        marked = plot_layers(result["layers"], tmp_path / name)
        assert (tmp_path / name).stat().st_size > 1000
        assert stages[marked] == result["layers"]["first_divergence"] == "layer 2"


def test_compare_and_perplexity_plots_from_the_cli(tiny, default_model_dir, tmp_path):
    png = tmp_path / "layers.png"
    result = subprocess.run([*CLI, "compare", "--model", str(tiny), "--tokens", "1,2,3,4,5", "--per-layer", "--plot", str(png), "--json"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["layers"]["first_divergence"] is None and png.stat().st_size > 1000
    text = ROOT / "tests" / "data" / "lighthouse.txt"
    bars = tmp_path / "ppl.svg"
    result = subprocess.run([*CLI, "perplexity", "--model", str(default_model_dir), "--file", str(text), "--ctx", "128", "--dtypes", "float32", "int8",
                             "--plot", str(bars), "--json"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)["by_dtype"]) == {"float32", "int8"} and bars.read_text().startswith("<?xml")


def test_plot_without_matplotlib_is_one_line(tiny, tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; sys.argv[0] = 'cli.py'; import cli; "
            f"sys.exit(cli.main(['compare', '--model', {str(tiny)!r}, '--tokens', '1,2', '--per-layer', '--plot', 'x.png']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "minillm[plot]" in result.stderr


def test_compare_cli_with_two_lora_adapters(tmp_path):
    """compare --lora twice: against peft's model with both adapters active, exact enough; a
    scaled adapter, which peft cannot load so, is one line."""
    from lora_tiny import make_adapter

    base = make_checkpoint(tmp_path / "base", num_hidden_layers=2)
    make_adapter(tmp_path / "a", base, r=4, target_modules=["q_proj", "v_proj"]).unload()
    make_adapter(tmp_path / "b", base, seed=2, r=8, target_modules="all-linear")
    args = [*CLI, "compare", "--model", str(tmp_path / "base"), "--tokens", ",".join(map(str, range(3, 30))), "--json"]
    result = subprocess.run([*args, "--lora", str(tmp_path / "a"), "--lora", str(tmp_path / "b")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    overall = json.loads(result.stdout)["overall"]
    assert overall["max_abs"] <= 2e-4 and overall["top1"] == 1.0
    scaled = subprocess.run([*args, "--lora", f"{tmp_path / 'a'}:0.5"], capture_output=True, text=True, timeout=300)
    assert scaled.returncode == 2 and "compare --lora" in scaled.stderr and len(scaled.stderr.strip().splitlines()) == 1
