"""Numba CPU kernels for a pre-norm Llama forward pass.

Every kernel is a pure function over preallocated float32 arrays, output first, and has a plain
NumPy reference in tests/test_kernels.py. Shapes: T tokens, H hidden, K/N matmul in/out,
nh/nkv query/KV heads, hd head dim, ctx cache length.
"""

from .attention import attention, kv_write
from .matmul import add_bias, matmul, matvec
from .rmsnorm import rmsnorm
from .rope import rope, rope_tables
from .swiglu import swiglu

__all__ = ["attention", "kv_write", "add_bias", "matmul", "matvec", "rmsnorm", "rope", "rope_tables", "swiglu"]
