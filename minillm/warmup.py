"""Compiling the kernels ahead of time: `minillm warmup`, for images, replicas and CI.

A first run compiles the forward pass and the kernels of the model's weight formats for this CPU
(tens of seconds), then Numba's on-disk cache loads them in milliseconds. `warm` does that
compiling without a model, for a list of formats or a load precision, so a container image or a
cluster replica can be built with its cache already filled (docs/performance.md).
"""

from __future__ import annotations

import time

import numpy as np

from .errors import UsageError

# NUMBA_CPU_FEATURES for NUMBA_CPU_NAME=haswell: an AVX2 laptop's CPU, for portable caches and for
# compiling (CI, tests/test_targets.py, benchmarks/first_run.py) as if on one.
HASWELL_FEATURES = (
    "+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fsgsbase,+fxsr,+invpcid,+lzcnt,+mmx,+movbe,"
    "+pclmul,+popcnt,+rdrnd,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave,+xsaveopt"
)


def formats_for(dtype: str | None = None, names=(), activations: int | None = None) -> list:
    """The weight formats (kernels.formats) that `--dtype` or the named formats run as: each name
    with its 16-row grouped layout for `activations` bits (None: the format's default), which the
    loader uses when a matrix's rows allow."""
    from . import kernels as K

    wanted = list(names)
    if dtype is not None:
        if dtype not in K.DTYPE_CHOICES or dtype == K.formats.AS_STORED:
            raise UsageError(f"--dtype {dtype!r}: choose one of {', '.join(K.LOAD_DTYPES)} (or --formats for a GGUF's)")
        wanted.append(K.LOAD_DTYPES[dtype])
        if dtype == "q4_0":
            wanted.append("Q8_0")  # its output matrix (checkpoint.matrix_format)
    found = []
    for name in wanted:
        fmt = K.BY_NAME.get(name.upper())
        if fmt is None:
            raise UsageError(f"--formats: no weight format {name!r}; minillm runs {', '.join(f.name for f in K.FORMATS)}")
        grouped = [K.with_activations(K.BY_NAME[fmt.grouped], activations)] if fmt.grouped else []
        found += [K.with_activations(fmt, activations)] + grouped + ([K.I8] if fmt.name == "Q8_0" else [])
    return sorted(set(found), key=lambda f: f.code)


def warm(formats, kv_dtype: str = "float32", experts: bool = False, gpt_oss: bool = False) -> float:
    """Compile (or load from the cache) the forward pass for a KV cache format (with a mixture of
    experts' steps when `experts`, and gpt-oss's attention sinks and clamped SwiGLU when
    `gpt_oss`), sampling's kernels and the kernels of `formats`; returns the seconds it took."""
    from . import kernels as K
    from .kernels.forward import forward
    from .kernels.forward_types import STATE_TYPE
    from .kernels.jit import CompileNotice
    from .kernels.steps import step_kernels

    start = time.perf_counter()
    operands = sorted({f.operand for f in formats} - {K.Operand.FLOAT32})
    names = ", ".join(sorted({f.group_of or f.name for f in formats})) or "no weight format"
    with CompileNotice(f"the forward pass and kernels for {names}", jobs=len(formats) + len(operands) + 3) as notice:
        step_kernels(kv_dtype, experts or gpt_oss, sinks=gpt_oss, activation=K.CLAMPED_SWIGLU if gpt_oss else K.SILU)
        notice.step()
        forward.compile(STATE_TYPE.types)  # the forward pass takes the state's parts as its arguments
        notice.step()
        K.top_k(np.zeros(1, np.int64), np.zeros(1, np.float32), np.zeros(4, np.float32))
        K.mask_logits(np.zeros(4, np.float32), np.zeros(1, np.int32))
        notice.step()
        for fmt in formats:
            K.kernels_for(fmt)
            notice.step()
        for op in operands:
            K.prepare_for(op)
            notice.step()
    return time.perf_counter() - start
