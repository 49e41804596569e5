"""Several models behind one server: each is its own app (minillm.serving.server.create_app: its
LLM, engine thread and prefix cache), loaded on first use and unloaded when idle or when room is
needed; requests go to the one their `model` field names.

    serve --model smol=HuggingFaceTB/SmolLM2-135M-Instruct --model qwen=Qwen/Qwen3-0.6B-GGUF:Q8_0
    serve --models-dir ~/models          (each GGUF file or checkpoint directory in it is a model)

One model given plainly (`serve --model X`, or none: the bundled model) is served as it always
was: loaded at start (503 until then), every request its own whatever `model` it names. The
router in front of the apps answers /health, /v1/models and the Ollama API (minillm.serving.ollama)
itself and passes everything else on, body and stream untouched.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import MiniLLMError, UsageError
from ..options import Options
from .gate import refuse, too_large

if TYPE_CHECKING:
    from ..api import LLM

LOAD_WAIT_SECONDS = 120.0  # a request waits this long for a model to free room, then 503


class ModelUnavailable(Exception):
    """A model cannot take a request now: no room (503) or it failed to load (500)."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class ModelEntry:
    name: str  # what requests call it
    options: Options  # its Options (model: its path or Hub name)
    app: object | None = None  # its FastAPI app while loaded
    llm: "LLM | None" = None
    running: int = 0  # requests inside its app now
    last_used: float = field(default_factory=time.monotonic)
    keep_alive: float | None = None  # seconds idle before unloading (None: the server's --idle-unload)
    loaded_at: float = 0.0  # when its LLM was last loaded (time.time)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def loaded(self) -> bool:
        return self.llm is not None

    def attach(self, llm: "LLM") -> None:
        """Its LLM is loaded (its app serves it)."""
        self.llm, self.loaded_at, self.last_used = llm, time.time(), time.monotonic()

    def idle_seconds(self, default: float | None) -> float | None:
        """How long it may stay loaded while idle (None: for ever)."""
        keep = self.keep_alive if self.keep_alive is not None else default
        return None if keep is None or keep < 0 else keep


def model_entries(specs: list[str] | None, models_dir: str | None, options: Options) -> tuple[list[ModelEntry], bool]:
    """The served models from --model (repeatable, NAME=PATH_OR_REPO or a plain one) and
    --models-dir, and whether the server routes by name (False: one model served as always)."""
    specs = list(specs or [])
    routed = models_dir is not None or len(specs) > 1 or any("=" in s for s in specs)
    if not routed:
        plain = options.replace(model=specs[0] if specs else options.model)
        return [ModelEntry(plain.served_name, plain)], False
    entries: dict[str, ModelEntry] = {}

    def add(name: str, source: str) -> None:
        from ..loading.hub import names_a_model

        if not name or not source:
            raise UsageError(f"--model {name}={source}: give NAME=PATH_OR_REPO (both parts)")
        if not Path(source).expanduser().exists() and not names_a_model(source):
            raise UsageError(f"--model {name}={source}: no such file or directory, nor a Hub name (ORG/NAME)")
        if name in entries:
            raise UsageError(f"--model: the name {name!r} is given twice")
        entries[name] = ModelEntry(name, options.replace(model=source, model_name=name))

    for spec in specs:
        name, _, source = spec.partition("=") if "=" in spec else (None, "", spec)
        add(name if name is not None else options.replace(model=spec).served_name, source)
    if models_dir is not None:
        folder = Path(models_dir).expanduser()
        if not folder.is_dir():
            raise UsageError(f"--models-dir {models_dir}: not a directory")
        for path in sorted(folder.iterdir()):
            if path.suffix == ".gguf" and not path.name.lower().startswith("mmproj") or (path / "config.json").is_file():
                add(path.stem if path.suffix == ".gguf" else path.name, str(path))
    if not entries:
        raise UsageError(f"--models-dir {models_dir}: no GGUF file or checkpoint directory in it")
    return list(entries.values()), True


class ModelSet:
    """The served models; loading, unloading and counting the requests of each."""

    def __init__(self, entries: list[ModelEntry], routed: bool, options: Options, make_app: Callable, load: Callable[[Options], "LLM"]):
        self.entries = {e.name: e for e in entries}
        self.routed = routed  # False: one model, whatever a request names
        self.idle_unload = options.idle_unload
        self.max_loaded, self.max_loaded_mb = options.max_loaded, options.max_loaded_mb
        self._make_app, self._load = make_app, load
        self._room = asyncio.Condition()  # notified when a request ends or a model unloads

    @property
    def default(self) -> ModelEntry:
        return next(iter(self.entries.values()))

    def find(self, name: str | None) -> ModelEntry | None:
        """The model a request names (any name, or none, when one model is served plainly)."""
        if not self.routed or name is None and len(self.entries) == 1:
            return self.default
        return self.entries.get(name) if name is not None else None

    def add(self, name: str, source: str, options: Options) -> ModelEntry:
        """A model added while serving (Ollama's /api/pull)."""
        if name not in self.entries:
            self.entries[name] = ModelEntry(name, options.replace(model=source, model_name=name))
            self.routed = self.routed or len(self.entries) > 1
        return self.entries[name]

    async def ensure_loaded(self, entry: ModelEntry) -> None:
        async with entry.lock:
            if entry.app is not None:  # loaded, or the plainly served model loading at start (its app answers 503)
                return
            await self._make_room(entry)
            try:
                llm = await asyncio.to_thread(self._load, entry.options)
            except MiniLLMError as e:
                raise ModelUnavailable(500, f"the model {entry.name!r} could not be loaded: {e}", "model_load_failed") from None
            entry.app = self._make_app(llm, entry.name)
            entry.attach(llm)

    def _over_budget(self, entry: ModelEntry) -> bool:
        """Whether loading `entry` now would pass --max-loaded or --max-loaded-mb (an unloaded
        model's weights estimated by its files' size)."""
        loaded = [e for e in self.entries.values() if e.loaded]
        if self.max_loaded is not None and len(loaded) >= self.max_loaded:
            return True
        if self.max_loaded_mb is None or not loaded:
            return False
        held = sum(e.llm.model.weights.nbytes for e in loaded)
        return (held + files_size(entry.options.model)) / 2**20 > self.max_loaded_mb

    async def _make_room(self, entry: ModelEntry) -> None:
        """Unload the least recently used idle models until loading `entry` keeps within the limits."""
        if self.max_loaded is None and self.max_loaded_mb is None:
            return
        deadline = time.monotonic() + LOAD_WAIT_SECONDS
        async with self._room:
            while self._over_budget(entry):
                idle = sorted((e for e in self.entries.values() if e.loaded and e.running == 0 and e is not entry), key=lambda e: e.last_used)
                if idle:
                    await self.unload(idle[0])
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ModelUnavailable(503, "every loaded model is busy and there is no room for another (--max-loaded, "
                                           "--max-loaded-mb); try again", "model_busy")
                try:
                    await asyncio.wait_for(self._room.wait(), timeout=left)
                except asyncio.TimeoutError:
                    pass

    async def use_start(self, entry: ModelEntry) -> None:
        await self.ensure_loaded(entry)
        entry.running += 1

    async def use_end(self, entry: ModelEntry) -> None:
        entry.running -= 1
        entry.last_used = time.monotonic()
        if entry.running == 0 and entry.idle_seconds(self.idle_unload) == 0:
            await self.unload(entry)
        async with self._room:
            self._room.notify_all()

    async def unload(self, entry: ModelEntry) -> None:
        """Let go of a model (its engine stops; its weights go); the next request loads it again."""
        llm, entry.app, entry.llm = entry.llm, None, None
        if llm is not None:
            await asyncio.to_thread(llm.close)

    async def reap(self) -> None:
        """Unload models idle longer than they may stay (a task for the server's life)."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for entry in list(self.entries.values()):
                keep = entry.idle_seconds(self.idle_unload)
                if entry.loaded and entry.running == 0 and keep is not None and now - entry.last_used >= keep:
                    async with entry.lock:
                        if entry.loaded and entry.running == 0:
                            await self.unload(entry)

    def close_all(self) -> None:
        for entry in self.entries.values():
            llm, entry.app, entry.llm = entry.llm, None, None
            if llm is not None:
                llm.close()

    def model_objects(self) -> list[dict]:
        """/v1/models' entries: OpenAI's fields, and whether each is loaded."""
        return [{"id": e.name, "object": "model", "created": int(e.loaded_at) or 0, "owned_by": "minillm", "loaded": e.loaded}
                for e in self.entries.values()]


def files_size(source: str | None) -> int:
    """Bytes of a model's files on disk (0 for a Hub name not fetched yet)."""
    path = Path(str(source or "")).expanduser()
    try:
        return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    except OSError:
        return 0


async def read_body(receive, limit: int) -> tuple[bytes, bool]:
    """A request's whole body (and False), or what came before it passed `limit` bytes (and True)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return b"", True
        if not message.get("more_body", False):
            return b"".join(chunks), False


def replayed(body: bytes, receive):
    """An ASGI receive that gives `body` once, then the client's own messages (a disconnect)."""
    sent = False

    async def receive_again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again


def requested_model(body: bytes) -> str | None:
    """The `model` a JSON body names, if it is a JSON object with a string there."""
    try:
        value = json.loads(body).get("model") if body else None
    except (ValueError, AttributeError, UnicodeDecodeError):
        return None
    return value if isinstance(value, str) else None


class Router:
    """The ASGI app in front: its own routes (`own`: /health, /v1/models, /api/*), and every other
    request passed to the app of the model it names."""

    OWN_PATHS = ("/health", "/v1/models")  # with several models; one model's app answers them otherwise

    def __init__(self, models: ModelSet, own, max_body_bytes: int):
        self.models, self.own, self.max_body_bytes = models, own, max_body_bytes
        self._reaper: asyncio.Task | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        path = scope.get("path", "")
        if path.startswith("/api/") or self.models.routed and (path in self.OWN_PATHS or path.startswith("/v1/models/")):
            return await self.own(scope, receive, send)
        body, over = (b"", False)
        if scope.get("method") == "POST":
            body, over = await read_body(receive, self.max_body_bytes)
        if over:
            return await refuse(send, 413, too_large(self.max_body_bytes), "invalid_request_error", "body_too_large")
        name = requested_model(body)
        entry = self.models.find(name)
        if entry is None:
            known = ", ".join(self.models.entries)
            return await refuse(send, 404, f"the model {name!r} does not exist; this server runs: {known}" if name else
                                 f"name a model in the request's 'model' field; this server runs: {known}",
                                 "not_found_error" if name else "invalid_request_error", "model_not_found")
        try:
            await self.models.use_start(entry)
        except ModelUnavailable as e:
            return await refuse(send, e.status, str(e), "service_unavailable" if e.status == 503 else "server_error", e.code)
        try:
            await entry.app(scope, replayed(body, receive), send)
        finally:
            await self.models.use_end(entry)

    async def _lifespan(self, receive, send):
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._reaper = asyncio.create_task(self.models.reap())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._reaper is not None:
                    self._reaper.cancel()
                await send({"type": "lifespan.shutdown.complete"})
                return


def start_loading(entry: ModelEntry, load: Callable[[Options], "LLM"], on_loaded: Callable[[], None],
                  on_failed: Callable[[Exception], None]) -> None:
    """The plainly served model, loaded in a thread at start while its app answers 503."""
    from ..errors import MiniLLMError

    def run():
        try:
            llm = load(entry.options)
            entry.app.state.service.attach(llm)
            entry.attach(llm)
            on_loaded()
        except MiniLLMError as e:
            on_failed(e)

    threading.Thread(target=run, name="minillm-load", daemon=True).start()
