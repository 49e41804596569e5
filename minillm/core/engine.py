"""The engine loop: continuous batching of generation requests on one thread.

Callers on any thread `submit` requests (or `submit_embedding`); one engine thread owns the model.
Each step it admits queued requests into free cache slots, then runs one batched step: a row for
every decoding sequence, the weights read once for all of them, plus a chunk of the prompts being
read (chunked prefill). The chunk is sized so a step costs about PREFILL_SHARE more than the decodes
alone do (the step times measured as it runs, on this machine), so a long prompt never stalls the
running streams; a prompt whose last row ran starts decoding. Finished or cancelled sequences
leave and free their slot. Only the engine thread enters Numba's parallel regions, which must
never be entered from two Python threads at once.

Each request keeps its own sampling settings and random generator, and a row's results do not
depend on what else is in its step, so a greedy or seeded request gives the same tokens whatever
else runs, and a prompt read in chunks gives the logits of a prompt read whole.
"""

from __future__ import annotations

import bisect
import queue
import statistics
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Iterator, Sequence

import numpy as np

from ..errors import ContextLengthError, GenerationError, MiniLLMError
from ..options import DEFAULT_SPEC_NGRAM, DEFAULT_SPEC_TOKENS, DEFAULTS, Options
from ..loading.lora import Adapter
from .cache import KVCache, KVPool
from .model import PREFILL_CHUNK, Model
from .prefix_cache import PrefixCache, PrefixFile, default_budget_mb
from .sampling import SamplingParams, apply_logit_bias, sample
from .speculative import DraftLength, DraftState, PromptLookup, RowCost, learned_rate
from .structured import Constraint

if TYPE_CHECKING:  # asyncio and its ssl cost ~7 MB; only the server's handles use it
    import asyncio


class QueueFullError(GenerationError):
    """The engine's queue is at its limit; try again later."""


class ShutdownError(GenerationError):
    """The server stopped before the request finished."""


PREFILL_SHARE = 1.0  # a step with prompt rows may cost this much more than its decode rows alone
FIRST_PREFILL_ROWS = 4  # beside decodes, until a step with prompt rows has been timed
DECODE_TIMES = 9  # decode-only steps whose median is the decode time prompt rows are sized by
TIMING_WEIGHT = 0.25  # of the newest step in the running estimates of step costs
DRAFT_COST_PRIOR = 0.4  # what a proposed token adds over a plain step, until measured


def check_prompt(ids: Sequence[int], vocab_size: int, ctx: int, max_tokens: int | None = None) -> None:
    """The one check of a prompt's token ids: not empty, each in the vocabulary, and fitting the
    context; with `max_tokens`, the prompt plus that many new tokens must fit too
    (ContextLengthError names which to shorten)."""
    if not len(ids):
        raise GenerationError("the prompt is empty")
    bad = [i for i in ids if not isinstance(i, (int, np.integer)) or not 0 <= i < vocab_size]
    if bad:
        raise GenerationError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    if len(ids) > ctx:
        raise ContextLengthError(
            f"the prompt has {len(ids)} tokens but the context holds {ctx}; "
            "ask for truncation (truncate=True, --truncate) to keep only its most recent tokens"
        )
    if max_tokens is not None and len(ids) + max_tokens > ctx:
        raise ContextLengthError(
            f"this model's context is {ctx} tokens; the prompt has {len(ids)} and max_tokens asks for {max_tokens}",
            param="max_tokens",
        )


@dataclass(frozen=True)
class TokenEvent:
    token: int
    logprob: float | None = None  # log-probability under the model's distribution
    top_logprobs: tuple[tuple[int, float], ...] = ()


_END = object()  # the engine's last item for a request


class RequestHandle:
    """The caller's side of a request. Read its TokenEvents with `for event in handle` (any thread)
    or, when submitted with an asyncio loop, `async for event in handle.events()`; an error in the
    engine is raised from the iteration, and a reader that stops early cancels the request.
    `finish_reason` once done: "stop" (end-of-sequence token), "length" (max_tokens), "context"
    (the context is full) or "cancelled"."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        if loop is None:
            self._queue = queue.SimpleQueue()
            self._put = self._queue.put
        else:
            import asyncio

            self._queue = asyncio.Queue()
            self._put = lambda item: self._put_async(loop, item)
        self._cancelled = threading.Event()
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0  # of them, served from the prefix cache (set before the first event)
        self.prompt_logprobs: list[TokenEvent] | None = None  # submit's prompt_logprobs (set before the first event)
        self.proposed_tokens = 0  # speculation's proposals for this request, and the ones kept
        self.accepted_tokens = 0
        self.generated = 0
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at = 0.0

    def __iter__(self) -> Iterator[TokenEvent]:
        finished = False
        try:
            while (event := _unwrap(self._queue.get())) is not None:
                yield event
            finished = True
        finally:
            if not finished:
                self.cancel()

    async def events(self) -> AsyncIterator[TokenEvent]:
        finished = False
        try:
            while (event := _unwrap(await self._queue.get())) is not None:
                yield event
            finished = True
        finally:
            if not finished:
                self.cancel()  # the client went away, a stop string ended it early, or an error

    def cancel(self) -> None:
        """Stop generating; the engine frees the sequence's slot before its next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _put_async(self, loop: asyncio.AbstractEventLoop, item) -> None:
        try:
            loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the reader's event loop is closed: nobody will read; stop generating
            self._cancelled.set()

    # the producer's side: the engine thread, or minillm.serving.cluster relaying a replica's stream
    def deliver(self, item) -> None:
        """Hand the reader a TokenEvent, or an exception to raise from its iteration."""
        self._put(item)

    def finish(self, reason: str) -> None:
        """End the stream with a finish_reason."""
        self.finish_reason = reason
        self._put(_END)


def _unwrap(item) -> TokenEvent | None:
    """A queued item as the reader sees it: an event, None at the end, or the engine's error raised."""
    if item is _END:
        return None
    if isinstance(item, BaseException):
        raise item
    return item


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop_ids: frozenset
    logprobs: int | None
    handle: RequestHandle
    constraint: Constraint | None = None  # structured output: the grammar the text must follow
    embedding: bool = False  # the mean of the final norm's output over the prompt, not generation
    prompt_logprobs: int | None = None  # score the prompt too: alternatives per prompt token
    prediction: tuple[int, ...] = ()  # tokens the reply is expected to copy: proposed by prompt lookup
    adapter: Adapter | None = None  # the LoRA adapter its rows run with (one of the model's adapters)

    @property
    def prefix_root(self):
        """Where its prompt's blocks chain from in the prefix cache: an adapter's keys and values are its own."""
        return 0 if self.adapter is None else self.adapter.key


@dataclass
class _Sequence:
    request: _Request
    slot: int
    cache: object
    rng: np.random.Generator
    generated: list[int] = field(default_factory=list)
    last: int = 0
    read: int = 0  # prompt tokens in the cache (the prefix cache's among them)
    normed: np.ndarray | None = None  # an embedding's final-norm output, (prompt, H)
    scored: list[TokenEvent] | None = None  # prompt_logprobs' events, prompt token 1 on
    lookup: PromptLookup | None = None  # speculative decoding's proposals, by prompt lookup
    drafter: DraftState | None = None  # or by the draft model

    @property
    def proposals(self):
        """The adaptive proposal length of whichever proposer the sequence has."""
        return self.lookup if self.lookup is not None else (self.drafter.proposals if self.drafter is not None else None)

    @property
    def prefilling(self) -> bool:
        return self.read < len(self.request.prompt)


@dataclass
class EngineStats:
    requests: int = 0
    finished: int = 0
    errors: int = 0
    rejected: int = 0
    cancelled: int = 0  # by the client (gone, or a stop string), queued or running
    embeddings: int = 0
    prompt_tokens: int = 0  # prefilled (computed)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache instead
    generated_tokens: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    latency_sum: float = 0.0
    latency_count: int = 0
    steps: int = 0
    batch_tokens: int = 0  # sum of decode rows over steps
    prefill_steps: int = 0  # steps that read prompt rows
    spec_draft_tokens: int = 0  # tokens proposed by speculative decoding
    spec_accepted_tokens: int = 0  # of them, the tokens plain decoding chose too
    # gaps between a running stream's tokens, seconds: a histogram by INTER_TOKEN_BUCKETS
    inter_token_counts: list = field(default_factory=lambda: [0] * (len(INTER_TOKEN_BUCKETS) + 1))
    inter_token_sum: float = 0.0

    def note_gap(self, seconds: float) -> None:
        self.inter_token_counts[bisect.bisect_left(INTER_TOKEN_BUCKETS, seconds)] += 1
        self.inter_token_sum += seconds


PREFIX_SAVE_INTERVAL = 60.0  # seconds between writes of a persistent prefix cache while serving
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class Engine:
    """options: max_batch (sequences decoded together), max_queue (requests allowed to wait),
    cache_mb (the prefix cache's budget, minillm.core.prefix_cache; None: a default from free memory,
    0: no prefix cache), prefill_chunk (prompt rows per step beside running decodes; None: sized
    by measured step costs) and speculative, spec_tokens, spec_ngram of minillm.options.Options.
    draft: the draft model of speculative="draft" (minillm.api.LLM loads it). prefix_file: where the
    prefix cache is kept between runs (read now, written when idle and at the end)."""

    def __init__(self, model: Model, options: Options = DEFAULTS, draft: Model | None = None, prefix_file: PrefixFile | None = None):
        max_batch, max_queue, cache_mb = options.max_batch, options.max_queue, options.cache_mb
        self.model, self.max_batch, self.max_queue = model, max_batch, max_queue
        self.prefill_chunk = options.prefill_chunk
        self.speculative = options.speculative
        self.spec_tokens = options.spec_tokens or DEFAULT_SPEC_TOKENS
        self.spec_ngram = options.spec_ngram or DEFAULT_SPEC_NGRAM
        if (options.speculative == "draft") != (draft is not None):
            raise GenerationError("speculative decoding with a draft model needs the draft model (minillm.load loads it)")
        self.draft = draft
        self.draft_pool = KVPool(draft.config, model.ctx, max_batch, draft.kv_format) if draft is not None else None
        self.pool = KVPool(model.config, model.ctx, max_batch, model.kv_format)
        self.prefix = PrefixCache(model.config, default_budget_mb() if cache_mb is None else cache_mb, model.kv_format)
        self.prefix_file = prefix_file
        if prefix_file is not None:
            self.prefix.restore(prefix_file)
        self._saved = (self.prefix.version, time.monotonic())  # what the file holds, and when it was written
        self.stats = EngineStats()
        self._pending: deque[_Request] = deque()
        self._running: list[_Sequence] = []  # in admission order; prefilling ones hold no logits yet
        self._claimed = 0  # slots held at the last admission (under _cond; high until the next one)
        self._shutdown: Exception | None = None
        self._decode_seconds: float | None = None  # running estimate of a step's cost (speculation's)
        self._decode_times: deque[float] = deque(maxlen=DECODE_TIMES)  # the latest decode-only steps'
        self._prompt_rows: float | None = None  # prompt rows beside decodes, as the latest steps sized them
        self._draft_seconds: float | None = None  # and of a draft step's
        self._row_cost = RowCost()  # and of a checked row, which speculation weighs
        self._draft_rate = DraftLength.PRIOR_RATE  # the draft's kept rate over all sequences: a new one's prior
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="minillm-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers

    def submit(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        max_tokens: int | None = None,
        stop_ids: Sequence[int] = (),
        logprobs: int | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        fit_max_tokens: bool = False,
        constraint: Constraint | None = None,
        prompt_logprobs: int | None = None,
        prediction: Sequence[int] = (),
        adapter: Adapter | None = None,
    ) -> RequestHandle:
        """Queue a request; returns its handle at once (deliver its events to `loop` for an
        asyncio reader). The prompt is checked here (check_prompt): with `fit_max_tokens` the
        prompt plus max_tokens must fit the context, as OpenAI's API asks; otherwise generation
        that fills the context stops with "context". max_tokens None: until the context is full.
        constraint: a grammar the generated text must follow (minillm.core.structured).
        prompt_logprobs: also score the prompt (the echo of OpenAI's completions): before its
        first event the handle's `prompt_logprobs` holds a TokenEvent for each prompt token after
        the first, with that many alternatives; max_tokens may then be 0 (score only). Such a
        prompt is computed whole, not read from the prefix cache.
        prediction: tokens the reply is expected to copy (OpenAI's predicted outputs): prompt lookup
        proposes from them (before the prompt), for this request in place of any draft model; the
        tokens are the same either way, only their steps fewer.
        adapter: a LoRA adapter of the model's (Model.set_adapters) to run this request with.
        Raises QueueFullError when the queue is full."""
        prompt = list(prompt)
        ctx = self.model.ctx
        check_prompt(prompt, self.model.config.vocab_size, ctx, max_tokens if fit_max_tokens else None)
        if max_tokens is None:
            max_tokens = max(1, ctx - len(prompt))
        least = 0 if prompt_logprobs is not None else 1
        if max_tokens < least:
            raise GenerationError(f"max_tokens must be >= {least}, got {max_tokens}")
        if prompt_logprobs is not None and prompt_logprobs < 0:
            raise GenerationError(f"prompt_logprobs must be >= 0, got {prompt_logprobs}")
        handle = RequestHandle(loop)
        handle.prompt_tokens = len(prompt)
        self.model.adapter_index(adapter)  # one of the model's, or an error now
        self._queue(_Request(prompt, params, max_tokens, frozenset(stop_ids), logprobs, handle, constraint, prompt_logprobs=prompt_logprobs,
                             prediction=tuple(int(t) for t in prediction), adapter=adapter))
        return handle

    def submit_embedding(self, prompt: Sequence[int], loop: asyncio.AbstractEventLoop | None = None,
                         adapter: Adapter | None = None) -> RequestHandle:
        """Queue an embedding of `prompt`: its handle yields one unit-length float32 vector, the
        mean over the prompt's tokens of the final norm's output. Read in chunks beside the
        running streams, as prompts are."""
        prompt = list(prompt)
        check_prompt(prompt, self.model.config.vocab_size, self.model.ctx)
        handle = RequestHandle(loop)
        handle.prompt_tokens = len(prompt)
        self.model.adapter_index(adapter)
        self._queue(_Request(prompt, SamplingParams(), 0, frozenset(), None, handle, embedding=True, adapter=adapter))
        return handle

    def _queue(self, request: _Request) -> None:
        with self._cond:
            if self._shutdown is not None:
                raise self._shutdown
            self._drop_cancelled_waiting()
            free = max(self.max_batch - self._claimed, 0)
            if len(self._pending) >= self.max_queue + free:  # free slots take a burst at once
                self.stats.rejected += 1
                raise QueueFullError(f"the queue is full ({self.max_queue} waiting requests)")
            self._pending.append(request)
            self.stats.requests += 1
            self._cond.notify()

    def shut_down(self, error: Exception) -> None:
        """End every queued and running request with `error` (their readers raise it) and refuse
        new ones: the server's last act when its shutdown time runs out."""
        with self._cond:
            self._shutdown = error
            self._cond.notify()

    def close(self, timeout: float | None = 10.0) -> None:
        """Shut down (requests still running end with a ShutdownError) and wait for the engine
        thread to finish its step and exit."""
        self.shut_down(ShutdownError("the engine was closed"))
        if threading.current_thread() is not self._thread:
            self._thread.join(None if self.prefix_file is not None else timeout)  # its last act writes the prefix cache

    @property
    def alive(self) -> bool:
        """The engine thread is running (it survives request errors; this is for health checks)."""
        return self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def batch_size(self) -> int:
        return len(self._running)

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of the batch slots' KV positions the running sequences hold."""
        return sum(s.cache.length for s in list(self._running)) / (self.max_batch * self.model.ctx)

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        """Steps until shut down: then every request has ended and the thread lets go of the
        model (an engine's thread is what keeps its weights and KV cache alive)."""
        while self._shutdown is None or self._running or self._pending:
            try:
                self._iteration()
            except Exception as e:  # a bug must not leave callers waiting forever
                error = GenerationError(f"internal engine error: {type(e).__name__}: {e}")
                for seq in self._running:
                    self._fail(seq, error)
                self._running = []
        self._save_prefix(force=True)

    def _save_prefix(self, force: bool = False) -> None:
        """Write the prefix cache to its file if it changed: at the end, or when idle and the last
        write is a minute old (a write takes the engine thread: not between steps of a batch)."""
        if self.prefix_file is None or self.prefix.version == self._saved[0]:
            return
        if not force and time.monotonic() - self._saved[1] < PREFIX_SAVE_INTERVAL:
            return
        try:
            self.prefix.save(self.prefix_file)
        except OSError as e:
            warnings.warn(f"{self.prefix_file.path}: cannot write the prefix cache: {e}", stacklevel=2)
        self._saved = (self.prefix.version, time.monotonic())

    def _iteration(self) -> None:
        """Admit waiting requests into free slots, drop cancelled ones, run one step."""
        if not self._pending and not self._running:
            self._save_prefix()  # idle: nothing waits on this thread
        with self._cond:
            while not self._pending and not self._running and self._shutdown is None:
                self._cond.wait(PREFIX_SAVE_INTERVAL if self.prefix_file is not None else None)
                if self.prefix_file is not None and not self._pending:
                    return  # to write what changed, then wait again
            if self._shutdown is not None:
                self._end_all(self._shutdown)
                return
            self._drop_cancelled_waiting()
            admitted = []
            while self._pending and len(self._running) + len(admitted) < self.max_batch:
                admitted.append(self._pending.popleft())
            self._claimed = len(self._running) + len(admitted)
        for request in admitted:
            self._admit(request)
        self._running = [s for s in self._running if not self._drop_if_cancelled(s)]
        if self._running:
            self._step()
        with self._cond:
            self._claimed = len(self._running)

    def _drop_cancelled_waiting(self) -> None:
        """Finish queued requests whose reader has gone (under _cond)."""
        if any(r.handle.cancelled for r in self._pending):
            for r in [r for r in self._pending if r.handle.cancelled]:
                self._pending.remove(r)
                self.stats.cancelled += 1
                r.handle.finish("cancelled")

    def _end_all(self, error: Exception) -> None:
        """Shutdown (under _cond): every request ends with `error`."""
        for seq in self._running:
            self._fail(seq, error)
        self._running = []
        while self._pending:
            self.stats.errors += 1
            self._pending.popleft().handle.deliver(error)
        self._claimed = 0

    def _admit(self, request: _Request) -> None:
        """Give a request a cache slot, with what the prefix cache holds of its prompt; its
        prompt is read by the following steps."""
        slot, cache = self.pool.acquire()
        seq = _Sequence(request, slot, cache, np.random.default_rng(request.params.seed))
        try:
            whole = request.embedding or request.prompt_logprobs is not None  # every prompt row is read
            seq.read = 0 if whole else self.prefix.load(request.prompt, cache, request.prefix_root)
            request.handle.cached_tokens = seq.read
            self.stats.cached_tokens += seq.read
            if request.prompt_logprobs is not None:
                seq.scored = []
            if request.embedding:
                seq.normed = np.empty((len(request.prompt), self.model.config.hidden_size), np.float32)
            elif self.speculative == "ngram" or request.prediction:  # a prediction is this request's proposer
                seq.lookup = PromptLookup(request.prompt, self.spec_tokens, self.spec_ngram, request.prediction)
            elif self.draft is not None:
                pool = self.draft_pool
                cache = KVCache(self.draft.config, pool.ctx, pool.k[slot], pool.v[slot], pool.format)
                seq.drafter = DraftState(cache, self.spec_tokens, self._draft_rate)
            self._running.append(seq)
        except MiniLLMError as e:
            self._fail(seq, e)
        except Exception as e:  # a bug: fail this request, keep serving the others
            self._fail(seq, GenerationError(f"internal engine error: {type(e).__name__}: {e}"))

    def _prefill_rows(self, decoding: int) -> int:
        """Prompt rows for this step: all of a chunk when nothing decodes, else as many as keep the
        step within 1 + PREFILL_SHARE times the decode rows' own time (the running streams' tokens
        stay regular), and at least one (a prompt always progresses). Sized from the step times
        measured on this machine (_note_cost), no count tuned on one CPU: where a prompt row
        costs more (a slower CPU, a deeper prompt), fewer are read per step."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        if not decoding:
            return PREFILL_CHUNK
        return FIRST_PREFILL_ROWS if self._prompt_rows is None else int(self._prompt_rows)  # whole rows, from below

    def _step(self) -> None:
        """One batched step: rows for each decoding sequence (its last token, then any tokens
        speculation proposes after it), then prompt rows of the prefilling ones in admission order,
        up to the step's share."""
        if any(s.request.adapter is not None for s in self._running):
            self._drop_unloaded_adapters()
        decoding = [s for s in self._running if not s.prefilling]
        tokens, positions, slots, logit_rows, adapters = [], [], [], [], []
        drafts = self._draft_proposals(decoding) if self.draft is not None else [[] for _ in decoding]
        cost = self._row_cost.of(len(decoding))  # prompt lookup weighs its tokens at a checked row's cost
        drafts = [s.lookup.propose(self._room(s), cost) if s.lookup is not None else draft for s, draft in zip(decoding, drafts)]
        for s, draft in zip(decoding, drafts):
            self.stats.spec_draft_tokens += len(draft)
            s.request.handle.proposed_tokens += len(draft)
            for i, token in enumerate([s.last, *draft]):
                logit_rows.append(len(tokens))
                tokens.append(token), positions.append(s.cache.length + i), slots.append(s.slot)
            adapters += [s.request.adapter] * (1 + len(draft))
        decode_rows = len(tokens)
        budget = allowed = self._prefill_rows(decode_rows)
        chunks = []  # (sequence, first row, rows, its first row of logits)
        for s in self._running:
            if budget <= 0:
                break
            if not s.prefilling:
                continue
            n = min(budget, len(s.request.prompt) - s.read)
            chunks.append((s, len(tokens), n, len(logit_rows)))
            if s.scored is not None:  # every row's, to score the prompt
                logit_rows += range(len(tokens), len(tokens) + n)
            elif s.read + n == len(s.request.prompt) and not s.request.embedding:
                logit_rows.append(len(tokens) + n - 1)
            tokens += s.request.prompt[s.read : s.read + n]
            positions += range(s.read, s.read + n)
            slots += [s.slot] * n
            adapters += [s.request.adapter] * n
            budget -= n
        hidden = None
        if any(s.request.embedding for s, _, _, _ in chunks):
            cfg = self.model.config
            hidden = np.empty((cfg.num_hidden_layers + 2, len(tokens), cfg.hidden_size), np.float32)
        started = time.perf_counter()
        try:
            for s, draft in zip(decoding, drafts):
                s.cache.reserve(1 + len(draft))
            logits = self.model.step(tokens, positions, slots, self.pool, logit_rows, hidden=hidden,
                                     adapters=[self.model.adapter_index(a) for a in adapters] if self.model.adapters else None)
        except MiniLLMError as e:
            for s in self._running:
                self._fail(s, e)
            self._running = []
            return
        self._note_cost(time.perf_counter() - started, decode_rows, len(tokens) - decode_rows, allowed)
        self.stats.steps += 1
        self.stats.batch_tokens += len(decoding)
        self.stats.prefill_steps += bool(chunks)
        keep = {id(s) for s in self._running}
        next_logits = 0
        for s, draft in zip(decoding, drafts):
            if not self._verify(s, draft, logits[next_logits : next_logits + 1 + len(draft)]):
                keep.discard(id(s))
            next_logits += 1 + len(draft)
        for s, first, n, _ in chunks:
            s.cache.length += n
            s.read += n
            if s.prefilling and not s.request.embedding:  # its whole blocks so far: a long prompt's copy spread over its steps
                self.prefix.store(s.request.prompt, s.cache, s.request.prefix_root)
        if self.draft is not None and chunks:
            self._draft_read([s for s, _, _, _ in chunks])  # before a finished prompt's first token starts its proposals
        for s, first, n, at in chunks:
            if not self._read_prompt_rows(s, first, n, logits, at, hidden):
                keep.discard(id(s))
        self._running = [s for s in self._running if id(s) in keep]

    def _drop_unloaded_adapters(self) -> None:
        """End, with an error, the sequences whose LoRA adapter was unloaded while they ran."""
        held = {id(a) for a in self.model.adapters}
        for s in [s for s in self._running if s.request.adapter is not None and id(s.request.adapter) not in held]:
            self._running.remove(s)
            self._fail(s, GenerationError(f"LoRA adapter {s.request.adapter.name!r} was unloaded while this request ran"))

    def _read_prompt_rows(self, s: _Sequence, first: int, n: int, logits: np.ndarray, at: int, hidden: np.ndarray | None) -> bool:
        """After a step that read n prompt rows of `s` (its rows from `first`, its logits from row
        `at`): what they give (an embedding's outputs, a scored prompt's logprobs) and, when the
        prompt is done, its first token. False when the sequence is done."""
        if s.request.embedding and hidden is not None:
            s.normed[s.read - n : s.read] = hidden[-1, first : first + n]
        if s.scored is not None:
            self._score_prompt(s, logits[at : at + n], s.read - n)
            at += n - 1  # the prompt's last row, when this chunk ends it
        if s.prefilling:
            return True
        self.stats.prompt_tokens += len(s.request.prompt) - s.request.handle.cached_tokens
        if s.request.embedding:
            self._end_embedding(s)
            return False
        self.prefix.store(s.request.prompt, s.cache, s.request.prefix_root)  # for requests that share this prompt, even now
        self.model.release_outside_windows(s.cache)
        if s.scored is not None:
            s.request.handle.prompt_logprobs, s.scored = s.scored, None
            if s.request.max_tokens == 0:  # scored, nothing to generate
                return self._end(s, "length")
        return self._advance_or_fail(s, logits[at])

    def _score_prompt(self, seq: _Sequence, logits: np.ndarray, start: int) -> None:
        """The prompt's own tokens scored by the logits of the rows before them (rows from prompt
        position `start`), as generated tokens' logprobs are."""
        prompt, top = seq.request.prompt, seq.request.prompt_logprobs
        for i in range(min(len(logits), len(prompt) - 1 - start)):
            token = prompt[start + i + 1]
            seq.scored.append(TokenEvent(token, *token_logprobs(logits[i], token, top)))

    @staticmethod
    def _room(seq: _Sequence) -> int:
        """How many proposed tokens can follow seq.last: what the context and max_tokens leave
        (each accepted one is emitted)."""
        return min(seq.cache.ctx - seq.cache.length - 1, seq.request.max_tokens - len(seq.generated) - 1)

    def _draft_proposals(self, decoding: list[_Sequence]) -> list[list[int]]:
        """The draft model's greedy tokens after each sequence's last one, as many as each one's
        proposal length: a first draft step reads what the draft has not seen of each sequence
        (its accepted tokens since the last proposal, and seq.last), then one row per sequence and
        step, batched like the model's own steps."""
        cost = self._draft_cost(len(decoding))
        wanted = [s.drafter.proposals.next(self._room(s), cost) if s.drafter is not None else 0 for s in decoding]
        drafts: list[list[int]] = [[] for _ in decoding]
        active = [i for i, k in enumerate(wanted) if k > 0]
        tokens, positions, slots, logit_rows = [], [], [], []
        for i in active:
            s = decoding[i]
            seen = s.request.prompt + s.generated  # the token at position cache.length is seq.last
            for position in range(s.drafter.synced, len(seen)):
                tokens.append(seen[position]), positions.append(position), slots.append(s.slot)
            logit_rows.append(len(tokens) - 1)
            s.drafter.synced = len(seen)
        for depth in range(max(wanted, default=0)):
            if depth:
                active = [i for i in active if wanted[i] > depth]
                tokens = [drafts[i][-1] for i in active]
                positions = [decoding[i].drafter.synced for i in active]
                slots = [decoding[i].slot for i in active]
                logit_rows = list(range(len(active)))
                for i in active:
                    decoding[i].drafter.synced += 1
            started = time.perf_counter()
            logits = self.draft.step(tokens, positions, slots, self.draft_pool, logit_rows)
            if depth:  # a step of one row per sequence (the first also reads what the draft had not seen)
                seconds, d = time.perf_counter() - started, self._draft_seconds
                self._draft_seconds = seconds if d is None else (1 - TIMING_WEIGHT) * d + TIMING_WEIGHT * seconds
            for i, row in zip(active, logits):  # the request's logit_bias too: it often decides the choice
                drafts[i].append(int(np.argmax(apply_logit_bias(row, decoding[i].request.params.logit_bias))))
        return drafts

    def _draft_cost(self, sequences: int) -> float:
        """What a proposed token adds to a step, as a fraction of a plain step (one row per
        sequence): a draft step and a checked row. Against the plain step, not the average check:
        cheaper checks must not make drafting look dearer (they did, and shortened proposals)."""
        if self._draft_seconds is None or not self._decode_seconds:
            return DRAFT_COST_PRIOR
        plain = self._row_cost.plain_seconds(sequences) or self._decode_seconds  # before the fit: the average check
        return self._row_cost.of(sequences) + self._draft_seconds / plain

    def _draft_read(self, sequences: list[_Sequence]) -> None:
        """The draft model reads the prompt rows the model just read (and any the prefix cache
        supplied), so its first proposal does not wait for a whole prompt."""
        tokens, positions, slots = [], [], []
        for s in sequences:
            if s.drafter is None:
                continue
            for position in range(s.drafter.synced, s.read):
                tokens.append(s.request.prompt[position]), positions.append(position), slots.append(s.slot)
            s.drafter.synced = s.read
        if tokens:
            self.draft.step(tokens, positions, slots, self.draft_pool, [])

    def _verify(self, seq: _Sequence, draft: list[int], logits: np.ndarray) -> bool:
        """Emit tokens from the rows of seq.last and its draft, in order, each sampled exactly as
        plain decoding samples it (the same settings, grammar state, history and random draws):
        row i's logits are valid while every draft token before it was the token emitted there, so
        the first mismatch ends it. The cache keeps the positions of the emitted tokens' inputs
        only. False when the sequence is done."""
        accepted, start = 0, seq.cache.length
        for i in range(len(draft) + 1):
            seq.cache.length += 1
            self.model.release_outside_windows(seq.cache)
            if not self._advance_or_fail(seq, logits[i]):
                return False
            if i == len(draft) or seq.last != draft[i]:
                break
            accepted += 1
        if seq.proposals is not None:
            seq.proposals.update(len(draft), accepted)
            self.stats.spec_accepted_tokens += accepted
            seq.request.handle.accepted_tokens += accepted
            if seq.drafter is not None and draft:
                self._draft_rate = learned_rate(self._draft_rate, len(draft), accepted)
        if seq.drafter is not None:  # the draft read seq.last and the draft but its last: keep what was accepted
            seq.drafter.synced = min(seq.drafter.synced, start + accepted + 1)
        return True

    def _note_cost(self, seconds: float, decode_rows: int, prompt_rows: int, budget: int) -> None:
        """Update the running estimates of a step's costs: a decode step's time, the rows a
        checked row costs (from steps without prompt rows), and the prompt rows to read beside
        decodes. Those follow the step times: this step's rows scaled by how far its time was
        from the target, 1 + PREFILL_SHARE times the median of the latest decode-only steps (a
        median, so one slow step on a shared machine does not move it). As a step's cost is
        about its decode time plus a cost per prompt row, this converges on the rows that meet
        the target, and follows it as a prompt's rows grow dearer with depth."""
        if not prompt_rows:
            self._row_cost.record(decode_rows, seconds)
            self._decode_times.append(seconds)
            d = self._decode_seconds
            self._decode_seconds = seconds if d is None else (1 - TIMING_WEIGHT) * d + TIMING_WEIGHT * seconds
        elif decode_rows and self._decode_times and prompt_rows >= budget:  # a step that read all it could
            target = (1 + PREFILL_SHARE) * statistics.median(self._decode_times)
            self._prompt_rows = min(float(PREFILL_CHUNK), max(1.0, prompt_rows * target / max(seconds, 1e-6)))

    def _advance_or_fail(self, seq: _Sequence, logits: np.ndarray) -> bool:
        try:
            return self._advance(seq, logits)
        except MiniLLMError as e:
            self._fail(seq, e)
            return False
        except Exception as e:  # a bug: fail this request, keep serving the others
            self._fail(seq, GenerationError(f"internal engine error: {type(e).__name__}: {e}"))
            return False

    def _advance(self, seq: _Sequence, logits: np.ndarray) -> bool:
        """Sample the next token from `logits`, emit it; False when the sequence is done."""
        request, handle = seq.request, seq.request.handle
        raw = logits
        if request.constraint is not None:  # logprobs stay the model's, the sample follows the grammar
            raw = logits.copy() if request.logprobs is not None else logits
            request.constraint.apply(logits)
        history = request.prompt + seq.generated if request.params.repetition_penalty != 1.0 else ()
        token = sample(logits, request.params, seq.rng, history, seq.generated)
        if token in request.stop_ids:
            return self._end(seq, "stop")
        if request.constraint is not None:
            request.constraint.consume(token)
        event = TokenEvent(token, *token_logprobs(raw, token, request.logprobs)) if request.logprobs is not None else TokenEvent(token)
        seq.generated.append(token)
        seq.last = token
        if seq.lookup is not None:
            seq.lookup.extend((token,))
        self.stats.generated_tokens += 1
        handle.generated += 1
        now = time.perf_counter()
        if handle.first_token_at is None:
            handle.first_token_at = now
            self.stats.ttft_sum += handle.first_token_at - handle.submitted
            self.stats.ttft_count += 1
        else:
            self.stats.note_gap(now - handle.last_token_at)
        handle.last_token_at = now
        handle.deliver(event)
        if request.constraint is not None and request.constraint.finished:
            return self._end(seq, "stop")
        if len(seq.generated) >= request.max_tokens:
            return self._end(seq, "length")
        if seq.cache.length >= seq.cache.ctx:
            return self._end(seq, "context")
        return True

    def _end_embedding(self, seq: _Sequence) -> None:
        mean = seq.normed.astype(np.float64).mean(axis=0)
        self.pool.release(seq.slot)
        self.stats.embeddings += 1
        self.stats.finished += 1
        seq.request.handle.deliver((mean / max(np.linalg.norm(mean), 1e-12)).astype(np.float32))
        seq.request.handle.finish("stop")

    def _drop_if_cancelled(self, seq: _Sequence) -> bool:
        if seq.request.handle.cancelled:
            self._end(seq, "cancelled")
            return True
        return False

    def _end(self, seq: _Sequence, reason: str) -> bool:
        if not seq.prefilling and not seq.request.embedding:  # the next turn of a chat resends it
            self.prefix.store(seq.request.prompt + seq.generated, seq.cache, seq.request.prefix_root)
        self.pool.release(seq.slot)
        if reason == "cancelled":
            self.stats.cancelled += 1
        else:
            self.stats.finished += 1
            self.stats.latency_sum += time.perf_counter() - seq.request.handle.submitted
            self.stats.latency_count += 1
        seq.request.handle.finish(reason)
        return False

    def _fail(self, seq: _Sequence, error: Exception) -> None:
        self.pool.release(seq.slot)
        self.stats.errors += 1
        seq.request.handle.deliver(error)


def token_logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, tuple]:
    """The token's log-probability (float64 log-softmax) and the `top` likeliest tokens with theirs,
    by value, ties by index. Picked one argmax at a time: at 49,152 tokens, np.argpartition took
    0.8 ms a row, most of a scored prompt row's cost; an argmax takes 0.01 ms."""
    x = logits.astype(np.float64)
    x -= x.max()
    log_probs = x - np.log(np.exp(x).sum())
    picked: list[int] = []
    for _ in range(min(top, x.size)):  # x is scratch from here
        i = int(np.argmax(x))
        if x[i] == -np.inf:  # the rest are all -inf: the lowest indices not picked
            picked += [int(j) for j in np.flatnonzero(log_probs == -np.inf)[: top - len(picked)]]
            break
        picked.append(i)
        x[i] = -np.inf
    return float(log_probs[token]), tuple((i, float(log_probs[i])) for i in picked)
