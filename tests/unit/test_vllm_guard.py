"""The key guard vLLM loads in front of its whole app: around a recording app, every path and method without the
right bearer key is refused before the app sees it; in vLLM's own app (built, not served, from the command line
the gateway starts), every route it has, the SageMaker ones included, answers 401 without the key."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from inference.samplers.vllm_guard import KeyGuard, Message, Receive, Scope, Send

KEY = "right-key-0123456789"
PATHS = [
    "/",
    "/health",
    "/ping",
    "/metrics",
    "/docs",
    "/openapi.json",
    "/adapters",
    "/adapters/policy-v1",
    "/invocations",
    "/v1/models",
    "/v1/completions",
    "/V1/models",
    "//adapters",
    "/adapters/..%2f..%2fv1",
    "/some/route/vllm/adds/later",
]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]


class Recorder:
    """The app behind the guard: answers 200 and remembers every scope that reached it."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.seen.append(f"{scope['type']} {scope.get('method', '')} {scope.get('path', '')}".strip())
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"inner"})


def guarded() -> tuple[httpx.AsyncClient, Recorder]:
    inner = Recorder()
    transport = httpx.ASGITransport(app=KeyGuard(inner, key=KEY))
    return httpx.AsyncClient(transport=transport, base_url="http://vllm"), inner


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Bearer wrong-key",
        f"Bearer {KEY}x",
        f"Bearer {KEY[:-1]}",
        f"Basic {KEY}",
        KEY,
        f"Bearer {KEY} extra",
        "Bearer ",
    ],
)
async def test_every_path_and_method_without_the_key_is_refused(authorization):
    client, inner = guarded()
    headers = {} if authorization is None else {"Authorization": authorization}
    async with client:
        for path in PATHS:
            for method in METHODS:
                r = await client.request(method, path, headers=headers, json={"name": "x", "src": "/tmp"})
                assert r.status_code == 401, (method, path, authorization, r.status_code)
                if method != "HEAD":
                    assert "Authorization: Bearer" in r.json()["error"]["message"]
                    assert KEY not in r.text
    assert inner.seen == []


async def test_the_right_key_passes_through_on_every_path():
    client, inner = guarded()
    async with client:
        for path in PATHS:
            for method in METHODS:
                for scheme in ("Bearer", "bearer"):
                    r = await client.request(method, path, headers={"Authorization": f"{scheme} {KEY}"})
                    assert r.status_code == 200 and (method == "HEAD" or r.text == "inner"), (method, path)
    assert len(inner.seen) == len(PATHS) * len(METHODS) * 2


async def test_two_authorization_headers_are_refused_even_if_one_is_right():
    client, inner = guarded()
    async with client:
        headers = [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer other")]
        r = await client.get("/health", headers=headers)
    assert r.status_code == 401 and inner.seen == []


async def call(guard: KeyGuard, scope: Scope) -> list[Message]:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "websocket.connect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await guard(scope, receive, send)
    return sent


async def test_websockets_without_the_key_are_closed_before_the_app_and_lifespan_passes():
    inner = Recorder()
    guard = KeyGuard(inner, key=KEY)
    ws: dict[str, Any] = {"type": "websocket", "path": "/v1/realtime", "headers": []}
    assert await call(guard, ws) == [{"type": "websocket.close", "code": 1008}]
    assert await call(guard, {**ws, "headers": [(b"authorization", b"Bearer nope")]}) == [
        {"type": "websocket.close", "code": 1008}
    ]
    assert inner.seen == []
    await call(guard, {**ws, "headers": [(b"authorization", f"Bearer {KEY}".encode())]})
    await call(guard, {"type": "lifespan"})
    assert inner.seen == ["websocket  /v1/realtime", "lifespan"]


def test_the_key_comes_from_vllms_environment_and_none_means_no_start(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    assert KeyGuard(Recorder())._key == KEY.encode()
    for empty in ("", "  "):
        monkeypatch.setenv("VLLM_API_KEY", empty)
        with pytest.raises(RuntimeError, match="VLLM_API_KEY is empty or unset"):
            KeyGuard(Recorder())
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(RuntimeError, match="VLLM_API_KEY"):
        KeyGuard(Recorder())
