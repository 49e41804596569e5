"""Ollama's API on the same port, for the clients written for it (Open WebUI, editor plugins, the
`ollama` Python and JavaScript libraries): /api/chat, /api/generate, /api/embed (and the older
/api/embeddings), /api/tags, /api/show, /api/ps, /api/pull, /api/version.

Each generating request is translated into the OpenAI request it means and run by that model's
own app in this process (minillm.serving.models), so tools, `format` (JSON or a schema), `think`
and sampling behave exactly as on /v1/chat/completions; its events are translated back into
Ollama's NDJSON lines (or one object with `stream: false`). `keep_alive` sets how long the model
stays loaded after the request (0: unload now). Errors are Ollama's: {"error": "..."} with its
status codes (a model not served: 404). The fields' meaning: minillm.serving.ollama_protocol.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import queue
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from ..errors import MiniLLMError
from .models import ModelEntry, ModelSet, ModelUnavailable, files_size
from .ollama_protocol import (NDJSON, VERSION, OllamaError, Reply, chat_messages, details, error_response, family, keep_alive_seconds,
                              now_iso, response_format, sampling)

async def call_app(app, path: str, payload: dict, host: str) -> tuple[int, AsyncIterator[bytes]]:
    """POST `payload` to an ASGI app in this process: its status, and its body as it comes."""
    body = json.dumps(payload).encode()
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "scheme": "http", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
             "headers": [(b"host", host.encode("latin-1")), (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    messages: asyncio.Queue = asyncio.Queue()
    given = asyncio.Event()

    async def receive():
        if not given.is_set():
            given.set()
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # never: the caller cancels the task when its client goes

    async def send(message):
        await messages.put(message)

    task = asyncio.create_task(app(scope, receive, send))
    task.add_done_callback(lambda t: messages.put_nowait({"type": "ended", "error": None if t.cancelled() else t.exception()}))
    start = await messages.get()
    if start["type"] == "ended":
        raise OllamaError(500, f"the model's app ended without answering: {start['error']}")

    async def chunks():
        try:
            while True:
                message = await messages.get()
                if message["type"] == "ended":
                    return
                if message["type"] == "http.response.body":
                    yield message.get("body", b"")
                    if not message.get("more_body", False):
                        return
        finally:
            task.cancel()

    return start["status"], chunks()


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict]:
    """The JSON events of a server-sent event stream."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        while b"\n\n" in pending:
            block, pending = pending.split(b"\n\n", 1)
            for line in block.decode("utf-8").splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[6:])


async def whole(chunks: AsyncIterator[bytes]) -> bytes:
    return b"".join([c async for c in chunks])


def error_message(status: int, raw: bytes) -> str:
    try:
        error = json.loads(raw).get("error")
        return error.get("message") if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        return raw.decode("utf-8", "replace") or f"HTTP {status}"


def size_on_disk(entry: ModelEntry) -> int:
    return files_size(entry.llm.source if entry.llm is not None else entry.options.model)


def digest(entry: ModelEntry, size: int) -> str:
    """A stable id of what the name serves (its source and size on disk; not a hash of the weights' bytes)."""
    return hashlib.sha256(f"{entry.options.model}|{size}".encode()).hexdigest()


class OllamaAPI:
    """The /api/* endpoints over a ModelSet."""

    def __init__(self, models: ModelSet, options):
        self.models, self.options = models, options

    def entry_for(self, body: dict) -> ModelEntry:
        name = body.get("model") or body.get("name")
        if not isinstance(name, str) or not name:
            raise OllamaError(400, "model is required")
        entry = self.models.find(name)
        if entry is None:
            raise OllamaError(404, f"model '{name}' not found")
        return entry

    # ------------------------------------------------------------------ what is served

    def tags(self) -> dict:
        listed = []
        for e in self.models.entries.values():
            size = size_on_disk(e)  # a directory's files are walked once
            listed.append({"name": e.name, "model": e.name, "modified_at": now_iso(), "size": size, "digest": digest(e, size), "details": details(e)})
        return {"models": listed}

    def ps(self) -> dict:
        running = []
        for e in self.models.entries.values():
            if e.llm is None:
                continue
            keep = e.idle_seconds(self.models.idle_unload)
            expires = (datetime.now(timezone.utc) + timedelta(seconds=keep - (time.monotonic() - e.last_used)) if keep is not None
                       else datetime(2318, 1, 1, tzinfo=timezone.utc))
            running.append({"name": e.name, "model": e.name, "size": int(e.llm.model.weights.nbytes), "digest": digest(e, size_on_disk(e)), "details": details(e),
                            "expires_at": expires.isoformat().replace("+00:00", "Z"), "size_vram": 0, "context_length": e.llm.model.ctx})
        return {"models": running}

    async def show(self, request: Request, body: dict) -> dict:
        """What Ollama's `show` says of a model (it is loaded to say it)."""
        entry = self.entry_for(body)
        await self.models.use_start(entry)
        try:
            llm, reasoning = entry.llm, entry.app.state.service.reasoning is not None
            config, arch = llm.model.config, family(llm.model.config)
            stops = [llm.tokenizer.decode([i], skip_special_tokens=False) for i in llm.eos_ids]
            return {
                "modelfile": f"FROM {llm.source}\n",
                "parameters": "\n".join(f'stop "{s}"' for s in stops),
                "template": llm.tokenizer.chat_template or "",
                "details": details(entry),
                "model_info": {"general.architecture": arch, f"{arch}.context_length": llm.model.ctx,
                               f"{arch}.embedding_length": config.hidden_size, f"{arch}.block_count": config.num_hidden_layers,
                               f"{arch}.attention.head_count": config.num_attention_heads, "general.basename": entry.name},
                "capabilities": ["completion", "tools", "embedding"] + (["thinking"] if reasoning else []),
                "modified_at": now_iso(),
            }
        finally:
            await self.models.use_end(entry)

    # ------------------------------------------------------------------ generating

    async def chat(self, request: Request, body: dict):
        entry = self.entry_for(body)
        payload = {"model": entry.name, "messages": chat_messages(body.get("messages") or []), **sampling(body.get("options")),
                   "stream": True, "stream_options": {"include_usage": True}}
        if body.get("tools"):
            payload["tools"] = body["tools"]
        return await self.reply(request, body, entry, "/v1/chat/completions", payload, chat=True)

    async def generate(self, request: Request, body: dict):
        entry = self.entry_for(body)
        for name, why in (("images", "minillm runs text models"), ("context", "Ollama's deprecated token state; send the conversation to /api/chat"),
                          ("template", "minillm renders the model's own chat template (or use raw)")):
            if body.get(name):
                raise OllamaError(400, f"{name} is not supported: {why}")
        prompt = body.get("prompt")
        if not prompt and not body.get("suffix"):  # Ollama's way to load, or with keep_alive 0 to unload
            return await self.load_or_unload(body, entry)
        if not isinstance(prompt, str):
            raise OllamaError(400, "prompt must be a string")
        stream = {"stream": True, "stream_options": {"include_usage": True}}
        if body.get("raw") or body.get("suffix") is not None:  # the text as it is: a completion
            payload = {"model": entry.name, "prompt": prompt, "max_tokens": None, **sampling(body.get("options")), **stream}
            if body.get("suffix") is not None:
                payload["suffix"] = body["suffix"]
            return await self.reply(request, body, entry, "/v1/completions", payload, chat=False)
        messages = ([{"role": "system", "content": body["system"]}] if body.get("system") else []) + [{"role": "user", "content": prompt}]
        payload = {"model": entry.name, "messages": messages, **sampling(body.get("options")), **stream}
        return await self.reply(request, body, entry, "/v1/chat/completions", payload, chat=False)

    async def load_or_unload(self, body: dict, entry: ModelEntry) -> dict:
        keep = keep_alive_seconds(body.get("keep_alive"))
        if keep == 0:
            async with entry.lock:
                await self.models.unload(entry)
        else:
            entry.keep_alive = keep
            await self.models.use_start(entry)
            await self.models.use_end(entry)
        return {"model": entry.name, "created_at": now_iso(), "response": "", "done": True, "done_reason": "unload" if keep == 0 else "load"}

    async def reply(self, request: Request, body: dict, entry: ModelEntry, path: str, payload: dict, chat: bool):
        """Run `payload` on the model's own endpoint at `path`; Ollama's lines (or one object) back."""
        fmt = response_format(body.get("format"))
        if fmt:
            payload["response_format"] = fmt
        keep, think = keep_alive_seconds(body.get("keep_alive")), body.get("think")
        run = Run(entry, chat, show_thinking=think is not False, wanted_text=path.endswith("/v1/completions"))
        await self.models.use_start(entry)
        entry.keep_alive = keep
        try:
            if path.endswith("chat/completions"):
                self.apply_think(think, entry, payload)
            run.loaded()
            status, chunks = await call_app(entry.app, path, payload, request.headers.get("host", "localhost"))
            if status != 200:
                raise OllamaError(status, error_message(status, await whole(chunks)))
        except BaseException:
            await self.models.use_end(entry)
            raise
        if body.get("stream", True) is False:
            try:
                return await run.whole(chunks)
            finally:
                await self.models.use_end(entry)

        async def lines():
            try:
                async for line in run.lines(chunks):
                    yield line
            finally:
                await self.models.use_end(entry)

        return StreamingResponse(lines(), media_type=NDJSON)

    @staticmethod
    def apply_think(think, entry: ModelEntry, payload: dict) -> None:
        """Ollama's `think` as the chat request's reasoning_effort."""
        if think is None:
            return
        reasoning = entry.app.state.service.reasoning is not None
        if think is False:
            if reasoning:
                payload["reasoning_effort"] = "none"
        elif not reasoning:
            raise OllamaError(400, f"\"{entry.name}\" does not support thinking")
        elif think is not True:
            if think not in ("low", "medium", "high"):
                raise OllamaError(400, "think must be true, false, \"low\", \"medium\" or \"high\"")
            payload["reasoning_effort"] = think

    # ------------------------------------------------------------------ embeddings and pulls

    async def embed(self, request: Request, body: dict) -> dict:
        entry = self.entry_for(body)
        texts = body.get("input")
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
            raise OllamaError(400, "input must be a non-empty string or list of strings")
        started = time.monotonic()
        vectors, usage, load_ns = await self.embeddings(request, body, entry, texts)
        unit = [[x / norm for x in v] if (norm := math.sqrt(sum(x * x for x in v))) > 0 else v for v in vectors]
        return {"model": entry.name, "embeddings": unit, "total_duration": int((time.monotonic() - started) * 1e9), "load_duration": load_ns,
                "prompt_eval_count": usage.get("prompt_tokens", 0)}

    async def embeddings(self, request: Request, body: dict, entry: ModelEntry, texts: list[str]):
        """(vectors as /v1/embeddings gives them, its usage, load time in ns)."""
        started, loaded_before = time.monotonic(), entry.loaded
        keep = keep_alive_seconds(body.get("keep_alive"))
        await self.models.use_start(entry)
        entry.keep_alive = keep
        try:
            load_ns = 0 if loaded_before else int((time.monotonic() - started) * 1e9)
            payload = {"model": entry.name, "input": texts}
            if body.get("dimensions") is not None:
                payload["dimensions"] = body["dimensions"]
            status, chunks = await call_app(entry.app, "/v1/embeddings", payload, request.headers.get("host", "localhost"))
            raw = await whole(chunks)
            if status != 200:
                raise OllamaError(status, error_message(status, raw))
            result = json.loads(raw)
        finally:
            await self.models.use_end(entry)
        vectors = [item["embedding"] for item in sorted(result["data"], key=lambda d: d["index"])]
        return vectors, result.get("usage") or {}, load_ns

    async def pull(self, request: Request, body: dict):
        """A Hub name fetched into the cache (huggingface_hub's progress relayed as Ollama's lines),
        then served under that name."""
        from ..loading.hub import ModelName

        name = body.get("model") or body.get("name")
        if not isinstance(name, str) or ModelName.parse(name) is None:
            raise OllamaError(400, f"pull takes a Hugging Face Hub name (ORG/NAME or ORG/NAME:QUANT), not {name!r}")
        progress: queue.Queue = queue.Queue()
        task = asyncio.get_running_loop().run_in_executor(None, fetch, name, progress)

        async def lines():
            yield {"status": "pulling manifest"}
            while not task.done() or not progress.empty():
                try:
                    yield progress.get_nowait()
                except queue.Empty:
                    await asyncio.sleep(0.1)
            try:
                path = task.result()
            except MiniLLMError as e:
                yield {"error": str(e)}
                return
            self.models.add(name, name, self.options)
            for status in ("verifying sha256 digest", "writing manifest"):
                yield {"status": status}
            yield {"status": "success", "path": str(path)}

        if body.get("stream", True) is False:
            result = [item async for item in lines()]
            return error_response(500, result[-1]["error"]) if "error" in result[-1] else {"status": "success"}
        return StreamingResponse((json.dumps(item) + "\n" async for item in lines()), media_type=NDJSON)


def fetch(name: str, progress: queue.Queue) -> Path:
    """minillm.loading.hub.resolve, its transfers' progress put on `progress` as Ollama's lines."""
    from tqdm.auto import tqdm

    from ..loading import hub

    class Report(tqdm):  # huggingface_hub's progress bars, relayed
        def __init__(self, *args, **kwargs):
            self.file = (kwargs.get("desc") or name).rsplit("/", 1)[-1]  # huggingface_hub's description may be the URL
            self.size, self.reported = kwargs.get("total") or 0, kwargs.get("initial") or 0
            kwargs["disable"] = True  # a disabled tqdm keeps neither its description nor its total
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            self.reported += n or 0
            progress.put({"status": f"pulling {self.file}", "digest": self.file, "total": self.size, "completed": self.reported})

    return hub.resolve(name, progress=False, tqdm_class=Report)


class Run:
    """One generating request's reply, read from the OpenAI endpoint's events into Ollama's shape."""

    def __init__(self, entry: ModelEntry, chat: bool, show_thinking: bool, wanted_text: bool):
        self.entry, self.chat, self.show_thinking = entry, chat, show_thinking
        self.key = "text" if wanted_text else "delta"
        self.started, self.loaded_before, self.load_ns = time.monotonic(), entry.loaded, 0
        self.reply = Reply()

    def loaded(self) -> None:
        if not self.loaded_before:
            self.load_ns = int((time.monotonic() - self.started) * 1e9)

    def line(self, text: str, thinking: str, done: bool = False) -> dict:
        out = {"model": self.entry.name, "created_at": now_iso()}
        shown = thinking if self.show_thinking else ""
        if self.chat:
            out["message"] = {"role": "assistant", "content": text, **({"thinking": shown} if shown else {})}
        else:
            out.update(response=text, **({"thinking": shown} if shown else {}))
        out["done"] = done
        return out

    def final(self, text: str = "", thinking: str = "") -> dict:
        reply, end = self.reply, time.monotonic()
        first, usage = reply.first_token_at or end, reply.usage or {}
        out = self.line(text, thinking, done=True)
        if self.chat and reply.calls:
            out["message"]["tool_calls"] = reply.tool_calls()
        out.update(done_reason=reply.done_reason, total_duration=int((end - self.started) * 1e9), load_duration=self.load_ns,
                   prompt_eval_count=usage.get("prompt_tokens", 0), prompt_eval_duration=max(int((first - self.started) * 1e9) - self.load_ns, 0),
                   eval_count=usage.get("completion_tokens", 0), eval_duration=int((end - first) * 1e9))
        return out

    async def lines(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
        async for event in sse_events(chunks):
            text, thinking = self.reply.read(event, self.key)
            if self.reply.error:
                yield json.dumps({"error": self.reply.error}) + "\n"
                return
            if text or (thinking and self.show_thinking):
                yield json.dumps(self.line(text, thinking)) + "\n"
        yield json.dumps(self.final()) + "\n"

    async def whole(self, chunks: AsyncIterator[bytes]):
        async for event in sse_events(chunks):
            self.reply.read(event, self.key)
        if self.reply.error:
            return error_response(500, self.reply.error)
        return self.final("".join(self.reply.content), "".join(self.reply.thinking))


def add_ollama_routes(app: FastAPI, models: ModelSet, options) -> None:
    """The /api/* routes on the router's own app."""
    api = OllamaAPI(models, options)

    async def json_body(request: Request) -> dict:
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError as e:
            raise OllamaError(400, f"invalid JSON: {e}") from None
        if not isinstance(body, dict):
            raise OllamaError(400, "the body must be a JSON object")
        return body

    @app.exception_handler(OllamaError)
    @app.exception_handler(ModelUnavailable)
    async def refused(request: Request, error):
        return error_response(error.status, str(error))

    app.get("/api/version")(lambda: {"version": VERSION})
    app.get("/api/tags")(api.tags)
    app.get("/api/ps")(api.ps)
    for path, method in (("/api/show", api.show), ("/api/embed", api.embed), ("/api/pull", api.pull), ("/api/chat", api.chat),
                         ("/api/generate", api.generate)):
        app.post(path)(_with_body(method, json_body))

    @app.post("/api/embeddings")
    async def embeddings_legacy(request: Request):
        body = await json_body(request)
        entry = api.entry_for(body)
        if not isinstance(body.get("prompt"), str) or not body["prompt"]:
            raise OllamaError(400, "prompt must be a non-empty string")
        vectors, _, _ = await api.embeddings(request, body, entry, [body["prompt"]])
        return {"embedding": vectors[0]}


def _with_body(method, json_body):
    """A route calling `method` with the request and its JSON body."""
    async def route(request: Request):
        return await method(request, await json_body(request))

    return route
