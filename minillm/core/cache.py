"""The KV cache: preallocated to the context size, written by position, owning its length."""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError, GenerationError, UsageError
from ..kernels.formats import KV_FORMATS, KVFormat
from ..loading.config import ModelConfig
from ..memory import lazy_zeros, release_pages


def kv_format(name: str, cfg: ModelConfig) -> KVFormat:
    """The KV format `name` (kernels.formats.KV_FORMATS), checked against the model's head size."""
    if name not in KV_FORMATS:
        raise UsageError(f"kv-dtype {name!r} is not one of {', '.join(KV_FORMATS)}")
    fmt = KV_FORMATS[name]
    if cfg.head_dim % fmt.block:
        raise ConfigError(f"config.json: head_dim {cfg.head_dim} is not a multiple of {fmt.block}, which kv-dtype {name} needs")
    return fmt


def kv_shape(cfg: ModelConfig, ctx: int, fmt: KVFormat) -> tuple[int, int, int, int]:
    """(layers, nkv, ctx, stored row) of one sequence's keys (or values) in format fmt."""
    return (cfg.num_hidden_layers, cfg.num_key_value_heads, ctx, fmt.row_length(cfg.head_dim))


def kv_bytes_per_token(cfg: ModelConfig, fmt: KVFormat) -> int:
    """Bytes the cache holds per token of context: keys and values, every layer and KV head."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * fmt.row_bytes(cfg.head_dim)


class KVCache:
    """Keys and values of one sequence, (layers, nkv, ctx, stored row) each, in a KV format
    (kernels.formats.KV_FORMATS: float32 rows of hd, or float16/bfloat16 bits, or Q8_0 blocks).

    Laid out so one KV head's keys are contiguous by position: decode attention streams them.
    `length` is the number of positions already filled; the model advances it after a forward.
    """

    def __init__(self, cfg: ModelConfig, ctx: int, k: np.ndarray | None = None, v: np.ndarray | None = None, fmt: KVFormat | None = None):
        self.format = fmt or KV_FORMATS["float32"]
        shape = kv_shape(cfg, ctx, self.format)
        self.k = lazy_zeros(shape, self.format.element) if k is None else k
        self.v = lazy_zeros(shape, self.format.element) if v is None else v
        self.ctx = ctx
        self.length = 0
        # sliding-window layers' positions below this were given back to the OS (read as zeros)
        self.released = 0

    def reserve(self, n: int) -> int:
        """Check that n more positions fit; returns the first of them."""
        if self.length + n > self.ctx:
            raise GenerationError(
                f"context full: {self.length} + {n} tokens exceed the context size {self.ctx}"
            )
        return self.length

    def reset(self) -> None:
        self.length = 0
        self.released = 0

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on (e.g. to reuse a shared prompt prefix)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        if self.released and length < self.length:
            raise GenerationError(
                f"cannot truncate to {length}: sliding-window layers no longer hold positions below {self.released}"
            )
        self.length = length

    def release_outside_window(self, layers: np.ndarray, window: int, step: int) -> None:
        """Give back the memory of positions the sliding-window `layers` will never read again
        (those before the next query's window of `window` positions), `step` positions at a time,
        so a long sequence holds only about window + step positions of them."""
        dead = self.length + 1 - window  # the next query, at `length`, reads from here on
        if dead - self.released < step:
            return
        dead -= dead % step
        for arr in (self.k, self.v):
            for layer in layers:
                for head in range(arr.shape[1]):
                    release_pages(arr[layer, head, self.released : dead])
        self.released = dead


class KVPool:
    """Cache slots for the sequences of a batch: k, v (slots, layers, nkv, ctx, stored row).

    A slot's KVCache is a view, so prefill (Model.forward) and batched decode
    (Model.decode_batch) write the same memory.
    """

    def __init__(self, cfg: ModelConfig, ctx: int, slots: int, fmt: KVFormat | None = None):
        self.format = fmt or KV_FORMATS["float32"]
        shape = (slots, *kv_shape(cfg, ctx, self.format))
        self.k, self.v = lazy_zeros(shape, self.format.element), lazy_zeros(shape, self.format.element)
        self.k_bytes, self.v_bytes = self.k.view(np.uint8), self.v.view(np.uint8)  # as the forward pass takes them
        self.cfg, self.ctx = cfg, ctx
        self.free = list(range(slots - 1, -1, -1))

    def acquire(self) -> tuple[int, KVCache]:
        slot = self.free.pop()
        return slot, KVCache(self.cfg, self.ctx, self.k[slot], self.v[slot], self.format)

    def release(self, slot: int) -> None:
        self.free.append(slot)
