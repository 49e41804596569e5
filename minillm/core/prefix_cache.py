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
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Sequence

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
        self._index: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent's uid, tokens) -> block
        self._key: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> its key
        self._uid: dict[int, int] = {}  # block -> a number never reused, its children's parent id
        self._lru: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._free = list(range(self.capacity - 1, -1, -1))
        self._next_uid = 1  # 0 is the root
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of them, served from the cache

    @property
    def blocks_used(self) -> int:
        return len(self._lru)

    def load(self, tokens: Sequence[int], cache: KVCache) -> int:
        """Fill an empty `cache` with the longest cached prefix of `tokens`, leaving at least one
        token to prefill (its logits start generation); returns the number of tokens loaded."""
        blocks = self._lookup(tokens, len(tokens) - 1)
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

    def store(self, tokens: Sequence[int], cache: KVCache) -> None:
        """Keep the full blocks of `tokens` whose keys and values `cache` holds."""
        parent, chain = 0, []
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
            chain.append(block)
            parent = self._uid[block]
        for block in reversed(chain):  # the root most recent, as in _lookup
            self._lru.move_to_end(block)

    def _lookup(self, tokens: Sequence[int], limit: int) -> list[int]:
        blocks, parent = [], 0
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
