"""The key check in front of the whole of vLLM's app, loaded inside vLLM's process (`--middleware`): every HTTP and
WebSocket request must carry `Authorization: Bearer $VLLM_API_KEY`, whatever its path or method; else 401.

Why a guard on every path: vLLM 0.32 checks its key only under /v1, /v2, /inference and /cohere, so its SageMaker
routes (POST /adapters loads any LoRA, DELETE /adapters/<name> unloads one, POST /invocations samples) answered
anyone on the loopback. An allow-list of guarded prefixes misses every route vLLM adds later; refusing all that
lacks the key does not, and costs nothing: the gateway sends the key on every call, its /health probe included.
It runs in vLLM's interpreter and is imported by name, so it imports the standard library only.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

KEY_ENV = "VLLM_API_KEY"
POLICY_VIOLATION = (
    1008  # WebSocket close code; closed before accept, the server answers the handshake with 403
)


def bearer_matches(headers: list[tuple[bytes, bytes]], key: bytes) -> bool:
    """Exactly one Authorization header, of the Bearer scheme, whose token is `key` (compared in constant time)."""
    values = [v for name, v in headers if name.lower() == b"authorization"]
    if len(values) != 1:
        return False
    scheme, _, token = values[0].strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


class KeyGuard:
    """Pure ASGI middleware; vLLM builds it with the app alone (`app.add_middleware(KeyGuard)`), so the key comes
    from the environment vLLM was started with. No key means no start: an open vLLM is never the fallback."""

    def __init__(self, app: ASGIApp, key: str | None = None) -> None:
        key = os.environ.get(KEY_ENV, "") if key is None else key
        if not key.strip():
            raise RuntimeError(
                f"inference.samplers.vllm_guard: {KEY_ENV} is empty or unset in vLLM's environment; vLLM with this "
                f"middleware answers only key holders. Start it through the gateway (it sets a random key) or "
                f"export {KEY_ENV}."
            )
        self.app = app
        self._key = key.strip().encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or bearer_matches(scope.get("headers") or [], self._key):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": POLICY_VIOLATION})
        else:
            await self._refuse(scope, send)

    @staticmethod
    async def _refuse(scope: Scope, send: Send) -> None:
        # vLLM's error shape, so the gateway's own error reporting reads the message if its key were ever wrong.
        where = f"{scope.get('method', '?')} {scope.get('path', '?')}"
        message = (
            f"{where}: missing or wrong 'Authorization: Bearer <{KEY_ENV}>'; vLLM answers only the gateway"
        )
        body = json.dumps({"error": {"message": message, "type": "Unauthorized", "code": 401}}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
