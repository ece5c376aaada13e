"""A Hugging Face Hub stand-in on 127.0.0.1 for tests: the two routes huggingface_hub's `model_info` and
`hf_hub_download` use, with the headers and error codes the real Hub sends (read from huggingface_hub's
file_download.py and utils/_http.py), and a record of every request."""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    revisions: dict[str, dict[str, bytes]]  # branch or tag -> its files (path -> bytes); each is one commit
    gated: bool = False  # files need the token, as on the Hub (its model info stays public)
    private: bool = False  # everything needs the token; without it the repo reads as missing

    def commit(self, revision: str) -> str:
        digest = hashlib.sha1(revision.encode())
        for name, data in sorted(self.revisions[revision].items()):
            digest.update(name.encode() + hashlib.sha256(data).digest())
        return digest.hexdigest()

    def resolve(self, revision: str) -> tuple[str, dict[str, bytes]] | None:
        """(commit, files) of a branch, tag or commit hash."""
        for name, files in self.revisions.items():
            if revision in (name, self.commit(name)):
                return self.commit(name), files
        return None


class FakeHub:
    TOKEN = "hf_fake_token"

    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) in arrival order
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.hub = self
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def requested_files(self, repo_id: str) -> set[str]:
        """Files of `repo_id` asked for on the download route (HEAD or GET)."""
        prefix = f"/{repo_id}/resolve/"
        return {unquote(path[len(prefix):].partition("/")[2]) for _, path in self.requests if path.startswith(prefix)}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(head=False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(head=True)

    def _answer(self, head: bool) -> None:
        hub: FakeHub = self.server.hub
        path = urlsplit(self.path).path
        hub.requests.append((self.command, path))
        authorized = self.headers.get("authorization") == f"Bearer {hub.TOKEN}"
        if path.startswith("/api/models/"):
            repo_id, _, revision = path[len("/api/models/"):].partition("/revision/")
            return self._model_info(unquote(repo_id), unquote(revision), authorized)
        repo_id, _, rest = path[1:].partition("/resolve/")
        revision, _, filename = rest.partition("/")
        return self._file(unquote(repo_id), unquote(revision), unquote(filename), authorized, head)

    def _repo(self, repo_id: str, authorized: bool) -> FakeRepo | None:
        repo = self.server.hub.repos.get(repo_id)
        if repo is None or (repo.private and not authorized):
            # The Hub answers 401 to an anonymous caller whether the repo is missing or private.
            self._error(404 if authorized else 401, "RepoNotFound", "Repository not found")
            return None
        return repo

    def _model_info(self, repo_id: str, revision: str, authorized: bool) -> None:
        repo = self._repo(repo_id, authorized)
        if repo is None:
            return
        resolved = repo.resolve(revision)
        if resolved is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        commit, files = resolved
        body = json.dumps({"id": repo_id, "sha": commit, "private": repo.private,
                           "gated": "manual" if repo.gated else False,
                           "siblings": [{"rfilename": name} for name in sorted(files)]}).encode()
        self._send(200, {"Content-Type": "application/json"}, body, head=False)

    def _file(self, repo_id: str, revision: str, filename: str, authorized: bool, head: bool) -> None:
        repo = self._repo(repo_id, authorized)
        if repo is None:
            return
        if repo.gated and not authorized:
            code = 403 if self.headers.get("authorization") else 401
            return self._error(code, "GatedRepo", "Access to this model is restricted")
        resolved = repo.resolve(revision)
        if resolved is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        commit, files = resolved
        if filename not in files:
            return self._error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": commit})
        data = files[filename]
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Content-Type": "application/octet-stream"}
        self._send(200, headers, data, head)

    def _error(self, status: int, code: str, message: str, extra: dict[str, str] | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(status, {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json",
                            **(extra or {})}, body, head=self.command == "HEAD")

    def _send(self, status: int, headers: dict[str, str], body: bytes, head: bool) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)
