"""The service's HTTP surface: the SDK's key check and refusal format, then one router per group of routes (server,
sessions, training, weights, external weights, sampling, and the REST routes of checkpoints.py), each a thin layer
over Service (app.py), which does the work."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rlcommon.browser_guard import BrowserGuard
from rlcommon.hosts import LOOPBACK_HOSTS
from trainer.service.app import API, Service
from trainer.service.checkpoints import (
    install,
    json_body,
)
from trainer.service.external_weights import external_weights_routes
from trainer.service.policies import MultiLora
from trainer.service.sampling import (
    sequence_ids,
)
from trainer.service.wire import (
    Result,
    UserError,
    body_field,
    call_of,
    decode_forward_backward,
)
from trainer.training.config import RunConfig


def new_model_id(body: dict[str, Any]) -> str:
    """A new training client's id: its session and its place among the session's clients."""
    return f"{body_field(body, 'session_id', str)}:train:{body_field(body, 'model_seq_id', int)}"


def build_app(cfg: RunConfig, policies: MultiLora) -> FastAPI:
    """The service: the SDK's key check and refusal format, then the routes, one router per group."""
    app = FastAPI(title="local Tinker-protocol service")
    service = Service(cfg, policies)
    app.state.service = service

    @app.exception_handler(UserError)
    async def refused(_: Request, exc: UserError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    # Outside the key check: a web page must not drive the service, key or no key (rlcommon/browser_guard.py).
    app.add_middleware(
        BrowserGuard,
        loopback_only=cfg.service.host in LOOPBACK_HOSTS,
        error_body=lambda status, message: json.dumps({"detail": message}).encode(),
    )

    @app.middleware("http")
    async def check_key(request: Request, call_next: Any) -> Response:
        key = cfg.service.api_key
        if key is not None and request.url.path.startswith(API) and request.headers.get("x-api-key") != key:
            return JSONResponse({"detail": "wrong or missing X-API-Key (service.api_key)"}, status_code=401)
        return await call_next(request)

    for routes in (
        server_routes,
        session_routes,
        training_routes,
        weights_routes,
        external_weights_routes,
        sampling_routes,
    ):
        app.include_router(routes(service))
    install(app, service)  # training runs and checkpoints over REST (trainer/service/checkpoints.py)
    return app


def server_routes(service: Service) -> APIRouter:
    """What the SDK asks before it opens a session: health, the one base model served, its client settings."""
    router, cfg = APIRouter(), service.cfg

    @router.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": cfg.model.path, "clients": len(service.models)}

    @router.get(f"{API}/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.get(f"{API}/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        return service.capabilities()

    @router.post(f"{API}/client/config")
    async def client_config() -> dict[str, Any]:
        return {"use_pyqwest_transport": False}

    @router.post(f"{API}/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}

    return router


def session_routes(service: Service) -> APIRouter:
    """A session's life (create, heartbeat, finish) and the futures every training or sampling call answers with."""
    router = APIRouter()

    @router.post(f"{API}/create_session")
    async def create_session() -> dict[str, str]:
        # the instance token keeps run ids (and their folders) of an earlier service apart from this one's; the
        # random part keeps one client from naming (and finishing, or training under) another client's session
        session_id = f"sess-{service.instance}-{secrets.token_hex(8)}"
        service.beats[session_id] = time.monotonic()
        service.start_reaper()
        return {"session_id": session_id}

    @router.post(f"{API}/session_heartbeat")
    async def heartbeat(request: Request) -> JSONResponse:
        session_id = body_field(await json_body(request), "session_id", str)
        if (
            session_id not in service.beats
        ):  # expired, closed, or from before a restart: the SDK stops beating
            return JSONResponse({"detail": f"session {session_id} has finished"}, status_code=410)
        service.beats[session_id] = time.monotonic()
        return JSONResponse({})

    @router.post(f"{API}/sessions/{{session_id}}/finish")
    async def finish(session_id: str) -> dict[str, Any]:
        service.end_session(session_id)
        return {}

    @router.post(f"{API}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        return await service.calls.retrieve(body_field(await json_body(request), "request_id", str))

    return router


def training_routes(service: Service) -> APIRouter:
    """Training clients: create one, describe it, and its forward(-backward) and optimizer calls, in seq_id order."""
    router = APIRouter()

    @router.post(f"{API}/create_model")
    async def create_model(request: Request) -> dict[str, str]:
        body = await json_body(request)
        model_id = new_model_id(body)
        base, lora = body.get("base_model"), body.get("lora_config") or {}
        if not isinstance(lora, dict):
            raise UserError(f"'lora_config' must be an object, got {lora!r}")
        service.calls.line(model_id)
        metadata = body.get("user_metadata")
        return {
            "request_id": service.calls.submit(
                lambda: service.create_model(model_id, str(base), lora, metadata)
            )
        }

    @router.post(f"{API}/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        return service.info(body_field(await json_body(request), "model_id", str))

    @router.post(f"{API}/forward_backward")
    async def forward_backward(request: Request) -> dict[str, str]:
        if request.headers.get("content-encoding") == "zstd":
            raise UserError("zstd-compressed bodies are not accepted (this service never asks for them)")
        model_id, seq_id, _, call = decode_forward_backward(
            await request.body(), service.policies.vocab_size, service.stability.get
        )

        def work() -> Result:
            if isinstance(call, UserError):
                raise call
            return service.forward_backward(call)

        return {"request_id": service.calls.submit(work, model_id, seq_id)}

    @router.post(f"{API}/optim_step")
    async def optim_step(request: Request) -> dict[str, str]:
        body = await json_body(request)
        model_id, seq_id = call_of(body)
        adam = body.get("adam_params")
        if adam is None and body.get("optimizer_params") is not None:
            raise UserError("only AdamParams are supported (optimizer_params of another type was sent)")
        return {
            "request_id": service.calls.submit(
                lambda: service.optim_step(model_id, seq_id, adam), model_id, seq_id
            )
        }

    return router


def weights_routes(service: Service) -> APIRouter:
    """Checkpoints (save_state, load_state into a client or a new one) and sampler weights (named, or an unnamed
    snapshot that a sampling session opens on)."""
    router = APIRouter()

    @router.post(f"{API}/save_weights")
    async def save_weights(request: Request) -> dict[str, str]:
        body = await json_body(request)
        (model_id, seq_id), name = call_of(body), body_field(body, "path", str)
        return {
            "request_id": service.calls.submit(
                lambda: service.save_state(model_id, name, body), model_id, seq_id
            )
        }

    @router.post(f"{API}/load_weights")
    async def load_weights(request: Request) -> dict[str, str]:
        body = await json_body(request)
        path, optimizer = body_field(body, "path", str), bool(body.get("optimizer", False))
        if "model_id" in body:
            model_id, seq_id = call_of(body)
            loaded = service.calls.submit(
                lambda: service.load_state(model_id, path, optimizer), model_id, seq_id
            )
            return {"request_id": loaded}
        new_id = new_model_id(body)
        service.calls.line(new_id)
        metadata = body.get("user_metadata")
        return {
            "request_id": service.calls.submit(lambda: service.load_state(new_id, path, optimizer, metadata))
        }

    @router.post(f"{API}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict[str, str]:
        body = await json_body(request)
        (model_id, seq_id), name = call_of(body), body.get("path")
        session_seq = body.get("sampling_session_seq_id")
        request_id = service.calls.submit(
            lambda: service.save_for_sampler(model_id, name, session_seq, body), model_id, seq_id
        )
        if not name:  # an unnamed snapshot: older ones go once it is saved
            service.drop_old_snapshots_after(request_id, model_id)
        return {"request_id": request_id}

    return router


def sampling_routes(service: Service) -> APIRouter:
    """Sampling sessions (the base model or saved sampler weights) and their samples, through the gateway."""
    router = APIRouter()

    @router.post(f"{API}/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, str]:
        return {"sampling_session_id": service.create_sampler(await json_body(request))}

    @router.get(f"{API}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        spec = service.samplers.get(sampler_id)
        if spec is None:
            raise UserError(f"no sampling session {sampler_id!r} here")
        return {"sampler_id": sampler_id, "base_model": service.cfg.model.path, "model_path": spec.model_path}

    @router.post(f"{API}/asample")
    async def asample(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        sampler_id = body_field(body, "sampling_session_id", str)
        n = body.get("num_samples", 1)
        count = n if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 1024 else 1
        ids = sequence_ids(sampler_id, body.get("seq_id"), count)
        return {
            "request_id": service.calls.submit_async(lambda: service.sample(body)),
            "sample_sequence_ids": ids,
        }

    return router
