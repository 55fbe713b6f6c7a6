"""Routes that sample one fixed target for an evaluation: /eval/{target}/..., where the target is `base` (the base
model) or the name of an adapter loaded with POST /adapters/load (named_adapters.py). An evaluation's environment process is
given `<gateway>/eval/<target>/v1` as its OpenAI base URL (atroposlib finds /generate and /health beside it).

They answer the bodies /generate and the OpenAI routes take, with the same checks, but bypass the on-policy gate, its
quota and the version ledger: an evaluation must neither wait for the trainer's next version nor take a rollout's
place in its batch, and no trainer trains on what it samples. Must not touch the policy registry or the gate.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from inference.errors import BackendError
from inference.http.intake import until_disconnect
from inference.http.named_adapters import BASE_TARGET, Host
from inference.http.sampling_bodies import (
    check_backend_up,
    generate_answer,
    read_generate,
    read_openai,
    scores_prompt,
)
from inference.policy.registry import Policy

EVAL_TARGET_HEADER = "X-Eval-Target"  # in place of X-Policy-Version: a target is no policy version
T = TypeVar("T")


class EvalHost(Host, Protocol):
    """What the routes use of the gateway (inference.app.Gateway)."""


def target_policy(gw: EvalHost, target: str) -> Policy:
    """The base model for `base`, else the named adapter (404 `adapter_not_loaded` if none has that name)."""
    return gw.registry.base if target == BASE_TARGET else gw.named.loaded(target)


def adapter_of(target: str) -> str | None:
    """The key /adapters/unload counts running requests under (None: the base model, never unloaded)."""
    return None if target == BASE_TARGET else target


async def sampled(gw: EvalHost, request: Request, scoring: bool, work: Callable[[], Awaitable[T]]) -> T:
    """work() alone in the engine where it scores the prompt (inference/samplers/solo_lane.py), cancelled if the client
    goes away. No gate, no quota: an evaluation never waits for the trainer."""
    check_backend_up(gw.backend)
    async with gw.lane.enter(scoring):
        return await until_disconnect(request, work())


def answer(body: Any, target: str) -> JSONResponse:
    return JSONResponse(body, headers={EVAL_TARGET_HEADER: target})


def eval_routes(gw: EvalHost) -> APIRouter:
    """/eval/{target}/health, /generate (both dialects), /v1/completions, /v1/chat/completions and /v1/models. A
    request counts as running on its adapter from the lookup on: /adapters/unload refuses it until it returns."""
    router = APIRouter(prefix="/eval/{target}")
    backend, named = gw.backend, gw.named

    @router.get("/health")
    async def health(target: str) -> JSONResponse:
        target_policy(gw, target)
        if not backend.ready:
            raise BackendError(503, f"sampling backend is {backend.state}")
        return answer({"status": "ok", "eval_target": target}, target)

    @router.post("/generate")
    async def generate(target: str, request: Request) -> JSONResponse:
        policy = target_policy(gw, target)
        with named.running(adapter_of(target)):
            dialect, req = await read_generate(gw, request, f"/eval/{target}/generate")
            scoring = req.sampling.get("prompt_logprobs") is not None
            samples = await sampled(gw, request, scoring, lambda: backend.sample(req, policy))
        return answer(generate_answer(dialect, req, samples, None), target)

    async def openai(target: str, request: Request, path: str) -> JSONResponse:
        policy = target_policy(gw, target)
        with named.running(adapter_of(target)):
            body = await read_openai(gw, request, f"/eval/{target}{path}")
            result = await sampled(
                gw, request, scores_prompt(body), lambda: backend.forward(path, body, policy)
            )
        result["eval_target"] = target  # where /v1/... answers carry policy_version
        return answer(result, target)

    @router.post("/v1/completions")
    async def completions(target: str, request: Request) -> JSONResponse:
        return await openai(target, request, "/v1/completions")

    @router.post("/v1/chat/completions")
    async def chat_completions(target: str, request: Request) -> JSONResponse:
        return await openai(target, request, "/v1/chat/completions")

    @router.get("/v1/models")
    async def models(target: str) -> JSONResponse:
        target_policy(gw, target)
        entry = {
            "id": target,
            "object": "model",
            "owned_by": "gateway",
            "max_model_len": backend.max_model_len,
        }
        return answer({"object": "list", "data": [entry]}, target)

    return router
