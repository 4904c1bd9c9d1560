"""A local stand-in for the Hugging Face Hub's endpoints that `huggingface_hub` calls to download a
model's files, on 127.0.0.1 (point `HF_ENDPOINT` at `FakeHub.url`): a repository's info with its files'
sizes and LFS sha256s (`GET /api/models/{repo}[/revision/{rev}]`), and each file's bytes (`HEAD` and
`GET /{repo}/resolve/{rev}/{path}`, with `Range` for a resumed download). `served[path]` counts the
GETs of each file's bytes and `ranges` the byte each one started from; `corrupt` names files whose
bytes differ from the sha256 listed; `cut_once` ({file: n}) ends the next GET of a file after n
bytes, the connection closed mid-body (a download broken off); `delay_s` slows each file's GET (a
download in progress)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos = repos
        self.served: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.ranges: dict[str, list[int]] = {}
        self.cut_once: dict[str, int] = {}
        self.delay_s = 0.0
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                hub._answer(self, body=True)

            def do_HEAD(self):
                hub._answer(self, body=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        if path.startswith("/api/models/"):
            repo = path.removeprefix("/api/models/").split("/revision/")[0]
            if repo not in self.repos:
                return self._send(handler, 404, {"X-Error-Code": "RepoNotFound"}, b'{"error":"Repository not found"}', body)
            siblings = [
                {
                    "rfilename": name,
                    "size": len(data),
                    "lfs": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134},
                }
                for name, data in self.repos[repo].items()
            ]
            info = json.dumps({"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings}).encode()
            return self._send(handler, 200, {"Content-Type": "application/json"}, info, body)
        parts = path.strip("/").split("/")
        repo, rest = "/".join(parts[:2]), parts[2:]
        if len(rest) < 3 or rest[0] != "resolve" or repo not in self.repos or "/".join(rest[2:]) not in self.repos[repo]:
            return self._send(handler, 404, {"X-Error-Code": "EntryNotFound"}, b'{"error":"Entry not found"}', body)
        name = "/".join(rest[2:])
        data = self.repos[repo][name]
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Accept-Ranges": "bytes"}
        if name in self.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        start = 0
        ranged = handler.headers.get("Range", "")
        if ranged.startswith("bytes="):
            start = int(ranged.removeprefix("bytes=").split("-")[0] or 0)
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if body:
            self.served[name] = self.served.get(name, 0) + 1
            self.ranges.setdefault(name, []).append(start)
            time.sleep(self.delay_s)
        cut = self.cut_once.pop(name, None) if body else None
        if cut is not None:  # promise the whole rest, send part of it, hang up
            handler.send_response(206 if start else 200)
            for key, value in (headers | {"Content-Length": str(len(data) - start)}).items():
                handler.send_header(key, value)
            handler.end_headers()
            handler.wfile.write(data[start : start + cut])
            handler.wfile.flush()
            handler.close_connection = True
            return None
        self._send(handler, 206 if start else 200, headers | {"Content-Type": "application/octet-stream"}, data[start:], body)

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, status: int, headers: dict, payload: bytes, body: bool) -> None:
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        if body:
            handler.wfile.write(payload)
