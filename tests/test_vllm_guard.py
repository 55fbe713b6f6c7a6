"""The key guard vLLM loads in front of its whole app: around a recording app, every path and method without the
right bearer key is refused before the app sees it; in vLLM's own app (built, not served, from the command line
the gateway starts), every route it has, the SageMaker ones included, answers 401 without the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import httpx
import pytest

from inference.config import GatewayConfig
from inference.samplers.vllm import VLLM_GUARD_MIDDLEWARE, build_vllm_command
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


# Run in a child: importing vLLM reconfigures logging. Builds vLLM's app from the gateway's own command line and
# environment (no engine, no server), then sends every route, with each of its methods, without the key, with a
# wrong one and with the right one.
VLLM_APP_PROBE = """
import json, os, sys
from starlette.testclient import TestClient
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.entrypoints.launchers.app import build_app

args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
app = build_app(args, ("generate",), None)
client = TestClient(app, raise_server_exceptions=False)
out = []
for route in app.routes:
    for method in sorted(getattr(route, "methods", None) or ["GET"]):
        path = route.path.replace("{", "").replace("}", "")
        codes = [
            client.request(method, path, json={}, headers=h).status_code
            for h in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer " + os.environ["VLLM_API_KEY"]})
        ]
        out.append([method, route.path, *codes])
print("ROUTES " + json.dumps({"middleware": args.middleware, "routes": out}))
"""


@pytest.mark.slow  # imports vLLM (~20 s)
def test_vllms_own_app_refuses_every_route_without_the_key():
    pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")
    argv, env = build_vllm_command(GatewayConfig(model="m"), "/models/m", 8123, KEY, serve_cli=False)
    vllm_args = argv[argv.index("--model") :]
    done = subprocess.run(
        [sys.executable, "-c", VLLM_APP_PROBE, *vllm_args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=240,
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("ROUTES ")), None)
    assert line is not None, done.stderr[-3000:]
    found = json.loads(line.removeprefix("ROUTES "))
    assert found["middleware"] == [VLLM_GUARD_MIDDLEWARE]
    routes = {(m, p): codes for m, p, *codes in found["routes"]}
    # The routes that answered anyone before the guard: vLLM checked its key only under /v1, /v2, ...
    for must in [("POST", "/adapters"), ("DELETE", "/adapters/{adapter_name}"), ("POST", "/invocations")]:
        assert must in routes, sorted(routes)
    open_ = {k: v for k, v in routes.items() if v[0] != 401 or v[1] != 401}
    assert not open_, f"answered without the key: {open_}"
    # With the key the request reaches vLLM's handlers (which fail here: no engine), so the guard let it through.
    assert all(v[2] != 401 for v in routes.values()), routes
    print(f"{len(routes)} (method, route) pairs refused without the key")
