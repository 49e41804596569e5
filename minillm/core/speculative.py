"""Speculative decoding: cheap guesses at the next tokens, kept only where plain decoding agrees.

Two proposers: prompt lookup (PromptLookup, below) and a draft model (the engine runs it; DraftState
is a sequence's side of it). Either way the engine runs the proposed tokens as extra rows of the
sequence's next step and keeps each while it is the very token plain decoding would choose there
(minillm.core.engine), so the text never changes.

Prompt lookup: the text proposes its own continuation.

Tasks whose output repeats their input (editing code, rewriting, extraction, quoting a document)
let the sequence's own tokens guess what comes next: when its last n tokens (NGRAM_MIN <= n <=
ngram, longest first) occurred before, in the prompt or the output, the tokens that followed their
latest occurrence are proposed; where those run into the sequence's end, the repetition they are
part of continues (a run of one token, a repeated line: otherwise a run of zeros would propose
one token a step). The engine runs them as extra rows of the sequence's next step and
keeps each while it is the very token plain decoding would choose there (minillm.core.engine), so
the text never changes; a row costs far less than a step, so every accepted token is nearly free.

How many to propose adapts, so open-ended text, where guesses are refused, costs next to nothing:
doubled (up to `most`) after a proposal is taken whole, halved after one is refused at its first
token, and after a refused single token none at all for BACKOFF_STEPS steps, twice as many after
each further refusal (up to MAX_BACKOFF_STEPS) until one is accepted.
"""

from __future__ import annotations

NGRAM_MIN = 2  # a single repeated token predicts too little to be worth a row
BACKOFF_STEPS = 16
MAX_BACKOFF_STEPS = 256
FIRST_PROPOSAL = 4


class ProposalLength:
    """How many tokens to propose next: adapted to how much of the last proposal was kept."""

    def __init__(self, most: int):
        self.most = most
        self.length = min(FIRST_PROPOSAL, most)
        self._resting = 0  # steps left without proposals
        self._backoff = BACKOFF_STEPS  # how long the next rest lasts

    def next(self, room: int) -> int:
        """The length of this step's proposal (0 while resting), at most `room`."""
        if self._resting:
            self._resting -= 1
            if not self._resting:
                self.length = 1
            return 0
        return max(0, min(self.length, room))

    def update(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        if accepted:
            self._backoff = BACKOFF_STEPS
        if accepted == proposed:
            self.length = min(self.most, 2 * self.length)
        elif accepted == 0:
            if self.length == 1:
                self._resting = self._backoff
                self._backoff = min(2 * self._backoff, MAX_BACKOFF_STEPS)
            self.length = max(1, self.length // 2)


class DraftLength:
    """How many tokens a draft model proposes: the length that gives the most tokens per unit of
    time, from the sequence's acceptance rate and the draft's measured cost. With per-token
    acceptance a, k proposals emit 1 + a + ... + a^k tokens for a step plus k draft steps; when no
    k beats plain decoding, none (but one every PROBE_STEPS steps, to keep measuring a)."""

    PRIOR_RATE = 0.8
    PROBE_STEPS = 16

    def __init__(self, most: int):
        self.most = most
        self.rate = self.PRIOR_RATE
        self._idle = 0

    def next(self, room: int, cost: float) -> int:
        """cost: a draft step's time over a step's."""
        best_k, best, expected = 0, 1.0, 1.0
        for k in range(1, min(self.most, room) + 1):
            expected += self.rate**k
            value = expected / (1 + k * cost)
            if value > best:
                best_k, best = k, value
        if best_k == 0 and room > 0:
            self._idle += 1
            if self._idle >= self.PROBE_STEPS:
                self._idle = 0
                return 1
        return best_k

    def update(self, proposed: int, accepted: int) -> None:
        if not proposed:
            return
        trials = accepted + (accepted < proposed)  # tokens checked: the accepted ones and the first refused
        self.rate += min(1.0, trials / 8) * (accepted / trials - self.rate)


class DraftState:
    """A sequence's draft-model side: its KV cache (the same slot in the draft's pool) and how many
    of the sequence's tokens it holds."""

    def __init__(self, cache, most: int):
        self.cache, self.synced = cache, 0
        self.proposals = DraftLength(most)


class PromptLookup(ProposalLength):
    """One sequence's n-gram index over its prompt and output, and its proposal length."""

    def __init__(self, tokens: list[int], most: int, ngram: int):
        super().__init__(most)
        self.ngram = max(ngram, NGRAM_MIN)
        self.tokens: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest earlier occurrence ends
        self.extend(tokens)

    def extend(self, tokens) -> None:
        """Append tokens; every n-gram that now has a token after it is indexed."""
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending here are followed by `token`
            for n in range(NGRAM_MIN, self.ngram + 1):
                if end >= n:
                    self._latest[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def propose(self, room: int) -> list[int]:
        """Up to min(the current length, room) tokens that followed the latest earlier occurrence
        of the longest n-gram the sequence now ends with, continued periodically past the
        sequence's end (the period: from that occurrence's end to the sequence's); [] when none
        occurred or resting."""
        limit = self.next(room)
        if limit <= 0:
            return []
        tokens = self.tokens
        for n in range(min(self.ngram, len(tokens)), NGRAM_MIN - 1, -1):
            end = self._latest.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                period = len(tokens) - end
                return [tokens[end + i % period] for i in range(limit)]
        return []
