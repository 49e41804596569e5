"""A stand-in for the Hugging Face Hub on 127.0.0.1, for the tests of models by name: the
endpoints huggingface_hub calls to list a repository and fetch its files (HF_ENDPOINT selects it).

    GET  /api/models/ORG/NAME[/revision/REV]          the repository's commit and files (with sizes)
    HEAD /ORG/NAME/resolve/REV/PATH, GET the same      a file: its commit, ETag and length; ranges

Errors carry the Hub's X-Error-Code header (RepoNotFound, GatedRepo, RevisionNotFound,
EntryNotFound), which huggingface_hub turns into its typed exceptions. A file can be set to have
its first transfer cut halfway, as a dropped connection would."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = "hf_standin_token"


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False
    revisions: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit

    def __post_init__(self):
        digest = hashlib.sha1(json.dumps(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in self.files.items())).encode())
        self.revisions.setdefault("main", digest.hexdigest())


class StandInHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.cut_once: set[str] = set()  # "ORG/NAME/PATH": the first GET of it stops halfway
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.sent: dict[str, int] = {}  # body bytes sent per file
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, repo: str, files: dict[str, bytes], gated: bool = False) -> Repo:
        self.repos[repo] = Repo(dict(files), gated)
        return self.repos[repo]

    def gets(self, repo: str) -> list[str]:
        """The files of `repo` whose bodies were asked for, in order."""
        prefix = f"/{repo}/resolve/"
        return [path[len(prefix):].split("/", 1)[1] for method, path, _ in self.log if method == "GET" and path.startswith(prefix)]

    def __enter__(self) -> "StandInHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                self._answer(body=True)

            def do_HEAD(self):
                self._answer(body=False)

            def _answer(self, body: bool):
                path = self.path.split("?", 1)[0]
                hub.log.append((self.command, path, self.headers.get("Range")))
                info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
                resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                match = info or resolve
                if match is None:
                    return self._error(404, "", "no such endpoint")
                repo = hub.repos.get(match[1])
                if repo is None:
                    return self._error(404, "RepoNotFound", f"Repository {match[1]} not found")
                if repo.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._error(401, "GatedRepo", f"Access to model {match[1]} is restricted")
                revision = match[2] or "main"
                commit = repo.revisions.get(revision, revision if revision in repo.revisions.values() else None)
                if commit is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                if info:
                    siblings = [{"rfilename": name, "size": len(data)} for name, data in sorted(repo.files.items())]
                    return self._send(200, json.dumps({"id": match[1], "sha": commit, "siblings": siblings, "private": False}).encode(),
                                      {"Content-Type": "application/json"}, body)
                data = repo.files.get(match[3])
                if data is None:
                    return self._error(404, "EntryNotFound", f"{match[3]} does not exist on {revision}", commit)
                headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Accept-Ranges": "bytes"}
                start = 0
                wanted = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if wanted and body:
                    start = int(wanted[1])
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                key = f"{match[1]}/{match[3]}"
                if body and key in hub.cut_once:
                    hub.cut_once.discard(key)
                    return self._send(200, data, headers, body, cut_at=len(data) // 2, key=key)
                self._send(206 if start else 200, data[start:], headers, body, key=key)

            def _error(self, status, code, message, commit=None):
                headers = {"Content-Type": "application/json", "X-Error-Message": message}
                if code:
                    headers["X-Error-Code"] = code
                if commit:
                    headers["X-Repo-Commit"] = commit
                self._send(status, json.dumps({"error": message}).encode(), headers, self.command != "HEAD")

            def _send(self, status, data, headers, body, cut_at=None, key=None):
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not body:
                    return
                sent = data if cut_at is None else data[:cut_at]
                self.wfile.write(sent)
                if key:
                    hub.sent[key] = hub.sent.get(key, 0) + len(sent)
                if cut_at is not None:  # a dropped connection: fewer bytes than the length promised
                    self.wfile.flush()
                    self.close_connection = True

        return Handler
