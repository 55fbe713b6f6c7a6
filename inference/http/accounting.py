"""Counts the gateway's generation requests and the ones it refused, and logs each refusal (rate-limited), so GET
/policy and the log can explain an idle run. It watches answers on their way out; it never decides one."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Hashable
from datetime import UTC, datetime

from inference.errors import default_reason
from inference.http.body_guard import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("inference.requests")

GENERATION_ROUTES = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
MESSAGE_CHARS = 300  # of a refusal's message, in the log line and in last_rejection
ERROR_BODY_BYTES = 64 * 1024  # of an error answer read back for its message; the gateway's are far smaller
WARNINGS_PER_MINUTE = 3  # log lines per (route, reason) in each minute; the rest are counted, not printed


class LogLimiter:
    """Lets at most `burst` lines per key through in each `window_s` window and counts the rest; the next line let
    through for that key learns how many were held back, so a long run's log stays short and loses no count."""

    def __init__(self, burst: int, window_s: float, clock: Callable[[], float] = time.monotonic):
        self.burst = burst
        self.window_s = window_s
        self.clock = clock
        self._windows: dict[Hashable, tuple[float, int]] = {}  # key -> (window start, lines let through)
        self._held: Counter[Hashable] = Counter()

    def admit(self, key: Hashable) -> int | None:
        """None: stay quiet. Otherwise log, and the number is how many lines were held back for `key` since the
        last one let through."""
        now = self.clock()
        start, shown = self._windows.get(key, (now, 0))
        if now - start >= self.window_s:
            start, shown = now, 0
        if shown >= self.burst:
            self._held[key] += 1
            return None
        self._windows[key] = (start, shown + 1)
        return self._held.pop(key, 0)


def shorten(text: str, limit: int = MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RequestStats:
    """Generation requests seen and refused since the gateway started, by reason (inference.errors.Reason)."""

    def __init__(self, limiter: LogLimiter | None = None):
        self.requests_total = 0
        self.rejected_total = 0
        self.rejected_by_reason: Counter[str] = Counter()
        self.last_rejection: str | None = None
        self.limiter = limiter or LogLimiter(WARNINGS_PER_MINUTE, 60.0)

    def count_request(self) -> None:
        self.requests_total += 1

    def reject(self, route: str, status: int, reason: str, message: str) -> None:
        message = shorten(" ".join(message.split()))  # one line, whatever vLLM put in its message
        self.rejected_total += 1
        self.rejected_by_reason[reason] += 1
        at = datetime.now(UTC).isoformat(timespec="seconds")
        self.last_rejection = f"{at} {route} {status} {reason}: {message}"
        held = self.limiter.admit((route, reason))
        if held is None:
            return
        unlogged = f" [{held} more {reason} refusals of {route} not logged]" if held else ""
        log.warning("refused %s with %d (%s): %s%s", route, status, reason, message, unlogged)


class RequestAccounting:
    """ASGI middleware, outermost: counts every request to a generation route and records every answer >= 400,
    whoever gave it (the body guard, a route's validation, vLLM's refusal passed back, an unexpected exception).
    The reason is the `type` the gateway writes into its error bodies."""

    def __init__(self, app: ASGIApp, stats: RequestStats):
        self.app = app
        self.stats = stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = scope.get("path", "")
        if scope["type"] != "http" or route not in GENERATION_ROUTES:
            await self.app(scope, receive, send)
            return
        self.stats.count_request()
        answer = _ErrorAnswer()

        async def watched(message: Message) -> None:
            answer.observe(message)
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:  # Starlette answers 500 further out; count it here, then let it go on
            self.stats.reject(route, 500, "internal_error", repr(exc))
            raise
        if answer.status >= 400:
            reason, message = answer.reason_and_message()
            self.stats.reject(route, answer.status, reason, message)


class _ErrorAnswer:
    """The status of an answer and, for an error, the start of its body."""

    def __init__(self) -> None:
        self.status = 0
        self.body = b""

    def observe(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
        elif message["type"] == "http.response.body" and self.status >= 400:
            room = ERROR_BODY_BYTES - len(self.body)
            if room > 0:
                self.body += bytes(message.get("body", b""))[:room]

    def reason_and_message(self) -> tuple[str, str]:
        """From the gateway's error body {"error": {"message", "type"}}; from the status for any other body."""
        try:
            error = json.loads(self.body)["error"]
            message, reason = error["message"], error.get("type")
            if isinstance(message, str):
                return (reason if isinstance(reason, str) else default_reason(self.status)), message
        except (ValueError, KeyError, TypeError):
            pass
        return default_reason(self.status), self.body.decode("utf-8", "replace")
