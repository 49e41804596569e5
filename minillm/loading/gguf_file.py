"""A checked GGUF file read as an HF checkpoint: its config as config.json fields, its tensors by
HF name (float32, or as stored: block formats untouched), its tokenizer files.

llama.cpp's metadata keys are mapped to HF config fields as transformers' GGUF loader maps them,
and tensor names through gguf-py's own name tables (what transformers uses too); where a GGUF
leaves a field out, llama.cpp's own default stands in (Gemma 3's sliding pattern of 6 and local
RoPE base 10000, Gemma's query scaling). What llama.cpp's converter changed is undone: Llama's
interleaved Q/K rows, Gemma's norms stored as 1 + w, and Phi-3's longrope factors and Llama 3's
RoPE frequency factors kept as tensors become config fields again.

Only check_gguf parses the file; everything here reads the layout it validated, through a
read-only memory map. A split file (llama.cpp's gguf-split: `NAME-00001-of-0000N.gguf`, metadata
in the first part, tensors spread over all) is read as one, given its first part.
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path

import numpy as np

from ..architectures import GGUF_NAMES, spec_of_gguf
from ..errors import ConfigError, GGUFError
from ..memory import release_pages
from .gguf_check import GGUFLayout, LazyArray, TensorEntry, check_gguf
from .tensor_names import check_tensor_set, expected_shapes, rope_halves_order

# Tensors that hold RoPE settings rather than weights: read into the config.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# ggml types that run on the float32 and bfloat16 kernels when a file holds nothing else
GGML_F32, GGML_F16, GGML_BF16 = 0, 1, 30
FLOAT_TYPES = {GGML_F32: np.float32, GGML_BF16: np.uint16}  # BF16 as bits


class Metadata:
    """Typed access to checked GGUF metadata, with errors that name the key."""

    def __init__(self, values: dict, path: Path):
        self.values, self.path = values, path

    def get(self, key: str, default=None):
        value = self.values.get(key, default)
        return value.read() if isinstance(value, LazyArray) else value

    def count(self, key: str) -> int:
        """The length of an array value (0 when absent), without reading a long one."""
        value = self.values.get(key)
        if isinstance(value, LazyArray):
            return value.count
        return len(value) if isinstance(value, list) else 0

    def require(self, key: str, kind):
        if self.values.get(key) is None:  # without reading a long array (typed reads it once)
            raise GGUFError(f"{self.path}: missing metadata {key!r}")
        return self.typed(key, kind)

    def typed(self, key: str, kind, default=None):
        """The value of `key` if present (else `default`), which must be of `kind`."""
        value = self.get(key)
        if value is None:
            return default
        kinds = (int, float) if kind is float else kind
        if not isinstance(value, kinds) or isinstance(value, bool) and kind is not bool:
            raise GGUFError(f"{self.path}: metadata {key!r} has the wrong type ({type(value).__name__})")
        return value


class GGUFModel:
    """A GGUF file as an HF model: `config` (config.json fields), tensors by HF name."""

    def __init__(self, path: str | Path):
        from .config import ModelConfig

        self.path = Path(path)
        self.layout: GGUFLayout = check_gguf(self.path)
        self.meta = Metadata(self.layout.metadata, self.path)
        self.arch = self.meta.require("general.architecture", str)
        self.spec = spec_of_gguf(self.arch, experts=bool(self.meta.typed(self.arch + ".expert_count", int, 0)))
        if self.spec is None:
            raise GGUFError(f"{self.path}: metadata 'general.architecture' is {self.arch!r}; supported: {', '.join(GGUF_NAMES)}")
        self.parts = split_parts(self.path, self.layout)  # [(path, layout)]: the file, or each part of a split one
        self._part_of = {t.name: i for i, (_, layout) in enumerate(self.parts) for t in layout.tensors}
        self.tensors = [t for _, layout in self.parts for t in layout.tensors]
        self._by_gguf_name = {t.name: t for t in self.tensors}
        self.config = hf_config(self.meta, self.arch, self.spec, self._small_tensor, self._by_gguf_name)
        self.config["tie_word_embeddings"] = "output.weight" not in self._by_gguf_name
        try:
            self.cfg = ModelConfig.from_dict(self.config, source=str(self.path))
        except ConfigError as e:
            raise GGUFError(str(e)) from None
        fused = any(t.name.endswith("ffn_gate_up_exps.weight") for t in self.tensors)
        split_kv_b = any(t.name.endswith("attn_k_b.weight") for t in self.tensors)  # llama.cpp's converter since its MLA change
        expected = expected_shapes(self.cfg, expert_layout="gguf_fused" if fused else "gguf", split_kv_b=split_kv_b)
        to_gguf = gguf_names(self.arch, self.cfg.num_hidden_layers, expected)
        found = {}
        self.entries: dict[str, TensorEntry] = {}
        for t in self.tensors:
            if t.name in ROPE_TENSORS:
                continue
            hf = to_gguf.get(t.name)
            if hf is None and self.spec.ignores(t.name, self.cfg.num_hidden_layers):
                continue
            if hf is None:
                raise GGUFError(f"{self.path}: unexpected tensor {t.name!r} for {self.arch}")
            found[hf] = tuple(reversed(t.shape))  # GGUF lists dimensions innermost first
            if hf in expected and [n for n in found[hf] if n != 1] == [n for n in expected[hf] if n != 1]:
                found[hf] = expected[hf]  # a (1, n) vector kept as (n,), or the other way (Qwen2-MoE's shared expert gate)
            self.entries[hf] = t
        self.metadata_tensors = self.spec.gguf_metadata_tensors(self.meta, self.arch + ".", self.cfg.num_hidden_layers)
        found.update({name: t.shape for name, t in self.metadata_tensors.items()})
        check_tensor_set(found, expected, self.cfg, where=lambda name: self.path, error=GGUFError)
        self.expected = expected  # HF name -> shape

    @cached_property
    def _maps(self) -> list[np.memmap]:
        # copy-on-write: arrays stay writeable (one Numba specialisation for every weight, as
        # safetensors_io maps its files) and nothing is ever written back
        return [np.memmap(path, dtype=np.uint8, mode="c") for path, _ in self.parts]

    def _raw(self, t: TensorEntry) -> np.ndarray:
        part = self._part_of[t.name]
        path, layout = self.parts[part]
        if len(t.shape) == 1:
            # Read, not mapped: a fault on the map maps the page cache's whole folio around the
            # page, which after a sequential read spans megabytes of matrices already copied into
            # their runnable layout. Reading the norms through the map kept ~9-20 MB of the default
            # model's Q4_0 file in this process's memory, as much as the page cache's folios held.
            start = layout.data_start + t.offset
            return np.fromfile(path, np.uint8, count=t.nbytes, offset=start).reshape(1, t.nbytes)
        return tensor_bytes(self._maps[part], layout, t)

    def _small_tensor(self, name: str) -> np.ndarray | None:
        """A 1-D float32 tensor read whole (RoPE factors), or None if the file has none."""
        t = self._by_gguf_name.get(name)
        if t is None:
            return None
        if t.type != GGML_F32 or len(t.shape) != 1:
            raise GGUFError(f"{self.path}: tensor {name!r} must be a 1-D F32 tensor")
        return np.array(self._raw(t).view(np.float32).reshape(-1))

    def ggml_type(self, hf_name: str) -> int:
        return self.entries[hf_name].type

    @property
    def names(self) -> list[str]:
        """Every tensor's HF name: those stored as tensors, then those kept as metadata."""
        return [*self.entries, *self.metadata_tensors]

    def float32(self, hf_name: str) -> np.ndarray:
        """The tensor dequantized to float32 in HF's layout (gguf-py dequantizes the checked bytes)."""
        if hf_name in self.metadata_tensors:
            return self.metadata_tensors[hf_name].copy()
        w = dequantized(self._raw(self.entries[hf_name]), self.entries[hf_name], self.path)
        if w.shape != self.expected[hf_name] and w.size == np.prod(self.expected[hf_name]):
            w = w.reshape(self.expected[hf_name])  # kept with other dimensions of 1 (the check above)
        if self.cfg.norm_offset and w.ndim == 1 and hf_name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # the converter stored Gemma's norms as 1 + w
        return np.ascontiguousarray(self._unpermute(hf_name, w))

    def stored(self, hf_name: str, as_bytes: bool = True) -> np.ndarray:
        """A 2-D tensor as stored, in HF row order: the raw bytes of each row, uint8 (N, bytes per
        row), or with as_bytes=False an F32 or BF16 tensor as float32 / bfloat16 bits (N, K).
        A 3-D tensor (E, N, K: experts) comes as its E * N rows.
        A view of the memory map, except Llama's Q and K, whose rows are put back in HF order
        (a copy)."""
        t = self.entries[hf_name]
        raw = self._raw(t)
        if not as_bytes and t.type in FLOAT_TYPES:
            raw = raw.view(FLOAT_TYPES[t.type])
        rows = self._unpermute(hf_name, raw)
        if rows is not raw:
            release_pages(raw)  # read once into the copy; not this process's memory twice
        return rows

    def _unpermute(self, hf_name: str, w: np.ndarray) -> np.ndarray:
        """Undo convert_hf_to_gguf's permute() of Q and K rows (and biases) where it permuted
        them for llama.cpp's RoPE on neighbouring pairs (Llama's; HF rotates halves)."""
        order = rope_halves_order(self.cfg, hf_name, w.shape[0], pairs=True, rotary=self.cfg.head_dim) if self.spec.gguf_permuted_qk else None
        return w if order is None else w[order]

    # ---------------------------------------------------------------- tokenizer files

    def text_files(self) -> dict:
        """{file name: text} of everything but the weights an HF directory holds: config.json,
        tokenizer.json, tokenizer_config.json (with the chat template), generation_config.json."""
        return {
            "config.json": _json_text(self.config),
            "tokenizer.json": self.tokenizer_json(),
            "tokenizer_config.json": _json_text(self.tokenizer_config()),
            "generation_config.json": _json_text(self.generation_config()),
        }

    def tokenizer_json(self) -> str:
        from .gguf_tokenizer import build_tokenizer_json

        return build_tokenizer_json(self.meta, self.spec.gguf_tokenizer)

    def tokenizer_config(self) -> dict:
        from .gguf_tokenizer import tokenizer_config

        return tokenizer_config(self.meta)

    def generation_config(self) -> dict:
        return {k: self.config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if self.config.get(k) is not None}


def split_parts(path: Path, layout: GGUFLayout) -> list[tuple[Path, GGUFLayout]]:
    """The parts of a split GGUF given its first (each checked, numbered and counted as the first
    says), or [(path, layout)] for a whole file."""
    meta = Metadata(layout.metadata, path)
    count = meta.typed("split.count", int, 1)
    if count <= 1:
        return [(path, layout)]
    numbered = re.search(r"-00001-of-(\d{5})\.gguf$", path.name)
    if meta.typed("split.no", int, 0) != 0 or numbered is None or int(numbered[1]) != count:
        raise GGUFError(f"{path}: part of a GGUF split in {count}; give its first part, named ...-00001-of-{count:05d}.gguf")
    parts = [(path, layout)]
    for number in range(2, count + 1):
        part = path.with_name(f"{path.name[:numbered.start()]}-{number:05d}-of-{count:05d}.gguf")
        if not part.is_file():
            raise GGUFError(f"{part}: missing part {number} of {count} of the split GGUF {path.name}")
        part_layout = check_gguf(part)
        found = Metadata(part_layout.metadata, part).typed("split.no", int)
        if found != number - 1:
            raise GGUFError(f"{part}: metadata 'split.no' is {found}, expected {number - 1}")
        parts.append((part, part_layout))
    total = meta.typed("split.tensors.count", int)
    held = sum(len(part_layout.tensors) for _, part_layout in parts)
    if total is not None and held != total:
        raise GGUFError(f"{path}: metadata 'split.tensors.count' is {total}, but the {count} parts hold {held} tensors")
    return parts


def gguf_names(arch: str, layers: int, expected: dict) -> dict[str, str]:
    """{GGUF tensor name: HF name} for the HF tensors `expected`, by gguf-py's name tables."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next(key for key, name in MODEL_ARCH_NAMES.items() if name == arch)
    table = get_tensor_name_map(arch_id, layers)
    names = {}
    for hf in expected:
        base, suffix = hf.rsplit(".", 1)
        if suffix == "sinks":  # gpt-oss's (nh,) tensor, written as attn_sinks.weight
            base, suffix = hf, "weight"
        elif suffix.endswith("e_score_correction_bias"):  # a router's selection bias, written as exp_probs_b.bias
            base, suffix = hf[: -len("_bias")], "bias"
        gguf = table.get_name(base)
        if gguf is None and base.endswith(".mlp.experts.gate_up_proj"):  # newer than gguf-py's tables for these
            gguf = f"blk.{base.split('.')[2]}.ffn_gate_up_exps"
        if gguf is not None:
            names[f"{gguf}.{suffix}"] = hf
    return names


def hf_config(meta: Metadata, arch: str, spec, tensor, names=()) -> dict:
    """config.json fields from GGUF metadata (and its RoPE tensors, read by `tensor(name)`; the
    biases it holds, from its tensor `names`) of general.architecture `arch`, read as its spec
    (minillm.architectures) says."""
    p = arch + "."
    hidden = meta.require(p + "embedding_length", int)
    heads = meta.require(p + "attention.head_count", int)
    kv_heads = meta.typed(p + "attention.head_count_kv", int, heads)
    head_dim = meta.typed(p + "attention.key_length", int)
    if head_dim is None and spec.gguf_head_dim_from_rope:  # as transformers reads it
        head_dim = meta.typed(p + "rope.dimension_count", int)
    head_dim = head_dim or hidden // max(heads, 1)
    layers = meta.require(p + "block_count", int)
    experts = meta.typed(p + "expert_count", int, 0)
    config = {
        "architectures": [spec.hf_names[0]],
        "model_type": arch,
        "vocab_size": meta.typed(p + "vocab_size", int) or meta.count("tokenizer.ggml.tokens"),
        "hidden_size": hidden,
        "intermediate_size": meta.require(p + "feed_forward_length", int),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": meta.require(p + "context_length", int),
        spec.eps_field: float(meta.require(p + spec.gguf_eps_key, float)),
        "bos_token_id": meta.typed("tokenizer.ggml.bos_token_id", int),
        "eos_token_id": _end_tokens(meta),
        "pad_token_id": meta.typed("tokenizer.ggml.padding_token_id", int),
        "torch_dtype": "float32",
    }
    for field, suffix in spec.gguf_bias_fields.items():
        config[field] = any(name.startswith("blk.") and name.endswith("." + suffix) for name in names)
    if experts:
        config.update(spec.gguf_experts(meta, p, experts))
    rope_dims = meta.typed(p + "rope.dimension_count", int, head_dim)
    if rope_dims != head_dim:
        config["partial_rotary_factor"] = rope_dims / head_dim
    theta = float(meta.typed(p + "rope.freq_base", float, spec.gguf_rope_theta))
    spec.gguf_config(meta, p, config, {"rope_theta": theta, **_rope_scaling(meta, p, tensor, config)})
    return config


def _end_tokens(meta: Metadata) -> int | list[int] | None:
    """The tokens that end a reply: EOS, and the end-of-turn tokens llama.cpp also stops at."""
    ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        i = meta.typed(key, int)
        if i is not None and i not in ids:
            ids.append(i)
    return ids[0] if len(ids) == 1 else ids or None


def _rope_scaling(meta: Metadata, p: str, tensor, config: dict) -> dict:
    """HF RoPE scaling fields: llama.cpp's linear and yarn keys; Phi-3's longrope factors and
    Llama 3's frequency factors, both stored as tensors (the latter as longrope factors with an
    attention factor of 1, which gives llama.cpp's frequencies: base^(2i/d) * factor_i)."""
    kind = meta.typed(p + "rope.scaling.type", str)
    factor = meta.typed(p + "rope.scaling.factor", float)
    original = meta.typed(p + "rope.scaling.original_context_length", int)
    long, short, freqs = (tensor(name) for name in ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight"))
    if kind in (None, "none") and freqs is None and long is None:
        return {}
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor:
        out = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original or config["max_position_embeddings"]}
        for key, name in (("attention_factor", "yarn_attn_factor"), ("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            value = meta.typed(f"{p}rope.scaling.{name}", float)
            if value is not None:
                out[key] = float(value)
        return out
    if long is not None or short is not None:
        if long is None or short is None:
            raise GGUFError(f"{meta.path}: longrope needs both 'rope_factors_long.weight' and 'rope_factors_short.weight'")
        out = {"rope_type": "longrope", "long_factor": long.tolist(), "short_factor": short.tolist()}
        if original:
            config["original_max_position_embeddings"] = original
        attn = meta.typed(p + "rope.scaling.attn_factor", float)
        if attn is not None:
            out["attention_factor"] = float(attn)
        return out
    if freqs is not None and kind in (None, "none"):
        return {"rope_type": "longrope", "long_factor": freqs.tolist(), "short_factor": freqs.tolist(), "attention_factor": 1.0,
                "original_max_position_embeddings": config["max_position_embeddings"]}
    raise GGUFError(f"{meta.path}: metadata '{p}rope.scaling.type' {kind!r} is not supported")


def tensor_bytes(data: np.ndarray, layout: GGUFLayout, t: TensorEntry) -> np.ndarray:
    """A checked tensor's bytes in the mapped file `data`, one row (innermost dimension) per
    line: (rows, bytes per row)."""
    rows = 1
    for d in t.shape[1:]:
        rows *= d
    start = layout.data_start + t.offset
    return data[start : start + t.nbytes].reshape(rows, t.nbytes // rows)


def dequantized(raw: np.ndarray, t: TensorEntry, path: Path) -> np.ndarray:
    """tensor_bytes dequantized to float32 by gguf-py, outermost dimension first."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        w = np.asarray(dequantize(raw, GGMLQuantizationType(t.type)), dtype=np.float32)
    except (ValueError, NotImplementedError, TypeError) as e:
        raise GGUFError(f"{path}: cannot dequantize tensor {t.name!r}: {e}") from None
    return w.reshape(tuple(reversed(t.shape)))


def gguf_tensors(path: Path, layout: GGUFLayout):
    """(entry, float32 array in GGUF order, outermost dimension first) for every tensor of a
    checked file, whatever it describes: gguf-py dequantizes the bytes check_gguf validated."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for t in layout.tensors:
        yield t, dequantized(tensor_bytes(data, layout, t), t, path)


def tokenizer_dir(path: str | Path, store: Path) -> Path:
    """A directory holding the tokenizer files of the GGUF at `path` (tokenizer.json,
    tokenizer_config.json, generation_config.json and config.json), rebuilt from its metadata
    the first time and kept under `store`, keyed by the file's path, size and time; written to a
    temporary name and renamed, as an import is."""
    import hashlib
    import os
    import shutil

    path = Path(path).absolute()  # not resolved: a split file's parts are found beside the name given (a Hub cache links blobs)
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    dest = store / f"{path.stem}-{key}"
    if (dest / "generation_config.json").is_file():
        return dest
    model = GGUFModel(path)
    files = model.text_files()
    store.mkdir(parents=True, exist_ok=True)
    tmp = store / f".writing-{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_text_files(tmp, files)
        os.rename(tmp, dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dest / "generation_config.json").is_file():
            raise
    return dest


def _json_text(obj) -> str:
    import json

    return json.dumps(obj, indent=2, ensure_ascii=False)


def write_text_files(directory: Path, files: dict) -> None:
    """GGUFModel.text_files written into `directory`, each ending in a newline."""
    for name, text in files.items():
        (directory / name).write_text(text + ("" if text.endswith("\n") else "\n"), encoding="utf-8")
