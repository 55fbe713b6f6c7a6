"""Adapters served by name beside the policy versions: what the local Tinker-protocol service samples (each of its
training clients saves adapters of its own, all on this gateway's one base model).

Named adapters bypass the on-policy gate and the version ledger: no trainer of this gateway trains on what they
sample. They are loaded again after a vLLM restart like the live policies. Must not change the policy registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import Counter
from collections.abc import Iterator
from typing import Protocol

from fastapi import APIRouter, Request
from pydantic import ValidationError

from inference.errors import BackendError
from inference.http.intake import (
    json_object,
    off_loop,
    resolved_path,
    until_disconnect,
    validation_message,
)
from inference.http.sampling_bodies import ServedModel, check_backend_up, checked_generate
from inference.policy.registry import Policy, PolicyRegistry
from inference.samplers.solo_lane import SoloLane
from inference.wire import (
    NamedAdapterLoad,
    NamedAdapterLoaded,
    NamedAdapterUnload,
    NamedSampleResponse,
)

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
NAMED_VERSION = -1  # a named adapter is no policy version: the ledger never records it
# The base model in /eval/base/... (inference/http/evalroutes.py): no adapter may take its name.
BASE_TARGET = "base"


def lora_name_of(name: str) -> str:
    return f"named-{name}"  # the policies' LoRA names start "policy-": the two never collide


class NamedAdapters:
    """name -> the policy vLLM serves it as; requests running on each (an unload waits for none)."""

    def __init__(self) -> None:
        self._by_name: dict[str, Policy] = {}
        self.in_flight: Counter[str] = Counter()

    def get(self, name: str) -> Policy | None:
        return self._by_name.get(name)

    def add(self, name: str, adapter_path: str) -> Policy:
        policy = Policy(NAMED_VERSION, lora_name_of(name), adapter_path)
        self._by_name[name] = policy
        return policy

    def remove(self, name: str) -> Policy | None:
        return self._by_name.pop(name, None)

    def policies(self) -> list[Policy]:
        return list(self._by_name.values())

    def paths(self) -> dict[str, str]:
        return {name: str(p.adapter_path) for name, p in self._by_name.items()}

    def loaded(self, name: str) -> Policy:
        """The adapter served as `name`; 404 `adapter_not_loaded` when none is."""
        policy = self._by_name.get(name)
        if policy is None:
            raise BackendError(
                404,
                f"no adapter named {name!r:.120} is loaded (the gateway may have restarted): load it with "
                "POST /adapters/load, then send the request again",
                reason="adapter_not_loaded",
            )
        return policy

    @contextlib.contextmanager
    def running(self, name: str | None) -> Iterator[None]:
        """Count a request on adapter `name` (None: the base model) while it runs: /adapters/unload waits for none."""
        key = name or ""
        self.in_flight[key] += 1
        try:
            yield
        finally:
            self.in_flight[key] -= 1
            if self.in_flight[key] <= 0:
                del self.in_flight[key]


def check_name(name: object) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise BackendError(
            400,
            f"adapter name {name!r:.120}: use 1-100 letters, digits, '_', '.' or '-', starting with a letter or "
            "digit",
        )
    return name


class Host(ServedModel, Protocol):
    """What the routes use of the gateway (inference.app.Gateway)."""

    registry: PolicyRegistry
    named: NamedAdapters
    publish_lock: asyncio.Lock
    lane: SoloLane

    def authorized(self, request: Request) -> bool: ...


async def _load(gw: Host, name: str, path: str | None) -> NamedAdapterLoaded:
    """Validate and load `path` under `name`; the same name and path again is a no-op, another path a 409."""
    if name == BASE_TARGET:
        raise BackendError(
            400,
            f"adapter name {name!r} is reserved for the base model (sampled at /eval/{BASE_TARGET}/... and by "
            "/adapters/generate with adapter null); choose another name",
        )
    async with gw.publish_lock:  # one adapter load at a time, policies' and names' alike
        known = gw.named.get(name)
        if known is not None:
            if known.adapter_path == path:
                return NamedAdapterLoaded(name=name, lora_name=known.model_name, load_s=0.0, noop=True)
            raise BackendError(
                409,
                f"adapter name {name!r} serves {known.adapter_path} already, not {path}: unload it first or "
                "use a new name (reloading one name in place would reuse stale prefix-cache blocks)",
            )
        started = time.perf_counter()
        assert path is not None
        await asyncio.to_thread(gw.backend.validate_adapter, path)  # off the event loop (inference/app.py)
        policy = gw.named.add(name, path)
        try:
            await gw.backend.load_adapter(policy)
        except BackendError:
            gw.named.remove(name)
            raise
    return NamedAdapterLoaded(name=name, lora_name=policy.model_name, load_s=time.perf_counter() - started)


def named_routes(gw: Host) -> APIRouter:
    """Load, unload, list and sample named adapters. Loading and unloading need the publish token (off loopback);
    sampling is open like /generate."""
    router = APIRouter()
    backend, named = gw.backend, gw.named

    def authorize(request: Request, what: str) -> None:
        if not gw.authorized(request):
            raise BackendError(401, f"{what} needs 'Authorization: Bearer <inference.publish_token>'")

    @router.get("/adapters")
    async def listing() -> dict[str, dict[str, str]]:
        return {"adapters": named.paths()}

    @router.post("/adapters/load")
    async def load(request: Request) -> NamedAdapterLoaded:
        authorize(request, "loading an adapter")
        try:
            req = NamedAdapterLoad.model_validate(await json_object(request))
        except ValidationError as exc:
            raise BackendError(400, validation_message(exc)) from exc
        return await _load(gw, check_name(req.name), resolved_path(req.adapter_path))

    @router.post("/adapters/unload")
    async def unload(request: Request) -> dict[str, object]:
        authorize(request, "unloading an adapter")
        try:
            req = NamedAdapterUnload.model_validate(await json_object(request))
        except ValidationError as exc:
            raise BackendError(400, validation_message(exc)) from exc
        async with gw.publish_lock:
            # Checked under the lock, with no await before the removal: a request that starts after it gets a 404.
            if named.in_flight[req.name]:
                raise BackendError(
                    409,
                    f"adapter {req.name!r} has {named.in_flight[req.name]} request(s) running; unload it later",
                )
            policy = named.remove(req.name)
            if policy is not None:
                await backend.unload_adapter(policy)
        return {"name": req.name, "unloaded": policy is not None}

    @router.post("/adapters/generate")
    async def generate(request: Request) -> NamedSampleResponse:
        """/generate's vLLM dialect plus "adapter" (a name; null: the base model) and "prompt_logprobs"."""
        body = await json_object(request)
        adapter = body.pop("adapter", None)
        policy = gw.registry.base if adapter is None else named.loaded(check_name(adapter))
        with named.running(adapter):  # from the lookup on: an unload must not pull the adapter from under it
            _, req, _ = await off_loop(request, checked_generate, gw, body)
            check_backend_up(backend)
            async with gw.lane.enter(req.sampling.get("prompt_logprobs") is not None):
                samples = await until_disconnect(request, backend.sample(req, policy))
        return NamedSampleResponse(adapter=adapter, samples=samples)

    return router
