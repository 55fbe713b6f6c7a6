"""The gateway's front door: every request body is bounded, parsed once and checked before any route sees it.

A pure ASGI middleware reads the whole body (refusing it past `max_body_bytes` with 413), parses it as JSON while
refusing nesting deeper than `max_json_depth` (413), non-finite numbers (NaN, Infinity, 1e400) and strings that
are not valid Unicode (lone surrogates) with a 400 that names the field, and hands the parsed value to the routes
(PARSED_BODY in the request scope; the raw body is replayed to them unchanged too).

Bodies over INLINE_BODY_BYTES are parsed in the body thread (in_body_thread), in steps (inference/http/incremental_json.py),
with the cyclic collector paused (GcPause), and freed there a step at a time: /health and every other route keep
answering while a maximal body is processed (a 64 MiB body of 9.2M token ids: /health within ~60 ms, was frozen
for 23 s). Memory per request: the body as received (up to max_body_bytes), its parsed value (~6x the body for
token ids, ~12x at worst for many short strings; incremental_json caps arrays, objects and members), and while it is
parsed, one body at a time, the decoded text (1-4x the body). That 64 MiB body peaks at +480 MB (was +1.8 GB).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from inference.errors import Reason, default_reason
from inference.http import incremental_json

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
T = TypeVar("T")

PARSED_BODY = "inference.parsed_body"  # request scope key: the guard's ParsedBody
# Bodies up to this size are parsed and validated on the event loop (well under a millisecond for what clients
# send; a few ms at worst); larger ones in the body thread. Chosen over a lower max_body_bytes: a trainer's
# /policy/lookup of a large batch is tens of MB (8M token ids), and a long-context prompt is a few MB.
INLINE_BODY_BYTES = 16 * 1024
# One thread parses and validates every large body, one body at a time: besides each request's own body and
# parsed value, at most one parse's working memory (the decoded text, up to 4 bytes per body byte) exists at once.
# Each step there holds the interpreter lock for about a millisecond (inference/http/incremental_json.py), so the event loop's
# thread gets it back within the interpreter's switch interval (5 ms).
_BODY_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-bodies")


async def in_body_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in the body thread. Cancelled while queued, it never runs; once running, it finishes."""
    return await asyncio.get_running_loop().run_in_executor(_BODY_THREAD, functools.partial(fn, *args))


class Refused(Exception):
    def __init__(self, status: int, message: str, reason: Reason | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason: Reason = reason or default_reason(status)


@dataclass
class ParsedBody:
    value: Any  # the JSON value (None if the body is not JSON)
    error: str | None  # why the body is not JSON: the route answers 400 with it
    size: int  # bytes: large bodies are validated off the event loop too (inference.http.intake.off_loop)


def check_json_body(raw: bytes | list[bytes], max_depth: int) -> ParsedBody:
    """The parsed body (given whole or in the chunks it came in), or Refused for a JSON body the routes must never
    see. An unparsable body is left to the route (which answers 400 with the parser's message)."""
    size = len(raw) if isinstance(raw, bytes) else sum(map(len, raw))
    try:
        value = incremental_json.parse(raw, max_depth)
    except (incremental_json.TooDeep, incremental_json.TooBig) as exc:
        raise Refused(413, str(exc)) from exc
    except incremental_json.Unsafe as exc:
        raise Refused(400, str(exc)) from exc
    except (ValueError, UnicodeDecodeError) as exc:
        return ParsedBody(None, str(exc), size)
    return ParsedBody(value, None, size)


class GcPause:
    """The cyclic garbage collector off while any holder needs it off. A collection walks every reference held
    by the containers it looks at, in one go: a maximal body's 9M token ids are ~0.1 s of held lock, at every
    minor collection while the body is young. So the collector is off while a large body is parsed, and while
    a body of GC_PAUSE_BYTES or more lives (GC_PAUSE_MAX_S at most): such bodies (a lookup, a prompt longer than
    the context) are answered in seconds and then freed a step at a time, never walked."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: set[object] = set()
        self._resume = False

    def hold(self) -> object:
        token = object()
        with self._lock:
            if not self._holders:
                self._resume = gc.isenabled()
                gc.disable()
            self._holders.add(token)
        return token

    def release(self, token: object) -> None:
        """Idempotent: the last holder's release turns the collector back on (if it was on)."""
        with self._lock:
            if token not in self._holders:
                return
            self._holders.discard(token)
            if not self._holders and self._resume:
                gc.enable()


GC_PAUSE_BYTES = 4 * 2**20  # ~600k token ids: walking fewer at a minor collection is ~10 ms
GC_PAUSE_MAX_S = 10.0
_GC_PAUSE = GcPause()


def _dispose(box: list[Any], token: object | None) -> None:
    try:
        incremental_json.dispose(box)
    finally:
        if token is not None:
            _GC_PAUSE.release(token)


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
            chunks, size = await self._read(scope, receive)
            parsed, pause = await self._parsed(chunks, size)
        except Refused as exc:
            await _answer(send, exc.status, exc.message, exc.reason)
            return
        scope[PARSED_BODY] = parsed
        replayed = 0

        async def replay() -> Message:  # the body as it came (never joined into one copy here)
            nonlocal replayed
            if replayed < len(chunks):  # _read gives one chunk at least
                replayed += 1
                return {
                    "type": "http.request",
                    "body": chunks[replayed - 1],
                    "more_body": replayed < len(chunks),
                }
            return await receive()  # after the body: disconnect notices

        try:
            await self.app(scope, replay, send)
        finally:
            del scope[PARSED_BODY]
            if size > INLINE_BODY_BYTES and parsed.value is not None:
                # Freed in the body thread a step at a time: 10M ids freed at once are 0.1 s of a held lock.
                box, parsed.value = [parsed.value], None
                _BODY_THREAD.submit(_dispose, box, pause)

    async def _parsed(self, chunks: list[bytes], size: int) -> tuple[ParsedBody, object | None]:
        """The checked body, and the GcPause token held while it lives (None: none held)."""
        if size <= INLINE_BODY_BYTES:
            return check_json_body(chunks, self.max_json_depth), None
        pause = _GC_PAUSE.hold()
        try:
            parsed = await in_body_thread(check_json_body, chunks, self.max_json_depth)
        except BaseException:
            _GC_PAUSE.release(pause)
            raise
        if size < GC_PAUSE_BYTES or parsed.value is None:
            _GC_PAUSE.release(pause)
            return parsed, None
        asyncio.get_running_loop().call_later(GC_PAUSE_MAX_S, _GC_PAUSE.release, pause)
        return parsed, pause

    async def _read(self, scope: Scope, receive: Receive) -> tuple[list[bytes], int]:
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
                return chunks, size


async def _answer(send: Send, status: int, message: str, reason: Reason) -> None:
    # The app's error shape (inference.app.error): `type` is the reason the request accounting counts.
    body = json.dumps({"error": {"message": message, "type": reason, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
