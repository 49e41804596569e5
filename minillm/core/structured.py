"""Structured output: the next token is drawn only from those a grammar allows (llguidance).

A request may ask for JSON (any object, or one that follows a JSON schema), or text that follows a
grammar (Lark, llama.cpp's GBNF, or a regular expression). llguidance keeps a parser per request
and computes, for each step, the bitmask of tokens that keep the text inside the grammar (0.4 ms a
token at SmolLM2's 49,152, measured); the sampler sets the others to -inf (kernels.mask_logits). Why llguidance: it has no
dependencies (a 3 MB wheel), takes JSON schema, Lark, GBNF and regex, and builds its mask from the
tokenizer lazily (no per-schema index to build); xgrammar requires torch and transformers, and
outlines-core builds an index per schema, seconds for nested ones.

llguidance is an optional extra: `pip install minillm[structured]`.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import MiniLLMError

EXTRA = "minillm[structured]"


class StructuredOutputError(MiniLLMError):
    """A schema or grammar that cannot be used; `param` names the request field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


MAX_REGEX_SIZE = 20_000  # a regular expression's size with its counted repetitions written out


def check_regex_size(text: str, param: str) -> None:
    """Refuse a regular expression whose counted repetitions nest into more than MAX_REGEX_SIZE
    pieces: `(a{1000}){1000}` passes every check llguidance makes up front, then exhausts its
    lexer some tokens into the reply. Read with Python's parser; syntax it does not take is
    llguidance's to judge."""
    import re._constants as c
    import re._parser as sre

    def size(parsed) -> int:
        total = 0
        for op, av in parsed:
            if op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
                low, high, sub = av
                total += max(high if high != c.MAXREPEAT else low, 1) * size(sub)
            elif op is c.SUBPATTERN:
                total += size(av[-1])
            elif op is c.BRANCH:
                total += sum(size(b) for b in av[1])
            elif op in (c.ASSERT, c.ASSERT_NOT, c.ATOMIC_GROUP):
                total += size(av[-1])
            else:
                total += 1
            if total > MAX_REGEX_SIZE:
                return total
        return total

    try:
        parsed = sre.parse(text)
    except (Exception, RecursionError):  # noqa: BLE001 - not Python's syntax: llguidance decides
        return
    if size(parsed) > MAX_REGEX_SIZE:
        raise StructuredOutputError(f"{param}: the regular expression's repetitions are too large to follow "
                                    f"(more than {MAX_REGEX_SIZE:,} pieces once written out)", param)


def _check_schema_patterns(schema, param: str, depth: int = 0) -> None:
    """check_regex_size on every `pattern` (and patternProperties key) in a JSON schema."""
    if depth > 64:
        raise StructuredOutputError(f"{param}: nested too deeply", param)
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key == "pattern" and isinstance(value, str):
                check_regex_size(value, param)
            elif key == "patternProperties" and isinstance(value, dict):
                for pattern in value:
                    check_regex_size(pattern, param)
            _check_schema_patterns(value, param, depth + 1)
    elif isinstance(schema, list):
        for value in schema:
            _check_schema_patterns(value, param, depth + 1)


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise StructuredOutputError(f"structured output needs llguidance: pip install '{EXTRA}'") from None
    return llguidance


class GrammarCompiler:
    """Grammars for one model's tokenizer, turned into per-request Constraints."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_ids: tuple[int, ...]):
        self.tokenizer_json, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, eos_ids

    @cached_property
    def _tokenizer(self):
        """llguidance's view of the tokenizer (about 0.4 s to build: once per model)."""
        llg = _llguidance()
        return llg.LLTokenizer(self.tokenizer_json.read_text(encoding="utf-8"), n_vocab=self.vocab_size,
                               eos_token=list(self.eos_ids) or None)

    def json_schema(self, schema, param: str) -> "Constraint":
        """Text that is JSON following `schema` (a dict; {"type": "object"} for any object)."""
        if not isinstance(schema, dict):
            raise StructuredOutputError(f"{param} must be a JSON schema object", param)
        _check_schema_patterns(schema, param)
        llg = _llguidance()
        return self.compile(_built(lambda: llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}),
                                   param, "not a JSON schema this server can follow"), param)

    def lark(self, text: str, param: str) -> "Constraint":
        llg = _llguidance()
        return self.compile(_built(lambda: llg.LLMatcher.grammar_from_lark(text), param, "not a valid Lark grammar"), param)

    def gbnf(self, text: str, param: str) -> "Constraint":
        llg = _llguidance()
        from llguidance.gbnf_to_lark import gbnf_to_lark

        lark = _built(lambda: gbnf_to_lark(text), param, "not a valid GBNF grammar")
        return self.compile(_built(lambda: llg.LLMatcher.grammar_from_lark(lark), param, "not a valid GBNF grammar"), param)

    def regex(self, text: str, param: str) -> "Constraint":
        check_regex_size(text, param)
        llg = _llguidance()
        return self.compile(_built(lambda: llg.LLMatcher.grammar_from_regex(text), param, "not a valid regular expression"), param)

    def compile(self, grammar: str, param: str) -> "Constraint":
        """A Constraint from a grammar in llguidance's form (what the methods above produce, and
        Constraint.grammar holds, so another process can compile the same one). Its first mask is
        computed here: a grammar that cannot start, or costs more than llguidance's limits, is
        refused now (the caller's thread), never at the first token (the engine's)."""
        llg = _llguidance()
        limits = llg.LLParserLimits(verbose_errors=False)  # errors name the problem, not the parser's state
        error = _built(lambda: llg.LLMatcher.validate_grammar(grammar, self._tokenizer, limits=limits), param, "not a valid grammar")
        if error:
            raise StructuredOutputError(f"{param}: {_first_line(error)}", param)
        constraint = Constraint(llg.LLMatcher(self._tokenizer, grammar, log_level=0, limits=limits), self.vocab_size, grammar)
        constraint.matcher.unsafe_compute_mask_ptr(constraint._bits.ctypes.data, constraint._bits.nbytes)
        if constraint.matcher.is_error() or not constraint._bits.any():
            reason = _first_line(constraint.matcher.get_error()) if constraint.matcher.is_error() else "no text can follow it"
            raise StructuredOutputError(f"{param}: this grammar cannot be served: {reason}", param)
        return constraint


def _first_line(message: str) -> str:
    return (message or "").strip().splitlines()[0][:300] if (message or "").strip() else "unknown error"


def _built(build, param: str, what: str):
    """build(), its errors (whatever the library raises for bad input) as StructuredOutputError."""
    try:
        return build()
    except UnicodeError:
        raise StructuredOutputError(f"{param}: {what}: the text is not valid Unicode", param) from None
    except RecursionError:
        raise StructuredOutputError(f"{param}: {what}: nested too deeply", param) from None
    except Exception as e:  # noqa: BLE001 - llguidance and its GBNF converter raise their own types
        raise StructuredOutputError(f"{param}: {what}: {_first_line(str(e))}", param) from None


class Constraint:
    """One request's grammar state: masks logits before each token, then consumes it."""

    def __init__(self, matcher, vocab_size: int, grammar: str):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.grammar = grammar  # llguidance's form, for GrammarCompiler.compile
        self._bits = np.zeros((vocab_size + 31) // 32, np.int32)

    def apply(self, logits: np.ndarray) -> None:
        """Set the logits of every token the grammar forbids now to -inf, in place."""
        from .. import kernels

        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        kernels.mask_logits(logits, self._bits)
        if self.matcher.is_error():
            raise StructuredOutputError(f"the grammar failed while generating: {_first_line(self.matcher.get_error())}", "grammar")

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise StructuredOutputError(f"the grammar failed while generating: {_first_line(self.matcher.get_error())}", "grammar")

    @property
    def finished(self) -> bool:
        """The text is complete: the grammar allows nothing more."""
        return self.matcher.is_stopped()


def response_format_constraint(compiler: GrammarCompiler, response_format: dict | None, grammar) -> Constraint | None:
    """The constraint an OpenAI request asks for: `response_format` {"type": "text" | "json_object" |
    "json_schema", "json_schema": {"name", "schema", "strict"}}, or the `grammar` extension (a GBNF
    string as llama.cpp's server takes, or {"type": "lark" | "gbnf" | "regex", "grammar": str})."""
    if grammar is not None:
        if isinstance(grammar, str):
            return compiler.gbnf(grammar, "grammar")
        if not isinstance(grammar, dict) or not isinstance(grammar.get("grammar"), str):
            raise StructuredOutputError("grammar must be a GBNF string or {\"type\": ..., \"grammar\": str}", "grammar")
        kind = grammar.get("type", "gbnf")
        build = {"lark": compiler.lark, "gbnf": compiler.gbnf, "regex": compiler.regex}.get(kind)
        if build is None:
            raise StructuredOutputError(f"grammar.type {kind!r} is not one of lark, gbnf, regex", "grammar.type")
        return build(grammar["grammar"], "grammar.grammar")
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return compiler.json_schema({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise StructuredOutputError("response_format.json_schema needs a 'schema'", "response_format.json_schema")
        schema = spec["schema"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise StructuredOutputError("response_format.json_schema.schema is not valid JSON", "response_format.json_schema.schema") from None
        if spec.get("strict"):
            schema = strict_schema(schema)
        return compiler.json_schema(schema, "response_format.json_schema.schema")
    raise StructuredOutputError(f"response_format.type {kind!r} is not one of text, json_object, json_schema", "response_format.type")


def strict_schema(schema):
    """OpenAI's strict mode: no object takes properties its schema does not list (unless it says so)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "$defs", "definitions"):  # maps of subschemas
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    for key in ("items", "additionalProperties", "not"):  # one subschema
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):  # lists of subschemas
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(sub) for sub in out[key]]
    if out.get("type") == "object" or "properties" in schema:
        out.setdefault("additionalProperties", False)
    return out
