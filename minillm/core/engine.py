"""The engine loop: continuous batching of generation requests on one thread.

Callers on any thread `submit` requests; one engine thread owns the model. Between decode steps it
admits queued requests (prefilling each into a free cache slot), then runs one batched decode step
for every active sequence, the weights read once for all of them; finished or cancelled sequences
leave and free their slot. Only the engine thread enters Numba's parallel regions, which must never
be entered from two Python threads at once.

Each request keeps its own sampling settings and random generator, and batched decode is
bit-identical per sequence, so a greedy or seeded request gives the same tokens whatever else runs.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Iterator, Sequence

import numpy as np

from ..errors import ContextLengthError, GenerationError, MiniLLMError
from ..options import DEFAULTS, Options
from .cache import KVPool
from .model import Model
from .prefix_cache import PrefixCache, default_budget_mb
from .sampling import SamplingParams, sample
from .structured import Constraint

if TYPE_CHECKING:  # asyncio and its ssl cost ~7 MB; only the server's handles use it
    import asyncio


class QueueFullError(GenerationError):
    """The engine's queue is at its limit; try again later."""


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
        self.generated = 0
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None

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


@dataclass
class _Sequence:
    request: _Request
    slot: int
    cache: object
    rng: np.random.Generator
    generated: list[int] = field(default_factory=list)
    last: int = 0


@dataclass
class EngineStats:
    requests: int = 0
    finished: int = 0
    errors: int = 0
    rejected: int = 0
    prompt_tokens: int = 0  # prefilled (computed)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache instead
    generated_tokens: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    latency_sum: float = 0.0
    latency_count: int = 0
    steps: int = 0
    batch_tokens: int = 0  # sum of batch sizes over steps


class Engine:
    """options: max_batch (sequences decoded together), max_queue (requests allowed to wait) and
    cache_mb (the prefix cache's budget, minillm.core.prefix_cache; None: a default from free memory,
    0: no prefix cache) of minillm.options.Options."""

    def __init__(self, model: Model, options: Options = DEFAULTS):
        max_batch, max_queue, cache_mb = options.max_batch, options.max_queue, options.cache_mb
        self.model, self.max_batch, self.max_queue = model, max_batch, max_queue
        self.pool = KVPool(model.config, model.ctx, max_batch)
        self.prefix = PrefixCache(model.config, default_budget_mb() if cache_mb is None else cache_mb)
        self.stats = EngineStats()
        self._pending: deque[_Request] = deque()
        self._active: list[_Sequence] = []
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
    ) -> RequestHandle:
        """Queue a request; returns its handle at once (deliver its events to `loop` for an
        asyncio reader). The prompt is checked here (check_prompt): with `fit_max_tokens` the
        prompt plus max_tokens must fit the context, as OpenAI's API asks; otherwise generation
        that fills the context stops with "context". max_tokens None: until the context is full.
        constraint: a grammar the generated text must follow (minillm.core.structured).
        Raises QueueFullError when the queue is full."""
        prompt = list(prompt)
        ctx = self.model.ctx
        check_prompt(prompt, self.model.config.vocab_size, ctx, max_tokens if fit_max_tokens else None)
        if max_tokens is None:
            max_tokens = max(1, ctx - len(prompt))
        if max_tokens < 1:
            raise GenerationError(f"max_tokens must be >= 1, got {max_tokens}")
        handle = RequestHandle(loop)
        handle.prompt_tokens = len(prompt)
        request = _Request(prompt, params, max_tokens, frozenset(stop_ids), logprobs, handle, constraint)
        with self._cond:
            if len(self._pending) >= self.max_queue:
                self.stats.rejected += 1
                raise QueueFullError(f"the queue is full ({self.max_queue} waiting requests)")
            self._pending.append(request)
            self.stats.requests += 1
            self._cond.notify()
        return handle

    @property
    def alive(self) -> bool:
        """The engine thread is running (it survives request errors; this is for health checks)."""
        return self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def batch_size(self) -> int:
        return len(self._active)

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of the batch slots' KV positions the running sequences hold."""
        return sum(s.cache.length for s in list(self._active)) / (self.max_batch * self.model.ctx)

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        while True:
            try:
                self._iteration()
            except Exception as e:  # a bug must not leave callers waiting forever
                error = GenerationError(f"internal engine error: {type(e).__name__}: {e}")
                for seq in self._active:
                    self._fail(seq, error)
                self._active = []

    def _iteration(self) -> None:
        """Admit waiting requests into free slots, drop cancelled ones, run one decode step."""
        with self._cond:
            while not self._pending and not self._active:
                self._cond.wait()
            admitted = []
            while self._pending and len(self._active) + len(admitted) < self.max_batch:
                admitted.append(self._pending.popleft())
        for request in admitted:
            self._start(request)
        self._active = [s for s in self._active if not self._drop_if_cancelled(s)]
        if self._active:
            self._step()

    def _start(self, request: _Request) -> None:
        """Prefill a new request into a free slot and emit its first token."""
        handle = request.handle
        if handle.cancelled:
            handle.finish("cancelled")
            return
        slot, cache = self.pool.acquire()
        seq = _Sequence(request, slot, cache, np.random.default_rng(request.params.seed))
        try:
            cached = self.prefix.load(request.prompt, cache)
            handle.cached_tokens = cached
            logits = self.model.forward(request.prompt[cached:], cache)
            self.prefix.store(request.prompt, cache)  # for requests that share this prompt, even now
            self.model.release_outside_windows(cache)
            self.stats.prompt_tokens += len(request.prompt) - cached
            self.stats.cached_tokens += cached
            if self._advance(seq, logits):
                self._active.append(seq)
        except MiniLLMError as e:
            self._fail(seq, e)
        except Exception as e:  # a bug: fail this request, keep serving the others
            self._fail(seq, GenerationError(f"internal engine error: {type(e).__name__}: {e}"))

    def _step(self) -> None:
        """One batched decode step for every active sequence."""
        active = self._active
        try:
            logits = self.model.decode_batch(
                [s.last for s in active], [s.cache for s in active], [s.slot for s in active], self.pool
            )
        except MiniLLMError as e:
            for s in active:
                self._fail(s, e)
            self._active = []
            return
        self.stats.steps += 1
        self.stats.batch_tokens += len(active)
        keep = []
        for s, row in zip(active, logits):
            self.model.release_outside_windows(s.cache)
            try:
                if self._advance(s, row):
                    keep.append(s)
            except MiniLLMError as e:
                self._fail(s, e)
        self._active = keep

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
        event = TokenEvent(token, *_logprobs(raw, token, request.logprobs)) if request.logprobs is not None else TokenEvent(token)
        seq.generated.append(token)
        seq.last = token
        self.stats.generated_tokens += 1
        handle.generated += 1
        if handle.first_token_at is None:
            handle.first_token_at = time.perf_counter()
            self.stats.ttft_sum += handle.first_token_at - handle.submitted
            self.stats.ttft_count += 1
        handle.deliver(event)
        if request.constraint is not None and request.constraint.finished:
            return self._end(seq, "stop")
        if len(seq.generated) >= request.max_tokens:
            return self._end(seq, "length")
        if seq.cache.length >= seq.cache.ctx:
            return self._end(seq, "context")
        return True

    def _drop_if_cancelled(self, seq: _Sequence) -> bool:
        if seq.request.handle.cancelled:
            self._end(seq, "cancelled")
            return True
        return False

    def _end(self, seq: _Sequence, reason: str) -> bool:
        self.prefix.store(seq.request.prompt + seq.generated, seq.cache)  # the next turn of a chat resends it
        self.pool.release(seq.slot)
        self.stats.finished += 1
        self.stats.latency_sum += time.perf_counter() - seq.request.handle.submitted
        self.stats.latency_count += 1
        seq.request.handle.finish(reason)
        return False

    def _fail(self, seq: _Sequence, error: Exception) -> None:
        self.pool.release(seq.slot)
        self.stats.errors += 1
        seq.request.handle.deliver(error)


def _logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, tuple]:
    x = logits.astype(np.float64)
    x -= x.max()
    log_probs = x - np.log(np.exp(x).sum())
    best = ()
    if top > 0:
        idx = np.argpartition(-log_probs, top - 1)[:top]
        idx = idx[np.argsort(-log_probs[idx], kind="stable")]
        best = tuple((int(i), float(log_probs[i])) for i in idx)
    return float(log_probs[token]), best

