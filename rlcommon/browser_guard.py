"""What keeps a web page from driving a local HTTP service (the gateway, the Tinker-protocol service).

A page in the user's browser can send requests to 127.0.0.1: "simple" cross-origin writes (a form content type, or
none) go out without a CORS preflight, and a DNS name that an attacker points at 127.0.0.1 (rebinding) lets a page
read the answers too. Two rules stop both, as the dashboard does, without touching the clients this project serves
(atroposlib, verifiers, openai, the tinker SDK, the trainer: none sends an Origin, all send JSON or protobuf):

- a server bound to a loopback address answers only requests addressed to a loopback name (`Host`);
- a write (POST, PUT, PATCH, DELETE) is refused when it comes from a web page of another origin (`Origin` names a
  host other than the request's own) or carries a content type a page may send without a preflight
  (text/plain, application/x-www-form-urlencoded, multipart/form-data).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from rlcommon.hosts import LOOPBACK_HOSTS

WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
PAGE_CONTENT_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
ErrorBody = Callable[[int, str], bytes]  # (status, message) -> the service's own error JSON


def host_name(host_header: str) -> str:
    """The name in a Host (or Origin netloc) value, without its port; IPv6 literals without brackets."""
    if host_header.startswith("["):
        return host_header[1 : host_header.find("]")].lower()
    return (host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header).lower()


def refusal(method: str, headers: dict[str, str], loopback_only: bool) -> tuple[int, str] | None:
    """(status, message) for a request a web page could have made, None for the others. `headers`: lower-case
    names."""
    host = headers.get("host", "")
    if loopback_only and host_name(host) not in LOOPBACK_HOSTS:
        return 403, (
            f"Host {host!r} is not this machine's loopback name: this server binds a loopback address and answers "
            "only http://127.0.0.1:PORT, http://localhost:PORT or http://[::1]:PORT (a web page cannot reach it "
            "through a DNS name pointed at 127.0.0.1)"
        )
    if method not in WRITES:
        return None
    origin = headers.get("origin")
    if origin is not None and urlsplit(origin).netloc.lower() != host.lower():
        return 403, (
            f"a write from the web page at {origin!r} is refused: this server takes writes from programs, not from "
            "pages of other sites (requests without an Origin header, or from its own origin)"
        )
    media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media in PAGE_CONTENT_TYPES:
        return 415, (
            f"Content-Type {media!r} is refused for {method}: send the body as JSON with Content-Type: "
            "application/json (curl: -H 'Content-Type: application/json')"
        )
    return None


class BrowserGuard:
    """ASGI middleware applying `refusal` to every HTTP request before its body is read."""

    def __init__(self, app: ASGIApp, loopback_only: bool, error_body: ErrorBody):
        self.app = app
        self.loopback_only = loopback_only
        self.error_body = error_body

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        refused = refusal(scope.get("method", ""), headers, self.loopback_only)
        if refused is None:
            await self.app(scope, receive, send)
            return
        status, message = refused
        body = self.error_body(status, message)
        response_headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": response_headers})
        await send({"type": "http.response.body", "body": body})
