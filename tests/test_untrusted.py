"""Untrusted checkpoints, GGUF files, tokenizers and templates: every malformed input is a typed
error naming what is wrong, never a crash, a hang or an out-of-bounds read."""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT
from hf_tiny import make_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm.errors import CheckpointError, ConfigError, GGUFError, MiniLLMError, TokenizerError
from minillm.loading.checkpoint import load_checkpoint
from minillm.loading.gguf_check import check_gguf
from minillm.loading.safetensors_io import SafetensorsFile

# ------------------------------------------------------------------ builders


def safetensors_bytes(header: dict, data: bytes = b"", raw_header: bytes | None = None, length: int | None = None) -> bytes:
    raw = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def gguf_string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def gguf_bytes(kvs=(), tensors=(), data=b"", version=3, n_tensors=None, n_kv=None, alignment=32) -> bytes:
    """kvs: (key, type, payload bytes); tensors: (name, dims, ggml type, offset)."""
    out = b"GGUF" + struct.pack("<I", version)
    out += struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv)
    for key, vtype, payload in kvs:
        out += gguf_string(key) + struct.pack("<I", vtype) + payload
    for name, dims, ttype, offset in tensors:
        out += gguf_string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", ttype, offset)
    out += b"\0" * (-len(out) % alignment)
    return out + data


F32 = 0  # ggml type
ARCH = ("general.architecture", 8, gguf_string("llama"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-untrusted")
    make_checkpoint(path)
    return path


@pytest.fixture
def model_copy(tiny_dir, tmp_path):
    dest = tmp_path / "model"
    shutil.copytree(tiny_dir, dest)
    return dest


# ------------------------------------------------------------------ safetensors corpus

GOOD_TENSOR = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
SAFETENSORS_CASES = {
    "header longer than the file": (safetensors_bytes({}, length=10_000), "header length"),
    "header over 100 MB": (safetensors_bytes({}, length=200_000_000), "header length"),
    "header not JSON": (safetensors_bytes({}, raw_header=b"{not json"), "not valid UTF-8 JSON"),
    "header not UTF-8": (safetensors_bytes({}, raw_header=b'{"\xff": 1}'), "not valid UTF-8 JSON"),
    "header a list": (safetensors_bytes({}, raw_header=b"[1, 2]"), "not a JSON object"),
    "duplicate key": (safetensors_bytes({}, raw_header=b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', data=b"\0" * 4), "duplicate key"),
    "unknown dtype": (safetensors_bytes({"a": dict(GOOD_TENSOR, dtype="Q4")}, b"\0" * 16), "unknown dtype"),
    "negative dimension": (safetensors_bytes({"a": dict(GOOD_TENSOR, shape=[-2, -2])}, b"\0" * 16), "non-negative"),
    "float dimension": (safetensors_bytes({"a": dict(GOOD_TENSOR, shape=[2.0, 2])}, b"\0" * 16), "non-negative"),
    "size mismatch": (safetensors_bytes({"a": dict(GOOD_TENSOR, shape=[2, 3])}, b"\0" * 16), "do not match"),
    "huge shape wraps in int64": (safetensors_bytes({"a": dict(GOOD_TENSOR, shape=[2**62, 2**62, 16])}, b"\0" * 16), "do not match"),
    "offsets past the end": (safetensors_bytes({"a": dict(GOOD_TENSOR, data_offsets=[16, 32])}, b"\0" * 16), "do not match"),
    "gap before a tensor": (safetensors_bytes({"a": dict(GOOD_TENSOR, data_offsets=[4, 20])}, b"\0" * 20), "gap or overlap"),
    "overlapping tensors": (safetensors_bytes({"a": GOOD_TENSOR, "b": GOOD_TENSOR}, b"\0" * 16), "gap or overlap"),
    "trailing bytes": (safetensors_bytes({"a": GOOD_TENSOR}, b"\0" * 20), "truncated or padded"),
    "truncated data": (safetensors_bytes({"a": GOOD_TENSOR}, b"\0" * 8), "do not match"),
    "metadata not strings": (safetensors_bytes({"__metadata__": {"a": 1}}), "__metadata__"),
    "no header length": (b"\x01\x02", "truncated safetensors"),
}


@pytest.mark.parametrize("case", list(SAFETENSORS_CASES))
def test_malformed_safetensors(tmp_path, case):
    content, message = SAFETENSORS_CASES[case]
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=message):
        SafetensorsFile(path)


# ------------------------------------------------------------------ index files


def _shard(model_copy, index_map):
    (model_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index_map}))


def _weight_map(model_copy):
    names = list(SafetensorsFile(model_copy / "model.safetensors").tensors)
    return {n: "model.safetensors" for n in names}


@pytest.mark.parametrize(
    "shard,message",
    [
        ("../outside.safetensors", "not a plain file name"),
        ("/etc/passwd", "not a plain file name"),
        ("sub/model.safetensors", "not a plain file name"),
        ("missing.safetensors", "does not exist"),
        ("..", "not a plain file name"),
    ],
)
def test_index_paths_stay_inside_the_model(model_copy, shard, message):
    weight_map = _weight_map(model_copy)
    weight_map["model.norm.weight"] = shard
    _shard(model_copy, weight_map)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(model_copy)


def test_index_symlink_leading_out(model_copy, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(model_copy / "model.safetensors", outside)
    (model_copy / "link.safetensors").symlink_to(outside)
    _shard(model_copy, {n: "link.safetensors" for n in _weight_map(model_copy)})
    with pytest.raises(CheckpointError, match="leads outside"):
        load_checkpoint(model_copy)


def test_index_tensor_not_in_its_shard(model_copy):
    weight_map = _weight_map(model_copy)
    weight_map["model.layers.0.mlp.up_proj.weight.extra"] = "model.safetensors"
    _shard(model_copy, weight_map)
    with pytest.raises(CheckpointError, match="does not hold it"):
        load_checkpoint(model_copy)


def test_index_not_json(model_copy):
    (model_copy / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CheckpointError, match="not a valid index"):
        load_checkpoint(model_copy)


# ------------------------------------------------------------------ model level


def _edit_config(model_copy, **changes):
    config = json.loads((model_copy / "config.json").read_text())
    config.update(changes)
    (model_copy / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes,error,message",
    [
        (dict(hidden_size=50), CheckpointError, "shape"),  # disagrees with the tensors
        (dict(num_hidden_layers=3), CheckpointError, "missing tensor"),
        (dict(num_hidden_layers=1), CheckpointError, "unexpected tensor"),
        (dict(vocab_size=98), CheckpointError, "shape"),
        (dict(num_attention_heads=7), ConfigError, "num_key_value_heads"),
        (dict(rms_norm_eps=-1.0), ConfigError, "rms_norm_eps"),
        (dict(intermediate_size=0), ConfigError, "intermediate_size"),
    ],
)
def test_config_and_tensors_must_agree(model_copy, changes, error, message):
    _edit_config(model_copy, **changes)
    with pytest.raises(error, match=message):
        load_checkpoint(model_copy)


def test_config_not_json(model_copy):
    (model_copy / "config.json").write_text("{'single': 'quotes'}")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_checkpoint(model_copy)


def test_shape_mismatch_rejected_before_any_kernel_runs(model_copy, monkeypatch):
    """A Numba kernel does not check bounds: a wrong shape must never reach one."""
    from minillm import kernels
    from minillm.core.model import Model

    def forbidden(*args, **kwargs):
        raise AssertionError("a kernel ran on an unchecked checkpoint")

    for name in kernels.__all__:
        if callable(getattr(kernels, name)) and name != "rope_tables":
            monkeypatch.setattr(kernels, name, forbidden)
    _edit_config(model_copy, intermediate_size=80)
    with pytest.raises(CheckpointError, match="mlp.gate_proj.weight"):
        Model.load(model_copy, dtype="int8")


def test_nan_weights_rejected_when_asked(model_copy):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(model_copy / "model.safetensors"))
    tensors["model.layers.1.self_attn.o_proj.weight"][3, 4] = np.nan
    save_file(tensors, str(model_copy / "model.safetensors"))
    load_checkpoint(model_copy)  # by default weights are not scanned
    for dtype in ("float32", "bfloat16", "int8"):
        with pytest.raises(CheckpointError, match="NaN or Inf"):
            load_checkpoint(model_copy, dtype=dtype, check_finite=True)


def test_weights_too_large_for_int8_scales_rejected(model_copy):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(model_copy / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"][1, 2] = 1e10
    save_file(tensors, str(model_copy / "model.safetensors"))
    load_checkpoint(model_copy, dtype="bfloat16")  # bfloat16 holds it
    with pytest.raises(CheckpointError, match="down_proj.weight.*float16 scales"):
        load_checkpoint(model_copy, dtype="int8")


# ------------------------------------------------------------------ GGUF corpus

ONE_TENSOR = [("token_embd.weight", (8, 2), F32, 0)]
GGUF_CASES = {
    "bad magic": (b"GGML" + b"\0" * 60, "bad magic"),
    "empty file": (b"", "magic needs 4 bytes"),
    "version 1": (gguf_bytes(version=1), "version 1"),
    "version 99": (gguf_bytes(version=99), "version 99"),
    "huge tensor count": (gguf_bytes(n_tensors=2**62), "tensor count"),
    "huge metadata count": (gguf_bytes(n_kv=2**40), "metadata count"),
    "huge key length": (gguf_bytes(kvs=[(b"", 0, b"")], n_kv=1)[:24] + struct.pack("<Q", 2**60), "key #0 length|needs"),
    "huge string value": (gguf_bytes(kvs=[("k", 8, struct.pack("<Q", 2**63))]), "only"),
    "huge array count": (gguf_bytes(kvs=[("k", 9, struct.pack("<IQ", 4, 2**61))]), "more than the file holds"),
    "unknown value type": (gguf_bytes(kvs=[("k", 77, b"")]), "unknown value type"),
    "deeply nested arrays": (gguf_bytes(kvs=[("k", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 0))]), "deeper"),
    "duplicate key": (gguf_bytes(kvs=[ARCH, ARCH]), "duplicate metadata key"),
    "five dimensions": (gguf_bytes(kvs=[ARCH], tensors=[("t", (1, 1, 1, 1, 1), F32, 0)], data=b"\0" * 32), "5 dimensions"),
    "zero dimensions": (gguf_bytes(kvs=[ARCH], tensors=[("t", (), F32, 0)]), "0 dimensions"),
    "unknown tensor type": (gguf_bytes(kvs=[ARCH], tensors=[("t", (4,), 250, 0)], data=b"\0" * 32), "unknown or unsupported type 250"),
    "misaligned offset": (gguf_bytes(kvs=[ARCH], tensors=[("t", (4,), F32, 4)], data=b"\0" * 64), "not aligned"),
    "data out of bounds": (gguf_bytes(kvs=[ARCH], tensors=[("t", (1024,), F32, 0)], data=b"\0" * 64), "outside the file"),
    "huge dimensions": (gguf_bytes(kvs=[ARCH], tensors=[("t", (2**40, 2**40), F32, 0)], data=b"\0" * 64), "outside the file"),
    "overlapping tensors": (gguf_bytes(kvs=[ARCH], tensors=[("a", (16,), F32, 0), ("b", (16,), F32, 32)], data=b"\0" * 128), "overlaps"),
    "duplicate tensor": (gguf_bytes(kvs=[ARCH], tensors=[("a", (8,), F32, 0), ("a", (8,), F32, 32)], data=b"\0" * 64), "duplicate tensor"),
    "partial quant block": (gguf_bytes(kvs=[ARCH], tensors=[("t", (33,), 8, 0)], data=b"\0" * 64), "whole blocks"),
    "bad alignment": (gguf_bytes(kvs=[("general.alignment", 4, struct.pack("<I", 3))]), "power of two"),
    # long arrays are checked in place and read later (gguf_check.LazyArray): still bounded here
    "long string array cut short": (gguf_bytes(kvs=[("k", 9, struct.pack("<IQ", 8, 2000) + gguf_string("ab") * 1900)]), "length needs 8 bytes"),
    "long string array, huge string": (gguf_bytes(kvs=[("k", 9, struct.pack("<IQ", 8, 2000) + gguf_string("ab") * 5 + struct.pack("<Q", 2**62) + b"\0" * 16000)]), "only"),
    "long int array cut short": (gguf_bytes(kvs=[("k", 9, struct.pack("<IQ", 5, 2000) + b"\0" * 7000)]), "more than the file holds"),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_malformed_gguf(tmp_path, case):
    content, message = GGUF_CASES[case]
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError, match=message):
        check_gguf(path)


def test_long_metadata_arrays_read_when_asked(tmp_path):
    """The tokenizer's long arrays are kept as checked offsets (not ~10 MB of Python objects) and
    read on demand: the same values, and invalid UTF-8 still a GGUFError naming the key."""
    from minillm.loading.gguf_check import LAZY_ARRAY_MIN, LazyArray
    from minillm.loading.gguf_file import Metadata

    words = [f"tok{i}\u00e9" for i in range(LAZY_ARRAY_MIN + 5)]
    types = list(range(LAZY_ARRAY_MIN + 5))
    short = ["a", "b"]
    kvs = [
        ("tokens", 9, struct.pack("<IQ", 8, len(words)) + b"".join(gguf_string(w) for w in words)),
        ("types", 9, struct.pack("<IQ", 5, len(types)) + struct.pack(f"<{len(types)}i", *types)),
        ("short", 9, struct.pack("<IQ", 8, 2) + b"".join(gguf_string(w) for w in short)),
        ("after", 4, struct.pack("<I", 7)),
    ]
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_bytes(kvs=kvs))
    values = check_gguf(path).metadata
    assert isinstance(values["tokens"], LazyArray) and isinstance(values["types"], LazyArray)
    assert values["short"] == short and values["after"] == 7  # short arrays and what follows: read at once
    meta = Metadata(values, path)
    assert meta.get("tokens") == words and meta.get("types") == types
    assert (meta.count("tokens"), meta.count("short"), meta.count("absent")) == (len(words), 2, 0)

    bad = [b"ok"] * LAZY_ARRAY_MIN + [b"\xff\xfe"]
    path.write_bytes(gguf_bytes(kvs=[("tokens", 9, struct.pack("<IQ", 8, len(bad)) + b"".join(gguf_string(w) for w in bad))]))
    meta = Metadata(check_gguf(path).metadata, path)
    with pytest.raises(GGUFError, match="'tokens' is not valid UTF-8"):
        meta.get("tokens")


def test_gguf_other_architecture_rejected(tmp_path):
    from minillm.loading.gguf_import import import_gguf

    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_bytes(kvs=[("general.architecture", 8, gguf_string("gpt2"))]))
    with pytest.raises(GGUFError, match="'gpt2'; supported: llama, qwen2, qwen3"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ tokenizer and templates


def _tokenizer_dir(default_model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    return tmp_path


def test_malformed_tokenizer_json(default_model_dir, tmp_path):
    from minillm.core.tokenizer import Tokenizer

    _tokenizer_dir(default_model_dir, tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}}')
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer(tmp_path)


def test_tokenizer_config_not_json(default_model_dir, tmp_path):
    from minillm.core.tokenizer import Tokenizer

    _tokenizer_dir(default_model_dir, tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer(tmp_path)


@pytest.mark.parametrize(
    "template,message",
    [
        ("{{ ''.__class__.__mro__ }}", "sandbox"),
        ("{{ messages.__class__.__init__.__globals__ }}", "sandbox"),
        ("{% for m in messages %}{{ m.content", "does not parse"),
        ("{{ messages.append(1) }}", "sandbox"),  # immutable: no mutation of the caller's objects
    ],
)
def test_hostile_chat_templates(default_model_dir, tmp_path, template, message):
    from minillm.core.tokenizer import Tokenizer

    _tokenizer_dir(default_model_dir, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=message):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_gguf_merge_that_names_unknown_tokens(tmp_path):
    """A crafted merge list must end as our error, never a crash in the tokenizer builder."""
    from minillm.loading.gguf_file import Metadata
    from minillm.loading.gguf_tokenizer import build_tokenizer_json

    values = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b"],
        "tokenizer.ggml.merges": ["a b c"],
    }
    meta = Metadata(values, tmp_path / "x.gguf")
    with pytest.raises(GGUFError, match="malformed merge"):
        build_tokenizer_json(meta, "llama")
    values["tokenizer.ggml.merges"] = ["x y"]  # tokens absent from the vocabulary
    try:
        build_tokenizer_json(meta, "llama")
    except GGUFError:
        pass


# ------------------------------------------------------------------ run time


@pytest.mark.slow
def test_prompt_longer_than_context(default_model_dir):
    import minillm

    llm = minillm.load(default_model_dir, ctx=32)
    long_prompt = "word " * 100
    with pytest.raises(MiniLLMError, match="truncat"):
        llm.generate(long_prompt, max_tokens=4)
    stream = llm.stream(long_prompt, max_tokens=4, temperature=0, truncate=True)
    assert len("".join(stream)) > 0


@pytest.mark.slow
def test_generation_stops_at_the_end_of_the_context(default_model_dir):
    import minillm

    llm = minillm.load(default_model_dir, ctx=24)
    stream = llm.stream("Count: 1, 2, 3, 4, 5,", max_tokens=100, temperature=0)
    "".join(stream)
    assert stream.finish_reason == "context"


# ------------------------------------------------------------------ fuzzing


@pytest.fixture(scope="module")
def fuzz_seeds(tmp_path_factory, tiny_dir):
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    root = tmp_path_factory.mktemp("fuzz")
    safetensors = (tiny_dir / "model.safetensors").read_bytes()
    path = root / "seed.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "ab"])
    writer.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    q = quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"safetensors": safetensors, "gguf": path.read_bytes()}


def mutations(seed_len):
    """Bit flips, truncation, byte overwrites and huge little-endian length fields."""
    position = st.integers(0, max(0, seed_len - 1))
    return st.one_of(
        st.tuples(st.just("flip"), position, st.integers(0, 7)),
        st.tuples(st.just("truncate"), position, st.just(0)),
        st.tuples(st.just("byte"), position, st.integers(0, 255)),
        st.tuples(st.just("huge"), position, st.sampled_from([2**31, 2**32 - 1, 2**63, 2**64 - 1, 2**40])),
    )


def mutate(data: bytes, ops) -> bytes:
    buf = bytearray(data)
    for kind, pos, arg in ops:
        if not buf:
            break
        pos %= len(buf)
        if kind == "flip":
            buf[pos] ^= 1 << arg
        elif kind == "truncate":
            del buf[pos:]
        elif kind == "byte":
            buf[pos] = arg
        else:
            buf[pos : pos + 8] = struct.pack("<Q", arg)[: len(buf) - pos]
    return bytes(buf)


FUZZ = settings(max_examples=2000, deadline=2000, derandomize=True, suppress_health_check=list(HealthCheck))


def _read_all_safetensors(path):
    f = SafetensorsFile(path)
    for name in f.tensors:
        f.float32(name).sum()


def _read_all_gguf(path):
    from minillm.loading.gguf_file import gguf_tensors

    layout = check_gguf(path)
    for _, w in gguf_tensors(path, layout):
        w.sum()


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_fuzz_mutated_files(fuzz_seeds, tmp_path_factory, fmt):
    seed = fuzz_seeds[fmt]
    folder = tmp_path_factory.mktemp(f"fuzz-{fmt}")
    reader = _read_all_safetensors if fmt == "safetensors" else _read_all_gguf
    outcomes = {"loaded": 0, "rejected": 0}
    warm = folder / f"seed.{fmt}"  # the unmutated file once: kernels it compiles stay outside the deadline
    warm.write_bytes(seed)
    reader(warm)

    @FUZZ
    @given(st.lists(mutations(len(seed)), min_size=1, max_size=4))
    def run(ops):
        path = folder / f"case{sum(outcomes.values()) % 8}.{fmt}"
        path.write_bytes(mutate(seed, ops))
        try:
            reader(path)
            outcomes["loaded"] += 1
        except MiniLLMError:
            outcomes["rejected"] += 1  # rejected with our error: fine; anything else fails the test

    run()
    print(f"{fmt}: {outcomes}")
    assert sum(outcomes.values()) >= 2000 and outcomes["rejected"] > 0


# ------------------------------------------------------------------ interrupted import


@pytest.mark.slow
def test_interrupted_import_leaves_nothing(default_gguf, tmp_path):
    dest = tmp_path / "store" / "model"
    cmd = [sys.executable, str(ROOT / "cli.py"), "import", str(default_gguf), str(dest)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    store = tmp_path / "store"
    while time.time() < deadline:  # wait until the import has its temporary directory: midway
        started = store.exists() and any(store.glob(".importing-*"))
        if started or proc.poll() is not None:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the import finished before it could be interrupted"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not dest.exists()  # no partial model under the final name
    # the next import cleans up what the killed one left and succeeds
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (dest / "config.json").is_file()
    assert not list((tmp_path / "store").glob(".importing-*"))
