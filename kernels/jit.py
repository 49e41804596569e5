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
