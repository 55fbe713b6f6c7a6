"""The gateway's HTTP surface, built by create_app(config, backend, ...): the one server environments talk to.

Routes are thin: parse and validate the body, pick the current policy, call the sampling backend, record which
version produced each completion. The backend (local vLLM, later Tinker) does the sampling.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import secrets
import time
from array import array
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from inference.config import GatewayConfig
from inference.errors import BackendError, Reason, default_reason
from inference.http.accounting import LogLimiter, RequestAccounting, RequestStats
from inference.http.body_guard import BodyGuard, in_body_thread
from inference.http.engine import engine_routes
from inference.http.evalroutes import eval_routes
from inference.http.intake import (
    request_env,
    resolved_path,
    respond,
    until_disconnect,
    validation_message,
)
from inference.http.named_adapters import NamedAdapters, named_routes
from inference.http.sampling_bodies import (
    check_backend_up,
    generate_answer,
    read_generate,
    read_openai,
    scores_prompt,
)
from inference.http.token_in_generate import token_in_generate_routes
from inference.http.tokenize_chat import tokenize_chat_routes
from inference.http.trainer_routes import trainer_routes
from inference.policy.gate import Gate
from inference.policy.lease import LeaseBook
from inference.policy.probe_check import (
    margin,
)
from inference.policy.registry import Policy, PolicyRegistry, Recorded, VersionLedger
from inference.samplers.solo_lane import SoloLane, scoring_runs_alone
from inference.verification import PublishVerifier
from inference.wire import (
    PublishRequest,
    PublishResponse,
    Sample,
    SamplingRequest,
)
from rlcommon.browser_guard import BrowserGuard
from rlcommon.hosts import LOOPBACK_HOSTS

log = logging.getLogger("inference.app")
INLINE_CONTINUATION_IDS = 4096  # prompt ids matched against the ledger on the event loop (Gateway.episode_of)


class SamplingBackend(Protocol):
    @property
    def url(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def restarts(self) -> int: ...
    @property
    def max_model_len(self) -> int | None: ...

    @property
    def ready(self) -> bool: ...
    @property
    def pid(self) -> int | None: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def sample(self, req: SamplingRequest, policy: Policy) -> list[Sample]: ...
    async def forward(self, path: str, body: dict[str, Any], policy: Policy) -> dict[str, Any]: ...
    def validate_adapter(self, path: str) -> None: ...
    async def load_adapter(self, policy: Policy) -> None: ...
    async def unload_adapter(self, policy: Policy) -> None: ...


def error(
    status: int, message: str, reason: Reason | None = None, detail: dict[str, Any] | None = None
) -> JSONResponse:
    """OpenAI's error shape; `type` is the reason key the request accounting counts (inference.errors.Reason)."""
    body = {"message": message, "type": reason or default_reason(status), "code": status, **(detail or {})}
    return JSONResponse({"error": body}, status_code=status)


class Gateway:
    """State shared by the routes: policies, ledger, limits."""

    def __init__(
        self,
        cfg: GatewayConfig,
        backend: SamplingBackend,
        registry: PolicyRegistry,
        vocab_size: int,
        named: NamedAdapters | None = None,
    ):
        self.cfg = cfg
        self.backend = backend
        self.registry = registry
        self.named = (
            named or NamedAdapters()
        )  # the Tinker-protocol service's adapters (inference/http/named_adapters.py)
        self.ledger = VersionLedger(cfg.ledger_size, registry.timeline)
        self.instance = secrets.token_hex(8)  # tells a client this gateway from one restarted since
        self.vocab_size = vocab_size
        self.publish_lock = asyncio.Lock()
        self.cleanup_lock = asyncio.Lock()
        # Prompt scoring runs alone in vLLM where it must (inference/samplers/solo_lane.py).
        self.lane = SoloLane(scoring_runs_alone(cfg))
        # Holds new requests while the trainer publishes the next version (inference/policy/gate.py).
        self.gate = Gate(lambda: registry.in_flight().get(registry.current.version, 0))
        self.stats = RequestStats()
        self.continuations_moved = 0  # episode turns sampled on another version than their episode's
        self.stop_notices = LogLimiter(burst=1, window_s=60.0)  # one INFO line per route and minute
        self.verifier = PublishVerifier(backend, self.lane, registry)
        # A shared engine's lease (inference/http/engine.py): None for a run's own gateway.
        self.leases = LeaseBook(cfg.lease_ttl_s) if cfg.engine else None

    def note_moved_stop_ids(self, route: str, ids: list[int]) -> None:
        """Say (at most once a minute per route) that integer stop entries became stop_token_ids: a rewrite of
        what the client sent must be visible, but an environment sends it with every request."""
        if not ids:
            return
        held = self.stop_notices.admit(route)
        if held is not None:
            more = f" ({held} more such requests since the last notice)" if held else ""
            log.info(
                "%s: integer stop entries %s moved to stop_token_ids (vLLM takes only strings in stop)%s",
                route,
                ids,
                more,
            )

    def validate_tokens(self, ids: list[int], max_tokens: int, field: str) -> None:
        bad = None
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):  # min/max: C loops, for long prompts
            bad = next((t for t in ids if t < 0 or t >= self.vocab_size), None)
        if bad is not None:
            raise BackendError(
                400, f"{field}: token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            )
        limit = self.backend.max_model_len
        if limit is not None and len(ids) + max_tokens > limit:
            raise BackendError(
                400,
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"context of {limit} tokens; lower max_tokens or shorten the prompt",
                reason="prompt_too_long",
            )

    def authorized(self, request: Request) -> bool:
        """The caller holds the publish token (anyone does when none is set: loopback only)."""
        if self.cfg.publish_token is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.cfg.publish_token}".encode())

    async def run(
        self,
        coro_fn: Any,
        request: Request | None = None,
        solo: bool = False,
        n: int = 1,
        prompt_ids: list[int] | None = None,
        prompt: Any = None,
    ) -> tuple[Any, Policy]:
        """Run a backend call on the current policy, keeping that policy loaded until the call returns. With the
        client's `request`, the call is cancelled (and vLLM aborts its work) when the client goes away; `solo`
        runs it alone in the engine (inference/samplers/solo_lane.py). A route that knows its prompt's token ids
        before sampling passes them as `prompt_ids`: a prompt that continues an episode (it starts with a turn the
        ledger recorded) passes the on-policy gate and its quota and is sampled on the version that sampled that
        turn while it is loaded (inference/policy/gate.py). Under a quota the prompt (`prompt`, else the token
        ids) names the request's group (group_key), so that a group asked for one rollout at a time is admitted
        whole; without one nothing is hashed."""
        check_backend_up(self.backend)
        episode = None if prompt_ids is None else await self.episode_of(prompt_ids)
        env = None if request is None else request_env(request)
        if episode is not None:
            self.gate.admit_continuation()
            group = None  # admitted with its episode's first turn, outside every group
        else:
            named = prompt if prompt is not None else prompt_ids
            group = None if named is None or self.gate.quota is None else group_key(named)
            await (
                self.gate.wait(n, env, group)
                if request is None
                else until_disconnect(request, self.gate.wait(n, env, group))
            )
        async with self.lane.enter(solo):
            return await self._run_on_policy(coro_fn, request, episode, env, group)

    async def episode_of(self, prompt_ids: list[int]) -> Recorded | None:
        """The episode turn `prompt_ids` continue (VersionLedger.continued). A long prompt is matched in the body
        thread: it costs a digest per distinct recorded length up to its own (about 25 ms for a 32k-token prompt
        against a full ledger), which would stall every other request on the event loop."""
        if len(prompt_ids) <= INLINE_CONTINUATION_IDS:
            return self.ledger.continued(prompt_ids)
        return await in_body_thread(self.ledger.continued, prompt_ids)

    async def _run_on_policy(
        self,
        coro_fn: Any,
        request: Request | None,
        episode: Recorded | None,
        env: str | None,
        group: str | None,
    ) -> tuple[Any, Policy]:
        # Chosen now, after any wait for the lane: the episode's version may have been unloaded meanwhile.
        policy = self.registry.acquire(episode)
        if episode is not None and not episode.sampled_by(policy):
            self.continuations_moved += 1  # its episode's version is gone: sampled on the current one
        self.gate.request_started(env, group)
        try:
            if request is None:
                return await coro_fn(policy), policy
            return await until_disconnect(request, coro_fn(policy)), policy
        finally:
            self.registry.release(policy)
            self.gate.request_done(env, group)
            if self.registry.removable():
                asyncio.get_running_loop().create_task(self.unload_stale())

    async def unload_stale(self) -> list[int]:
        removed = []
        async with self.cleanup_lock:
            for policy in self.registry.removable():
                # An episode's later turn may have taken one of them while an earlier unload was awaited.
                if policy not in self.registry.removable():
                    continue
                self.registry.remove(policy)
                removed.append(policy.version)
                try:
                    await self.backend.unload_adapter(policy)
                except BackendError as exc:  # a leaked slot is not worth failing a request over
                    log.warning("unloading %s failed: %s", policy.model_name, exc.message)
        return removed

    def record(self, prompt_ids: list[int], completion_ids: list[int], policy: Policy) -> None:
        self.ledger.record(prompt_ids, completion_ids, policy.version, policy.generation)

    async def publish(self, req: PublishRequest) -> PublishResponse:
        """Make req.version current: a newer version (loaded first), the current one again (a retried publish:
        nothing happens), or with replace_newer an older one (a rollback: every newer version is retracted). With
        a probe, the loaded adapter must reproduce the trainer's logprobs before it serves anything (422 if not).
        Opens the on-policy gate when the version it waits for (or any rollback) becomes current."""
        path = resolved_path(req.adapter_path)
        async with self.publish_lock:
            policy, needs_load = self._publish_target(req, path)
            if policy == self.registry.current:
                log.info("version %d is current already with %s: nothing to do", req.version, path)
                self._open_gate_if_due(req)
                return PublishResponse(
                    version=req.version, lora_name=policy.model_name, load_s=0.0, unloaded=[], noop=True
                )
            started = time.perf_counter()
            noise = None if req.probe is None else await self.verifier.calibrate(req.probe)
            if needs_load:
                assert req.adapter_path is not None  # only version 0 has none, and it is never loaded
                # In a worker thread: reading a large adapter must not stall every other request and /health.
                await asyncio.to_thread(self.backend.validate_adapter, req.adapter_path)
                await self.backend.load_adapter(policy)
            check, verify_s = (
                (None, None)
                if req.probe is None
                else await self.verifier.verify(policy, req.probe, needs_load, noise)
            )
            retracted = self.registry.make_current(policy)
            load_s = time.perf_counter() - started
            closing = self._open_gate_if_due(req, new_version=True)
        unloaded = await self.unload_stale()
        log.info(
            "published version %d as %s in %.3fs (retracted %s, unloaded %s%s%s)",
            req.version,
            policy.model_name,
            load_s,
            [p.version for p in retracted],
            unloaded,
            "" if check is None else f"; verified: {check.describe()}",
            ""
            if closing is None
            else f"; held {closing.held_requests} request(s) for {closing.closed_s:.3f}s and let "
            f"{closing.continuations} episode continuation(s) through",
        )
        return PublishResponse(
            version=req.version,
            lora_name=policy.model_name,
            load_s=load_s,
            unloaded=unloaded,
            retracted=[p.version for p in retracted],
            hold_s=0.0 if closing is None else closing.closed_s,
            held_requests=0 if closing is None else closing.held_requests,
            verify_max_abs_diff=None if check is None else check.max_abs_diff,
            verify_mean_abs_diff=None if check is None else check.mean_abs_diff,
            verify_tolerance=None if check is None else check.tolerance,
            verify_noise=noise,
            verify_margin=None if check is None else margin(check),
            verify_separation=None if check is None else check.separation,
            verify_s=verify_s,
        )

    def _open_gate_if_due(self, req: PublishRequest, new_version: bool = False) -> Any:
        waiting_for = self.gate.waiting_for
        if waiting_for is not None and (req.replace_newer or waiting_for <= self.registry.current.version):
            return self.gate.open()
        if waiting_for is None and new_version and self.gate.quota is not None:
            self.gate.open()  # no gate, a quota (a mixed run at max_staleness 1): the new version's own shares
        return None

    def _publish_target(self, req: PublishRequest, path: str | None) -> tuple[Policy, bool]:
        """The policy a publish makes current and whether it must be loaded first; 409 for a plain publish that
        would go back in time or change the current version's adapter."""
        current = self.registry.current
        if req.replace_newer or req.version > current.version:
            return self.registry.prepare(req.version, path)
        if req.version == current.version and path == current.adapter_path:
            return current, False
        raise BackendError(
            409,
            f"version {req.version} ({path}) is not newer than the current version {current.version} "
            f"({current.adapter_path}); a trainer that restarted from a checkpoint publishes its checkpoint's "
            "version with replace_newer: true",
        )


def _page_refusal(status: int, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "from_web_page", "code": status}}).encode()


def create_app(
    cfg: GatewayConfig,
    backend: SamplingBackend,
    registry: PolicyRegistry,
    vocab_size: int,
    start_backend: bool = True,
    named: NamedAdapters | None = None,
) -> FastAPI:
    gw = Gateway(cfg, backend, registry, vocab_size, named)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(start()) if start_backend else None
        yield
        if task is not None and not task.done():
            task.cancel()
        await backend.stop()

    async def start() -> None:
        try:
            await backend.start()
        except BackendError as exc:  # the backend is "failed" now: __main__ stops the gateway
            log.error("the sampling backend did not start: %s", exc.message)

    # No /docs, /redoc or /openapi.json unless asked for: they answer anyone, and the docs page loads from a CDN.
    docs = cfg.openapi_docs
    app = FastAPI(
        title="RL policy gateway",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.gateway = gw
    app.add_middleware(BodyGuard, max_body_bytes=cfg.max_body_bytes, max_json_depth=cfg.max_json_depth)
    # Before the body is read: a web page must not publish, gate or sample (rlcommon/browser_guard.py).
    app.add_middleware(BrowserGuard, loopback_only=cfg.host in LOOPBACK_HOSTS, error_body=_page_refusal)
    # Added last, so outermost: it also sees the refusals the guards answer before any route runs.
    app.add_middleware(RequestAccounting, stats=gw.stats)
    app.add_exception_handler(BackendError, _backend_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _request_validation_error)  # type: ignore[arg-type]
    app.include_router(sampling_routes(gw))
    app.include_router(openai_routes(gw))
    app.include_router(trainer_routes(gw))
    app.include_router(named_routes(gw))
    app.include_router(eval_routes(gw))
    app.include_router(token_in_generate_routes(gw))
    app.include_router(tokenize_chat_routes(gw))
    app.include_router(engine_routes(gw))
    return app


async def _backend_error(_: Request, exc: BackendError) -> JSONResponse:
    response = error(exc.status, exc.message, exc.reason, exc.detail)
    if exc.retry_after is not None:
        response.headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return response


async def _request_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error(400, validation_message(exc))


def sampling_routes(gw: Gateway) -> APIRouter:
    """What environments call: /generate (both dialects) and /health."""
    router = APIRouter()
    backend, registry = gw.backend, gw.registry

    @router.get("/health")
    async def health() -> JSONResponse:
        if backend.ready:
            return JSONResponse({"status": "ok", "policy_version": registry.current.version})
        return error(503, f"sampling backend is {backend.state}")

    @router.post("/generate")
    async def generate(request: Request) -> JSONResponse:
        dialect, req = await read_generate(gw, request, "/generate")
        solo = req.sampling.get("prompt_logprobs") is not None
        samples, policy = await gw.run(
            lambda p: backend.sample(req, p), request, solo, req.n, req.prompt_token_ids
        )
        answer = generate_answer(dialect, req, samples, policy.version)
        for s in samples:
            gw.record(req.prompt_token_ids, s.token_ids, policy)
        return respond(answer, policy)

    return router


def openai_routes(gw: Gateway) -> APIRouter:
    """What evals and judges call: OpenAI completions and chat completions, any model name, the current policy."""
    router = APIRouter()
    backend, registry = gw.backend, gw.registry

    @router.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        return await openai_route(gw, request, "/v1/completions")

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        return await openai_route(gw, request, "/v1/chat/completions")

    @router.get("/v1/models")
    async def models() -> JSONResponse:
        current = registry.current
        return respond(
            {
                "object": "list",
                "data": [
                    {
                        "id": gw.cfg.served_model_name,
                        "object": "model",
                        "owned_by": "gateway",
                        "max_model_len": backend.max_model_len,
                        "policy_version": current.version,
                    }
                ],
            },
            current,
        )

    return router


async def openai_route(gw: Gateway, request: Request, path: str) -> JSONResponse:
    """An OpenAI body passed to the backend under the current policy; what was sampled goes into the ledger."""
    body = await read_openai(gw, request, path)
    result, policy = await gw.run(
        lambda p: gw.backend.forward(path, body, p),
        request,
        scores_prompt(body),
        requested_sequences(body),
        token_prompt(body) if path == "/v1/completions" else None,
        body["messages"] if "messages" in body else body.get("prompt"),
    )
    for choice in result.get("choices", []):
        prompt_ids = choice.get("prompt_token_ids") or result.get("prompt_token_ids")
        if prompt_ids is not None and choice.get("token_ids") is not None:
            gw.record(list(prompt_ids), list(choice["token_ids"]), policy)
    result["policy_version"] = policy.version
    return respond(result, policy)


def group_key(prompt: Any) -> str:
    """A prompt's identity for the gate's whole-group admission: the samples of one group share their prompt
    (token ids, checked already, or a chat's messages)."""
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        data = array("q", prompt).tobytes()
    else:
        data = json.dumps(prompt, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def token_prompt(body: dict[str, Any]) -> list[int] | None:
    """A completions body's prompt when it is one prompt of token ids (checked already): what may continue an
    episode. Texts, and several prompts in one body, are sampled as they always were."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    # The body check made every id of a token prompt an int.
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return prompt
    return None


def requested_sequences(body: dict[str, Any]) -> int:
    """Completions an OpenAI body asks for: n per prompt (a completions body may hold several prompts)."""
    n = body.get("n")
    per_prompt = n if isinstance(n, int) and n > 0 else 1
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else 1
    return per_prompt * prompts
