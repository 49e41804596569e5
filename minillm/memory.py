"""Memory for weights, activations and the KV cache: arrays on cache lines, pages given back.

Used by the loaders (weights copied or converted at load), the model (its buffers) and the KV
cache (lazily materialised, released in sliding windows).
"""

from __future__ import annotations

import mmap

import numpy as np


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


def lazy_zeros(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """Zeros (float32 by default) whose pages are only materialised when first written.

    Not np.zeros: NumPy advises huge pages for large arrays, so the first write at each
    position of each (layer, head) slab would zero a whole 2 MiB page, hundreds of milliseconds
    on a fresh cache. An anonymous map touches 4 KiB pages, only for positions in use.
    """
    dtype = np.dtype(dtype)
    n = dtype.itemsize
    for d in shape:
        n *= d
    if hasattr(mmap, "MAP_PRIVATE"):  # private, so release_pages' MADV_DONTNEED frees the pages
        buf = mmap.mmap(-1, max(n, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:
        buf = mmap.mmap(-1, max(n, 1))
    return np.frombuffer(buf, dtype=dtype, count=n // dtype.itemsize).reshape(shape)
