"""Weight formats: the one table of how a matrix is stored and how activations meet it.

Every weight matrix carries one of these after load (minillm.loading.checkpoint.Linear.format),
and nothing downstream asks its dtype or layout again: the loaders convert and regroup by the
table, the forward pass calls each matrix's own compiled kernels (`matmul.kernels_for`), the CLI's
`--dtype` choices and the docs' table are read from it. Adding a format is adding a row here and
its kernel functions, each registered for it where it is defined (`kernel_of`, below).

    name      stored as (element, block)            activations meet it as (Operand)
    F32       float32 rows                          float32, FMAs
    BF16      bfloat16 bits (uint16) rows           rounded to bfloat16, pairs of products
    I8        int8 rows + a float16 scale per 32    int16 per block of 32, vpmaddwd
    Q4_0..MXFP4 GGUF blocks as stored (uint8 rows)  float32: each block dequantized in registers
    *_R16     those blocks regrouped by 16 rows     int16 split into bytes: integer dot products
    *_R16_A8  the same bytes                        int8: half the integer products (`--activations 8`)

Each compiled kernel has one C signature whatever the format (weights come as their raw bytes),
and the forward pass calls it through its address: a format's code is compiled only when a model
needs it, in its own small module, once per machine (Numba's disk cache), and the forward pass is
the same compiled code for every model.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
from numba import types


class Operand(IntEnum):
    """How activations meet a format's rows, prepared once per vector (kernels.activation_operands)."""

    FLOAT32 = 0  # as they are
    BFLOAT16 = 1  # rounded to bfloat16 bits
    INT16 = 2  # quantized to int16 per block of 32 (scale = the block's largest magnitude / 32767)
    SPLIT_BYTES = 3  # int16 per block of 32 (largest / 32639), each split into a high and a low byte
    BYTES = 4  # int8 per block of 32 (largest / 127): llama.cpp's Q8_0 activations, half the products


@dataclass(frozen=True)
class WeightFormat:
    name: str
    element: type  # dtype of the stored array: float32, uint16 (bfloat16 bits), int8, uint8 (raw blocks)
    block: int  # weights per block; rows are whole blocks (1: any length)
    block_bytes: int  # bytes per block in the stored rows
    operand: Operand
    summary: str
    ggml_type: int | None = None  # its number in GGUF files, and then its code too
    own_code: int | None = None  # the kernels' number for a format GGUF has not
    scales_beside: bool = False  # a float16 scale per block of 32 kept beside the rows (Linear.scales)
    groupable: bool = False  # regrouped at load into its 16-row layout (`grouped`), when rows allow
    group_of: str | None = None  # for a grouped layout: the format it regroups
    default_activations: int = 16  # a groupable format's activation bits unless chosen (`with_activations`)

    @property
    def code(self) -> int:
        """The kernels' number for the format (a compile-time constant of its kernels)."""
        return self.ggml_type if self.own_code is None else self.own_code

    @property
    def grouped(self) -> str | None:
        """The name of the 16-row layout it is regrouped into, if any."""
        return f"{self.name}_R16" if self.groupable else None

    @property
    def activation_bits(self) -> int:
        """A grouped layout's activations: 8-bit bytes or 16-bit levels split in two."""
        return 8 if self.operand == Operand.BYTES else 16

    @property
    def is_gguf_blocks(self) -> bool:
        """Rows of raw blocks (uint8), as a GGUF file stores them or regrouped."""
        return self.element is np.uint8

    def row_bytes(self, k: int) -> int:
        """Bytes of one stored row of k weights."""
        return k // self.block * self.block_bytes

    def bits_per_weight(self) -> float:
        extra = 16 / 32 if self.scales_beside else 0
        return 8 * self.block_bytes / self.block + extra


GROUP_ROWS = 16  # rows of a grouped layout (kernels.grouped_layouts)
# What activations are quantized to against a grouped layout (`--activations`): per width, its
# layout's name suffix, Operand, code base (+ the ggml type it regroups) and summary's end
ACTIVATION_WIDTHS = {
    16: ("", Operand.SPLIT_BYTES, 1000, ": integer dot products"),
    8: ("_A8", Operand.BYTES, 2000, ", met by 8-bit activations (llama.cpp's numerics): half the products"),
}


def _grouped_layout(source: WeightFormat, bits: int) -> WeightFormat:
    """The row of source's 16-row layout met by activations of `bits` bits: its blocks, met by
    integer dot products."""
    suffix, operand, codes, what = ACTIVATION_WIDTHS[bits]
    return WeightFormat(source.grouped + suffix, np.uint8, source.block, source.block_bytes, operand, f"{source.name} regrouped by 16 rows{what}",
                        own_code=codes + source.ggml_type, group_of=source.name)


_F = Operand.FLOAT32
_STORED = (
    WeightFormat("F32", np.float32, 1, 4, _F, "float32: exact, transformers' logits", ggml_type=0),
    WeightFormat("BF16", np.uint16, 1, 2, Operand.BFLOAT16, "bfloat16: half the bytes; activations rounded to bfloat16", ggml_type=30),
    WeightFormat("I8", np.int8, 1, 1, Operand.INT16, "int8 per block of 32 with a float16 scale, the error-minimising scale searched at load",
                 own_code=1100, scales_beside=True),
    WeightFormat("F16", np.uint8, 32, 64, _F, "GGUF float16 rows, widened in registers", ggml_type=1),
    WeightFormat("Q4_0", np.uint8, 32, 18, _F, "GGUF 4-bit blocks, a float16 scale", ggml_type=2, groupable=True, default_activations=8),
    WeightFormat("Q4_1", np.uint8, 32, 20, _F, "GGUF 4-bit blocks, a float16 scale and minimum", ggml_type=3),
    WeightFormat("Q5_0", np.uint8, 32, 22, _F, "GGUF 5-bit blocks, a float16 scale", ggml_type=6, groupable=True, default_activations=8),
    WeightFormat("Q5_1", np.uint8, 32, 24, _F, "GGUF 5-bit blocks, a float16 scale and minimum", ggml_type=7),
    WeightFormat("Q8_0", np.uint8, 32, 34, _F, "GGUF 8-bit blocks, a float16 scale", ggml_type=8, groupable=True, default_activations=8),
    WeightFormat("Q4_K", np.uint8, 256, 144, _F, "GGUF 4-bit super-blocks, 6-bit scales and minimums", ggml_type=12, groupable=True, default_activations=8),
    WeightFormat("Q5_K", np.uint8, 256, 176, _F, "GGUF 5-bit super-blocks, 6-bit scales and minimums", ggml_type=13),
    WeightFormat("Q6_K", np.uint8, 256, 210, _F, "GGUF 6-bit super-blocks, 8-bit scales", ggml_type=14, groupable=True, default_activations=8),
    WeightFormat("MXFP4", np.uint8, 32, 17, _F, "GGUF microscaling FP4 blocks (gpt-oss's experts), a power-of-two scale", ggml_type=39,
                 groupable=True),
)
FORMATS = _STORED + tuple(_grouped_layout(f, bits) for bits in ACTIVATION_WIDTHS for f in _STORED if f.groupable)
BY_NAME = {f.name: f for f in FORMATS}
BY_CODE = {f.code: f for f in FORMATS}
BY_GGML_TYPE = {f.ggml_type: f for f in FORMATS if f.ggml_type is not None}
assert len(BY_NAME) == len(BY_CODE) == len(FORMATS), "a format's name or code used twice"
F32, BF16, I8 = BY_NAME["F32"], BY_NAME["BF16"], BY_NAME["I8"]

# What `--dtype` converts a checkpoint's weights to at load (minillm.loading.checkpoint), and the
# format each gives a matrix; "gguf" runs a GGUF file's tensors as stored.
LOAD_DTYPES = {"float32": "F32", "bfloat16": "BF16", "int8": "I8", "q4_0": "Q4_0"}
AS_STORED = "gguf"
DTYPE_CHOICES = (*LOAD_DTYPES, AS_STORED)


# ---------------------------------------------------------------- each format's kernels, by job
#
# As llama.cpp's type_traits_cpu: the one place that says which function does a job for a format.
# The kernel modules put their functions here where they define them (`@kernel_of("Q4_K", "tile")`),
# and the dispatchers look them up by the format's code (`kernel_for(code, "tile")`), so adding a
# format is its row above plus its functions, each named for it once. Jobs:
#   chunks   GGUF blocks run as stored: (IR builder, WeightFormat, block pointer) -> the block as
#            float32 chunks of 16 (kernels.gguf_blocks)
#   regroup  a grouped layout's regrouping at load: (out, rows of blocks) (kernels.grouped_layouts)
#   row      a grouped layout's row read back as float32 (kernels.grouped_layouts)
#   tile     a grouped layout's integer products, rows of a group x tokens (kernels.integer_products)
# (How activations meet a format is its row's `operand`: kernels.activation_operands.)
JOBS = ("chunks", "regroup", "row", "tile")
_KERNELS: dict[tuple[int, str], object] = {}


def kernel_of(names, job: str):
    """Decorator: the function is format(s) `names`' kernel for `job` (one of JOBS)."""
    assert job in JOBS, job

    def register(fn):
        for name in (names,) if isinstance(names, str) else names:
            key = (BY_NAME[name].code, job)
            assert key not in _KERNELS, f"{name} has two {job} kernels"
            _KERNELS[key] = fn
        return fn

    return register


def kernel_for(fmt: WeightFormat | int | None, job: str):
    """Format fmt's (a row or its code) kernel for `job`, or None when it has none."""
    code = fmt.code if isinstance(fmt, WeightFormat) else fmt
    return _KERNELS.get((code, job))


def registered_jobs() -> dict[str, set[str]]:
    """Each format's name -> the jobs it has kernels for (what the table's test checks)."""
    jobs: dict[str, set[str]] = {}
    for code, job in _KERNELS:
        jobs.setdefault(BY_CODE[code].name, set()).add(job)
    return jobs


def layouts_of(name: str) -> tuple[str, ...]:
    """The grouped layouts of format `name`, one per activation width: the same bytes, so the
    same regrouping and row reader (their kernels are registered for all of them)."""
    return tuple(f.name for f in FORMATS if f.group_of == name)


def with_activations(fmt: WeightFormat, bits: "int | dict[str, int] | None" = None) -> WeightFormat:
    """The format a matrix of fmt runs as when activations are quantized to `bits` bits against
    grouped layouts (the same weights: a grouped layout's other row); any other format unchanged.
    bits None: the regrouped format's own default (`default_activations`, chosen by perplexity:
    docs/performance.md); a dict: bits per stored format's name, the others their default."""
    if not fmt.group_of:
        return fmt
    source = BY_NAME[fmt.group_of]
    if bits is None or isinstance(bits, dict):
        bits = (bits or {}).get(source.name, source.default_activations)
    if bits not in ACTIVATION_WIDTHS:
        raise ValueError(f"activations must be {' or '.join(map(str, ACTIVATION_WIDTHS))} bits, got {bits}")
    return next(BY_NAME[name] for name in layouts_of(source.name) if BY_NAME[name].activation_bits == bits)


def runnable(fmt: WeightFormat, rows: int) -> WeightFormat:
    """The format a matrix of `rows` rows runs as: its grouped layout when the rows are whole
    groups of 16, else itself. (A Q8_0 matrix that cannot be grouped is split to I8 by the loader:
    the same weights, on vpmaddwd.)"""
    if fmt.grouped and rows % GROUP_ROWS == 0:
        return BY_NAME[fmt.grouped]
    return fmt



# ---------------------------------------------------------------- KV cache formats
#
# How keys and values are kept (`--kv-dtype`): each KV head's row of hd values at each position is
# stored in the format and widened to float32 in registers as attention reads it (kernels.kv_rows),
# so attention's sums are float32 over exactly the stored values, in the same order in every path.


@dataclass(frozen=True)
class KVFormat:
    name: str  # as `--kv-dtype` spells it
    element: type  # dtype of the stored rows; a distinct one per format, so the kernels specialise on it
    block: int  # values per block (a row is whole blocks)
    block_bytes: int
    summary: str

    def row_length(self, hd: int) -> int:
        """Elements of `element` per stored row of hd values."""
        return hd // self.block * self.block_bytes // np.dtype(self.element).itemsize

    def row_bytes(self, hd: int) -> int:
        return hd // self.block * self.block_bytes


KV_FORMATS = {
    "float32": KVFormat("float32", np.float32, 1, 4, "exact: transformers' attention"),
    "float16": KVFormat("float16", np.int16, 1, 2, "float16 bits (int16), nearest-even: half the memory"),
    "bfloat16": KVFormat("bfloat16", np.uint16, 1, 2, "bfloat16 bits (uint16), nearest-even: half the memory, float32's range"),
    "q8_0": KVFormat("q8_0", np.uint8, 32, 34, "llama.cpp's Q8_0 blocks: 32 int8 and a float16 scale, 0.27 of float32"),
}
KV_DTYPE_CHOICES = tuple(KV_FORMATS)

# ---------------------------------------------------------------- each format's compiled kernels

# One C signature per kind of kernel, whatever the format:
#   linear(out, col, w, scales, x, xo, xs, scratch, claims, t): thread t's share of
#       out[:, col:col + N] = x @ W.T, tasks of 16 rows claimed from claims (kernels.work_sharing)
#   row(out, w, scales, n): out = row n of W as float32 (an embedding lookup)
#   prepare(xo, xs, x, r0, r1): rows r0..r1-1 of x as the format's operand
F32_2D, U8_2D, U16_2D, I64_2D = (types.Array(t, 2, "C") for t in (types.float32, types.uint8, types.uint16, types.int64))
F32_1D = types.Array(types.float32, 1, "C")
LINEAR_SIGNATURE = types.void(F32_2D, types.int64, U8_2D, U16_2D, F32_2D, U16_2D, F32_2D, F32_1D, I64_2D, types.int64)
ROW_SIGNATURE = types.void(F32_1D, U8_2D, U16_2D, types.int64)
PREPARE_SIGNATURE = types.void(U16_2D, F32_2D, F32_2D, types.int64, types.int64)


def markdown_table() -> str:
    """The docs' table of formats (docs/performance.md)."""
    lines = ["| format | stored as | bits per weight | activations meet it as | what |", "|---|---|---|---|---|"]
    for f in FORMATS:
        stored = {np.float32: "float32", np.uint16: "bfloat16 bits", np.int8: "int8 + float16 scales"}.get(f.element, f"blocks of {f.block}")
        lines.append(f"| {f.name} | {stored} | {f.bits_per_weight():.3g} | {f.operand.name.lower().replace('_', ' ')} | {f.summary} |")
    return "\n".join(lines)
