"""Many engine replicas behind one OpenAI endpoint, on Ray Serve (`pip install "minillm[cluster]"`).

    python cli.py serve --replicas 2 [--threads-per-replica 1] [--autoscale 1:4] [--ray-address ADDR]

Two deployments:
- `EngineReplica` (N of them, or autoscaled): one minillm engine each, in its own process with
  `num_cpus` = NUMBA_NUM_THREADS = --threads-per-replica, taking at most its batch slots at once
  (max_ongoing_requests). `generate` streams a request's tokens; Ray's health check asks whether
  the engine thread is alive.
- the ingress: minillm's own FastAPI app (minillm.serving.server), unchanged, over a RemoteLLM that
  tokenizes, renders chat templates and checks prompts locally and sends token ids to a replica.
  So every endpoint, error shape, stream and the API key behave as the single server's.

Routing (minillm.serving.cluster_router, a Ray Serve RequestRouter running in the ingress): a request goes
to the replica that rendezvous hashing assigns to its first prompt tokens, so a chat's turns and
the chats sharing a system prompt meet the same replica's prefix cache; when that replica's slots
are all taken, to the least loaded other one. /metrics counts both.

A replica that dies mid-stream ends its streams with an error event (SSE) or a 500; Ray starts a
new one, and new requests go to the live ones meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading
import uuid
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

from ..core.engine import INTER_TOKEN_BUCKETS, QueueFullError, RequestHandle, TokenEvent, check_prompt
from ..core.reasoning import ThinkingControl
from ..errors import GenerationError, MiniLLMError, UsageError
from ..options import Options

APP_NAME = "minillm"
EXTRA = 'pip install "minillm[cluster]"'


def require_ray():
    """ray.serve, or a one-line error naming the extra."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise UsageError(f"--replicas needs Ray Serve: {EXTRA}") from None
    return ray, serve


# ------------------------------------------------------------------ the replica


class EngineReplica:
    """One engine (the body of the Ray Serve deployment; see build_app)."""

    def __init__(self, options: Options):
        import minillm

        self.llm = minillm.load(progress=False, options=options)
        self.llm.engine  # noqa: B018 - starts the engine thread now, not on the first request
        self.replica = _replica_id()

    async def generate(self, spec: dict):
        """A request's stream: ("start", replica, pid), ("event", token, logprob, top_logprobs)..., then
        ("end", finish_reason, cached_tokens, stats, (proposed, accepted)) or ("error", kind, message,
        param); a scored prompt's ("prompt", [(token, logprob, top_logprobs), ...]) before its first
        event or end."""
        yield ("start", self.replica, os.getpid())
        llm = self.llm
        try:
            constraint = llm.grammars.compile(spec["grammar"], "grammar") if spec.get("grammar") else None
            if spec.get("thinking"):  # a reasoning reply's budget and answer-only grammar (minillm.core.reasoning)
                constraint = ThinkingControl(llm.tokenizer, llm.reasoning, spec["prompt"], spec["thinking"]["budget"], constraint)
            handle = llm.engine.submit(
                spec["prompt"], spec["params"], spec["max_tokens"], spec["stop_ids"], spec["logprobs"],
                loop=asyncio.get_running_loop(), fit_max_tokens=spec["fit_max_tokens"], constraint=constraint,
                prompt_logprobs=spec.get("prompt_logprobs"), prediction=spec.get("prediction") or (),
            )
            scored = False  # a scored prompt's events go first (the engine sets them before any other)
            async for event in handle.events():
                if not scored and handle.prompt_logprobs is not None:
                    scored = True
                    yield _prompt_item(handle)
                yield ("event", event.token, event.logprob, event.top_logprobs)
            if not scored and handle.prompt_logprobs is not None:  # max_tokens 0: scored only
                yield _prompt_item(handle)
            yield ("end", handle.finish_reason, handle.cached_tokens, self.stats(), (handle.proposed_tokens, handle.accepted_tokens))
        except MiniLLMError as e:
            yield ("error", type(e).__name__, str(e), getattr(e, "param", None))

    def embed(self, inputs: list) -> Any:
        return self.llm.embed(inputs)

    def stats(self) -> dict:
        engine = self.llm.engine
        return {**vars(engine.stats), "queue_depth": engine.queue_depth, "batch_size": engine.batch_size,
                "kv_cache_usage": engine.kv_cache_usage, "prefix_queries": engine.prefix.queries,
                "prefix_hits": engine.prefix.hits, "prefix_blocks": engine.prefix.blocks_used}

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died is restarted."""
        if not self.llm.engine.alive:
            raise RuntimeError("the engine thread is not running")


def _prompt_item(handle) -> tuple:
    return ("prompt", [(e.token, e.logprob, e.top_logprobs) for e in handle.prompt_logprobs])


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a replica (tests)
        return "local"


# ------------------------------------------------------------------ the ingress's view of the replicas


class _RemoteHandle(RequestHandle):
    """A RequestHandle fed by a replica's stream; cancelling it cancels the stream, which
    cancels the request on the replica (its engine frees the slot)."""

    task: asyncio.Task | None = None

    def cancel(self) -> None:
        super().cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()


class RemoteEngine:
    """What minillm.serving.server reads of an Engine, over the replicas: submit, and counters summed
    from each replica's latest report (sent at the end of each of its requests)."""

    def __init__(self, handle, vocab_size: int, ctx: int, capacity: int):
        self.handle, self.vocab_size, self.ctx, self.capacity = handle, vocab_size, ctx, capacity
        self.in_flight = 0
        self.running: dict[str, int] = defaultdict(int)  # requests streaming, by replica
        self.reports: dict[str, dict] = {}
        self.pids: dict[str, int] = {}  # each replica's process, as it last reported
        # where requests went: the replica their prefix maps to (cluster_router), or another
        self.routing = {"affinity": 0, "fallback": 0, "by_replica": defaultdict(int)}
        self.replica_errors = 0

    def submit(self, prompt, params, max_tokens=None, stop_ids=(), logprobs=None, loop=None, fit_max_tokens=False, constraint=None,
               prompt_logprobs=None, prediction=()):
        prompt = [int(t) for t in prompt]
        check_prompt(prompt, self.vocab_size, self.ctx, max_tokens if fit_max_tokens else None)
        if max_tokens is None:
            max_tokens = max(1, self.ctx - len(prompt))
        if self.in_flight >= self.capacity:  # every replica's slots and the waiting room are taken
            raise QueueFullError(f"the queue is full ({self.capacity} requests running or waiting)")
        handle = _RemoteHandle(loop)
        handle.prompt_tokens = len(prompt)
        spec = {"prompt": prompt, "params": params, "max_tokens": max_tokens, "stop_ids": list(stop_ids), "logprobs": logprobs,
                "fit_max_tokens": fit_max_tokens, "grammar": constraint.grammar if constraint is not None else None,
                "thinking": {"budget": constraint.budget} if isinstance(constraint, ThinkingControl) else None,
                "prompt_logprobs": prompt_logprobs, "prediction": list(prediction)}
        self.in_flight += 1
        handle.task = asyncio.get_running_loop().create_task(self._relay(spec, handle))
        return handle

    async def _relay(self, spec: dict, handle: RequestHandle) -> None:
        _own_request_id()  # in this task's context only
        stream = self.handle.options(stream=True).generate.remote(spec)
        replica = None
        try:
            async for item in stream:
                kind = item[0]
                if kind == "start":
                    replica, self.pids[item[1]] = item[1], item[2]
                    self.running[replica] += 1
                    self._count_route(spec.get("preferred_replica"), replica)
                elif kind == "event":
                    handle.deliver(TokenEvent(*item[1:]))
                elif kind == "prompt":
                    handle.prompt_logprobs = [TokenEvent(*e) for e in item[1]]
                elif kind == "end":
                    handle.cached_tokens = item[2]
                    self.reports[replica] = item[3]
                    handle.proposed_tokens, handle.accepted_tokens = item[4]
                    handle.finish(item[1])
                else:
                    handle.deliver(_remote_error(item[1], item[2], item[3]))
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as e:  # the replica died or Ray failed: end this stream with an error
            self.replica_errors += 1
            handle.deliver(GenerationError(f"replica failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        finally:
            self.in_flight -= 1
            if replica is not None:
                self.running[replica] -= 1

    def _count_route(self, preferred: str | None, replica: str) -> None:
        self.routing["by_replica"][replica] += 1
        if preferred is not None:
            self.routing["affinity" if preferred == replica else "fallback"] += 1

    # the counters minillm.serving.server's /metrics reads, summed over the replicas' reports
    def _sum(self, key: str):
        return sum(r.get(key, 0) for r in self.reports.values())

    @property
    def stats(self):
        keys = ("requests", "finished", "errors", "rejected", "cancelled", "embeddings", "prompt_tokens", "cached_tokens",
                "generated_tokens", "ttft_sum", "ttft_count", "latency_sum", "latency_count", "steps", "batch_tokens",
                "prefill_steps", "inter_token_sum", "spec_draft_tokens", "spec_accepted_tokens")
        buckets = len(INTER_TOKEN_BUCKETS) + 1
        gaps = [sum(c) for c in zip(*(r.get("inter_token_counts", [0] * buckets) for r in self.reports.values()))]
        return SimpleNamespace(**{k: self._sum(k) for k in keys}, inter_token_counts=gaps or [0] * buckets)

    @property
    def queue_depth(self) -> int:
        return max(0, self.in_flight - sum(self.running.values()))

    @property
    def batch_size(self) -> int:
        return sum(self.running.values())

    @property
    def kv_cache_usage(self) -> float:
        return self._sum("kv_cache_usage") / max(1, len(self.reports))

    @property
    def prefix(self):
        return SimpleNamespace(queries=self._sum("prefix_queries"), hits=self._sum("prefix_hits"), blocks_used=self._sum("prefix_blocks"))

    def extra_metrics(self) -> str:
        """Prometheus lines for the routing and the replicas."""
        routing = self.routing
        lines = [
            "# HELP minillm_router_prefix_affinity_total Requests sent to the replica their prompt prefix maps to",
            "# TYPE minillm_router_prefix_affinity_total counter",
            f"minillm_router_prefix_affinity_total {routing['affinity']}",
            "# HELP minillm_router_fallback_total Requests sent elsewhere because that replica was full",
            "# TYPE minillm_router_fallback_total counter",
            f"minillm_router_fallback_total {routing['fallback']}",
            "# HELP minillm_router_requests_total Requests routed, by replica",
            "# TYPE minillm_router_requests_total counter",
        ]
        lines += [f'minillm_router_requests_total{{replica="{r}"}} {n}' for r, n in sorted(routing["by_replica"].items())]
        lines += ["# HELP minillm_replica_prefix_cache_hits_total Prompt tokens found in a replica's prefix cache",
                  "# TYPE minillm_replica_prefix_cache_hits_total counter"]
        lines += [f'minillm_replica_prefix_cache_hits_total{{replica="{r}"}} {s["prefix_hits"]}' for r, s in sorted(self.reports.items())]
        lines += ["# HELP minillm_replica_running Requests streaming from a replica now",
                  "# TYPE minillm_replica_running gauge"]
        lines += [f'minillm_replica_running{{replica="{r}",pid="{self.pids.get(r, 0)}"}} {n}' for r, n in sorted(self.running.items())]
        lines += ["# HELP minillm_replica_failures_total Streams ended because their replica failed",
                  "# TYPE minillm_replica_failures_total counter", f"minillm_replica_failures_total {self.replica_errors}"]
        return "\n".join(lines) + "\n"


def _own_request_id() -> None:
    """Give the engine call about to be made its own internal request id. Ray Serve passes the HTTP
    request's id down to every call made while serving it, and its router matches a routed call
    to its waiting request by that id: of n > 1 choices or several prompts (calls sharing one
    id), all but the first waited forever. (Ray's private request context; without it, as before.)"""
    try:
        from ray.serve import context
    except ImportError:
        return
    current = getattr(context, "_serve_request_context", None)
    if current is not None and dataclasses.is_dataclass(current.get()):
        current.set(dataclasses.replace(current.get(), _internal_request_id=uuid.uuid4().hex))


def _remote_error(kind: str, message: str, param) -> MiniLLMError:
    from .. import errors

    cls = getattr(errors, kind, None) or (QueueFullError if kind == "QueueFullError" else None)
    if not (isinstance(cls, type) and issubclass(cls, MiniLLMError)):
        cls = GenerationError
    try:
        error = cls(message)
    except TypeError:
        error = GenerationError(message)
    if param is not None:
        error.param = param
    return error


class RemoteLLM:
    """What minillm.serving.server reads of an LLM, in the ingress: the tokenizer, chat template, grammar
    compiler and prompt checks are local (the model's tokenizer files are read here); generating
    and embedding go to the replicas."""

    def __init__(self, options: Options, handle, replicas: int, deployment: str):
        from ..api import LLMFiles, tokenizer_files
        from ..loading.config import ModelConfig

        self.model_dir, config_file = tokenizer_files(options.model)
        cfg = ModelConfig.from_file(config_file)
        self.model = SimpleNamespace(config=cfg, ctx=cfg.context_size(options.ctx))
        self.engine = RemoteEngine(handle, cfg.vocab_size, self.model.ctx, replicas * options.max_batch + options.max_queue)
        self.handle, self.deployment = handle, deployment
        self.files = LLMFiles(self.model_dir, cfg, options.chat_template)  # each part read on first use

    @property
    def tokenizer(self):
        return self.files.tokenizer

    @property
    def eos_ids(self):
        return self.files.eos_ids

    @property
    def grammars(self):
        return self.files.grammars

    def check_prompt(self, ids) -> None:
        check_prompt(ids, self.model.config.vocab_size, self.model.ctx)

    def embed(self, inputs):
        return self.handle.embed.remote(list(inputs)).result()

    def health(self) -> dict:
        """Ray Serve's view of the engine replicas: running and target counts."""
        from ray import serve

        try:
            app = serve.status().applications[APP_NAME]
            state = app.deployments[self.deployment]
            counts = {str(k).split(".")[-1].lower(): v for k, v in state.replica_states.items()}
        except Exception as e:  # the controller is unreachable
            return {"status": f"unknown: {type(e).__name__}"}
        running = counts.get("running", 0)
        return {"status": "ok" if running else "no replica running", "replicas": {"running": running, **counts}}


# ------------------------------------------------------------------ building and running


def build_app(options: Options):
    """The Ray Serve application: options.ingress_replicas ingresses over options.replicas engine
    replicas (or autoscaled), each with options.threads CPUs (default 1). The ingress relays every
    token (about 2 ms of CPU each, docs/scaling.md), so a cluster of many machines wants about one
    per machine; each keeps its own --max-queue count and /metrics counters, and all route by the
    same prefix hash. options.shutdown_timeout: seconds a stopping replica lets its running
    requests finish (serve's --shutdown-timeout)."""
    ray, serve = require_ray()
    from ray.serve.config import RequestRouterConfig

    from .server import create_app

    threads = options.replica_threads
    scaling = {"num_replicas": options.replica_count}
    if options.autoscale is not None:
        # scale on ongoing requests: a replica is busy when its batch slots are
        low, high = options.autoscale
        scaling = {"autoscaling_config": {"min_replicas": low, "max_replicas": high, "target_ongoing_requests": max(1, options.max_batch // 2)}}
    engine = serve.deployment(
        EngineReplica, name="EngineReplica",
        ray_actor_options={"num_cpus": threads, "runtime_env": {"env_vars": {"NUMBA_NUM_THREADS": str(threads)}}},
        max_ongoing_requests=options.max_batch, health_check_period_s=5, health_check_timeout_s=30,
        graceful_shutdown_timeout_s=options.shutdown_timeout,
        request_router_config=RequestRouterConfig(request_router_class="minillm.serving.cluster_router:PrefixAffinityRouter"),
        **scaling,
    ).bind(options.replace(threads=threads))

    count = options.autoscale[1] if options.autoscale is not None else options.replica_count

    @serve.deployment(name="Ingress", num_replicas=options.ingress_replicas, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000,
                      graceful_shutdown_timeout_s=options.shutdown_timeout)
    @serve.ingress()
    class Ingress:
        """minillm's own FastAPI app, built in the ingress replica over the engine replicas."""

        def __init__(self, engine_handle):
            self.engine_handle = engine_handle

        def __serve_build_asgi_app__(self):
            app = create_app(None, options.served_name, options.api_key, options)
            app.state.service.attach(RemoteLLM(options, self.engine_handle, count, "EngineReplica"))
            return app

    return Ingress.bind(engine)


def run(options: Options, on_ready=None) -> None:
    """Start Ray (or join the cluster at options.ray_address), serve until SIGTERM or Ctrl-C, then
    stop the application, and the local Ray instance if this started one."""
    ray, serve = require_ray()
    started_ray = options.ray_address is None
    # NUMBA_NUM_THREADS is set per replica; this process does no model work.
    ray.init(address=options.ray_address, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             **({} if options.ray_address else {"num_cpus": os.cpu_count()}))
    try:
        serve.start(http_options={"host": options.host, "port": options.port})
        serve.run(build_app(options), name=APP_NAME, route_prefix="/")
        if on_ready is not None:
            on_ready()
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        try:
            serve.delete(APP_NAME)
            serve.shutdown()
        finally:
            if started_ray:
                ray.shutdown()


def deployment_app(args: dict):
    """An application builder for Ray's own tooling: `serve run minillm.serving.cluster:deployment_app
    model=/models/x.gguf replicas=4`, or a KubeRay RayService's serveConfigV2 (import_path, args).
    args: minillm.options.Options by name (model, model_name, api_key, replicas, threads (per
    replica), autoscale as "MIN:MAX", ingress_replicas, max_batch, max_queue, ctx, dtype, kv_dtype,
    cache_mb, check_weights, shutdown_timeout), as strings or values; any other name is an error
    that names it."""
    return build_app(Options.from_strings(args, where="minillm.serving.cluster:deployment_app"))
