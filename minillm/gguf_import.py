"""Importing a Llama-architecture GGUF file as an ordinary HF checkpoint directory.

Tensors are dequantized to float32 with the `gguf` package, llama.cpp's Q/K row permutation is
undone, and the tokenizer is rebuilt from the GGUF's BPE vocabulary and merges with `tokenizers`.
transformers reads the same GGUF (`from_pretrained(dir, gguf_file=...)`), so it checks every
file written here.

Everything is written into a temporary directory beside the destination and renamed at the end,
so an interrupted import never leaves a half-made model under the final name.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from .errors import GGUFError
from .gguf_check import check_gguf

TMP_PREFIX = ".importing-"

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Pre-tokenizer regexes by `tokenizer.ggml.pre`, for vocabularies whose merges were learned on a
# split other than GPT-2's. Names absent here use GPT-2's split.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_SPLITS = {name: LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx")}

TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4


class _Metadata:
    """Typed access to the checked GGUF metadata, with errors that name the key."""

    def __init__(self, values: dict, path: Path):
        self.values, self.path = values, path

    def get(self, key: str, default=None):
        return self.values.get(key, default)

    def require(self, key: str, kind):
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: missing metadata {key!r}")
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise GGUFError(f"{self.path}: metadata {key!r} has the wrong type ({type(value).__name__})")
        return value


def gguf_tensors(path: Path, layout):
    """(entry, float32 array in HF (row-major) shape) for each tensor of a checked GGUF.

    Bytes come from a read-only map at the offsets check_gguf validated; the gguf package only
    dequantizes them.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = np.memmap(path, dtype=np.uint8, mode="r")
    for t in layout.tensors:
        rows = 1
        for d in t.shape[1:]:
            rows *= d
        start = layout.data_start + t.offset
        raw = np.asarray(data[start : start + t.nbytes]).reshape(rows, t.nbytes // rows)
        shape = tuple(reversed(t.shape))  # GGUF lists dims innermost first
        try:
            w = np.asarray(dequantize(raw, GGMLQuantizationType(t.type)), dtype=np.float32).reshape(shape)
        except (ValueError, NotImplementedError, TypeError) as e:
            raise GGUFError(f"{path}: cannot dequantize tensor {t.name!r}: {e}") from None
        yield t, w


def hf_config(meta: _Metadata) -> dict:
    arch = meta.require("general.architecture", str)
    if arch != "llama":
        raise GGUFError(f"{meta.path}: metadata 'general.architecture' is {arch!r}; only 'llama' can be imported")
    p = "llama."
    hidden = meta.require(p + "embedding_length", int)
    heads = meta.require(p + "attention.head_count", int)
    head_dim = meta.get(p + "attention.key_length", meta.get(p + "rope.dimension_count", hidden // max(heads, 1)))
    vocab = meta.get(p + "vocab_size") or len(meta.require("tokenizer.ggml.tokens", list))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta.require(p + "feed_forward_length", int),
        "num_hidden_layers": meta.require(p + "block_count", int),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(p + "attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": meta.require(p + "context_length", int),
        "rms_norm_eps": float(meta.require(p + "attention.layer_norm_rms_epsilon", float)),
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    scaling = meta.get(p + "rope.scaling.type")
    if scaling not in (None, "none"):
        factor = meta.get(p + "rope.scaling.factor")
        if scaling != "linear" or not factor:
            raise GGUFError(f"{meta.path}: metadata 'llama.rope.scaling.type' {scaling!r} is not supported")
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    return config


def hf_name(name: str, path: Path) -> str:
    """The HF tensor name of a GGUF tensor name."""
    if name.startswith("blk."):
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[1].isdigit() and parts[2] in LAYER_TENSORS:
            return f"model.layers.{int(parts[1])}.{LAYER_TENSORS[parts[2]]}"
    elif name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    raise GGUFError(f"{path}: unexpected tensor {name!r}")


def check_tensors(layout, config: dict, path: Path) -> None:
    """Every tensor the config implies is present with that shape, and nothing else is."""
    from .checkpoint import check_tensor_set, expected_shapes
    from .config import ModelConfig
    from .errors import ConfigError

    names = {hf_name(t.name, path): tuple(reversed(t.shape)) for t in layout.tensors}
    try:
        cfg = ModelConfig.from_dict(dict(config, tie_word_embeddings="lm_head.weight" not in names), source=str(path))
    except ConfigError as e:
        raise GGUFError(str(e)) from None
    check_tensor_set(names, expected_shapes(cfg), cfg, where=lambda name: path, error=GGUFError)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's permute(): llama.cpp stores RoPE pairs interleaved, HF split-half."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(layout, config: dict, path: Path, progress: bool):
    """Yield (HF name, float32 array) for every tensor of the GGUF."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    bar = _progress(len(layout.tensors), "importing default model" if progress else None)
    for t, w in gguf_tensors(path, layout):
        hf = hf_name(t.name, path)
        if hf.endswith("q_proj.weight"):
            w = unpermute_qk(w, heads)
        elif hf.endswith("k_proj.weight"):
            w = unpermute_qk(w, kv_heads)
        yield hf, np.ascontiguousarray(w)
        bar.update(1)
    bar.close()


def _progress(total: int, desc: str | None):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=desc is None, file=sys.stderr, leave=False)


# ------------------------------------------------------------------ tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def build_tokenizer_json(meta: _Metadata) -> str:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    path = meta.path
    model = meta.require("tokenizer.ggml.model", str)
    if model != "gpt2":
        raise GGUFError(f"{path}: metadata 'tokenizer.ggml.model' is {model!r}; only byte-level BPE ('gpt2') is supported")
    tokens = meta.require("tokenizer.ggml.tokens", list)
    merges = meta.require("tokenizer.ggml.merges", list)
    types = meta.get("tokenizer.ggml.token_type") or []
    if not all(isinstance(t, str) for t in tokens) or not all(isinstance(m, str) for m in merges):
        raise GGUFError(f"{path}: tokenizer tokens and merges must be strings")

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        key = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(key, i)
    pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise GGUFError(f"{path}: malformed merge {m!r} in 'tokenizer.ggml.merges'")
        pairs.append((parts[0], parts[1]))
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    except Exception as e:  # tokenizers raises its own exception types on bad merges
        raise GGUFError(f"{path}: cannot build the tokenizer: {e}") from None

    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # "smollm" and other names not listed get GPT-2's split, as transformers builds them. (llama.cpp
    # splits every \p{N} alone for "smollm"; the two differ only on rare numerals such as " ½".)
    if pre in PRE_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()

    special = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types)
        if kind == TOKEN_CONTROL and set(t) <= alphabet
    ]
    user = [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types) if kind == TOKEN_USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tok.to_str()


def tokenizer_config(meta: _Metadata) -> dict:
    tokens = meta.require("tokenizer.ggml.tokens", list)

    def token(key):
        i = meta.get(key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
    }


# ------------------------------------------------------------------ the import


def import_gguf(gguf_path: str | Path, dest: str | Path, progress: bool = True) -> Path:
    """Import `gguf_path` into the HF-format directory `dest` (which must not exist yet)."""
    from safetensors.numpy import save_file

    gguf_path, dest = Path(gguf_path), Path(dest)
    if dest.exists():
        raise GGUFError(f"{dest}: already exists")
    layout = check_gguf(gguf_path)  # everything below reads what this parsed and validated
    meta = _Metadata(layout.metadata, gguf_path)
    config = hf_config(meta)
    check_tensors(layout, config, gguf_path)
    tokenizer_json = build_tokenizer_json(meta)
    tok_config = tokenizer_config(meta)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}

    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_imports(dest.parent)
    tmp = dest.parent / f"{TMP_PREFIX}{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        tensors = dict(hf_tensors(layout, config, gguf_path, progress))
        config["tie_word_embeddings"] = "lm_head.weight" not in tensors
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        _write_json(tmp / "config.json", config)
        (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        _write_json(tmp / "tokenizer_config.json", tok_config)
        _write_json(tmp / "generation_config.json", generation)
        # Where the weights came from: `compare` uses transformers reading this same GGUF as the oracle.
        record = {"source": gguf_path.name, "path": str(gguf_path.resolve()), "size": gguf_path.stat().st_size}
        _write_json(tmp / "minillm_import.json", record)
        os.rename(tmp, dest)  # atomic: the model appears whole or not at all
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if (dest / "config.json").exists():  # another process finished the same import first
            return dest
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _remove_stale_imports(parent: Path) -> None:
    """Delete temporary directories left by imports that were killed (their process is gone)."""
    for tmp in parent.glob(TMP_PREFIX + "*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
