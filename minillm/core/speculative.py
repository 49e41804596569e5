"""Speculative decoding: cheap guesses at the next tokens, kept only where plain decoding agrees.

Two proposers: prompt lookup (PromptLookup, below) and a draft model (the engine runs it; DraftState
is a sequence's side of it). Either way the engine runs the proposed tokens as extra rows of the
sequence's next step and keeps each while it is the very token plain decoding would choose there
(minillm.core.engine), so the text never changes.

Prompt lookup: the text proposes its own continuation.

Tasks whose output repeats their input (editing code, rewriting, extraction, quoting a document)
let the sequence's own tokens guess what comes next: when its last tokens occurred before, in the
prompt or the output, the tokens that followed are proposed (PromptLookup). Which occurrence: the
one nearest the copy point, where the last proposal left off (a reply that copies its input with
a few words changed resumes after each change: even one token matching there realigns it),
otherwise the latest occurrence of the longest n-gram (NGRAM_MIN <= n <= ngram) the sequence ends
with. Where the tokens that followed run into the sequence's end, the repetition they are part of
continues (a run of one token, a repeated line).

How many to propose is what gives the most tokens per unit of time (best_length): a checked row
costs `cost` of a step (the engine measures it, RowCost: a few percent of a step at float32, a quarter on a
Q4_0 file, where the weights are read fast and the rows are arithmetic), and a guess is kept with a
probability learned per kind of match (near the copy point or not, and how many tokens before it
agree: a long agreement predicts a long copy). When no length pays, none is proposed, but one
every PROBE_STEPS steps keeps the estimate honest, so open-ended text costs next to nothing.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

NGRAM_MIN = 2  # away from the copy point a single repeated token predicts too little
NEAR_BEHIND, NEAR_AHEAD = 2, 16  # how far from the copy point an occurrence counts as near it
LONGEST_AGREEMENT = 16  # tokens compared before a match, to class it
# Kept-token rates to start from, by how many tokens agree before the match (a class's lower
# bound: 1, 2, 3, 4-5, 6-9, 10+); learned per sequence from there.
PRIOR_RATES = {1: 0.35, 2: 0.5, 3: 0.6, 4: 0.7, 6: 0.8, 10: 0.85}
PROBE_STEPS = 16


def best_length(rate: float, cost: float, most: int) -> int:
    """The proposal length k <= most that maximises tokens per unit of time when each proposed
    token is kept with probability `rate` (while the ones before it were) and a checked row
    costs `cost` of a step: k rows emit 1 + rate + ... + rate^k tokens for 1 + k cost; 0 when
    no k beats plain decoding."""
    best_k, best, expected, kept = 0, 1.0, 1.0, 1.0
    for k in range(1, most + 1):
        kept *= rate
        expected += kept
        value = expected / (1 + k * cost)
        if value > best:
            best_k, best = k, value
    return best_k


def learned_rate(rate: float, proposed: int, accepted: int) -> float:
    """A kept-token rate moved toward what a proposal showed (its kept tokens and the first
    refused one), by more the more tokens it checked."""
    trials = accepted + (accepted < proposed)
    return rate + min(1.0, trials / 8) * (accepted / trials - rate)


class DraftLength:
    """How many tokens a draft model proposes: the length that gives the most tokens per unit of
    time, from the sequence's acceptance rate and the draft's measured cost. With per-token
    acceptance a, k proposals emit 1 + a + ... + a^k tokens for a plain step plus k draft steps
    and k checked rows; when no k beats plain decoding, none (but one every PROBE_STEPS steps, to
    keep measuring a). A sequence's rate starts from what the engine learned over those before it."""

    PRIOR_RATE = 0.8  # until the engine has seen the draft's proposals checked

    def __init__(self, most: int, rate: float = PRIOR_RATE):
        self.most = most
        self.rate = rate
        self._idle = 0

    def next(self, room: int, cost: float) -> int:
        """cost: what a proposed token adds (a draft step and its checked row), as a fraction of
        a plain step's time."""
        best_k = best_length(self.rate, cost, min(self.most, room))
        if best_k == 0 and room > 0:
            self._idle += 1
            if self._idle >= PROBE_STEPS:
                self._idle = 0
                return 1
        return best_k

    def update(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        self.rate = learned_rate(self.rate, proposed, accepted)


class RowCost:
    """What a checked row costs, as a fraction of a step: a running least-squares fit of decode
    steps' seconds as base + per_row * rows (exponentially weighted, so it follows the machine's
    load), over steps that read no prompt rows. Until the rows have varied enough to separate the
    two, PRIOR."""

    PRIOR = 0.1  # between float32's few percent and a Q4_0 file's quarter
    WEIGHT = 0.05
    MIN_SPREAD = 0.25  # variance of the rows per step below which the fit says nothing

    def __init__(self):
        self._moments: list[float] | None = None  # weighted means of x, y, x^2, x y (x rows, y seconds)
        self._per_row = self._base = None

    def record(self, rows: int, seconds: float) -> None:
        sample = (rows, seconds, rows * rows, rows * seconds)
        if self._moments is None:
            self._moments = list(sample)
            return
        w = self.WEIGHT
        self._moments = [(1 - w) * m + w * v for m, v in zip(self._moments, sample)]
        mx, my, mxx, mxy = self._moments
        spread = mxx - mx * mx
        if spread >= self.MIN_SPREAD:
            self._per_row = max((mxy - mx * my) / spread, 0.0)
            self._base = my - self._per_row * mx

    def of(self, sequences: int) -> float:
        """A checked row's time over that of a step of one row per sequence."""
        if self._per_row is None:
            return self.PRIOR
        plain = self.plain_seconds(sequences)
        return min(1.0, self._per_row / plain) if plain else 1.0

    def plain_seconds(self, sequences: int) -> float | None:
        """The fitted time of a step of one row per sequence; None until fitted (or not positive)."""
        if self._per_row is None:
            return None
        plain = self._base + self._per_row * sequences
        return plain if plain > 0 else None


class DraftState:
    """A sequence's draft-model side: its KV cache (the same slot in the draft's pool) and how many
    of the sequence's tokens it holds."""

    def __init__(self, cache, most: int, rate: float = DraftLength.PRIOR_RATE):
        self.cache, self.synced = cache, 0
        self.proposals = DraftLength(most, rate)


class PromptLookup:
    """One sequence's n-gram index over its prompt and output, its copy point and what it has
    learned of its matches."""

    def __init__(self, tokens: list[int], most: int, ngram: int, prediction: Sequence[int] = ()):
        """prediction: text the reply is expected to copy (OpenAI's predicted outputs), indexed
        before the prompt, with the copy point at its start."""
        self.most = most
        self.ngram = max(ngram, NGRAM_MIN)
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> where its occurrences end, in order
        self._copy_point: int | None = 0 if prediction else None  # where the next token would be, were the copy to go on
        self._rates: dict[tuple[bool, int], float] = {}  # (near the copy point, agreement class) -> kept rate
        self._pending: tuple[int, tuple[bool, int]] | None = None  # the proposal awaiting update()
        self._idle = 0  # steps with a match but no proposal
        self.extend(prediction)
        self.extend(tokens)

    def extend(self, tokens) -> None:
        """Append tokens; every n-gram (n >= 1) that now has a token after it is indexed."""
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending here are followed by `token`
            for n in range(1, min(self.ngram, end) + 1):
                self._ends.setdefault(tuple(self.tokens[end - n : end]), []).append(end)
            self.tokens.append(token)

    def _match(self) -> tuple[int, tuple[bool, int]] | None:
        """Where the tokens to propose start, and the match's class: for the longest n-gram the
        sequence ends with, its occurrence nearest the copy point, or failing that (n >= NGRAM_MIN)
        its latest one."""
        tokens = self.tokens
        for n in range(min(self.ngram, len(tokens)), 0, -1):
            ends = self._ends.get(tuple(tokens[len(tokens) - n :]))
            if not ends:
                continue
            if self._copy_point is not None:
                i = bisect_left(ends, self._copy_point - NEAR_BEHIND)
                if i < len(ends) and ends[i] <= self._copy_point + NEAR_AHEAD:
                    return ends[i], (True, self._agreement(ends[i], n))
            if n >= NGRAM_MIN:
                return ends[-1], (False, self._agreement(ends[-1], n))
        return None

    def _agreement(self, end: int, n: int) -> int:
        """The class of how many tokens before `end` agree with the sequence's last ones (n at
        least, up to LONGEST_AGREEMENT): a key of PRIOR_RATES."""
        tokens, last = self.tokens, len(self.tokens) - 1
        while n < LONGEST_AGREEMENT and end - 1 - n >= 0 and tokens[end - 1 - n] == tokens[last - n]:
            n += 1
        return max(k for k in PRIOR_RATES if k <= n)

    def _rate(self, kind: tuple[bool, int]) -> float:
        """The kept rate learned for a kind of match, or its prior."""
        return self._rates.get(kind, PRIOR_RATES[kind[1]])

    def propose(self, room: int, cost: float) -> list[int]:
        """The tokens that followed the match (continued periodically past the sequence's end),
        as many as pay at a checked row's `cost` (a fraction of a step), at most `room`; [] when
        nothing matches or no length pays."""
        self._pending = None
        match = self._match() if room > 0 else None
        if match is None:
            return []
        end, kind = match
        k = best_length(self._rate(kind), cost, min(self.most, room))
        if k == 0:
            self._idle += 1
            if self._idle < PROBE_STEPS:
                return []
            k = 1  # a probe: the rate may have changed
        self._idle = 0
        self._pending = match
        period = len(self.tokens) - end
        return [self.tokens[end + i % period] for i in range(k)]

    def update(self, proposed: int, accepted: int) -> None:
        """Learn from the last proposal: its class's rate, and the copy point (after the kept
        tokens, past the refused one: the reply changed a token of what it copies)."""
        if not proposed or self._pending is None:
            return
        end, kind = self._pending
        self._rates[kind] = learned_rate(self._rate(kind), proposed, accepted)
        self._copy_point = end + accepted + (accepted < proposed)
        self._pending = None
