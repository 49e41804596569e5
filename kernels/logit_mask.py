"""The structured-output mask applied to logits (minillm.core.structured): a bit per token, packed 32 to
an int32 word as llguidance writes it."""

import numpy as np

from .jit import kernel


@kernel(parallel=False)
def mask_logits(logits, bits):
    """logits[i] = -inf for every token i whose bit (bit i % 32 of word i // 32) is clear."""
    for i in range(logits.shape[0]):
        if (bits[i >> 5] >> (i & 31)) & 1 == 0:
            logits[i] = -np.inf
