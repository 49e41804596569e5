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
from typing import Callable, Sequence

import numpy as np

from .cache import KVPool
from .errors import GenerationError, MiniLLMError
from .model import Model
from .sampling import SamplingParams, sample


class QueueFullError(GenerationError):
    """The engine's queue is at its limit; try again later."""


@dataclass(frozen=True)
class TokenEvent:
    token: int
    logprob: float | None = None  # log-probability under the model's distribution
    top_logprobs: tuple[tuple[int, float], ...] = ()


_END = object()


class RequestHandle:
    """The caller's side of a request: iterate for TokenEvents; `finish_reason` once done
    ("stop": end-of-sequence token, "length": max_tokens, "context": the context is full,
    "cancelled"). An error in the engine is raised from the iteration."""

    def __init__(self, sink: Callable | None = None):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._sink = sink or self._queue.put
        self._cancelled = threading.Event()
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.generated = 0
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None

    def __iter__(self):
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def ids(self):
        for event in self:
            yield event.token

    def cancel(self) -> None:
        """Stop generating; the engine frees the sequence's slot before its next step."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    # engine side
    def _emit(self, item) -> None:
        self._sink(item)

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self._sink(_END)


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop_ids: frozenset
    logprobs: int | None
    handle: RequestHandle


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
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_sum: float = 0.0
    ttft_count: int = 0
    latency_sum: float = 0.0
    latency_count: int = 0
    steps: int = 0
    batch_tokens: int = 0  # sum of batch sizes over steps


class Engine:
    def __init__(self, model: Model, max_batch: int = 8, max_queue: int = 64):
        if max_batch < 1 or max_queue < 0:
            raise GenerationError("max_batch must be >= 1 and max_queue >= 0")
        self.model, self.max_batch, self.max_queue = model, max_batch, max_queue
        self.pool = KVPool(model.config, model.ctx, max_batch)
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
        max_tokens: int,
        stop_ids: Sequence[int] = (),
        logprobs: int | None = None,
        sink: Callable | None = None,
    ) -> RequestHandle:
        """Queue a request; returns its handle at once. Raises if it can never fit or the queue is full."""
        prompt = list(prompt)
        if not prompt:
            raise GenerationError("the prompt is empty")
        if max_tokens < 1:
            raise GenerationError(f"max_tokens must be >= 1, got {max_tokens}")
        if len(prompt) > self.model.ctx:  # generation past the context end stops with "context"
            raise GenerationError(f"the prompt has {len(prompt)} tokens, more than the context size {self.model.ctx}")
        handle = RequestHandle(sink)
        handle.prompt_tokens = len(prompt)
        request = _Request(prompt, params, max_tokens, frozenset(stop_ids), logprobs, handle)
        with self._cond:
            if len(self._pending) >= self.max_queue:
                self.stats.rejected += 1
                raise QueueFullError(f"the queue is full ({self.max_queue} waiting requests)")
            self._pending.append(request)
            self.stats.requests += 1
            self._cond.notify()
        return handle

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def batch_size(self) -> int:
        return len(self._active)

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
            handle._finish("cancelled")
            return
        slot, cache = self.pool.acquire()
        seq = _Sequence(request, slot, cache, np.random.default_rng(request.params.seed))
        try:
            logits = self.model.forward(request.prompt, cache)
            self.stats.prompt_tokens += len(request.prompt)
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
            try:
                if self._advance(s, row):
                    keep.append(s)
            except MiniLLMError as e:
                self._fail(s, e)
        self._active = keep

    def _advance(self, seq: _Sequence, logits: np.ndarray) -> bool:
        """Sample the next token from `logits`, emit it; False when the sequence is done."""
        request, handle = seq.request, seq.request.handle
        history = request.prompt + seq.generated if request.params.repetition_penalty != 1.0 else ()
        token = sample(logits, request.params, seq.rng, history, seq.generated)
        if token in request.stop_ids:
            return self._end(seq, "stop")
        event = TokenEvent(token, *_logprobs(logits, token, request.logprobs)) if request.logprobs is not None else TokenEvent(token)
        seq.generated.append(token)
        seq.last = token
        self.stats.generated_tokens += 1
        handle.generated += 1
        if handle.first_token_at is None:
            handle.first_token_at = time.perf_counter()
            self.stats.ttft_sum += handle.first_token_at - handle.submitted
            self.stats.ttft_count += 1
        handle._emit(event)
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
        self.pool.release(seq.slot)
        self.stats.finished += 1
        self.stats.latency_sum += time.perf_counter() - seq.request.handle.submitted
        self.stats.latency_count += 1
        seq.request.handle._finish(reason)
        return False

    def _fail(self, seq: _Sequence, error: Exception) -> None:
        self.pool.release(seq.slot)
        self.stats.errors += 1
        seq.request.handle._emit(error)


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

