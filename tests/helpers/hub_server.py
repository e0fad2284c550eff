"""A fake Hugging Face Hub on a loopback port, for tests: just enough of the Hub's HTTP API for
``huggingface_hub`` to create a repo, commit files to it, and download them again.

Endpoints (as ``huggingface_hub`` 1.x / 2.x sends them; see ``hf_api.py`` ``create_repo``,
``_commit_api.py`` ``_fetch_upload_modes`` / ``_send_commit``, ``_snapshot_download.py`` and
``file_download.py``):

* ``POST /api/repos/create``                           create (409 when it exists)
* ``POST /api/validate-yaml``                          README metadata check (must parse as YAML)
* ``POST /api/models/{repo}/preupload/{rev}``          every file ``regular`` (sent inline in the commit)
* ``POST /api/models/{repo}/commit/{rev}``             the NDJSON commit: header, files, deletions
* ``GET  /api/models/{repo}[/revision/{rev}]``         repo info (sha, siblings)
* ``GET  /api/models/{repo}/tree/{rev}[/{path}]``      the file list
* ``HEAD|GET /{repo}/resolve/{rev}/{path}``            file metadata and bytes

Errors carry the ``X-Error-Code`` header the client maps to its exceptions (``RepoNotFound``,
``RevisionNotFound``, ``EntryNotFound``). Every request is recorded (method, path, Authorization header),
every commit too. With ``token`` set, a write (any POST) without ``Authorization: Bearer <token>`` gets
401, as the Hub answers a missing or read-only token. With ``models`` set, a card whose ``base_model`` is not
one of them fails validation (400), as the Hub refuses a base model it does not have. Bounded: loopback
only, request bodies over ``max_body`` bytes are refused, and the server shuts itself down after
``lifetime_s`` seconds even if a test never stops it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

import yaml


@dataclass
class FakeRepo:
    """One model repo: its files at the head of ``main`` and its commits (oldest first)."""

    private: bool
    files: dict[str, bytes] = field(default_factory=dict)
    commits: list[dict[str, Any]] = field(default_factory=list)

    @property
    def sha(self) -> str:
        return self.commits[-1]["sha"] if self.commits else "0" * 40


def _sha(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


class FakeHub:
    """The server; a context manager. ``url`` is its endpoint (``HF_ENDPOINT``)."""

    def __init__(
        self,
        lifetime_s: float = 120.0,
        max_body: int = 64 << 20,
        token: str | None = None,
        models: set[str] | None = None,
    ) -> None:
        self.token = token
        self.models = models
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.max_body = max_body
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._timer = threading.Timer(lifetime_s, self.stop)
        self._timer.daemon = True

    def __enter__(self) -> FakeHub:
        self._thread.start()
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._timer.cancel()
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------------ state
    def add_repo(self, repo_id: str, files: dict[str, bytes], private: bool = False) -> None:
        """Seed a repo with one commit of ``files`` (e.g. a repo that holds no heads)."""
        with self._lock:
            repo = self.repos.setdefault(repo_id, FakeRepo(private))
            self._commit(repo, "seed", dict(files), [])

    def _commit(self, repo: FakeRepo, summary: str, added: dict[str, bytes], deleted: list[str]) -> str:
        for path in deleted:
            repo.files.pop(path, None)
        repo.files.update(added)
        state = json.dumps(sorted((p, _sha(b)) for p, b in repo.files.items())) + repo.sha + summary
        sha = hashlib.sha1(state.encode()).hexdigest()
        repo.commits.append({"sha": sha, "summary": summary, "added": added, "deleted": deleted})
        return sha


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    api_repo = re.compile(r"/api/models/([^/]+/[^/]+)(?:/(preupload|commit|revision|tree)/([^/]+)(?:/(.*))?)?")
    resolve = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet
            pass

        # -------------------------------------------------------------- plumbing
        def _body(self) -> bytes:
            n = int(self.headers.get("Content-Length") or 0)
            if n > hub.max_body:
                raise ValueError(f"request body of {n} bytes is over the limit")
            return self.rfile.read(n) if n else b""

        def _send(self, status: int, payload: Any = None, headers: dict[str, str] | None = None, raw=None) -> None:
            body = raw if raw is not None else (b"" if payload is None else json.dumps(payload).encode())
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if raw is None else "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, status: int, code: str, message: str) -> None:
            self._send(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

        def _repo(self, repo_id: str) -> FakeRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}")
            return repo

        def _revision_ok(self, repo: FakeRepo, rev: str) -> bool:
            if unquote(rev) in ("main", repo.sha):
                return True
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return False

        def _record(self) -> str:
            path = urlsplit(self.path).path
            hub.requests.append((self.command, path, self.headers.get("Authorization")))
            return path

        # -------------------------------------------------------------- routes
        def do_POST(self) -> None:
            path = self._record()
            try:
                body = self._body()
            except ValueError as err:
                self._send(413, {"error": str(err)})
                return
            if hub.token is not None and self.headers.get("Authorization") != f"Bearer {hub.token}":
                self._send(401, {"error": "Invalid credentials in Authorization header"})
                return
            with hub._lock:
                if path == "/api/repos/create":
                    data = json.loads(body)
                    repo_id = f"{data['organization']}/{data['name']}"
                    if repo_id in hub.repos:
                        self._send(409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"})
                        return
                    hub.repos[repo_id] = FakeRepo(
                        private=data.get("visibility") == "private" or bool(data.get("private"))
                    )
                    self._send(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})
                    return
                if path == "/api/validate-yaml":
                    text = json.loads(body)["content"]
                    try:
                        meta = yaml.safe_load(text.split("---")[1]) or {}
                    except (yaml.YAMLError, IndexError) as err:
                        self._send(400, {"errors": [{"message": str(err)}]})
                        return
                    if hub.models is not None and meta.get("base_model") not in hub.models:
                        message = f'"base_model" with value "{meta.get("base_model")}" is not a valid model id'
                        self._send(400, {"errors": [{"message": message}]})
                        return
                    self._send(200, {"errors": [], "warnings": []})
                    return
                m = api_repo.fullmatch(path)
                if m is None or m.group(2) not in ("preupload", "commit"):
                    self._error(404, "EntryNotFound", f"no route {path}")
                    return
                repo = self._repo(m.group(1))
                if repo is None or not self._revision_ok(repo, m.group(3)):
                    return
                if m.group(2) == "preupload":
                    files = json.loads(body)["files"]
                    modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                    self._send(200, {"files": modes, "commitOid": repo.sha})
                    return
                summary, added, deleted = "", {}, []
                for line in body.splitlines():
                    item = json.loads(line)
                    if item["key"] == "header":
                        summary = item["value"]["summary"]
                    elif item["key"] == "file":
                        added[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                    elif item["key"] == "deletedFile":
                        if item["value"]["path"] not in repo.files:
                            self._error(404, "EntryNotFound", "A file with this name doesn't exist")
                            return
                        deleted.append(item["value"]["path"])
                    else:
                        self._send(400, {"error": f"the fake Hub does not take {item['key']!r}"})
                        return
                sha = hub._commit(repo, summary, added, deleted)
                self._send(200, {"commitUrl": f"{hub.url}/{m.group(1)}/commit/{sha}", "commitOid": sha})

        def do_GET(self) -> None:
            self._get()

        def do_HEAD(self) -> None:
            self._get()

        def _get(self) -> None:
            path = self._record()
            with hub._lock:
                m = resolve.fullmatch(path)
                if m is not None:
                    repo = self._repo(m.group(1))
                    if repo is None or not self._revision_ok(repo, m.group(2)):
                        return
                    name = unquote(m.group(3))
                    if name not in repo.files:
                        self._error(404, "EntryNotFound", f"{name} does not exist on main")
                        return
                    data = repo.files[name]
                    meta = {"X-Repo-Commit": repo.sha, "ETag": f'"{_sha(data)}"'}
                    self._send(200, headers=meta, raw=data)
                    return
                m = api_repo.fullmatch(path)
                if m is None or m.group(2) not in (None, "revision", "tree"):
                    self._error(404, "EntryNotFound", f"no route {path}")
                    return
                repo = self._repo(m.group(1))
                if repo is None or (m.group(3) is not None and not self._revision_ok(repo, m.group(3))):
                    return
                if m.group(2) == "tree":
                    entries = [
                        {"type": "file", "path": p, "size": len(b), "oid": _sha(b)}
                        for p, b in sorted(repo.files.items())
                    ]
                    self._send(200, entries)
                    return
                siblings = [{"rfilename": p, "size": len(b)} for p, b in sorted(repo.files.items())]
                info = {"id": m.group(1), "modelId": m.group(1), "sha": repo.sha, "private": repo.private}
                self._send(200, {**info, "siblings": siblings})

    return Handler
