"""What this CPU offers the kernels.

float32 and int8 kernels are plain LLVM vectors, which compile for any x86-64 (LLVM splits the
16-wide vectors where AVX-512 is missing). bfloat16 kernels use vdpbf16ps and vcvtne2ps2bf16
where the CPU has AVX-512 BF16, and the same products and roundings in plain vectors where it
does not (kernels.ir_blocks.native_bf16).
"""

from functools import lru_cache


@lru_cache(maxsize=1)
def host_features() -> frozenset[str]:
    """The CPU features LLVM finds on this machine (empty if it cannot tell)."""
    import llvmlite.binding as llvm

    try:
        return frozenset(name for name, on in llvm.get_host_cpu_features().items() if on)
    except RuntimeError:
        return frozenset()
