"""The routes the trainer calls: `/policy/publish`, `/policy/expect` (the on-policy gate and its quotas),
`/policy/refill`, `/policy/lookup` (which version sampled a sequence) and `GET /policy` (the gateway's state).
`gw` is inference.app.Gateway (not imported: app.py imports this module)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from pydantic import BaseModel, ValidationError

from inference.errors import BackendError
from inference.http.engine import require_lease
from inference.http.intake import STEP_IDS, json_object, lookup_request, off_loop, validation_message
from inference.wire import (
    ExpectRequest,
    ExpectResponse,
    LookupResponse,
    PolicyStatus,
    PublishRequest,
    PublishResponse,
    RefillRequest,
    RefillResponse,
)

log = logging.getLogger("inference.app")


async def look_up(gw: Any, sequences: list[list[int]]) -> list[int | None]:
    """Ledger versions, yielding to the event loop every STEP_IDS token ids hashed (a training batch's lookup
    hashes millions). A sequence longer than the context was never sampled here: None without hashing it."""
    context, hashed = gw.backend.max_model_len, 0
    versions: list[int | None] = []
    for i, seq in enumerate(sequences):
        if context is not None and len(seq) > context:
            versions.append(None)
            continue
        versions.append(gw.ledger.lookup(seq))
        hashed += len(seq)
        if hashed >= STEP_IDS or i % 1024 == 1023:
            hashed = 0
            await asyncio.sleep(0)
    return versions


def trainer_routes(gw: Any) -> APIRouter:
    """What the trainer calls: publish, expect and refill (token-protected off loopback), lookup, status."""
    router = APIRouter()
    registry = gw.registry

    @router.post("/policy/publish")
    async def publish(request: Request) -> PublishResponse:
        return await gw.publish(await owner_body(gw, request, PublishRequest, "publishing"))

    @router.post("/policy/expect")
    async def expect(request: Request) -> ExpectResponse:
        req = await owner_body(gw, request, ExpectRequest, "closing the gate")
        changed = gw.gate.set_quota(
            req.quota, req.refill_s, req.env_quotas, req.hold_s, req.lead, req.group_size, req.env_group_sizes
        )
        if req.version > registry.current.version:
            gw.gate.close(req.version, req.hold_s)
            return ExpectResponse(holding_for=req.version)
        if gw.gate.waiting_for is None and not changed and not req.batch_taken:
            # The quotas as they were, on an open gate (a mixed run's trainer re-sending them, a resumed trainer):
            # what the current version started still counts against them.
            return ExpectResponse(holding_for=None)
        spell = gw.gate.open()  # nothing newer is coming (the step made no update), or new quotas from now
        if spell is None:
            return ExpectResponse(holding_for=None)
        return ExpectResponse(holding_for=None, hold_s=spell.closed_s, held_requests=spell.held_requests)

    @router.post("/policy/refill")
    async def refill(request: Request) -> RefillResponse:
        req = await owner_body(gw, request, RefillRequest, "refilling")
        refilled = gw.gate.refill_envs(req.short)
        if refilled:
            log.info(
                "on-policy gate: refilled %s on version %d (short of their share)",
                refilled,
                registry.current.version,
            )
        return RefillResponse(refilled=refilled)

    @router.post("/policy/lookup")
    async def lookup(request: Request) -> LookupResponse:
        req = await off_loop(request, lookup_request, await json_object(request))
        return LookupResponse(versions=await look_up(gw, req.sequences))

    @router.get("/policy")
    async def status(request: Request) -> PolicyStatus:
        return policy_status(gw, request)

    return router


Body = TypeVar("Body", bound=BaseModel)


async def owner_body(gw: Any, request: Request, model: type[Body], what: str) -> Body:
    """The body of a call only the trainer (the publish token's holder, with the engine's lease) may make; the
    token is checked before the body is read: strangers learn nothing from a parse error."""
    if not gw.authorized(request):
        raise BackendError(401, f"{what} needs 'Authorization: Bearer <inference.publish_token>'")
    require_lease(gw, request, what)
    try:
        return model.model_validate(await json_object(request))
    except ValidationError as exc:
        raise BackendError(400, validation_message(exc)) from exc


def policy_status(gw: Any, request: Request) -> PolicyStatus:
    """GET /policy: versions, in-flight counts, the backend's state and the gate's counts."""
    backend = gw.backend
    state = PolicyStatus(
        instance=gw.instance,
        generation=gw.registry.generation,
        current_version=gw.registry.current.version,
        loaded_versions=[p.version for p in gw.registry.loaded()],
        in_flight=gw.registry.in_flight(),
        healthy=backend.ready,
        state=backend.state,
        restarts=backend.restarts,
        restart_reasons=list(getattr(backend, "restart_reasons", [])),
        requests_total=gw.stats.requests_total,
        rejected_total=gw.stats.rejected_total,
        rejected_by_reason=dict(gw.stats.rejected_by_reason),
        last_rejection=gw.stats.last_rejection,
        gate_waiting_for=gw.gate.waiting_for,
        gate_holding=gw.gate.holding,
        gate_held_total=gw.gate.held_total,
        gate_expired_total=gw.gate.expired_total,
        gate_deadline_passes_total=gw.gate.deadline_passes_total,
        gate_refills_total=gw.gate.refills_total,
        gate_carried_total=gw.gate.carried_total,
        gate_continuations_total=gw.gate.continuations_total,
        gate_group_passes_total=gw.gate.group_passes_total,
        gate_released_total=gw.gate.released_total,
        continuations_moved_total=gw.continuations_moved,
        gate_started_by_env=gw.gate.started_by_env(),
    )
    if gw.authorized(request):  # where vLLM listens and its PIDs are for the token's holders only
        state.backend_url = backend.url
        state.backend_pid = backend.pid
        state.backend_pids = getattr(backend, "pids", [backend.pid])
    return state
