"""Models by name (`--model ORG/NAME`, `ORG/NAME:QUANT`; minillm.loading.hub) against a stand-in
for the Hugging Face Hub on 127.0.0.1 (HF_ENDPOINT): only the files a model needs are fetched,
once; a cut transfer resumes; the cache serves offline; the same files by name and by path give
the same tokens; each failure is one line and exit code 2; pull, list and rm."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf_tiny import write_gguf
from hf_tiny import make_checkpoint
from hub_standin import TOKEN, StandInHub
from reasoning_tiny import make_reasoning_model

import minillm
from minillm.core.model import Model
from minillm.errors import HubError, UsageError
from minillm.loading import hub as hubs
from minillm.loading.hub import ModelName, choose_files, names_a_model, quant_of
from minillm.options import Options

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, str(ROOT / "cli.py")]
CHECKPOINT = "minillm-test/tiny-qwen3"
GGUFS = "minillm-test/tiny-llama-GGUF"
PROMPT = [2, 5, 7, 11, 3]
CHECKPOINT_NEEDS = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny checkpoint (with a tokenizer and chat template) and one tiny model at three GGUF quantizations."""
    root = tmp_path_factory.mktemp("hub_files")
    checkpoint = make_reasoning_model(root / "ckpt", "qwen3")
    make_checkpoint(root / "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    ggufs = {f"tiny-llama-{tag}.gguf": write_gguf(root / "llama", root / f"tiny-llama-{tag}.gguf", qtype)
             for tag, qtype in (("Q4_0", QT.Q4_0), ("Q8_0", QT.Q8_0), ("Q4_K_M", QT.Q4_K))}
    return checkpoint, ggufs, root / "llama"


@pytest.fixture
def hub(files, tmp_path, monkeypatch):
    """The stand-in Hub holding both repositories (with files a model does not need beside them),
    selected through the environment as a user would, with an empty cache."""
    checkpoint, ggufs, _ = files
    with StandInHub() as standin:
        repo = {p.name: p.read_bytes() for p in checkpoint.iterdir() if p.is_file()}
        repo.update({"README.md": b"# tiny", "pytorch_model.bin": b"not needed", "onnx/model.onnx": b"not needed"})
        standin.add(CHECKPOINT, repo)
        gguf_repo = {name: path.read_bytes() for name, path in ggufs.items()}
        gguf_repo["mmproj-tiny-llama-F16.gguf"] = b"a vision projector, not a model"
        standin.add(GGUFS, gguf_repo)
        monkeypatch.setenv("HF_ENDPOINT", standin.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield standin


def greedy(source) -> str:
    with minillm.load(source, progress=False) as llm:
        return llm.generate(PROMPT, max_tokens=12, temperature=0)


def cli(*args, extra_env=None):
    env = dict(os.environ, **(extra_env or {}))
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_a_checkpoint_by_name_fetches_what_loading_reads_once_and_then_runs_offline(hub, files, monkeypatch):
    by_path = greedy(files[0])
    assert greedy(CHECKPOINT) == by_path
    assert set(hub.gets(CHECKPOINT)) == CHECKPOINT_NEEDS  # no README, .bin twin or ONNX export
    assert greedy(CHECKPOINT) == by_path  # the cache: asked about, not fetched again
    assert len(hub.gets(CHECKPOINT)) == len(CHECKPOINT_NEEDS)
    asked = len(hub.log)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert greedy(CHECKPOINT) == by_path
    assert len(hub.log) == asked  # offline: not one request


def test_a_gguf_repository_gives_the_quantization_named_and_a_default(hub, files, capsys, monkeypatch):
    ggufs = files[1]
    hub.cut_once.add(f"{GGUFS}/tiny-llama-Q8_0.gguf")  # its first transfer stops halfway
    path = hubs.resolve(f"{GGUFS}:q8_0", progress=False)  # tags are case-insensitive, as llama.cpp's -hf
    assert path.read_bytes() == ggufs["tiny-llama-Q8_0.gguf"].read_bytes()
    assert hub.gets(GGUFS) == ["tiny-llama-Q8_0.gguf"] * 2  # cut, then fetched again (a file under 10 MiB starts over)
    assert greedy(f"{GGUFS}:Q8_0") == greedy(ggufs["tiny-llama-Q8_0.gguf"])
    assert len(hub.gets(GGUFS)) == 2  # once: loading by name again asks, does not fetch
    asked = len(hub.log)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hubs.resolve(f"{GGUFS}:Q8_0", progress=False) == path and len(hub.log) == asked
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert hubs.resolve(GGUFS).name == "tiny-llama-Q4_K_M.gguf"
    said = capsys.readouterr().err
    assert "using Q4_K_M" in said and "Q4_0, Q4_K_M, Q8_0" in said  # which, and the others there are
    assert "mmproj" not in said


def test_a_cut_transfer_resumes_where_it_stopped(hub, tmp_path):
    # huggingface_hub writes what it received in 10 MiB pieces; a range request asks for the rest
    data = os.urandom(25 * 2**20)
    hub.add("minillm-test/big-GGUF", {"big-Q4_0.gguf": data})
    hub.cut_once.add("minillm-test/big-GGUF/big-Q4_0.gguf")
    path = hubs.resolve("minillm-test/big-GGUF:Q4_0", progress=False)
    assert path.read_bytes() == data
    ranges = [r for method, _, r in hub.log if method == "GET" and r]
    assert ranges == [f"bytes={10 * 2**20}-"]
    assert hub.sent["minillm-test/big-GGUF/big-Q4_0.gguf"] < 1.2 * len(data)


def test_a_sharded_checkpoint_loads_from_the_cache_links(hub, tmp_path):
    # the Hub's cache links each snapshot file to a blob outside the snapshot directory
    make_checkpoint(tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 1
    hub.add("minillm-test/sharded", {p.name: p.read_bytes() for p in (tmp_path / "sharded").iterdir()})
    path = hubs.resolve("minillm-test/sharded", progress=False)
    assert (path / shards[0]).is_symlink()
    by_name, by_path = Model.load(path), Model.load(tmp_path / "sharded")
    np.testing.assert_array_equal(by_name.forward(PROMPT, by_name.new_cache()), by_path.forward(PROMPT, by_path.new_cache()))


def test_a_gated_repository_needs_a_token(hub, files, monkeypatch):
    hub.add("minillm-test/gated", {p.name: p.read_bytes() for p in files[0].iterdir() if p.is_file()}, gated=True)
    with pytest.raises(HubError, match="gated: accept its terms .* and set HF_TOKEN"):
        hubs.resolve("minillm-test/gated", progress=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert (hubs.resolve("minillm-test/gated", progress=False) / "model.safetensors").is_file()


def test_a_revision_names_a_branch_tag_or_commit(hub, files):
    repo = hub.repos[CHECKPOINT]
    repo.revisions["v1"] = repo.revisions["main"]
    assert hubs.resolve(CHECKPOINT, "v1", progress=False).name == repo.revisions["main"]
    assert hubs.resolve(CHECKPOINT, repo.revisions["main"], progress=False).name == repo.revisions["main"]
    with pytest.raises(HubError, match="has no revision 'v2'"):
        hubs.resolve(CHECKPOINT, "v2", progress=False)
    with pytest.raises(UsageError, match="--revision is for a Hugging Face Hub name"):
        Options(model=str(files[0]), revision="v1")


def test_a_split_gguf_by_name_loads_as_one_file(hub, files, tmp_path):
    (tmp_path / "split").mkdir()
    first = write_gguf(files[2], tmp_path / "split" / "tiny-llama-Q8_0.gguf", QT.Q8_0, split_max_tensors=8)
    parts = sorted(first.parent.iterdir())
    assert first.name == "tiny-llama-Q8_0-00001-of-00003.gguf" and len(parts) == 3
    hub.add("minillm-test/split-GGUF", {f"Q8_0/{p.name}": p.read_bytes() for p in parts})
    path = hubs.resolve("minillm-test/split-GGUF:Q8_0", progress=False)
    assert path.name == first.name and sorted(hub.gets("minillm-test/split-GGUF")) == [f"Q8_0/{p.name}" for p in parts]
    assert greedy(path) == greedy(files[1]["tiny-llama-Q8_0.gguf"])  # the same tensors as the whole file
    parts[2].unlink()
    with pytest.raises(minillm.GGUFError, match="missing part 3 of 3"):
        minillm.load(first, progress=False)


@pytest.mark.slow
def test_each_failure_is_one_line_and_exit_code_2(hub, tmp_path):
    assert_one_line_error(cli("pull", "minillm-test/no-such-model"), "no model minillm-test/no-such-model on http://127.0.0.1")
    hub.add("minillm-test/gated", {"config.json": b"{}", "model.safetensors": b"x"}, gated=True)
    assert_one_line_error(cli("pull", "minillm-test/gated"), "is gated", "HF_TOKEN")
    assert_one_line_error(cli("generate", "--model", f"{GGUFS}:Q5_K_M", "--prompt", "hi"),
                          "has no Q5_K_M file; it has: Q4_0, Q4_K_M, Q8_0")
    assert_one_line_error(cli("pull", GGUFS, extra_env={"HF_HUB_OFFLINE": "1"}), "HF_HUB_OFFLINE is set", "not in the cache")
    closed = f"http://127.0.0.1:{_closed_port()}"
    assert_one_line_error(cli("generate", "--model", CHECKPOINT, "--prompt", "hi", extra_env={"HF_ENDPOINT": closed}),
                          f"cannot reach {closed}", "not in the cache")
    assert_one_line_error(cli("generate", "--model", "weigths/missing-dir", "--prompt", "hi"), "weigths/missing-dir")


@pytest.mark.slow
def test_pull_list_and_rm(hub):
    pulled = cli("pull", f"{GGUFS}:Q4_0")
    assert pulled.returncode == 0, pulled.stderr
    assert Path(pulled.stdout.strip()).name == "tiny-llama-Q4_0.gguf"
    assert cli("pull", f"{GGUFS}:Q8_0").returncode == 0
    assert cli("pull", CHECKPOINT).returncode == 0
    listed = cli("list").stdout.splitlines()
    assert listed[0].split() == ["NAME", "SIZE", "MODIFIED"]
    names = [line.split()[0] for line in listed[1:]]
    assert names == [f"{GGUFS}:Q4_0", f"{GGUFS}:Q8_0", CHECKPOINT]
    removed = cli("rm", f"{GGUFS}:q4_0")
    assert removed.returncode == 0 and "deleted" in removed.stderr
    assert [line.split()[0] for line in cli("list").stdout.splitlines()[1:]] == [f"{GGUFS}:Q8_0", CHECKPOINT]
    blobs = list((Path(os.environ["HF_HUB_CACHE"]) / f"models--{GGUFS.replace('/', '--')}" / "blobs").iterdir())
    assert len(blobs) == 1  # Q4_0's bytes are gone, Q8_0's stay
    assert cli("rm", CHECKPOINT).returncode == 0
    assert_one_line_error(cli("rm", CHECKPOINT), "not in the cache")
    assert_one_line_error(cli("rm", f"{GGUFS}:Q4_0"), "not in the cache; cached: " + f"{GGUFS}:Q8_0")


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a name means, without a network

def test_names_and_paths():
    assert ModelName.parse("Qwen/Qwen3-0.6B-GGUF:Q4_K_M") == ModelName("Qwen/Qwen3-0.6B-GGUF", "Q4_K_M")
    assert ModelName.parse("HuggingFaceTB/SmolLM2-135M-Instruct") == ModelName("HuggingFaceTB/SmolLM2-135M-Instruct", None)
    assert ModelName.parse("model.gguf") is None and ModelName.parse("a/b/c") is None
    assert not names_a_model("./org/name") and not names_a_model("/abs/path") and not names_a_model(None)
    assert not names_a_model("weights/model.Q4_0.gguf")  # a missing file, not a repository named model.Q4_0.gguf
    assert names_a_model("org/name:Q8_0")
    assert Options(model="org/name:Q8_0").served_name == "org/name:Q8_0"


def test_quantizations_read_from_file_names():
    assert quant_of("Llama-3.2-1B-Instruct-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_of("qwen3-8b-iq4_xs.gguf") == "IQ4_XS"
    assert quant_of("Model-UD-Q4_K_XL-00001-of-00003.gguf") == "Q4_K_XL"
    assert quant_of("gpt-oss-20b-mxfp4.gguf") == "MXFP4"
    assert quant_of("model.Q8_0.gguf") == "Q8_0"
    assert quant_of("model-bf16.gguf") == "BF16"
    assert quant_of("model.gguf") is None


def test_which_files_a_name_picks():
    name = ModelName("o/m", None)
    split = {"Q4_K_M/m-Q4_K_M-00001-of-00002.gguf": 5, "Q4_K_M/m-Q4_K_M-00002-of-00002.gguf": 5, "m-Q8_0.gguf": 12, "mmproj-m-f16.gguf": 1}
    assert choose_files(name, split).files == ("Q4_K_M/m-Q4_K_M-00001-of-00002.gguf", "Q4_K_M/m-Q4_K_M-00002-of-00002.gguf")
    assert choose_files(name, split).entry == "Q4_K_M/m-Q4_K_M-00001-of-00002.gguf"
    no_default = {"m-Q8_0.gguf": 8, "m-IQ4_XS.gguf": 4, "m-Q4_0.gguf": 5, "m-Q2_K.gguf": 2}
    assert choose_files(name, no_default).entry == "m-IQ4_XS.gguf"  # the smallest 4-bit, not the smallest
    assert "the smallest 4-bit file" in choose_files(name, no_default).note
    assert choose_files(ModelName("o/m", "UD-Q4_K_XL"), {"m-UD-Q4_K_XL.gguf": 1, "m-Q4_K_M.gguf": 1}).entry == "m-UD-Q4_K_XL.gguf"
    mistral = {"config.json": 1, "consolidated.safetensors": 9, "model-00001-of-00002.safetensors": 5,
               "model-00002-of-00002.safetensors": 4, "model.safetensors.index.json": 1, "tokenizer.json": 1, "params.json": 1}
    assert choose_files(name, mistral).files == ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                                 "model.safetensors.index.json", "tokenizer.json")
    with pytest.raises(HubError, match="has no GGUF files"):
        choose_files(ModelName("o/m", "Q4_0"), mistral)
    with pytest.raises(HubError, match="neither a safetensors checkpoint"):
        choose_files(name, {"README.md": 1})


def test_ollamas_pull_fetches_a_model_by_name_and_serves_it(hub, files):
    import ollama
    from conftest import running_server

    from minillm.serving.server import server_app

    app, models = server_app(lambda opts: minillm.load(options=opts, progress=False), Options(), [f"local={files[0]}"])
    try:
        with running_server(app) as base:
            client = ollama.Client(host=base)
            statuses = [p.status for p in client.pull(f"{GGUFS}:Q8_0", stream=True)]
            assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
            assert any(s and s.startswith("pulling tiny-llama-Q8_0.gguf") for s in statuses), statuses  # the transfer's progress
            assert f"{GGUFS}:Q8_0" in [m.model for m in client.list().models]
            raw = client.generate(model=f"{GGUFS}:Q8_0", prompt="hello the answer", raw=True, options={"temperature": 0, "num_predict": 4})
            assert raw.done and raw.eval_count == 4
            with pytest.raises(ollama.ResponseError, match="no model minillm-test/missing"):
                client.pull("minillm-test/missing", stream=False)
            with pytest.raises(ollama.ResponseError, match="takes a Hugging Face Hub name"):
                client.pull("llama3.2")
    finally:
        models.close_all()


def test_a_served_model_that_cannot_be_fetched_is_a_clear_error(hub, files):
    from conftest import httpx, running_server

    from minillm.serving.server import server_app

    app, models = server_app(lambda opts: minillm.load(options=opts, progress=False), Options(),
                             [f"local={files[0]}", "gone=minillm-test/missing"])
    try:
        with running_server(app) as base:
            listed = httpx.get(base + "/v1/models").json()["data"]
            assert [(m["id"], m["loaded"]) for m in listed] == [("local", False), ("gone", False)]
            answer = httpx.post(base + "/v1/completions", json={"model": "gone", "prompt": "hello", "max_tokens": 2})
            assert answer.status_code == 500 and answer.json()["error"]["code"] == "model_load_failed"
            assert "no model minillm-test/missing" in answer.json()["error"]["message"]
            unknown = httpx.post(base + "/v1/completions", json={"model": "other", "prompt": "hello", "max_tokens": 2})
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
            assert httpx.post(base + "/v1/completions", json={"model": "local", "prompt": "hello", "max_tokens": 2}).status_code == 200
    finally:
        models.close_all()
