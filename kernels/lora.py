"""A LoRA adapter's low-rank update on one row: out += scale * B (A x), beside a base matrix's
product (which the row's output already holds), in float32 as PEFT's `lora_B(lora_A(x)) * scaling`.

An adapter's matrices live in one flat array of bytes, in the precision the file holds them
(float32, float16 or bfloat16: widened exactly as read, so a 16-bit adapter is read at half the
bytes): A as PEFT stores it, (r, K), its rows dot products with x in a fixed order; B
transposed, (r, N), so B (A x) is a weighted sum of B's rows over independent lanes. No sum
depends on the other rows of the batch, or on how the columns are shared among threads: every row
gets the same bits as that row alone.
"""

import numpy as np
from numba import njit

from .float_sums import dot_chunks, dot_rows16, weighted_rows_1, weighted_rows_2, weighted_rows_3
from .jit import EXACT_MATH
from .kv_rows import kv_at
from .vector_ir import LANES

# The columns of ModelWeights.lora_entries: where an update's A and B start in lora_data (in
# elements of its kind), its rank, its input and output widths, the column of the base output it
# adds into, the next update on the same matrix for the same adapter (-1: none; Qwen2-MoE's
# router and shared-expert gate share one matrix), and how A and B are stored.
LORA_A, LORA_B, LORA_RANK, LORA_IN, LORA_OUT, LORA_COL, LORA_NEXT, LORA_KIND = range(8)
LORA_FIELDS = 8
ROW_GROUP = 8  # rows of one adapter updated together: B is read once for them
LORA_F32, LORA_F16, LORA_BF16 = 0, 1, 2  # how an update's A and B are stored (LORA_KIND): as the file holds them


@njit(fastmath=EXACT_MATH, cache=True, _nrt=False)
def lora_rows(out, x, data, a0, b0, rank, stride, scale, scratch):
    """out[g] += scale * (B (A x[g])) for the G rows of x (G, K) and out (G, n): A at data[a0:]
    as (rank, K); B's columns for out at data[b0:], rank rows `stride` apart (B is (rank, N);
    out may be a part of the N columns). data: float32, or float16 / bfloat16 bits (int16 /
    uint16), widened exactly as they are read. scratch (at least G (rank + 16) float32) holds
    A x[g], then B (A x[g]) a chunk of columns at a time.

    A x: 16 rows of A at a time against one pass over x[g] (float_sums.dot_rows16: the
    accumulators stay in registers; a loop over the rank per element of x waited on memory, 4x
    slower). B (A x): float_sums' weighted rows, as attention weighs values: each row of B loaded
    once for up to three rows of the group. Every sum has one fixed order: a row's bits do not
    depend on the group it is in, nor on how its columns are shared."""
    G, K, N = x.shape[0], x.shape[1], out.shape[1]
    u = scratch[: G * rank]
    for g in range(G):
        j = 0
        while j + LANES <= rank:
            dot_rows16(u, g * rank + j, x[g], 0, data, a0 + j * K, K, K)
            j += LANES
        for j in range(j, rank):
            u[g * rank + j] = dot_chunks(x[g], 0, data, a0 + j * K, K)
        for j in range(rank):
            for k in range(K - K % LANES, K):
                u[g * rank + j] += kv_at(data, a0 + j * K, k) * x[g, k]
    chunk = min(512, (scratch.shape[0] - G * rank) // G // LANES * LANES)
    d0 = G * rank
    for n0 in range(0, N, chunk):
        width = min(N - n0, chunk)
        full = width - width % LANES
        g = 0
        while g < G:
            if G - g >= 3:
                weighted_rows_3(scratch, d0 + g * chunk, chunk, u, g * rank, rank, data, b0 + n0, rank, stride, full)
                g += 3
            elif G - g == 2:
                weighted_rows_2(scratch, d0 + g * chunk, chunk, u, g * rank, rank, data, b0 + n0, rank, stride, full)
                g += 2
            else:
                weighted_rows_1(scratch, d0 + g * chunk, chunk, u, g * rank, rank, data, b0 + n0, rank, stride, full)
                g += 1
        for g in range(G):
            d = scratch[d0 + g * chunk : d0 + g * chunk + width]
            for n in range(full, width):
                total = np.float32(0.0)
                for j in range(rank):
                    total += kv_at(data, b0 + j * stride + n0, n) * u[g * rank + j]
                d[n] = total
            o = out[g, n0 : n0 + width]
            for n in range(width):
                o[n] += d[n] * scale
