"""The instructions each weight precision's kernels need, and which of them this CPU lacks.

float32 and int8 kernels are plain LLVM vectors, which compile for any x86-64 (LLVM splits the
16-wide vectors where AVX-512 is missing). bfloat16 kernels call vdpbf16ps and vcvtne2ps2bf16
(AVX-512 BF16), which LLVM cannot compile for a CPU without them: the process would abort, so a
model is checked before it loads at bfloat16.
"""

from functools import lru_cache

NEEDS = {"float32": (), "bfloat16": ("avx512f", "avx512bf16"), "int8": ()}


@lru_cache(maxsize=1)
def host_features() -> frozenset[str]:
    """The CPU features LLVM finds on this machine (empty if it cannot tell)."""
    import llvmlite.binding as llvm

    try:
        return frozenset(name for name, on in llvm.get_host_cpu_features().items() if on)
    except RuntimeError:
        return frozenset()


def missing_features(dtype: str, features: frozenset[str] | None = None) -> list[str]:
    """The features dtype's kernels need that this CPU (or `features`) lacks."""
    have = host_features() if features is None else features
    return [f for f in NEEDS[dtype] if f not in have]
