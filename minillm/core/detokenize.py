"""From generated token ids to text: streaming detokenization and stop strings.

Tokens come from the engine (minillm.core.engine). `StreamDecoder` turns them into text as it becomes
final (characters split over byte-level tokens come out whole), `TextAssembler` adds stop strings,
one token at a time (the server), and `TextStream` iterates a request's text pieces (the Python
API and the CLI).
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass
class Parts:
    """What became final with one token: thinking text, answer text, and tool calls completed."""

    reasoning: str = ""
    content: str = ""
    calls: list = field(default_factory=list)  # minillm.core.reasoning.HarmonyCall

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def add(self, other: "Parts") -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls


class PlainReader:
    """A reply read as plain text (a model that does not reason apart, a completion, or
    --reasoning-format none): every token is the answer's."""

    thinking_tokens = 0

    def __init__(self, tokenizer: Tokenizer, stop=()):
        self.answer = TextAssembler(tokenizer, stop)

    @property
    def stopped(self) -> bool:
        return self.answer.stopped

    @property
    def stop_string(self) -> str | None:
        return self.answer.stop_string

    def push(self, token: int) -> Parts:
        return Parts(content=self.answer.push(token))

    def finish(self) -> Parts:
        return Parts(content=self.answer.finish())


class TextStream:
    """Text pieces of one request's answer as they are generated; `finish_reason` once exhausted:
    "stop" (end-of-sequence token or stop string), "length" (max_tokens) or "context" (the context
    filled up). A reasoning model's thinking is not among the pieces: it gathers in `reasoning`
    (or read `parts()` for both as they come). Abandoning the iteration cancels the request."""

    def __init__(self, handle, tokenizer: Tokenizer, stop: Sequence[str] = (), owner: object = None, reader=None):
        self.handle = handle  # minillm.core.engine.RequestHandle
        self.owner = owner  # the LLM whose engine runs the request: alive while this is read
        self.reader = reader or PlainReader(tokenizer, stop)  # or minillm.core.reasoning.ReplyReader
        self.reasoning = ""
        self.finish_reason: str | None = None

    def __iter__(self) -> Iterator[str]:
        for parts in self.parts():
            if parts.content:
                yield parts.content

    def parts(self) -> Iterator[Parts]:
        """The reply's parts (thinking, answer) as they become final."""
        done = False
        try:
            for event in self.handle:
                parts = self.reader.push(event.token)
                if parts:
                    self.reasoning += parts.reasoning
                    yield parts
                if self.reader.stopped:
                    self.finish_reason = "stop"
                    return
            tail = self.reader.finish()
            if tail:
                self.reasoning += tail.reasoning
                yield tail
            self.finish_reason = "stop" if self.reader.stopped else self.handle.finish_reason
            done = True
        finally:
            if not done:
                self.handle.cancel()  # a stop string, an error or a caller that stopped reading
