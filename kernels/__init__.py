"""Numba CPU kernels for a pre-norm Llama forward pass.

Every kernel is a pure function over preallocated arrays, output first, and has a plain NumPy
reference in tests/test_kernels.py. Shapes: T tokens, H hidden, K/N matmul in/out, nh/nkv
query/KV heads, hd head dim, ctx cache length. Weight matrices come at any precision of
`quant` (float32, bfloat16 bits, int8 blocks + scales) or as GGUF blocks (`blocks`); sums are float32, and so are
activations, except that they are rounded to bfloat16 where they meet bfloat16 weights and
quantized to int16 per block of 32 where they meet int8 weights or GGUF blocks regrouped for
integer products (`row_groups`).
"""

import os
import sys

# GNU OpenMP (Numba's omp threading layer on Linux) keeps one thread pool per Python thread that
# enters a parallel region. Once a second one does (a model loads on the caller's thread, then
# the engine thread decodes), it counts more threads than CPUs and "throttles": workers spin
# ~100 times instead of ~300000 before sleeping, and every parallel region then wakes them
# through the kernel. A decode step of the default model's Q4_0 file took 11.9 ms on a second
# thread against 5.9 ms on the first (2 cores, alternating). ACTIVE with the default spin count
# keeps the default spin-then-sleep in both cases. Set before libgomp starts (the first
# parallel call reads them); a user's own settings win.
if sys.platform.startswith("linux") and "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    os.environ["GOMP_SPINCOUNT"] = "300000"

from . import jit  # first: every kernel's on-disk cache is stamped with the whole package (jit.PackageCacheLocator)
from .activation_prep import quantize_activations
from .blocks import FORMATS as BLOCK_FORMATS, Q4_0, Q8_0
from .attention import QUERIES_PER_TASK, attend, attention, kv_write
from .decode import DecodeBuffers, DecodeWeights, decode_batch
from .ir_blocks import QBLOCK
from .mask import mask_logits
from .row_groups import GROUP as ROW_GROUP, GROUPED, PER_BLOCK as SPLIT_PER_BLOCK, can_group, group_rows
from .matmul import add_bias, matmul, matvec
from .quant import INT8_MAX_WEIGHT, Q4_0_BYTES, Q8_0_BYTES, dequantize, gather_rows, quantize_int8, quantize_q4_0, quantize_q8_0, split_q8_0, to_bf16
from .rmsnorm import rmsnorm, rmsnorm_row
from .rope import rope, rope_row, rope_tables
from .select import top_k
from .swiglu import gated, softcap_row, swiglu

__all__ = [
    "QUERIES_PER_TASK", "attend", "attention", "kv_write", "DecodeBuffers", "DecodeWeights", "decode_batch", "add_bias", "matmul", "matvec",
    "mask_logits", "ROW_GROUP", "GROUPED", "SPLIT_PER_BLOCK", "can_group", "group_rows", "BLOCK_FORMATS", "Q4_0", "Q4_0_BYTES", "quantize_q4_0", "Q8_0", "Q8_0_BYTES", "quantize_q8_0", "split_q8_0", "INT8_MAX_WEIGHT", "QBLOCK", "dequantize", "gather_rows", "quantize_activations", "quantize_int8", "to_bf16", "rmsnorm", "rmsnorm_row",
    "rope", "rope_row", "rope_tables", "gated", "softcap_row", "swiglu", "top_k",
]
