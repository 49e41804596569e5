"""Reasoning models' replies read apart: thinking, answer and (Harmony) tool calls, token by token.

Two formats, detected from the tokenizer:
- "think": `<think>...</think>` then the answer (Qwen3, SmolLM3, DeepSeek-R1 and its distills). The
  opening tag may be written by the model or by the template at the generation prompt.
- "harmony": gpt-oss's messages, `<|channel|>NAME [to=RECIPIENT]<|message|>BODY<|end|>`, with the
  thinking on the analysis channel, tool calls on commentary addressed `to=functions.NAME`, and the
  answer on final.

`ReplyReader` turns generated tokens into parts as they become final; `ThinkingControl` is the
engine's constraint for a reasoning reply: after a budget of thinking tokens it writes the
end-of-thinking marker itself, and a grammar (structured output, a forced tool call) applies to the
answer only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .detokenize import Parts, PlainReader, TextAssembler
from .tokenizer import Tokenizer

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
LATEST = 16  # prompt tokens looked at for a template that opened the thinking at the generation prompt


@dataclass(frozen=True)
class ReasoningFormat:
    kind: str  # "think" or "harmony"
    markers: dict[str, int]  # marker text -> token id

    def id(self, marker: str) -> int:
        return self.markers[marker]


def reasoning_format(tokenizer: Tokenizer) -> ReasoningFormat | None:
    """The format a model's replies are written in, from its tokenizer's marker tokens; None for
    a model that does not reason apart from its answer."""
    for kind, names in (("harmony", HARMONY), ("think", (THINK_OPEN, THINK_CLOSE))):
        ids = {name: tokenizer.token_id(name) for name in names}
        if None not in ids.values():
            return ReasoningFormat(kind, ids)
    return None


def starts_thinking(fmt: ReasoningFormat, prompt: list[int]) -> bool:
    """Whether the reply starts inside its thinking: the template opened `<think>` at the
    generation prompt (R1 distills, Qwen3's thinking models) and did not close it (a template's
    switch off writes an empty `<think></think>`)."""
    if fmt.kind != "think":
        return False
    for token in reversed(prompt[-LATEST:]):
        if token == fmt.id(THINK_CLOSE):
            return False
        if token == fmt.id(THINK_OPEN):
            return True
    return False


@dataclass
class HarmonyCall:
    """A tool call read from a Harmony reply: the function's name and its arguments' text."""

    name: str
    arguments: str = ""


class ReplyReader(PlainReader):
    """Generated tokens in, the reply's parts out: a plain reader's answer (stop strings end it),
    and the thinking apart. Thinking text starts without leading whitespace, and so does the answer
    after it. With text=False only the state is followed (which part is being written, thinking
    tokens so far), for the engine."""

    def __init__(self, tokenizer: Tokenizer, fmt: ReasoningFormat, prompt: list[int], stop=(), text: bool = True):
        super().__init__(tokenizer, stop)
        self.tokenizer, self.fmt, self.text = tokenizer, fmt, text
        self.thinking = TextAssembler(tokenizer)
        self.generated = 0
        self.thinking_tokens = 0  # generated tokens read as thinking (markers left out)
        self._trim = {"reasoning": True, "content": fmt.kind == "harmony"}
        # think: "reasoning" or "content"; harmony: the channel of the message being read, or None between messages
        self.channel: str | None = "reasoning" if starts_thinking(fmt, prompt) else ("content" if fmt.kind == "think" else None)
        self._header: list[int] | None = []  # harmony: the header being read (up to <|message|>); None in a body
        self._call: HarmonyCall | None = None
        self._call_text: TextAssembler | None = None
        self._separator = ""  # written before the next thinking text

    @property
    def in_thinking(self) -> bool:
        return self.channel == "reasoning"

    def push(self, token: int) -> Parts:
        if self.stopped:
            return Parts()
        self.generated += 1
        if self.fmt.kind == "think":
            return self._push_think(token)
        return self._push_harmony(token)

    def finish(self) -> Parts:
        """Whatever is held back once generation ends; an unfinished Harmony call is kept as one
        (its <|call|> is an end-of-sequence token, never delivered)."""
        parts = self._close_message()
        parts.content += self._trimmed("content", self.answer.finish())
        return parts

    # ---------------------------------------------------------------- <think>...</think>

    def _push_think(self, token: int) -> Parts:
        if token == self.fmt.id(THINK_OPEN) and self.channel == "content" and self.generated == 1:
            self.channel = "reasoning"  # the model opens its thinking (only at the start of its reply)
            return Parts()
        if token == self.fmt.id(THINK_CLOSE) and self.channel == "reasoning":
            self.channel = "content"
            self._trim["content"] = True
            return Parts(reasoning=self._thinking_text(self.thinking.finish(), final=True))
        return self._body(token)

    def _thinking_text(self, text: str, final: bool = False) -> str:
        """Thinking text as it becomes final, trailing whitespace held back (it may end the
        thinking) until more comes, and dropped at the end (final)."""
        text = self._trimmed("reasoning", text)
        kept = text.rstrip()
        if not final:
            self.thinking.pending = text[len(kept) :] + self.thinking.pending
        if kept and self._separator:
            kept, self._separator = self._separator + kept, ""
        return kept

    def _trimmed(self, part: str, text: str) -> str:
        """`text` without the whitespace that would start its part."""
        if self._trim[part] and text:
            text = text.lstrip()
            self._trim[part] = not text
        return text

    # ---------------------------------------------------------------- Harmony

    def _push_harmony(self, token: int) -> Parts:
        marker = next((name for name, t in self.fmt.markers.items() if t == token), None)
        if marker is None:
            if self._header is not None and self.channel is None:
                self._header.append(token)
                return Parts()
            return self._body(token)
        if marker == "<|message|>" and self.channel is None:
            self._open_message()
            return Parts()
        if marker in ("<|end|>", "<|return|>", "<|call|>"):
            return self._close_message()
        if marker in ("<|start|>", "<|channel|>") and self.channel is None and (marker == "<|start|>" or self._header is None):
            self._header = []  # a new message's header
        return Parts()  # markers are never text

    def _open_message(self) -> None:
        """<|message|> ends a header: `[assistant] <|channel|>NAME [to=RECIPIENT] [<|constrain|>json]`."""
        header = self.tokenizer.decode(self._header, skip_special_tokens=True)
        channel = re.search(r"(analysis|commentary|final)", header)
        recipient = re.search(r"to=([^\s<]+)", header)
        name = channel.group(1) if channel else "final"
        self._header = None
        if recipient and recipient.group(1).startswith("functions."):
            self._call = HarmonyCall(recipient.group(1)[len("functions.") :])
            self._call_text = TextAssembler(self.tokenizer)
            self.channel = "call"
        else:
            self.channel = "reasoning" if name == "analysis" else "content"
            self._trim[self.channel] = True
            if self.channel == "reasoning" and self.thinking_tokens:
                self._separator = "\n"  # Harmony's analysis messages read as paragraphs

    def _body(self, token: int) -> Parts:
        """A token of the thinking, the answer or a call's arguments."""
        if self.channel == "reasoning":
            self.thinking_tokens += 1
        if not self.text:
            return Parts()
        if self.channel == "call":
            self._call.arguments += self._call_text.push(token)
            return Parts()
        if self.channel == "reasoning":
            return Parts(reasoning=self._thinking_text(self.thinking.push(token)))
        return Parts(content=self._trimmed("content", self.answer.push(token)))

    def _close_message(self) -> Parts:
        parts = Parts()
        if not self.text:
            pass
        elif self.channel == "call":
            self._call.arguments += self._call_text.finish()
            parts.calls.append(self._call)
            self._call = None
        elif self.channel == "reasoning":
            parts.reasoning = self._thinking_text(self.thinking.finish(), final=True)
            self.thinking = TextAssembler(self.tokenizer)
        if self.fmt.kind == "harmony":
            self.channel, self._header = None, []
        return parts


def reply_constraint(tokenizer: Tokenizer, fmt: ReasoningFormat, prompt: list[int], budget: int | None, answer=None):
    """The engine's constraint for a reasoning reply: a ThinkingControl where a budget or a grammar
    needs one, else none at all (a reply that only thinks and answers costs the engine nothing)."""
    if budget is None and answer is None:
        return None
    return ThinkingControl(tokenizer, fmt, prompt, budget, answer)


class ThinkingControl:
    """The engine's constraint for a reasoning reply (the interface of minillm.core.structured's
    Constraint): counts thinking tokens, and once `budget` of them are spent writes the
    end-of-thinking marker (Harmony: closes the analysis message and opens the final channel);
    `answer` (a grammar) masks the answer's tokens only."""

    def __init__(self, tokenizer: Tokenizer, fmt: ReasoningFormat, prompt: list[int], budget: int | None, answer=None):
        self.reader = ReplyReader(tokenizer, fmt, prompt, text=False)
        self.budget, self.answer = budget, answer
        if fmt.kind == "think":
            self.closing = [fmt.id(THINK_CLOSE)]
        else:
            final = tokenizer.encode("final", add_special_tokens=False)
            assistant = tokenizer.encode("assistant", add_special_tokens=False)
            self.closing = [fmt.id("<|end|>"), fmt.id("<|start|>"), *assistant, fmt.id("<|channel|>"), *final, fmt.id("<|message|>")]
        self.forcing: list[int] = []
        # a think-format reply may open its thinking with its first token, whatever the grammar says
        self.may_open = fmt.id(THINK_OPEN) if fmt.kind == "think" and not self.reader.in_thinking else None

    def apply(self, logits: np.ndarray) -> None:
        if not self.forcing and self.reader.in_thinking and self.budget is not None and self.reader.thinking_tokens >= self.budget:
            self.forcing = list(self.closing)
        if self.forcing:
            keep = self.forcing[0]
            value = logits[keep]
            logits[:] = -np.inf
            logits[keep] = value if np.isfinite(value) else 0.0
        elif self._answer_phase() and self.answer is not None:
            opening = logits[self.may_open] if self.may_open is not None else None
            self.answer.apply(logits)
            if opening is not None:
                logits[self.may_open] = opening

    def consume(self, token: int) -> None:
        answering = self._answer_phase()
        if self.forcing and token == self.forcing[0]:
            self.forcing.pop(0)
        opened = token == self.may_open
        self.may_open = None
        self.reader.push(token)
        if answering and self.answer is not None and not opened:
            self.answer.consume(token)

    def _answer_phase(self) -> bool:
        """The answer is being written (a grammar then applies): past the thinking, not in a header."""
        return not self.forcing and self.reader.channel == "content"

    @property
    def finished(self) -> bool:
        return self.answer is not None and self._answer_phase() and self.answer.finished

    @property
    def grammar(self) -> str | None:
        """The answer's grammar, in llguidance's form (a replica compiles it again)."""
        return self.answer.grammar if self.answer is not None else None
