"""Shared Numba settings for the kernels."""

from numba import njit

# Fused multiply-add allowed, reordering not: the model's sums keep their fixed order.
EXACT_MATH = {"contract"}

# Reductions may be reordered (so LLVM can vectorise float32 sums) and multiply-adds fused;
# no `nnan`/`ninf`, so NaN and Inf still propagate. Only for sums whose order cannot change a
# result (quantization's error search).
REDUCE_MATH = {"reassoc", "contract"}


def kernel(parallel: bool = True, fastmath=False):
    """`@njit` with on-disk caching: compiled once per machine, loaded in milliseconds after."""
    return njit(parallel=parallel, cache=True, fastmath=fastmath, nogil=True)


def array_key(a) -> tuple:
    """What decides an array's Numba type (dtype, dimensions, layout, writability, alignment)."""
    f = a.flags
    return a.dtype.str, a.ndim, f.c_contiguous, f.f_contiguous, f.writeable, f.aligned


class DirectCall:
    """A kernel called without its dispatcher's per-call type resolution.

    Numba's dispatcher resolves the types of NamedTuple and typed-List arguments in Python on
    every call: for the decode step's two NamedTuples of ~50 arrays that is ~0.3 ms, 5% of a
    4-bit decode step of the default model. The compiled entry point takes the same arguments
    and unboxes them in ~10 us. The caller names what can change the arguments' types (`key`);
    the first call with a new key goes through the dispatcher (compiling or loading the kernel)
    and keeps the entry point it chose."""

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        self._entries = {}

    def __call__(self, key, *args):
        entry = self._entries.get(key)
        if entry is not None:
            return entry(*args)
        result = self.dispatcher(*args)
        signature = tuple(self.dispatcher.typeof_pyval(a) for a in args)
        self._entries[key] = self.dispatcher.overloads[signature].entry_point
        return result
