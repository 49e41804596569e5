"""Sampling: pure functions of (logits, settings, a numpy Generator). Never inside the model.

Order as in transformers and llama.cpp: logit bias, repetition penalty, temperature, top-k, top-p,
min-p.
Temperature 0 is greedy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import GenerationError
from ..kernels import top_k

# The draw finds its block of this many tokens by block sums, then its token by a cumulative sum
# inside that block. OpenAI's defaults (no top-k, top-p 1) sample from the whole vocabulary, on
# the path of every streamed token: a float64 softmax and cumulative sum over 49152 logits took
# 0.8 ms per token, 6.4 ms for the 8 sequences of a ~13 ms step on a 4-bit file; float32 (as
# transformers samples) and block sums take ~0.1 ms.
DRAW_BLOCK = 256


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40  # 0: off
    top_p: float = 0.95  # 1: off
    min_p: float = 0.05  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per time a token was generated
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: (token, bias in [-100, 100]) added first

    def __post_init__(self):
        def bad(field, value, rule):
            raise GenerationError(f"{field} must be {rule}, got {value!r}")

        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            bad("temperature", t, "a finite number >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", self.top_k, "an integer >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad("min_p", self.min_p, "in [0, 1]")
        r = self.repetition_penalty
        if not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
            bad("repetition_penalty", r, "a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                bad(name, value, "in [-2, 2]")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", self.seed, "an integer >= 0")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or token < 0:
                bad("logit_bias", token, "keyed by token ids >= 0")
            if not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                bad("logit_bias", bias, "values in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_logit_bias(logits: np.ndarray, bias) -> np.ndarray:
    """OpenAI's logit_bias: each listed token's logit plus its bias (ids past the vocabulary ignored)."""
    if not bias:
        return logits
    logits = logits.copy()
    for token, value in bias:
        if token < len(logits):
            logits[token] += np.float32(value)
    return logits


def apply_repetition_penalty(logits: np.ndarray, history, penalty: float) -> np.ndarray:
    """CTRL-style penalty on every token seen so far: divide positive logits, multiply negative."""
    if penalty == 1.0 or len(history) == 0:
        return logits
    seen = np.unique(np.asarray(history, dtype=np.int64))
    values = logits[seen]
    logits = logits.copy()
    logits[seen] = np.where(values > 0, values / penalty, values * penalty)
    return logits


def apply_openai_penalties(logits: np.ndarray, generated, presence: float, frequency: float) -> np.ndarray:
    """logit -= presence * [count > 0] + frequency * count, over the tokens generated so far."""
    if (presence == 0.0 and frequency == 0.0) or len(generated) == 0:
        return logits
    tokens, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
    logits = logits.copy()
    logits[tokens] -= presence + frequency * counts
    return logits


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, history=(), generated=()) -> int:
    """The next token id from last-position logits (V,).

    history: the tokens the repetition penalty looks at (prompt and output);
    generated: the output so far, for the presence and frequency penalties.
    """
    if np.isnan(logits).any():
        raise GenerationError("the model produced NaN logits; refusing to sample")
    logits = apply_logit_bias(logits, params.logit_bias)
    logits = apply_repetition_penalty(logits, history, params.repetition_penalty)
    logits = apply_openai_penalties(logits, generated, params.presence_penalty, params.frequency_penalty)
    if params.greedy:
        return int(np.argmax(logits))

    if 0 < params.top_k < len(logits):
        # chosen on the float32 logits (the same set as on the scaled ones: dividing by a
        # positive temperature keeps the order), so only k values are widened; best first, ties
        # in index order (kernels.top_k)
        candidates, kept = np.empty(params.top_k, np.int64), np.empty(params.top_k, np.float32)
        top_k(candidates, kept, np.ascontiguousarray(logits, dtype=np.float32))
    else:
        candidates, kept = None, np.asarray(logits, np.float32)  # None: every token, by id
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        scaled = kept / np.float32(params.temperature)
    top = scaled.max()
    if top == -np.inf:
        raise GenerationError("every token's logit is -inf; nothing to sample")
    if not top < np.inf:  # a temperature so small that float32 overflows (or rounds to 0): its limit, greedy
        i = int(np.argmax(kept))
        return i if candidates is None else int(candidates[i])
    probs = np.exp(scaled - top)
    probs /= probs.sum()

    if params.top_p < 1.0:
        candidates, probs = _kept(candidates, probs, top_p_keep(probs, params.top_p))
    if params.min_p > 0.0:
        candidates, probs = _kept(candidates, probs, probs >= params.min_p * probs.max())

    i = draw(probs, rng.random())
    return i if candidates is None else int(candidates[i])


def _kept(candidates: np.ndarray | None, probs: np.ndarray, keep: np.ndarray):
    """The candidates and probabilities `keep` selects (candidates None: every token, by id)."""
    return (np.flatnonzero(keep) if candidates is None else candidates[keep]), probs[keep]


def draw(weights: np.ndarray, u: float) -> int:
    """The index whose span of the cumulative sum of `weights` (>= 0, some > 0) holds u * their
    total, u in [0, 1): never a zero weight. Block sums, then one block's cumulative sum."""
    n = len(weights)
    if n <= DRAW_BLOCK:
        cumulative = np.cumsum(weights, dtype=np.float64)
        return _first_above(cumulative, u * cumulative[-1], weights)
    full = n - n % DRAW_BLOCK
    sums = weights[:full].reshape(-1, DRAW_BLOCK).sum(axis=1)
    if full < n:
        sums = np.append(sums, weights[full:].sum())
    cumulative = np.cumsum(sums, dtype=np.float64)
    target = u * cumulative[-1]
    block = _first_above(cumulative, target, sums)
    start = block * DRAW_BLOCK
    inside = weights[start:start + DRAW_BLOCK]
    before = cumulative[block - 1] if block else 0.0
    return start + _first_above(np.cumsum(inside, dtype=np.float64), target - before, inside)


def _first_above(cumulative: np.ndarray, target: float, parts: np.ndarray) -> int:
    """The first i with cumulative[i] > target; past the end (rounding between two sums of the
    same weights), the last i whose part is > 0."""
    i = int(np.searchsorted(cumulative, target, side="right"))
    return i if i < len(cumulative) else int(np.flatnonzero(parts > 0)[-1])


def top_p_keep(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Which tokens top-p keeps: the fewest most probable ones whose mass reaches top_p (at least
    one), and any tied with the least probable of them. Found from the sorted values, so no
    argsort: a stable argsort of 49152 tokens took ~5-9 ms per token, more than a decode step."""
    ordered = np.sort(probs)[::-1]
    cumulative = np.cumsum(ordered, dtype=np.float64)
    n = min(int(np.searchsorted(cumulative, top_p * cumulative[-1], side="left")), len(ordered) - 1)
    return probs >= ordered[n]
