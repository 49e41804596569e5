"""Models by name: `ORG/NAME` (a Hugging Face Hub repository) and `ORG/NAME:QUANT` (one
quantization of a GGUF repository), resolved to files in the Hub's standard cache.

Nothing here runs unless a model is named this way: the bundled default model and local paths
never touch the network. huggingface_hub moves the bytes (its cache layout, HF_ENDPOINT,
HF_TOKEN, a cut connection resumed with a range request); this module decides which files a
model needs, reads the cache when offline, and turns the Hub's errors into one-line ones.
The environment is read at each call, not at import, so a test or a service can change it.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import HubError

# ORG/NAME with an optional :QUANT; a path that exists locally is never taken for a name
_NAME = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<tag>[\w.+-]+))?$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
# a quantization as llama.cpp's tools name it inside file names: Q4_K_M, IQ4_XS, Q8_0, BF16, MXFP4_MOE..
_QUANT = re.compile(r"(?:^|[-._])((?:I?Q[1-8](?:_[A-Z0-9]{1,3})*)|BF16|F16|F32|MXFP4(?:_MOE)?|TQ[12]_0)(?=$|[-._])", re.IGNORECASE)
DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's -hf default; else the smallest 4-bit file

# A checkpoint's files at the repository's top level: what loading reads, nothing else (no
# PyTorch .bin twins, ONNX exports or original/ folders)
_CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "chat_template.jinja", "chat_template.json", "model.safetensors.index.json")


@dataclass(frozen=True)
class ModelName:
    repo: str  # ORG/NAME
    tag: str | None  # a GGUF repository's quantization, as written

    @classmethod
    def parse(cls, text: str) -> "ModelName | None":
        match = _NAME.match(text)
        return None if match is None else cls(match["repo"], match["tag"])

    def __str__(self) -> str:
        return self.repo if self.tag is None else f"{self.repo}:{self.tag}"


def names_a_model(text: str | os.PathLike | None) -> bool:
    """Whether `text` is a Hub name to resolve: ORG/NAME[:QUANT] that is not a local path."""
    if text is None or not isinstance(text, str) or Path(text).expanduser().exists():
        return False
    if text.lower().endswith((".gguf", ".safetensors")):  # a file meant, if missing
        return False
    return not text.startswith((".", "/", "~")) and ModelName.parse(text) is not None


def quant_of(filename: str) -> str | None:
    """The quantization a GGUF file's name says (upper case), or None."""
    stem = _SPLIT.sub("", Path(filename).name)
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    found = _QUANT.findall(stem)
    return found[-1].upper() if found else None


@dataclass(frozen=True)
class Choice:
    files: tuple[str, ...]  # repository paths to fetch
    entry: str | None  # the GGUF (its first part) to load; None: the checkpoint directory
    note: str | None = None  # a default pick, said aloud


def gguf_groups(files: dict[str, int]) -> dict[str, list[str]]:
    """A repository's model GGUFs (projectors and importance matrices left out), split parts grouped:
    {first part's path: every part's path}."""
    groups: dict[str, list[str]] = {}
    for path in sorted(files):
        base = Path(path).name.lower()
        if not base.endswith(".gguf") or "mmproj" in base or "imatrix" in base:
            continue
        key = _SPLIT.sub("-00001-of-\\2.gguf", path) if _SPLIT.search(path) else path
        groups.setdefault(key, []).append(path)
    return groups


def is_checkpoint(files) -> bool:
    return "config.json" in files and any("/" not in f and f.endswith(".safetensors") for f in files)


def choose_files(name: ModelName, files: dict[str, int]) -> Choice:
    """Which of a repository's files (path -> size) make the model `name` asks for."""
    groups = gguf_groups(files)
    if name.tag is None and is_checkpoint(files):
        weights = [f for f in files if "/" not in f and f.endswith(".safetensors")]
        if any(f.startswith("model") for f in weights):  # Mistral's repos add consolidated.safetensors, the same weights again
            weights = [f for f in weights if f.startswith("model")]
        return Choice(tuple(sorted([f for f in _CHECKPOINT_FILES if f in files] + weights)), None)
    if not groups:
        if name.tag is not None:
            raise HubError(f"{name}: {name.repo} has no GGUF files to pick a quantization from; name it without ':{name.tag}'")
        raise HubError(f"{name}: {name.repo} holds neither a safetensors checkpoint (config.json and *.safetensors) nor a GGUF file")
    quants = {first: quant_of(first) for first in groups}
    available = ", ".join(sorted({q for q in quants.values() if q})) or ", ".join(Path(f).name for f in groups)
    if name.tag is not None:
        tag = name.tag.upper()
        picked = [f for f, q in quants.items() if q == tag] or [f for f in groups if re.search(rf"(?:^|[-._/]){re.escape(name.tag)}(?:$|[-._])", f, re.I)]
        if not picked:
            raise HubError(f"{name}: {name.repo} has no {name.tag} file; it has: {available}")
        first, note = min(picked, key=len), None  # the plainest name when several match
    else:
        size = {first: sum(files.get(p) or 0 for p in parts) for first, parts in groups.items()}
        preferred = [f for f, q in quants.items() if q == DEFAULT_QUANT]
        four_bit = [f for f, q in quants.items() if q and q.lstrip("I").startswith("Q4")]
        first = min(preferred or four_bit or list(groups), key=lambda f: size[f])
        how = "llama.cpp's default" if preferred else ("the smallest 4-bit file" if four_bit else "the smallest file")
        note = (f"{name.repo}: using {quants[first] or Path(first).name} ({how}); name another as {name.repo}:QUANT "
                f"(this repository has: {available})")
    return Choice(tuple(groups[first]), first, note)


@dataclass(frozen=True)
class Hub:
    """Where the Hub and its cache are, read from the environment as huggingface_hub reads it."""

    endpoint: str
    cache_dir: Path
    token: str | None
    offline: bool

    @classmethod
    def from_environment(cls) -> "Hub":
        env = os.environ
        home = Path(env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface").expanduser()
        cache = Path(env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or home / "hub").expanduser()
        offline = env.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
        return cls((env.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/"), cache, env.get("HF_TOKEN") or None, offline)

    def repo_folder(self, repo: str) -> Path:
        return self.cache_dir / ("models--" + repo.replace("/", "--"))

    def cached_files(self, repo: str, revision: str | None) -> tuple[Path, dict[str, int]] | None:
        """(snapshot folder, its files and sizes) of `repo` at `revision` in the cache, or None."""
        folder = self.repo_folder(repo)
        ref = folder / "refs" / (revision or "main")
        commit = ref.read_text().strip() if ref.is_file() else (revision or "")
        snapshot = folder / "snapshots" / commit
        if not commit or not snapshot.is_dir():
            return None
        return snapshot, {name: path.stat().st_size for name, path in snapshot_files(snapshot).items()}

    def listing(self, repo: str, revision: str | None) -> dict[str, int]:
        """The repository's files and sizes, asked of the Hub."""
        from huggingface_hub import HfApi

        info = HfApi(endpoint=self.endpoint, token=self.token).model_info(repo, revision=revision, files_metadata=True)
        return {s.rfilename: s.size or 0 for s in info.siblings or ()}

    def download(self, repo: str, filename: str, revision: str | None, progress: bool, tqdm_class=None) -> Path:
        from huggingface_hub import hf_hub_download

        kwargs = {"tqdm_class": tqdm_class} if tqdm_class else {} if progress else {"tqdm_class": _silent_tqdm()}
        return Path(hf_hub_download(repo, filename, revision=revision, cache_dir=self.cache_dir, endpoint=self.endpoint,
                                    token=self.token, **kwargs))


def _silent_tqdm():
    """A tqdm that draws nothing (huggingface_hub takes a class for its progress bars)."""
    from tqdm.auto import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def model_path(source: str | os.PathLike | None, revision: str | None = None, progress: bool = True) -> Path:
    """Where a model is on this machine: the bundled default model for None (imported on first
    use), a local path as given, a Hub name resolved (and downloaded if the cache lacks it)."""
    if source is None:
        from .default_model import default_model_dir

        return default_model_dir(progress=progress)
    if names_a_model(source):
        return resolve(str(source), revision, progress)
    return Path(source)


def resolve(text: str, revision: str | None = None, progress: bool = True, tqdm_class=None) -> Path:
    """The local path of the model named `text` (ORG/NAME or ORG/NAME:QUANT): a checkpoint's snapshot
    directory or a GGUF file (the first part of a split one), downloading what the cache lacks.
    With HF_HUB_OFFLINE=1, or when the Hub cannot be reached, only the cache is read. tqdm_class:
    the progress bars of the transfers (Ollama's /api/pull relays them)."""
    name = ModelName.parse(text)
    if name is None:
        raise HubError(f"{text}: not a model name (ORG/NAME or ORG/NAME:QUANT) nor an existing path")
    hub = Hub.from_environment()
    if hub.offline:
        return _from_cache(hub, name, revision, "HF_HUB_OFFLINE is set")
    try:
        files = hub.listing(name.repo, revision)
    except Exception as e:  # noqa: BLE001 - each kind of failure gets its own message
        reason = _unreachable(e)
        if reason is None:
            raise HubError(_hub_message(name, revision, hub, e)) from None
        return _from_cache(hub, name, revision, f"cannot reach {hub.endpoint} ({reason})")
    choice = choose_files(name, files)
    if choice.note and progress:
        print(choice.note, file=sys.stderr)
    paths = []
    for filename in choice.files:
        try:
            paths.append(hub.download(name.repo, filename, revision, progress, tqdm_class))
        except Exception as e:  # noqa: BLE001
            reason = _unreachable(e)
            raise HubError(f"{name}: downloading {filename} failed: " + (reason or _hub_message(name, revision, hub, e))) from None
    if choice.entry is None:
        return paths[0].parent  # the snapshot directory (every checkpoint file is at its top level)
    return paths[choice.files.index(choice.entry)]


def _from_cache(hub: Hub, name: ModelName, revision: str | None, why: str) -> Path:
    cached = hub.cached_files(name.repo, revision)
    if cached is None:
        raise HubError(f"{name}: {why}, and it is not in the cache ({hub.cache_dir}); "
                       f"fetch it once with network: minillm pull {name}")
    snapshot, files = cached
    try:
        choice = choose_files(name, files)
    except HubError as e:  # "NAME: what is wrong"
        raise HubError(f"{name}: {why}, and in the cache: {str(e).split(': ', 1)[1]}") from None
    missing = [f for f in choice.files if f not in files]
    if missing:
        raise HubError(f"{name}: {why}, and the cache lacks {missing[0]}; fetch it once with network: minillm pull {name}")
    return snapshot if choice.entry is None else snapshot / choice.entry


def _unreachable(error: Exception) -> str | None:
    """Why the Hub could not be reached (a network failure, not an answer), or None."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    seen = error
    while seen is not None:  # the HTTP library's own errors, by name: huggingface_hub 1.x uses httpx, 2.x httpx2
        names = {kind.__name__ for kind in type(seen).__mro__}
        if names & {"ConnectError", "TimeoutException", "NetworkError", "RemoteProtocolError", "ConnectionError", "TimeoutError"}:
            return str(seen).splitlines()[0] if str(seen) else type(seen).__name__
        if not isinstance(seen, LocalEntryNotFoundError):  # which hf_hub_download raises with the network error as its cause
            return None
        seen = seen.__cause__ or seen.__context__
    return None


def _hub_message(name: ModelName, revision: str | None, hub: Hub, error: Exception) -> str:
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(error, GatedRepoError):
        return (f"{name}: {name.repo} is gated: accept its terms on {hub.endpoint}/{name.repo} and set HF_TOKEN"
                + (" (the token given has no access)" if hub.token else ""))
    if isinstance(error, RepositoryNotFoundError):
        return f"{name}: no model {name.repo} on {hub.endpoint}" + ("" if hub.token else " (if it is private, set HF_TOKEN)")
    if isinstance(error, RevisionNotFoundError):
        return f"{name}: {name.repo} has no revision {revision!r}"
    if isinstance(error, EntryNotFoundError):
        return f"{name}: a file the listing named is missing on {hub.endpoint}"
    if isinstance(error, HfHubHTTPError):
        status = getattr(error.response, "status_code", "?")
        return f"{name}: {hub.endpoint} answered HTTP {status}"
    if isinstance(error, OSError):
        return f"{name}: {error.strerror or error}" + (f": {error.filename}" if error.filename else "")
    return f"{name}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


# The cache as a model list: `minillm list` and `minillm rm`

@dataclass(frozen=True)
class CachedModel:
    name: str  # ORG/NAME or ORG/NAME:QUANT
    size: int  # bytes on disk
    modified: float  # the newest file's time
    files: tuple[Path, ...]  # the snapshot's links


def snapshot_files(snapshot: Path) -> dict[str, Path]:
    """A cached snapshot's files by repository path (links to blobs that are there)."""
    return {path.relative_to(snapshot).as_posix(): path for path in snapshot.rglob("*") if path.is_file()}


def cached_models(hub: Hub | None = None) -> list[CachedModel]:
    """Every model in the cache that minillm can load: a checkpoint repository as one entry, a GGUF
    repository as one entry per quantization held."""
    hub = hub or Hub.from_environment()
    found = []
    for folder in sorted(hub.cache_dir.glob("models--*--*")):
        repo = folder.name[len("models--"):].replace("--", "/", 1)
        name = ModelName.parse(repo)
        for snapshot in sorted((folder / "snapshots").glob("*")):
            files = snapshot_files(snapshot)
            if name is None or not files:
                continue
            listing = {f: 0 for f in files}
            entries = [(repo, choose_files(ModelName(repo, None), listing))] if is_checkpoint(listing) else []
            for first, parts in gguf_groups(listing).items():
                label = quant_of(first) or Path(first).stem
                entries.append((f"{repo}:{label}", Choice(tuple(parts), first)))
            for model_name, choice in entries:
                paths = tuple(files[f] for f in choice.files if f in files)
                stats = [p.stat() for p in paths]
                found.append(CachedModel(model_name, sum(s.st_size for s in stats), max(s.st_mtime for s in stats), paths))
    return found


def remove(text: str, hub: Hub | None = None) -> list[str]:
    """Delete a model from the cache: ORG/NAME the whole repository, ORG/NAME:QUANT that
    quantization's files (and their blobs when nothing else links them). Returns what went."""
    hub = hub or Hub.from_environment()
    name = ModelName.parse(text)
    if name is None:
        raise HubError(f"{text}: not a model name (ORG/NAME or ORG/NAME:QUANT)")
    folder = hub.repo_folder(name.repo)
    if name.tag is None:
        if not folder.is_dir():
            raise HubError(f"{name}: not in the cache ({hub.cache_dir})")
        shutil.rmtree(folder)
        return [name.repo]
    links = []  # the files the name picks in each snapshot, as resolve would pick them
    for snapshot in (folder / "snapshots").glob("*"):
        files = snapshot_files(snapshot)
        try:
            links += [files[f] for f in choose_files(name, {f: 0 for f in files}).files if f in files]
        except HubError:
            pass
    if not links:
        held = [m.name for m in cached_models(hub) if m.name.startswith(name.repo + ":")]
        raise HubError(f"{name}: not in the cache" + (f"; cached: {', '.join(held)}" if held else f" ({hub.cache_dir})"))
    blobs = {link.resolve() for link in links}
    for link in links:
        link.unlink()
    still_linked = {p.resolve() for p in (folder / "snapshots").rglob("*") if p.is_symlink()}
    for blob in blobs - still_linked:
        if folder in blob.parents:
            blob.unlink(missing_ok=True)
    return sorted({f"{name.repo}:{quant_of(link.name) or link.stem}" for link in links})


def age(modified: float) -> str:
    """'3 minutes ago', for `minillm list`."""
    seconds = max(time.time() - modified, 0)
    for unit, length in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= length:
            count = int(seconds // length)
            return f"{count} {unit}{'s' if count > 1 else ''} ago"
    return "just now"
