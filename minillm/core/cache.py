"""The KV cache: preallocated to the context size, written by position, owning its length."""

from __future__ import annotations

import numpy as np

from ..errors import GenerationError
from ..loading.config import ModelConfig
from ..memory import lazy_zeros, release_pages


class KVCache:
    """Keys and values of one sequence, (layers, nkv, ctx, hd) each.

    Laid out so one KV head's keys are contiguous by position: decode attention streams them.
    `length` is the number of positions already filled; the model advances it after a forward.
    """

    def __init__(self, cfg: ModelConfig, ctx: int, k: np.ndarray | None = None, v: np.ndarray | None = None):
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, ctx, cfg.head_dim)
        self.k = lazy_zeros(shape) if k is None else k
        self.v = lazy_zeros(shape) if v is None else v
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
    """Cache slots for the sequences of a batch: k, v (slots, layers, nkv, ctx, hd).

    A slot's KVCache is a view, so prefill (Model.forward) and batched decode
    (Model.decode_batch) write the same memory.
    """

    def __init__(self, cfg: ModelConfig, ctx: int, slots: int):
        shape = (slots, cfg.num_hidden_layers, cfg.num_key_value_heads, ctx, cfg.head_dim)
        self.k, self.v = lazy_zeros(shape), lazy_zeros(shape)
        self.cfg, self.ctx = cfg, ctx
        self.free = list(range(slots - 1, -1, -1))

    def acquire(self) -> tuple[int, KVCache]:
        slot = self.free.pop()
        return slot, KVCache(self.cfg, self.ctx, self.k[slot], self.v[slot])

    def release(self, slot: int) -> None:
        self.free.append(slot)
