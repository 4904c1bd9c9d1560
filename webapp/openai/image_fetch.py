"""Image URLs fetched for a request, where the operator allows it (`LLM_IMAGE_FETCH`; off by default).

Contract: `ImageFetcher.from_setting(hosts, max_bytes, seconds)` is None for an empty setting, else a
fetcher for `http(s)` URLs whose host the setting names: a comma-separated list of hosts (`.example.com`
also takes its subdomains), or `*` for any host whose addresses are public ones (no loopback,
private, link-local or reserved address: a request must not reach the server's own network through
it; checked when the name resolves and again on the address connected to, so a name that resolves
otherwise the second time is still refused). `fetcher(url, where, param)` returns the body's bytes, or raises `ApiError` 400 naming the part
and what went wrong: a scheme or host not allowed, a redirect to one (each of at most MAX_REDIRECTS
is checked again), an answer other than 200, more than `max_bytes`, longer than `seconds` in all.
Runs on the handler thread that parses the request.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

from webapp.openai.errors import ApiError

MAX_REDIRECTS = 3
CHUNK = 64 * 1024


class _NotAllowed(Exception):
    pass


def _public_only(connection: type) -> type:
    """`connection` (http.client's) refusing, once connected, a peer address that is not public."""

    class PublicOnly(connection):
        def connect(self):
            super().connect()
            peer = self.sock.getpeername()[0]
            if not ipaddress.ip_address(peer.split("%")[0]).is_global:
                self.sock.close()
                raise _NotAllowed(f"the host {self.host!r} has an address that is not public")

    return PublicOnly


class _PublicHTTP(urllib.request.HTTPHandler):
    def http_open(self, req):
        return self.do_open(_public_only(http.client.HTTPConnection), req)


class _PublicHTTPS(urllib.request.HTTPSHandler):
    def https_open(self, req):
        return self.do_open(_public_only(http.client.HTTPSConnection), req, context=self._context)


class ImageFetcher:
    def __init__(self, hosts: frozenset[str] | None, max_bytes: int, seconds: float):
        self.hosts = hosts  # None: any host with public addresses only
        self.max_bytes, self.seconds = max_bytes, seconds
        fetcher = self

        class CheckedRedirects(urllib.request.HTTPRedirectHandler):
            max_redirections = MAX_REDIRECTS

            def redirect_request(self, req, fp, code, msg, headers, newurl):
                fetcher.check(newurl)  # a redirect is a new URL the policy must allow
                return super().redirect_request(req, fp, code, msg, headers, newurl)

        # no proxies from the environment: the host checked is the host reached
        handlers = [urllib.request.ProxyHandler({}), CheckedRedirects]
        if hosts is None:
            handlers += [_PublicHTTP, _PublicHTTPS]
        self._opener = urllib.request.build_opener(*handlers)

    @classmethod
    def from_setting(cls, setting, max_bytes: int, seconds: float) -> ImageFetcher | None:
        names = [h.strip().lower() for h in str(setting or "").split(",") if h.strip()]
        if not names:
            return None
        return cls(None if "*" in names else frozenset(names), int(max_bytes), float(seconds))

    def check(self, url: str) -> None:
        """_NotAllowed where the policy does not take `url`."""
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").lower()
        if parts.scheme not in ("http", "https") or not host:
            raise _NotAllowed(f"only http(s) URLs are fetched, not {url[:80]!r}")
        if self.hosts is not None:
            if not any(host == h or (h.startswith(".") and host.endswith(h)) for h in self.hosts):
                raise _NotAllowed(f"the host {host!r} is not one this server fetches images from (LLM_IMAGE_FETCH)")
            return
        try:
            addresses = {info[4][0] for info in socket.getaddrinfo(host, parts.port or 443, type=socket.SOCK_STREAM)}
        except (OSError, UnicodeError) as e:
            raise _NotAllowed(f"the host {host!r} does not resolve ({e})") from e
        if not all(ipaddress.ip_address(a.split("%")[0]).is_global for a in addresses):
            raise _NotAllowed(f"the host {host!r} has an address that is not public")

    def __call__(self, url: str, where: str, param: str) -> bytes:
        started = time.monotonic()
        try:
            self.check(url)
            with self._opener.open(urllib.request.Request(url, headers={"Accept": "image/*"}), timeout=self.seconds) as answer:
                length = answer.headers.get("Content-Length")
                if length is not None and length.isdigit() and int(length) > self.max_bytes:
                    raise _NotAllowed(f"the image is {length} bytes; at most {self.max_bytes} are fetched")
                data = bytearray()
                while chunk := answer.read(CHUNK):
                    data += chunk
                    if len(data) > self.max_bytes:
                        raise _NotAllowed(f"the image is over {self.max_bytes} bytes; at most that many are fetched")
                    if time.monotonic() - started > self.seconds:
                        raise _NotAllowed(f"fetching it took over {self.seconds:g} s")
                return bytes(data)
        except _NotAllowed as e:
            raise ApiError(400, f"'{where}': {e}.", param, "image_url_refused") from e
        except urllib.error.HTTPError as e:
            raise ApiError(400, f"'{where}': the image URL answered {e.code}.", param, "image_url_failed") from e
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise ApiError(400, f"'{where}': the image URL could not be fetched ({reason}).", param, "image_url_failed") from e
