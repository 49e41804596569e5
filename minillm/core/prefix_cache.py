"""A prefix KV cache across requests: the keys and values of token prefixes already computed,
kept in fixed-size blocks (in the KV cache's format) and reused by later requests that start with the same tokens.

Chat clients and agents resend the whole conversation every turn; with this cache only the new
tokens are prefilled. Blocks of BLOCK_TOKENS tokens live in one preallocated pool (layers, KV heads,
block, head dim), sized by a memory budget. A block is found by its key (the id of the block before
it, its own tokens): a hash chain, so a block matches only where its whole prefix matches. Blocks
are evicted least recently used first; a lookup refreshes a chain from its leaf to its root, so
leaves go before the prefixes they extend.

Blocks are copies: a request's cache slot is filled from the pool before its prefill (load) and
the pool from the slot after its prefill and when it ends (store). So a running sequence never
depends on a pool block, eviction cannot touch it, and its logits are those of a cold prefill bit for
bit: the copied keys and values are the same floats its own prefill or decode would have written
(prefill, decode and batched decode agree to the last bit, at any chunking).

With a cache directory (`--cache-dir`) the blocks outlive the process: written when the engine
is idle (at most once a minute) and when it ends, read back when the same weights start again
with the same KV format (PrefixFile: the file is named and stamped by the model's identity; a
file that is foreign, truncated or malformed is ignored with a warning, never used).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..loading.config import ModelConfig
from ..memory import lazy_zeros
from ..kernels.formats import KV_FORMATS, KVFormat
from .cache import KVCache, kv_bytes_per_token, kv_shape

BLOCK_TOKENS = 32
DEFAULT_BUDGET_FRACTION = 0.2  # of the memory available at start-up
DEFAULT_BUDGET_MAX_MB = 2048


def default_budget_mb() -> int:
    """A fifth of the memory available now, at most 2 GiB (pages are only used once written)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available_mb = int(fields["MemAvailable"].split()[0]) // 1024
    except (OSError, KeyError, ValueError):
        available_mb = 4096
    return min(DEFAULT_BUDGET_MAX_MB, int(available_mb * DEFAULT_BUDGET_FRACTION))


class PrefixCache:
    def __init__(self, cfg: ModelConfig, budget_mb: float, fmt: KVFormat | None = None):
        # a block copied after its sequence's sliding-window layers gave its positions back
        # (KVCache.released) holds zeros there: usable inside a chain, never as one of the
        # last `window` positions before a load's end
        self.window = cfg.widest_window
        self._whole: dict[int, bool] = {}  # block -> its sliding layers' positions are all there
        fmt = fmt or KV_FORMATS["float32"]  # blocks are kept in the KV cache's format: copies, bit for bit
        self.block_bytes = BLOCK_TOKENS * kv_bytes_per_token(cfg, fmt)
        self.capacity = max(0, int(budget_mb * 2**20) // self.block_bytes)
        if budget_mb > 0 and self.capacity == 0:
            warnings.warn(f"cache-mb {budget_mb:g} is less than one {BLOCK_TOKENS}-token block of this model "
                          f"({self.block_bytes / 2**20:.2f} MB): the prefix cache is off", stacklevel=2)
        shape = (self.capacity, *kv_shape(cfg, BLOCK_TOKENS, fmt))
        self.k, self.v = lazy_zeros(shape, fmt.element), lazy_zeros(shape, fmt.element)
        self._clear()
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of them, served from the cache
        self.version = 0  # counts changes to the blocks: what a saved copy is compared by

    def _clear(self) -> None:
        """No blocks (their memory is simply overwritten later)."""
        self._index: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent's uid, tokens) -> block
        self._key: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> its key
        self._uid: dict[int, int] = {}  # block -> a number never reused, its children's parent id
        self._whole.clear()
        self._lru: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._free = list(range(self.capacity - 1, -1, -1))
        self._next_uid = 1  # 0 is the root

    @property
    def blocks_used(self) -> int:
        return len(self._lru)

    def load(self, tokens: Sequence[int], cache: KVCache, root=0) -> int:
        """Fill an empty `cache` with the longest cached prefix of `tokens`, leaving at least one
        token to prefill (its logits start generation); returns the number of tokens loaded.
        root: whose keys and values (0: the base model's; a LoRA adapter's key, Adapter.key, for
        rows computed with it: its chains are its own, and kept in memory only)."""
        blocks = self._lookup(tokens, len(tokens) - 1, root)
        while blocks and not all(self._whole[b] for b in blocks[max(0, len(blocks) * BLOCK_TOKENS + 1 - self.window) // BLOCK_TOKENS :]):
            blocks.pop()  # the next query's window would reach positions this block lacks
        for i, block in enumerate(blocks):
            at = slice(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS)
            cache.k[:, :, at] = self.k[block]
            cache.v[:, :, at] = self.v[block]
        cache.length = len(blocks) * BLOCK_TOKENS
        self.queries += len(tokens)
        self.hits += cache.length
        return cache.length

    def store(self, tokens: Sequence[int], cache: KVCache, root=0) -> None:
        """Keep the full blocks of `tokens` whose keys and values `cache` holds (root: as in load)."""
        parent, chain = root, []
        for i in range(min(len(tokens), cache.length) // BLOCK_TOKENS):
            at = slice(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS)
            key = (parent, tuple(int(t) for t in tokens[at]))
            block = self._index.get(key)
            whole = at.start >= cache.released
            if block is None:
                block = self._allocate()
                if block is None:
                    break
                self._insert(block, key)
            if block not in self._whole or (whole and not self._whole[block]):
                self.k[block] = cache.k[:, :, at]
                self.v[block] = cache.v[:, :, at]
                self._whole[block] = whole
                self.version += 1
            chain.append(block)
            parent = self._uid[block]
        for block in reversed(chain):  # the root most recent, as in _lookup
            self._lru.move_to_end(block)

    def _lookup(self, tokens: Sequence[int], limit: int, root=0) -> list[int]:
        blocks, parent = [], root
        for i in range(max(0, limit) // BLOCK_TOKENS):
            block = self._index.get((parent, tuple(int(t) for t in tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS])))
            if block is None:
                break
            blocks.append(block)
            parent = self._uid[block]
        for block in reversed(blocks):  # the root most recent: leaves are evicted first
            self._lru.move_to_end(block)
        return blocks

    def _allocate(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None  # no budget at all
        block, _ = self._lru.popitem(last=False)
        del self._index[self._key.pop(block)]
        del self._uid[block], self._whole[block]
        return block

    def _insert(self, block: int, key: tuple[int, tuple[int, ...]]) -> None:
        self._index[key] = block
        self._key[block] = key
        self._uid[block] = self._next_uid
        self._next_uid += 1
        self._lru[block] = None

    # ------------------------------------------------------------------ on disk

    def save(self, file: "PrefixFile") -> int:
        """Write every reachable block (parents first, with its recency) to file.path, through a
        temporary name and a rename; returns the blocks written."""
        reachable, written = [], set()  # a block whose parent was evicted is never matched again
        for uid, block in sorted((uid, block) for block, uid in self._uid.items()):  # a parent's uid is below its children's
            parent = self._key[block][0]
            if parent == 0 or parent in written:
                reachable.append(block)
                written.add(uid)
        position = {self._uid[block]: i for i, block in enumerate(reachable)}
        recency = {block: rank for rank, block in enumerate(self._lru)}
        header = {
            "identity": file.identity,
            "element": np.dtype(self.k.dtype).str,
            "block_shape": list(self.k.shape[1:]),
            "parents": [position[self._key[b][0]] if self._key[b][0] else -1 for b in reachable],
            "tokens": [list(self._key[b][1]) for b in reachable],
            "whole": [bool(self._whole[b]) for b in reachable],
            "recency": [recency[b] for b in reachable],
        }
        encoded = json.dumps(header).encode()
        file.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.path.with_name(f".{file.path.name}.{os.getpid()}.writing")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + len(encoded).to_bytes(8, "little") + encoded)
                for block in reachable:
                    f.write(memoryview(np.ascontiguousarray(self.k[block])).cast("B"))
                    f.write(memoryview(np.ascontiguousarray(self.v[block])).cast("B"))
            os.replace(tmp, file.path)
        finally:
            if tmp.exists():
                tmp.unlink()
        return len(reachable)

    def restore(self, file: "PrefixFile") -> int:
        """Read the blocks file.path holds if it was written for this model (file.identity) in this
        cache's format, the most recent first when they do not all fit; returns the blocks read.
        A missing file reads nothing; a foreign or damaged one is ignored with a warning."""
        if not file.path.is_file() or self.capacity == 0:
            return 0
        try:
            with open(file.path, "rb") as f:
                header, data_start = _read_header(f, file)
                blocks = self._restore_blocks(header, f, data_start, file)
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            self._clear()  # nothing half-read stays
            warnings.warn(f"{file.path}: not a prefix cache of this model ({e}); starting with an empty one", stacklevel=2)
            return 0
        return blocks

    def _restore_blocks(self, header: dict, f, data_start: int, file: "PrefixFile") -> int:
        if header["element"] != np.dtype(self.k.dtype).str or header["block_shape"] != list(self.k.shape[1:]):
            raise ValueError("written for another KV format")
        parents, tokens, whole, recency = header["parents"], header["tokens"], header["whole"], header["recency"]
        count = len(parents)
        if not (len(tokens) == len(whole) == len(recency) == count):
            raise ValueError("its block lists disagree")
        block_bytes = self.k[0].nbytes
        if os.fstat(f.fileno()).st_size != data_start + 2 * count * block_bytes:
            raise ValueError("its size is not what its header says")
        newest = set(sorted(range(count), key=lambda i: recency[i])[-self.capacity:])
        kept: dict[int, int] = {}  # saved index -> block
        for i in range(count):
            parent = parents[i]
            if not (isinstance(parent, int) and -1 <= parent < i) or len(tokens[i]) != BLOCK_TOKENS:
                raise ValueError(f"block {i} is malformed")
            if i not in newest or (parent >= 0 and parent not in kept):
                continue
            block = self._allocate()
            self._insert(block, (self._uid[kept[parent]] if parent >= 0 else 0, tuple(int(t) for t in tokens[i])))
            f.seek(data_start + 2 * i * block_bytes)
            self.k[block] = np.frombuffer(f.read(block_bytes), self.k.dtype).reshape(self.k.shape[1:])
            self.v[block] = np.frombuffer(f.read(block_bytes), self.v.dtype).reshape(self.v.shape[1:])
            self._whole[block] = bool(whole[i])
            kept[i] = block
        for i in sorted(kept, key=lambda i: recency[i]):
            self._lru.move_to_end(kept[i])
        return len(kept)


MAGIC = b"minillm prefix cache 1\n"


def _read_header(f, file: "PrefixFile") -> tuple[dict, int]:
    if f.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a minillm prefix cache file")
    length = int.from_bytes(f.read(8), "little")
    if not 0 < length < 2**31:
        raise ValueError("a damaged header")
    header = json.loads(f.read(length))
    if header.get("identity") != file.identity:
        raise ValueError("written for other weights or settings")
    return header, len(MAGIC) + 8 + length


@dataclass(frozen=True)
class PrefixFile:
    """Where a model's prefix cache is kept between runs, and what it must have been written for:
    the weights (each file's size, first and last MiB), how they are kept, the KV format, the
    context (RoPE tables may depend on it) and the block size."""

    path: Path
    identity: dict

    @classmethod
    def for_model(cls, directory: str | Path, source: Path, model) -> "PrefixFile":
        identity = {
            "weights": _fingerprint(source),
            "dtype": model.dtype,
            "kv": model.kv_dtype,
            "activations": model.activations,
            "ctx": model.ctx,
            "block_tokens": BLOCK_TOKENS,
        }
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
        return cls(Path(directory) / f"prefix-{digest}.kv", identity)


def _fingerprint(source: Path) -> str:
    """A hash of a checkpoint's or GGUF's weight files: names, sizes, and their first and last MiB
    (headers and the last tensors; reading whole multi-GB files would cost a start-up)."""
    files = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.suffix in (".safetensors", ".json"))
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}|{size}|".encode())
        with open(path, "rb") as f:
            digest.update(f.read(2**20))
            f.seek(max(size - 2**20, 0))
            digest.update(f.read(2**20))
    return digest.hexdigest()
