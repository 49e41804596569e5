"""From generated token ids to text: streaming detokenization and stop strings.

Tokens come from the engine (minillm.core.engine). `StreamDecoder` turns them into text as it becomes
final (characters split over byte-level tokens come out whole), `TextAssembler` adds stop strings,
one token at a time (the server), and `TextStream` iterates a request's text pieces (the Python
API and the CLI).
"""

from __future__ import annotations

from typing import Iterator, Sequence

from .tokenizer import Tokenizer


class StreamDecoder:
    """Turns a stream of token ids into text pieces, holding back incomplete UTF-8 sequences.

    Decodes a short window of recent tokens and emits only what has become final, so a
    character split over several byte-level tokens comes out whole, once.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens before this are already emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if text.endswith("\ufffd") or len(text) <= len(before):
            return ""  # an unfinished multi-byte character, or a token that decodes to nothing yet
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]

    def flush(self) -> str:
        """Whatever is still held back at the end (e.g. a truly invalid byte sequence)."""
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(before) :]


class TextAssembler:
    """Token ids in, final text out: multi-byte characters kept whole, text cut before the first
    stop string, and text that could still become a stop string held back until it cannot."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self.decoder = StreamDecoder(tokenizer)
        self.stop = [s for s in stop if s]
        self.pending = ""
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text

    def push(self, token: int) -> str:
        """Text that became final with this token ('' if none). Sets `stopped` at a stop string."""
        if self.stopped:
            return ""
        self.pending += self.decoder.push(token)
        return self._release()

    def finish(self) -> str:
        """Whatever is left once generation ends."""
        if self.stopped:
            return ""
        self.pending += self.decoder.flush()
        text = self._release(final=True)
        return text

    def _release(self, final: bool = False) -> str:
        hits = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            first, self.stop_string = min(hits, key=lambda hit: hit[0])
            text, self.pending = self.pending[:first], ""
            return text
        keep = 0 if final else self._held_back(self.pending)
        text = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return text

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest


class TextStream:
    """Text pieces of one request as they are generated; `finish_reason` once exhausted:
    "stop" (end-of-sequence token or stop string), "length" (max_tokens) or "context" (the context
    filled up). Abandoning the iteration cancels the request."""

    def __init__(self, handle, tokenizer: Tokenizer, stop: Sequence[str] = (), owner: object = None):
        self.handle = handle  # minillm.core.engine.RequestHandle
        self.owner = owner  # the LLM whose engine runs the request: alive while this is read
        self.assembler = TextAssembler(tokenizer, stop)
        self.finish_reason: str | None = None

    def __iter__(self) -> Iterator[str]:
        done = False
        try:
            for event in self.handle:
                piece = self.assembler.push(event.token)
                if piece:
                    yield piece
                if self.assembler.stopped:
                    self.finish_reason = "stop"
                    return
            tail = self.assembler.finish()
            if tail:
                yield tail
            self.finish_reason = "stop" if self.assembler.stopped else self.handle.finish_reason
            done = True
        finally:
            if not done:
                self.handle.cancel()  # a stop string, an error or a caller that stopped reading
