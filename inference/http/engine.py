"""A shared engine's routes (`launch.sh engine`, GatewayConfig.engine): runs attach to the gateway one at a time.

- `POST /engine/attach` (publish token): the run's lease id, its model's identity and its staleness window. The
  engine refuses another model or tokenizer than its own (both named), a window wider than the versions it keeps,
  and any run while another holds the lease (named, with when it lapses). A newly granted lease starts a clean run:
  the base model current, every adapter of the previous run unloaded, the ledger, the gate and its quota reset, and
  the run's LoRA names its own (policy-r<N>-v<version>), so nothing of one run is served or attributed in the next.
- `POST /engine/renew` every few seconds, `POST /engine/release` at the end; a run that dies lapses after
  `lease_ttl_s`.
- `GET /engine`: what the engine serves; who holds it, for the publish token's holders.

Publishing, closing the gate and refilling need the current lease (`X-Engine-Lease`): a run that lost its lease can
no longer steer what the next run samples.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from inference.errors import BackendError
from inference.http.intake import json_object, validation_message
from inference.policy.lease import LeaseBook, LeaseHeld
from inference.wire import (
    LEASE_HEADER,
    AttachRequest,
    AttachResponse,
    EngineStatus,
    LeaseRequest,
    LeaseStatus,
)
from rlcommon.model_identity import ModelIdentity, model_identity

log = logging.getLogger("inference.engine")


def require_lease(gw: Any, request: Request, what: str) -> None:
    """On an engine, `what` needs the caller to hold the current lease (409 `no_lease` otherwise)."""
    leases: LeaseBook | None = gw.leases
    if leases is None:
        return
    now = time.monotonic()
    if leases.holds(request.headers.get(LEASE_HEADER), now):
        return
    lease = leases.current(now)
    held = "no run holds it" if lease is None else f"it is leased to {lease.who}"
    raise BackendError(
        409,
        f"{what} on this shared engine needs its lease ({LEASE_HEADER}), and {held}: attach the run first "
        "(bash launch.sh ENV inference.engine_url=URL)",
        reason="no_lease",
    )


async def start_run(gw: Any, run: int) -> list[str]:
    """A newly attached run: the base model current, nothing of the previous run loaded, counted or gated."""
    async with gw.publish_lock, gw.cleanup_lock:
        held = gw.registry.start_run(run)
        gw.ledger.clear(gw.registry.timeline)
        gw.gate.set_quota(None, 1.0)
        gw.gate.open()  # whatever the previous run's gate held goes through on the base model
        gw.continuations_moved = 0
        named = [p for p in (gw.named.remove(n) for n in list(gw.named.paths())) if p is not None]
        unloaded = []
        for policy in held + named:
            try:
                await gw.backend.unload_adapter(policy)
                unloaded.append(policy.model_name)
            except BackendError as exc:  # a restarted vLLM holds none of them: nothing to free
                log.warning("unloading %s of the previous run failed: %s", policy.model_name, exc.message)
    return unloaded


def _book(gw: Any) -> LeaseBook:
    if gw.leases is None:
        raise BackendError(404, "this gateway is no shared engine (start one with: bash launch.sh engine)")
    leases: LeaseBook = gw.leases
    return leases


def _authorize(gw: Any, request: Request, what: str) -> None:
    if not gw.authorized(request):
        raise BackendError(401, f"{what} needs 'Authorization: Bearer <the engine's publish token>'")


def _body_of(model: type[Any], raw: Any) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise BackendError(400, validation_message(exc)) from exc


def _status(gw: Any, served: Callable[[], ModelIdentity], request: Request | None) -> EngineStatus:
    """What the engine serves; who holds it only for the token's holders (request None: the attaching run)."""
    cfg, leases, now = gw.cfg, _book(gw), time.monotonic()
    lease = leases.current(now)
    state = EngineStatus(
        instance=gw.instance,
        model=served(),
        keep_versions=cfg.keep_versions,
        named_slots=cfg.named_slots,
        vllm_dtype=cfg.vllm.dtype,
        vllm=cfg.vllm.model_dump(mode="json", exclude={"api_key"}),
        lease_ttl_s=leases.ttl_s,
        runs=leases.runs,
        lapsed=leases.lapsed,
    )
    if lease is not None and (request is None or gw.authorized(request)):
        state.lease = LeaseStatus(
            who=lease.who, held_s=now - lease.acquired_at, expires_in_s=leases.expires_in(now)
        )
    return state


def _refuse_unfit(req: AttachRequest, served: ModelIdentity, keep_versions: int) -> None:
    """409 for a run of another model, or one whose staleness window needs more versions than the engine keeps."""
    differs = req.model.mismatch(served)
    if differs is not None:
        raise BackendError(
            409,
            f"this engine serves {served.name}; the run's model is {req.model.name}, whose {differs} "
            "differs: attach a run of the engine's model, or start an engine for this one "
            "(bash launch.sh engine --config FILE)",
            reason="model_mismatch",
        )
    if req.max_staleness > keep_versions:
        raise BackendError(
            409,
            f"the run's rollout.max_staleness={req.max_staleness} needs {req.max_staleness} versions kept "
            f"loaded; this engine keeps {keep_versions} (start it with inference.keep_versions="
            f"{req.max_staleness} or lower the run's rollout.max_staleness)",
            reason="engine_too_small",
        )


def _grant(leases: LeaseBook, req: AttachRequest) -> bool:
    """The lease for the run (True when that starts a new run); 409 naming the holder while another holds it."""
    try:
        return leases.attach(req.holder, req.who, time.monotonic())
    except LeaseHeld as held:
        raise BackendError(
            409,
            f"this engine is leased to {held.lease.who}; the lease lapses in {held.expires_in_s:.0f} s unless "
            "that run renews it: wait for the run to end (or attach with --wait)",
            reason="lease_held",
            retry_after=max(1.0, held.expires_in_s),
            detail={"expires_in_s": held.expires_in_s},
        ) from None


def engine_routes(gw: Any) -> APIRouter:
    router = APIRouter()
    identity: dict[str, ModelIdentity] = {}

    def served() -> ModelIdentity:
        if "model" not in identity:  # read once: config.json, the tokenizer's files, the weights' sizes
            identity["model"] = model_identity(gw.cfg.model)
        return identity["model"]

    @router.get("/engine")
    async def engine(request: Request) -> EngineStatus:
        return _status(gw, served, request)

    @router.post("/engine/attach")
    async def attach(request: Request) -> AttachResponse:
        _authorize(gw, request, "attaching a run")
        req: AttachRequest = _body_of(AttachRequest, await json_object(request))
        leases = _book(gw)
        _refuse_unfit(req, served(), gw.cfg.keep_versions)
        new_run = _grant(leases, req)
        unloaded: list[str] = []
        if new_run:
            unloaded = await start_run(gw, leases.runs - 1)  # the first run keeps the plain names
            log.info("run %d attached: %s (unloaded %s)", leases.runs, req.who, unloaded)
        return AttachResponse(engine=_status(gw, served, None), new_run=new_run, unloaded=unloaded)

    @router.post("/engine/renew")
    async def renew(request: Request) -> dict[str, Any]:
        _authorize(gw, request, "renewing a lease")
        req: LeaseRequest = _body_of(LeaseRequest, await json_object(request))
        leases, now = _book(gw), time.monotonic()
        if not leases.renew(req.holder, now):
            lease = leases.current(now)
            held = "it lapsed" if lease is None else f"{lease.who} holds it now"
            raise BackendError(409, f"this run no longer holds the engine's lease: {held}", reason="no_lease")
        return {"expires_in_s": leases.expires_in(now)}

    @router.post("/engine/release")
    async def release(request: Request) -> dict[str, Any]:
        _authorize(gw, request, "releasing a lease")
        req: LeaseRequest = _body_of(LeaseRequest, await json_object(request))
        released = _book(gw).release(req.holder, time.monotonic())
        if released:
            log.info("the engine's lease was released by its run")
        return {"released": released}

    return router
