"""A `tokenizers` tokenizer rebuilt from a GGUF file's vocabulary metadata.

A GGUF carries no tokenizer.json: it stores the tokens, merges or scores, token types and special
ids under llama.cpp's keys. Two kinds of vocabulary are rebuilt here, as transformers builds them
from a GGUF (its integrations/gguf/gguf_tokenizer_mapping.py):

- `gpt2`: byte-level BPE (SmolLM2, Llama 3, Qwen, OLMo 2), with the pre-tokenizer split named by
  `tokenizer.ggml.pre`;
- `llama`: SentencePiece BPE with byte fallback (Gemma, Phi-3, Llama 2, Mistral); when the file
  lists no merges they are recovered from the vocabulary, best-scored first (Gemma: in file order).

Control tokens become special tokens and user-defined ones added tokens, so neither is split.
"""

from __future__ import annotations

from ..errors import GGUFError

TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4
SPACE = "\u2581"  # SentencePiece's visible space

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pre-tokenizer splits by `tokenizer.ggml.pre`, for byte-level vocabularies whose merges were
# learned on a split other than GPT-2's (names absent here, "smollm" among them, use GPT-2's).
PRE_SPLITS = {
    **{name: LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "lfm2")},
    **{name: QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen", "megrez")},
    **{name: GPT4O_SPLIT for name in ("gpt-4o", "llama4")},
}


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


def build_tokenizer_json(meta, spelling: str) -> str:
    """tokenizer.json text for the vocabulary in `meta` (gguf_file.Metadata); a SentencePiece
    vocabulary spelled as the architecture's spec says (`spelling`: "llama", "phi3" or "gemma")."""
    model = meta.require("tokenizer.ggml.model", str)
    tokens = meta.require("tokenizer.ggml.tokens", list)
    if not all(isinstance(t, str) for t in tokens):
        raise GGUFError(f"{meta.path}: metadata 'tokenizer.ggml.tokens' must hold strings")
    types = meta.get("tokenizer.ggml.token_type") or []
    if model == "gpt2":
        tok = _byte_level(meta, tokens)
    elif model == "llama":
        tok = _sentencepiece(meta, tokens, spelling)
    else:
        raise GGUFError(
            f"{meta.path}: metadata 'tokenizer.ggml.model' is {model!r}; supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
        )
    _add_special_tokens(tok, tokens, types, byte_level=model == "gpt2")
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if _adds_bos(meta) and isinstance(bos_id, int) and 0 <= bos_id < len(tokens):
        from tokenizers import processors

        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tok.to_str()


def _adds_bos(meta) -> bool:
    """llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise."""
    default = meta.get("tokenizer.ggml.model") == "llama"
    return bool(meta.get("tokenizer.ggml.add_bos_token", default))


def tokenizer_config(meta) -> dict:
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
        "add_bos_token": _adds_bos(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
    }


def _merges(meta) -> list[tuple[str, str]] | None:
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        return None
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise GGUFError(f"{meta.path}: metadata 'tokenizer.ggml.merges' must hold strings")
    pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise GGUFError(f"{meta.path}: malformed merge {m!r} in 'tokenizer.ggml.merges'")
        pairs.append((parts[0], parts[1]))
    return pairs


def _bpe(meta, vocab: dict, merges, **options):
    from tokenizers import Tokenizer, models

    try:
        return Tokenizer(models.BPE(vocab=vocab, merges=merges, **options))
    except Exception as e:  # tokenizers raises its own exception types on bad merges
        raise GGUFError(f"{meta.path}: cannot build the tokenizer: {e}") from None


def _byte_level(meta, tokens: list[str]):
    from tokenizers import Regex, decoders, pre_tokenizers

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        key = token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(key, i)
    merges = _merges(meta)
    if merges is None:
        raise GGUFError(f"{meta.path}: missing metadata 'tokenizer.ggml.merges'")
    tok = _bpe(meta, vocab, merges, fuse_unk=False, byte_fallback=False)
    split = PRE_SPLITS.get(meta.get("tokenizer.ggml.pre", "default"))
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta, tokens: list[str], spelling: str):
    """SentencePiece BPE with byte fallback. Llama's spelling: a space prepended, spaces as "▁"
    (Metaspace); Phi-3 the same through a normalizer; Gemma no prefix space, and a token of
    several spaces stored as real spaces is looked up as that many "▁"."""
    from tokenizers import decoders, normalizers, pre_tokenizers

    gemma = spelling == "gemma"
    if gemma:
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    merges = _merges(meta)
    if merges is None:  # recovered from the vocabulary: Gemma's scores do not follow its merge order
        if gemma:
            rank = {t: -i for i, t in enumerate(tokens)}
        else:
            scores = meta.require("tokenizer.ggml.scores", list)
            if len(scores) != len(tokens) or not all(isinstance(s, (int, float)) for s in scores):
                raise GGUFError(f"{meta.path}: metadata 'tokenizer.ggml.scores' must hold one number per token")
            rank = dict(zip(tokens, scores))
        merges = merges_from_vocab(vocab, rank)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    tok = _bpe(meta, vocab, merges, fuse_unk=True, byte_fallback=True, unk_token=unk_token)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif spelling == "phi3":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        steps.append(decoders.Strip(content=" ", left=1))
    else:  # a space before the text unless the file says otherwise (tokenizer.ggml.add_space_prefix)
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False)
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def merges_from_vocab(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary: every split of a token into two tokens, ordered by the
    merged token's rank, then the lengths of the two parts (all descending; ties keep vocabulary
    order), as transformers recovers them."""
    found = []
    for token, score in rank.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found += [(left, right, score) for left, right in pairs]
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_special_tokens(tok, tokens: list[str], types: list, byte_level: bool) -> None:
    """Control tokens whole, as special tokens; user-defined ones whole, as added tokens. In a
    byte-level vocabulary a control token outside the byte alphabet is a mislabel llama.cpp
    makes, and is left out (adding it would grow the vocabulary past the model's)."""
    from tokenizers import AddedToken

    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    special = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types)
        if kind == TOKEN_CONTROL and (alphabet is None or set(t) <= alphabet)
    ]
    user = [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types) if kind == TOKEN_USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
