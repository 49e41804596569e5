"""The Python API: load a model once, then generate, stream, chat or read logits.

    import minillm
    llm = minillm.load()                      # the default model; or load("path/to/hf_dir")
    print(llm.generate("Once upon a time", max_tokens=32, temperature=0))
    for piece in llm.stream("Hello", seed=1):
        print(piece, end="", flush=True)
    llm.chat([{"role": "user", "content": "Hi!"}])

Calls from several threads are safe and are batched: every request goes to one engine thread
(minillm.core.engine) that decodes all active requests together, the weights read once per step.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import deque
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .core.detokenize import TextStream
from .core.engine import Engine, check_prompt
from .core.model import Model
from .core.prefix_cache import PrefixFile
from .core.reasoning import ReasoningFormat, ReplyReader, reasoning_format, reply_constraint
from .core.sampling import SamplingParams
from .core.tokenizer import Tokenizer
from .errors import GenerationError, UsageError
from .loading.hub import model_path
from .loading.lora import Adapter, combined, load_adapter, parse_lora_spec
from .options import DEFAULTS, Options

if TYPE_CHECKING:
    from .core.structured import GrammarCompiler


class Reply(str):
    """A chat's answer; `reasoning` holds a reasoning model's thinking ('' for other models)."""

    reasoning: str = ""


MAX_DRAFT_SHARE = 0.6  # of the model's weight bytes: a draft step must cost well under a step


class LLMFiles:
    """What needs only a model's tokenizer and config files: the tokenizer (with the chat
    template), the end-of-sequence ids and the grammar compiler. An LLM has one; so does the
    ingress of a cluster (minillm.serving.cluster), which holds no weights."""

    def __init__(self, model_dir: Path, config, chat_template: str | None = None):
        self.model_dir, self.config = Path(model_dir), config
        self.chat_template = _read_template(chat_template) if chat_template else None  # replaces the model's

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """Loaded on first use: `logits` on token ids needs no tokenizer files."""
        tokenizer = Tokenizer(self.model_dir)
        if self.chat_template is not None:
            tokenizer.chat_template = self.chat_template
        return tokenizer

    @cached_property
    def eos_ids(self) -> tuple[int, ...]:
        return _eos_ids(self.model_dir, self.config.eos_token_id, self.tokenizer)

    @cached_property
    def grammars(self) -> "GrammarCompiler":
        """Structured output for this model's tokenizer (minillm.core.structured; needs llguidance)."""
        from .core.structured import GrammarCompiler

        return GrammarCompiler(self.model_dir / "tokenizer.json", self.config.vocab_size, self.eos_ids)


class LLM:
    """A loaded model with its tokenizer, and the engine that serves it (minillm.options.Options:
    the model, its precision and context, threads, batch, queue and cache)."""

    def __init__(self, options: Options = DEFAULTS, progress: bool = True):
        self.options = options
        # what was loaded: a checkpoint directory or a GGUF file (a Hub name's, in the Hub's cache)
        self.source = model_path(options.model, options.revision, progress)
        self._model: Model | None = Model.load(self.source, ctx=options.ctx, dtype=options.dtype, check_finite=options.check_weights, threads=options.threads,
                                kv_dtype=options.kv_dtype, activations=options.activations)
        # where the tokenizer and generation config are: a GGUF's, rebuilt from its metadata
        self.model_dir = tokenizer_files(self.source)[0]
        self.files = LLMFiles(self.model_dir, self.model.config, options.chat_template)
        self.draft = load_draft(self.model, self.source, options) if options.speculative == "draft" else None
        self.adapters: dict[str, Adapter] = {}  # LoRA adapters by name (options.lora, load_adapter)
        self._adapters_changing = threading.Lock()  # callers' threads load, unload and combine them
        for spec in (options.lora,) if isinstance(options.lora, str) else options.lora:
            name, path, scale = parse_lora_spec(spec)
            if name is None:  # named by its file; the same file twice (other scales) is two adapters
                name = _unused_name(Path(path).stem if path.endswith(".gguf") else Path(path).resolve().name, self.adapters)
            self.load_adapter(path, name, scale)

    # ------------------------------------------------------------------ LoRA adapters

    def load_adapter(self, path: str | Path, name: str | None = None, scale: float = 1.0) -> Adapter:
        """Load a PEFT LoRA adapter (a directory) as `name` (default: the directory's name),
        its updates times `scale`; requests then choose it by name (lora=). The base weights are
        shared, never copied."""
        adapter = load_adapter(path, self.model.config, name, scale)
        with self._adapters_changing:
            if adapter.name in self.adapters or "+" in adapter.name:
                raise UsageError(f"a LoRA adapter named {adapter.name!r} is already loaded" if "+" not in adapter.name
                                 else f"LoRA adapter name {adapter.name!r}: '+' joins names of adapters applied together")
            self.adapters[adapter.name] = adapter
            self.model.set_adapters(self.model.adapters + (adapter,))
        return adapter

    def unload_adapter(self, name: str) -> None:
        """Forget adapter `name` (and the combinations it is in): requests can no longer choose it."""
        with self._adapters_changing:
            if self.adapters.pop(name, None) is None:
                raise UsageError(f"no LoRA adapter named {name!r} is loaded")
            keep = set(self.adapters)
            self.model.set_adapters(a for a in self.model.adapters if all(part in keep for part in a.name.split("+")))

    def adapter(self, lora: str | Sequence[str] | None = None) -> Adapter | None:
        """The adapter a call runs with: lora None is every loaded adapter at once (as llama.cpp
        applies each --lora; none loaded: the base model); a name or names, those (summed); () or
        "" the base model."""
        names = tuple(self.adapters) if lora is None else ((lora,) if isinstance(lora, str) else tuple(lora))
        names = tuple(n for n in names if n)
        if not names:
            return None
        for n in names:
            if n not in self.adapters:
                raise UsageError(f"no LoRA adapter named {n!r} (loaded: {', '.join(self.adapters) or 'none'})")
        name = "+".join(names)
        with self._adapters_changing:
            held = next((a for a in self.model.adapters if a.name == name), None)
            if held is None:  # a combination used for the first time
                held = combined([self.adapters[n] for n in names])
                self.model.set_adapters(self.model.adapters + (held,))
        return held

    @property
    def tokenizer(self) -> Tokenizer:
        return self.files.tokenizer

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.files.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: tuple[int, ...]) -> None:
        """Override the end-of-sequence ids (() lets every reply run to max_tokens)."""
        self.files.eos_ids = tuple(ids)

    @property
    def grammars(self) -> "GrammarCompiler":
        return self.files.grammars

    @property
    def model(self) -> Model:
        if self._model is None:
            raise GenerationError("this LLM was closed (LLM.close); load the model again")
        return self._model

    @cached_property
    def engine(self) -> Engine:
        """The batching engine thread, started on first use; it ends with close() or when this
        LLM is garbage collected (the thread alone would keep the weights alive)."""
        prefix_file = PrefixFile.for_model(self.options.cache_dir, self.source, self.model) if self.options.cache_dir else None
        engine = Engine(self.model, self.options, draft=self.draft, prefix_file=prefix_file)
        self._stop_engine = weakref.finalize(self, engine.close, timeout=0)
        return engine

    def close(self) -> None:
        """Stop the engine (requests still running end with a ShutdownError) and let go of the
        weights, even while something still holds this LLM (a server's routes, a web framework's
        caches); using it afterwards is an error."""
        if "engine" in self.__dict__:
            self.__dict__.pop("engine").close()
            self._stop_engine.detach()  # the finalizer's reference to the engine goes too
        self._model = self.draft = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def config(self):
        return self.model.config

    def health(self) -> dict:
        """{"status": "ok"} while the engine thread runs (the server's /health)."""
        return {"status": "ok" if self.engine.alive else "the engine thread stopped"}

    # ------------------------------------------------------------------ text in, text out

    def stream(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 256,
        stop: Sequence[str] = (),
        truncate: bool = False,
        **sampling,
    ) -> TextStream:
        """An iterator of text pieces as they are generated; `.finish_reason` once exhausted.

        A prompt longer than the context is an error unless `truncate`, which keeps its most
        recent tokens (leaving room for max_tokens, and at least half the context to the prompt).
        json_schema (a dict) or grammar (GBNF text, or {"type": "lark" | "gbnf" | "regex",
        "grammar": str}) constrain the text (minillm.core.structured); logit_bias maps token ids to biases.
        prediction (text or token ids the reply is expected to copy, OpenAI's predicted outputs)
        lets prompt lookup propose from it: the same text in fewer steps. lora: the LoRA adapter(s)
        to run with, by name (LLM.adapter; default: every one loaded).
        """
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self._stream(ids, max_tokens, stop, truncate, sampling)

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 256, stop: Sequence[str] = (), truncate: bool = False, **sampling) -> str:
        return "".join(self.stream(prompt, max_tokens, stop, truncate, **sampling))

    def chat_stream(self, messages: list[dict], max_tokens: int = 256, stop: Sequence[str] = (), truncate: bool = False, thinking: bool = True,
                    thinking_budget: int | None = None, chat_template_kwargs: dict | None = None, **sampling) -> TextStream:
        """The answer's text pieces; a reasoning model's thinking gathers in the stream's `reasoning`
        (its `parts()` give both as they come). A final assistant message is continued, not answered.
        thinking False switches it off (the template's enable_thinking, and no thinking tokens
        allowed); thinking_budget: thinking tokens before the model is made to answer;
        chat_template_kwargs: more variables for the template."""
        if thinking_budget is not None and self.reasoning is None:
            raise GenerationError("thinking_budget: this model's replies are not read as thinking and answer")
        variables = dict(self.options.template_variables, **(chat_template_kwargs or {}))
        if not thinking:
            variables["enable_thinking"], thinking_budget = False, 0
        continued = bool(messages) and messages[-1].get("role") == "assistant" and bool(messages[-1].get("content"))
        ids = self.tokenizer.encode_chat(messages, not continued, variables=variables, continue_final=continued)
        return self._stream(ids, max_tokens, stop, truncate, sampling, chat=True, thinking_budget=thinking_budget)

    def chat(self, messages: list[dict], max_tokens: int = 256, stop: Sequence[str] = (), truncate: bool = False, **settings) -> "Reply":
        """The answer, as a str whose `reasoning` holds a reasoning model's thinking (chat_stream's settings)."""
        stream = self.chat_stream(messages, max_tokens, stop, truncate, **settings)
        reply = Reply("".join(stream))
        reply.reasoning = stream.reasoning
        return reply

    @cached_property
    def reasoning(self) -> ReasoningFormat | None:
        """How this model's replies separate thinking from answer (None: they do not, or
        reasoning_format is none)."""
        return reasoning_format(self.tokenizer) if self.options.reasoning_format == "auto" else None

    def _stream(self, ids: list[int], max_tokens: int, stop, truncate: bool, sampling: dict, chat: bool = False,
                thinking_budget: int | None = None) -> TextStream:
        ctx = self.model.ctx
        if truncate and len(ids) > ctx:
            ids = ids[-max(ctx // 2, ctx - max_tokens) :]
        schema, grammar = sampling.pop("json_schema", None), sampling.pop("grammar", None)
        constraint = None
        if schema is not None or grammar is not None:
            from .core.structured import response_format_constraint

            response_format = {"type": "json_schema", "json_schema": {"schema": schema}} if schema is not None else None
            constraint = response_format_constraint(self.grammars, response_format, grammar)
        if "logit_bias" in sampling:
            sampling["logit_bias"] = tuple((int(t), float(b)) for t, b in dict(sampling["logit_bias"]).items())
        adapter = self.adapter(sampling.pop("lora", None))
        prediction = sampling.pop("prediction", None) or ()
        if isinstance(prediction, str):
            prediction = self.tokenizer.encode(prediction, add_special_tokens=False)
        reader = None
        if chat and self.reasoning is not None:  # the thinking apart, its budget, a grammar for the answer alone
            reader = ReplyReader(self.tokenizer, self.reasoning, ids, stop)
            constraint = reply_constraint(self.tokenizer, self.reasoning, ids, thinking_budget, constraint)
        handle = self.engine.submit(ids, SamplingParams(**sampling), max_tokens, self.eos_ids, constraint=constraint, prediction=prediction,
                                    adapter=adapter)
        return TextStream(handle, self.tokenizer, stop, owner=self, reader=reader)

    # ------------------------------------------------------------------ numbers

    def logits(self, tokens: Sequence[int], lora: str | Sequence[str] | None = None) -> np.ndarray:
        """float32 logits (T, V) for every position of `tokens`, from an empty cache (lora: as in stream)."""
        ids = list(tokens)
        self.check_prompt(ids)
        return self.model.forward(ids, self.model.new_cache(), all_logits=True, adapter=self.adapter(lora))

    def embed(self, inputs: Sequence[str | Sequence[int]], lora: str | Sequence[str] | None = None) -> np.ndarray:
        """One unit-length float32 vector per input (text or token ids): the mean over its tokens
        of the final norm's output. Read by the engine in chunks beside running streams; a row's
        results do not depend on its step, so a batch equals its inputs one by one."""
        prompts = [self.tokenizer.encode(item) if isinstance(item, str) else list(item) for item in inputs]
        adapter = self.adapter(lora)
        for ids in prompts:
            self.check_prompt(ids)
        vectors, window = [], deque()
        try:
            for ids in prompts:
                if len(window) >= self.engine.max_batch:  # more would only wait in the queue
                    vectors.append(_only(window.popleft()))
                window.append(self.engine.submit_embedding(ids, adapter=adapter))
            vectors += [_only(handle) for handle in window]
        finally:
            for handle in window:
                handle.cancel()  # an error or an interrupt: the rest need not run
        return np.stack(vectors) if vectors else np.zeros((0, self.model.config.hidden_size), np.float32)

    def check_prompt(self, ids: Sequence[int]) -> None:
        """The engine's prompt check (minillm.core.engine.check_prompt) for this model."""
        check_prompt(ids, self.model.config.vocab_size, self.model.ctx)


def load(model_dir: str | Path | None = None, *, progress: bool = True, options: Options | None = None, **settings) -> LLM:
    """Load an HF checkpoint directory or a GGUF file, or the default model when `model_dir` is None.

    settings: any field of minillm.Options (or pass `options`), the ones below among them.

    dtype: how weights are kept. A directory's are converted at load: "float32" (default;
    exact), "bfloat16", "int8" (blocks of 32 with a scale each) or "q4_0" (4-bit blocks and a Q8_0
    output matrix, as llama.cpp's Q4_0 quantizer makes them). A GGUF's run as stored ("gguf", the default; Q4_0, Q5_0, Q8_0, Q4_K, Q6_K and
    MXFP4 on integer products, by default against 8-bit activations as llama.cpp's (MXFP4: 16),
    the other formats exactly the logits of their dequantized float32 weights), or are converted
    to one of those.
    check_weights: reject weights containing NaN or Inf (reads every weight once at load).
    max_batch / max_queue: sequences decoded together, and requests allowed to wait.
    cache_mb: memory for the prefix cache, which lets requests that share a prefix (a chat's
    earlier turns, a system prompt) skip prefilling it; None: a default from free memory, 0: off.
    threads: the most threads a step uses (default: every CPU); fewer are used while more would
    wait on a busy machine (minillm.core.threads).
    activations: 16 or 8: the bits activations are quantized to against GGUF blocks run on integer
    products; 8 is llama.cpp's numerics (faster prefill, its accuracy); None (default): each
    format's own choice (kernels.formats: 8 where perplexity stays within llama.cpp's bar).
    kv_dtype: how the KV cache (and the prefix cache) keeps keys and values: "float32" (default;
    exact), "float16" or "bfloat16" (half the memory), "q8_0" (34 bytes per 32 values, as
    llama.cpp's -ctk/-ctv q8_0). Attention widens them to float32 as it reads, with the same sums.
    lora: LoRA adapters as PEFT saves them, "[NAME=]PATH[:SCALE]" each (LLM.load_adapter); calls
    run with all of them unless they name some (lora="NAME") or none (lora=()).
    """
    try:
        options = (options or DEFAULTS).replace(**settings)
    except TypeError as e:  # an unknown keyword
        raise UsageError(f"minillm.load: {e}") from None
    if model_dir is not None:
        options = options.replace(model=str(model_dir))
    return LLM(options, progress=progress)


def _unused_name(name: str, taken) -> str:
    """name, or name-2, name-3 .. the first not in `taken`."""
    n, candidate = 1, name
    while candidate in taken:
        n += 1
        candidate = f"{name}-{n}"
    return candidate


def tokenizer_files(source: str | Path | None) -> tuple[Path, Path]:
    """(the directory with tokenizer.json, tokenizer_config.json and generation_config.json, the
    config.json to read) for a checkpoint directory, a GGUF file (its tokenizer rebuilt from
    the metadata once, kept in the model store) or None (the default model)."""
    from .loading.default_model import weights_dir

    source = model_path(source, progress=False)
    if source.is_dir():
        return source, source / "config.json"
    from .loading.gguf_file import tokenizer_dir

    files = tokenizer_dir(source, weights_dir() / "gguf-tokenizers")
    return files, files / "config.json"


def _read_template(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"chat-template: cannot read {path}: {e}") from None


def _eos_ids(model_dir: Path, config_eos: tuple[int, ...], tokenizer: Tokenizer) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json (an int or a list), else config.json, else the tokenizer's."""
    path = model_dir / "generation_config.json"
    if path.is_file():
        try:
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError) as e:
            raise GenerationError(f"{path}: not valid JSON: {e}") from None
        ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise GenerationError(f"{path}: field 'eos_token_id' must be an integer or a list of integers")
        if ids:
            return tuple(ids)
    if config_eos:
        return config_eos
    eos = tokenizer.token_id(tokenizer.eos_token) if tokenizer.eos_token else None
    return (eos,) if eos is not None else ()


def load_draft(model: Model, source: Path, options: Options) -> Model:
    """The draft model of `--speculative draft` for `model` (loaded from `source`):
    options.draft_model (default: the model's own weights) at options.draft_dtype (default int8, or
    q4_0 for a GGUF), with the model's context."""
    source = model_path(options.draft_model) if options.draft_model else Path(source)
    dtype = options.draft_dtype or ("q4_0" if source.suffix == ".gguf" else "int8")
    draft = Model.load(source, ctx=model.ctx, dtype=dtype, threads=options.threads, kv_dtype=options.kv_dtype, activations=options.activations)
    if draft.config.vocab_size != model.config.vocab_size:
        raise UsageError(f"--draft-model {source}: its vocabulary has {draft.config.vocab_size} tokens, the model's "
                         f"{model.config.vocab_size}; a draft must share the model's tokenizer")
    if draft.weights.nbytes > MAX_DRAFT_SHARE * model.weights.nbytes:  # a step reads every weight once
        raise UsageError(f"the draft ({source.name} at {dtype}, {draft.weights.nbytes / 2**20:.0f} MiB) is not much cheaper than the "
                         f"model ({model.weights.nbytes / 2**20:.0f} MiB), so it could only slow decoding; give "
                         "--draft-model a smaller model or --draft-dtype a smaller precision")
    return draft


def _only(handle):
    """The one item an embedding's handle yields."""
    items = list(handle)
    return items[0]
