"""The KV cache: preallocated to the context size, written by position, owning its length."""

from __future__ import annotations

import mmap

import numpy as np

from .config import ModelConfig
from .errors import GenerationError


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


def release_pages(arr: np.ndarray) -> None:
    """Return the whole pages inside a C-contiguous slice of a lazy_zeros array to the OS; they
    read as zeros afterwards and take memory again only when written. On a file's copy-on-write
    map (never written) the pages leave this process's memory and read as the file again."""
    buf = arr
    while not isinstance(buf, mmap.mmap):
        buf = buf.obj if isinstance(buf, memoryview) else getattr(buf, "base", None)
        if buf is None:
            return  # not from lazy_zeros: nothing to give back
    start = arr.ctypes.data - np.frombuffer(buf, np.uint8, count=1).ctypes.data
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (start + arr.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first and hasattr(mmap, "MADV_DONTNEED"):
        buf.madvise(mmap.MADV_DONTNEED, first, last - first)


# Weight matrices start on a cache line. Their rows are whole lines at the shapes of this field, so
# every 64-byte vector load of a row then reads one line, not two: the default model's float32
# prefill 512 ran at 555-582 tok/s from a safetensors file whose tensors all sat 40 bytes past a
# line, 730-747 from the same bytes aligned (decode level: it waits on memory either way).
CACHE_LINE = 64


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a cache line."""
    dtype = np.dtype(dtype)
    n = dtype.itemsize
    for d in shape:
        n *= d
    raw = np.empty(n + CACHE_LINE, np.uint8)
    start = -raw.ctypes.data % CACHE_LINE
    return raw[start : start + n].view(dtype).reshape(shape)


def aligned_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeros whose data starts on a cache line (activation buffers, read as weights are)."""
    out = aligned_empty(shape, dtype)
    out.fill(0)
    return out


def lazy_zeros(shape: tuple[int, ...]) -> np.ndarray:
    """float32 zeros whose pages are only materialised when first written.

    Not np.zeros: NumPy advises huge pages for large arrays, so the first write at each
    position of each (layer, head) slab would zero a whole 2 MiB page, hundreds of milliseconds
    on a fresh cache. An anonymous map touches 4 KiB pages, only for positions in use.
    """
    n = 4
    for d in shape:
        n *= d
    if hasattr(mmap, "MAP_PRIVATE"):  # private, so release_pages' MADV_DONTNEED frees the pages
        buf = mmap.mmap(-1, max(n, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:
        buf = mmap.mmap(-1, max(n, 1))
    return np.frombuffer(buf, dtype=np.float32, count=n // 4).reshape(shape)
