"""The gateway's front door: every request body is bounded and checked before any route parses it.

A pure ASGI middleware reads the whole body (refusing it past `max_body_bytes` with 413), refuses JSON nested
deeper than `max_json_depth` (413, before the parser recurses), and, for JSON bodies, refuses non-finite numbers
(NaN, Infinity, 1e400) and strings that are not valid Unicode (lone surrogates) with a 400 that names the field.
The routes then see a body that is safe to parse and convert. The body is replayed to them unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from inference.errors import Reason, default_reason

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Refused(Exception):
    def __init__(self, status: int, message: str, reason: Reason | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason: Reason = reason or default_reason(status)


def json_depth(raw: bytes) -> int:
    """Deepest nesting of [ and { in a JSON text, outside strings. Linear, no recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def find_unsafe_value(value: Any, path: str = "") -> str | None:
    """A message naming the first non-finite number or invalid string in a parsed JSON value, else None."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return f"{where or 'body'}: {item!r} is not a finite number; send a finite value"
        if isinstance(item, str) and not _valid_unicode(item):
            return f"{where or 'body'}: the string is not valid Unicode (a lone surrogate escape); send UTF-8 text"
        if isinstance(item, dict):
            for key, child in item.items():
                if not _valid_unicode(key):
                    return f"{where or 'body'}: a key is not valid Unicode (a lone surrogate escape)"
                stack.append((f"{where}.{key}" if where else key, child))
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", child) for i, child in enumerate(item))
    return None


def _valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_json_body(raw: bytes, max_depth: int) -> None:
    """Raise Refused for a JSON body the routes must never see. An unparsable body is left to the route (which
    answers 400 with the parser's message)."""
    if json_depth(raw) > max_depth:
        raise Refused(413, f"JSON nested deeper than {max_depth} levels; flatten the request")
    try:
        parsed = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return
    problem = find_unsafe_value(parsed)
    if problem is not None:
        raise Refused(400, problem)


class BodyGuard:
    """ASGI middleware: bounded, checked bodies for every HTTP route."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_json_depth: int):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
            if body:
                check_json_body(body, self.max_json_depth)
        except Refused as exc:
            await _answer(send, exc.status, exc.message, exc.reason)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices

        await self.app(scope, replay, send)

    async def _read(self, scope: Scope, receive: Receive) -> bytes:
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise Refused(
                413, f"request body of {int(declared)} bytes exceeds the limit of {self.max_body_bytes}"
            )
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Refused(400, "client disconnected before sending the body", "client_disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise Refused(413, f"request body exceeds the limit of {self.max_body_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _answer(send: Send, status: int, message: str, reason: Reason) -> None:
    # The app's error shape (inference.app.error): `type` is the reason the request accounting counts.
    body = json.dumps({"error": {"message": message, "type": reason, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
