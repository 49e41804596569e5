"""Generation: prefill, then token-by-token decode over the KV cache.

`generate_tokens` is the one token generator; `TextStream` turns it into text pieces with stop
strings. The CLI and the Python API both use them.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from .cache import KVCache
from .errors import GenerationError
from .model import Model
from .sampling import SamplingParams, sample
from .tokenizer import StreamDecoder, Tokenizer


class TokenStream:
    """Iterates over generated token ids; `finish_reason` is set when it ends:
    "stop" (an end-of-sequence token), "length" (max_tokens) or "context" (the cache is full).
    """

    def __init__(
        self,
        model: Model,
        prompt: Sequence[int],
        params: SamplingParams,
        max_tokens: int,
        stop_ids: Sequence[int] = (),
        cache: KVCache | None = None,
    ):
        if max_tokens < 0:
            raise GenerationError(f"max_tokens must be >= 0, got {max_tokens}")
        if len(prompt) == 0:
            raise GenerationError("the prompt is empty")
        cache = cache if cache is not None else model.new_cache()
        if cache.length + len(prompt) > cache.ctx:
            raise GenerationError(
                f"the prompt has {len(prompt)} tokens, more than the context size {cache.ctx} allows"
            )
        self.model, self.prompt, self.params, self.max_tokens = model, list(prompt), params, max_tokens
        self.stop_ids = frozenset(stop_ids)
        self.cache = cache
        self.finish_reason: str | None = None
        self.generated: list[int] = []

    def __iter__(self) -> Iterator[int]:
        model, cache, params = self.model, self.cache, self.params
        rng = np.random.default_rng(params.seed)
        history = self.prompt if params.repetition_penalty != 1.0 else ()
        if self.max_tokens == 0:
            self.finish_reason = "length"
            return
        logits = model.forward(self.prompt, cache)
        while True:
            token = sample(logits, params, rng, history + self.generated if history else ())
            if token in self.stop_ids:
                self.finish_reason = "stop"
                return
            self.generated.append(token)
            yield token
            if len(self.generated) >= self.max_tokens:
                self.finish_reason = "length"
                return
            if cache.length >= cache.ctx:
                self.finish_reason = "context"
                return
            logits = model.forward([token], cache)


class TextStream:
    """Text pieces of a generation, cut before the first stop string.

    Text that could still become a stop string is held back until it is known not to.
    """

    def __init__(self, tokens: TokenStream, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self.tokens, self.tokenizer = tokens, tokenizer
        self.stop = [s for s in stop if s]
        self.finish_reason: str | None = None

    def __iter__(self) -> Iterator[str]:
        decoder = StreamDecoder(self.tokenizer)
        pending = ""
        for token in self.tokens:
            pending += decoder.push(token)
            cut = self._find_stop(pending)
            if cut is not None:
                if pending[:cut]:
                    yield pending[:cut]
                self.finish_reason = "stop"
                return
            safe = len(pending) - self._held_back(pending)
            if safe > 0:
                yield pending[:safe]
                pending = pending[safe:]
        pending += decoder.flush()
        cut = self._find_stop(pending)
        if cut is not None:
            pending, self.tokens.finish_reason = pending[:cut], "stop"
        if pending:
            yield pending
        self.finish_reason = self.tokens.finish_reason

    def _find_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
