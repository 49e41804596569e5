"""The CPU the kernels are compiled for, and the instructions it offers them.

By default that is this machine. `NUMBA_CPU_NAME` (with or without `NUMBA_CPU_FEATURES`) names
another: a portable cache for containers and clusters (`generic`), or an AVX2 laptop's code built
on an AVX-512 server (`haswell`). The kernels must then emit nothing outside that target, so their
probe reads the target, never the host: with `NUMBA_CPU_NAME=haswell` alone on an AVX-512
machine, a probe of the host once emitted AVX-512 permutes that LLVM could not lower for Haswell
and the process aborted.

Numba itself pairs a named CPU with the *host's* features unless told otherwise, which would let
LLVM use AVX-512 in a "haswell" build; `use_named_cpu_features` makes an empty feature string the
default instead, so LLVM takes the named CPU's own features.

The explicit intrinsics the kernels choose by feature: AVX-512 F (float permutes), AVX-512 VNNI
or AVX-VNNI (vpdpbusd), AVX-512 BF16 (vdpbf16ps), AVX2 (vpmaddubsw/vpmaddwd for the integer
products). Everything else is plain LLVM vectors, which compile for any x86-64 (and any other
architecture LLVM targets).
"""

from __future__ import annotations

import os
from functools import lru_cache

# The features the kernels ask about, for CPU names LLVM knows, where NUMBA_CPU_NAME gives a name
# without NUMBA_CPU_FEATURES. An unknown name is taken to have none of them: the plain-vector
# paths run everywhere.
_AVX2 = {"avx", "avx2", "fma", "f16c"}
_AVX512 = _AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
_VNNI512 = _AVX512 | {"avx512vnni"}
NAMED_CPUS = {
    "generic": set(), "x86-64": set(), "x86-64-v2": set(), "nehalem": set(), "westmere": set(),
    "sandybridge": {"avx"}, "ivybridge": {"avx", "f16c"},
    "x86-64-v3": _AVX2, "haswell": _AVX2, "broadwell": _AVX2, "skylake": _AVX2, "alderlake": _AVX2 | {"avxvnni"},
    "raptorlake": _AVX2 | {"avxvnni"}, "meteorlake": _AVX2 | {"avxvnni"}, "arrowlake": _AVX2 | {"avxvnni"},
    "znver1": _AVX2, "znver2": _AVX2, "znver3": _AVX2,
    "x86-64-v4": _AVX512, "skylake-avx512": _AVX512, "cascadelake": _VNNI512, "cooperlake": _VNNI512 | {"avx512bf16"},
    "icelake-client": _VNNI512, "icelake-server": _VNNI512, "tigerlake": _VNNI512, "rocketlake": _VNNI512,
    "sapphirerapids": _VNNI512 | {"avx512bf16", "avxvnni"}, "emeraldrapids": _VNNI512 | {"avx512bf16", "avxvnni"},
    "graniterapids": _VNNI512 | {"avx512bf16", "avxvnni"}, "znver4": _VNNI512 | {"avx512bf16"},
    "znver5": _VNNI512 | {"avx512bf16", "avxvnni"},
}


def use_named_cpu_features() -> None:
    """Where NUMBA_CPU_NAME names a CPU and NUMBA_CPU_FEATURES is unset, compile for that CPU's own
    features (an empty feature string), not the host's. Called before the first compile."""
    import numba

    if os.environ.get("NUMBA_CPU_NAME") and os.environ.get("NUMBA_CPU_FEATURES") is None:
        os.environ["NUMBA_CPU_FEATURES"] = ""
        numba.config.CPU_FEATURES = ""


@lru_cache(maxsize=1)
def target_name() -> str:
    """The CPU the kernels are compiled for, as LLVM names it."""
    import llvmlite.binding as llvm

    return os.environ.get("NUMBA_CPU_NAME") or llvm.get_host_cpu_name()


@lru_cache(maxsize=1)
def target_features() -> frozenset[str]:
    """The CPU features LLVM may use in the kernels (empty if it cannot tell)."""
    features = os.environ.get("NUMBA_CPU_FEATURES")
    if features:  # "+avx2,+fma,-avx512f": LLVM's form
        return frozenset(f[1:] for f in features.split(",") if f.startswith("+"))
    if os.environ.get("NUMBA_CPU_NAME"):
        return frozenset(NAMED_CPUS.get(os.environ["NUMBA_CPU_NAME"].lower(), set()))
    import llvmlite.binding as llvm

    try:
        return frozenset(name for name, on in llvm.get_host_cpu_features().items() if on)
    except RuntimeError:
        return frozenset()


def has(feature: str) -> bool:
    return feature in target_features()


def vector_registers() -> int:
    """How many 16-float vectors the target holds in registers: 32 with AVX-512, else 8 (16 ymm
    halves), which sets how large a register tile can be before it spills."""
    return 32 if has("avx512f") else 8


def describe() -> str:
    """A one-line description for messages: the CPU name and its widest vectors."""
    width = "AVX-512" if has("avx512f") else "AVX2" if has("avx2") else "no AVX2"
    return f"{target_name()}, {width}"
