"""What minillm.kernels exports, and the settings made before any kernel compiles (imported by
kernels/__init__.py under the package's own name only)."""

import os
import sys

# GNU OpenMP (Numba's omp threading layer on Linux) keeps one thread pool per Python thread that
# enters a parallel region. Once a second one does (a model loads on the caller's thread, then
# the engine thread decodes), it counts more threads than CPUs and "throttles": workers spin
# ~100 times instead of ~300000 before sleeping, and every parallel region then wakes them
# through the kernel (a decode step twice as slow on a second thread: docs/performance.md,
# "The measurements behind the kernels"). ACTIVE with the default spin count keeps the default spin-then-sleep in both cases. Set before libgomp starts (the first
# parallel call reads them); a user's own settings win.
if sys.platform.startswith("linux") and "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE"
    os.environ["GOMP_SPINCOUNT"] = "300000"

from . import target

target.use_named_cpu_features()  # before anything compiles: NUMBA_CPU_NAME alone means that CPU's features

from . import jit  # noqa: F401 - every kernel's on-disk cache is stamped with the whole package (jit.PackageCacheLocator)
from .activation_operands import PER_BLOCK as SPLIT_PER_BLOCK
from .activation_operands import prepare_for, quantize_activations
from .attention import QUERIES_PER_TASK, attend, attention, kv_write
from .formats import BY_CODE, BY_GGML_TYPE, BY_NAME, DTYPE_CHOICES, FORMATS, KV_DTYPE_CHOICES, KV_FORMATS, LOAD_DTYPES, KVFormat, Operand, WeightFormat, with_activations
from .forward_types import PARAMS as forward_params
from .forward_types import STATE_TYPE as forward_state_type
from .forward_types import SIGMOID_ROUTER, SOFTMAX_ROUTER, TOPK_SIGMOID_INPUT_ROUTER, TOPK_SOFTMAX_ROUTER, ModelWeights, Rows, Workspace
from .grouped_layouts import GROUP as ROW_GROUP
from .grouped_layouts import group_rows
from .logit_mask import mask_logits
from .matmul import add_bias, dequantize, kernels_for, matmul
from .quantize import INT8_MAX_WEIGHT, Q4_0_BYTES, Q8_0_BYTES, quantize_int8, quantize_q4_0, quantize_q8_0, split_q8_0, to_bf16
from .rmsnorm import layernorm_row, rmsnorm, rmsnorm_row
from .rope import rope, rope_row, rope_tables
from .swiglu import CLAMPED_SWIGLU, GELU_TANH, SILU, XIELU, gated, softcap_row, swiglu
from .top_k import top_k
from .vector_ir import QBLOCK

__all__ = [
    "forward_state_type", "forward_params", "QUERIES_PER_TASK", "attend", "attention", "kv_write", "BY_CODE", "BY_GGML_TYPE", "BY_NAME", "DTYPE_CHOICES", "FORMATS", "KV_DTYPE_CHOICES", "KV_FORMATS", "KVFormat", "LOAD_DTYPES", "Operand", "with_activations",
    "WeightFormat", "kernels_for", "prepare_for", "ModelWeights", "Rows", "Workspace", "SOFTMAX_ROUTER", "TOPK_SOFTMAX_ROUTER", "SIGMOID_ROUTER", "TOPK_SIGMOID_INPUT_ROUTER",
    "ROW_GROUP", "SPLIT_PER_BLOCK", "group_rows", "mask_logits", "add_bias", "dequantize", "matmul", "INT8_MAX_WEIGHT", "Q4_0_BYTES", "Q8_0_BYTES",
    "quantize_activations", "quantize_int8", "quantize_q4_0", "quantize_q8_0", "split_q8_0", "to_bf16", "rmsnorm", "rmsnorm_row", "layernorm_row",
    "rope", "rope_row", "rope_tables", "gated", "SILU", "GELU_TANH", "CLAMPED_SWIGLU", "XIELU", "softcap_row", "swiglu", "top_k", "QBLOCK",
]
