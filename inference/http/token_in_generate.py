"""vLLM's token-in generate dialect, `POST /inference/v1/generate`: what verifiers v1's training client calls (the
`renderers` package renders the chat to token ids on the client, posts them here and parses the sampled ids back).

Body: {"model", "token_ids": [...], "sampling_params": {"max_tokens", "temperature", "stop_token_ids", "logprobs": 1,
...}, "request_id"?, "cache_salt"?, "priority"?, "return_token_ids"?}. Answer (vLLM's GenerateTokensResponse):
{"request_id", "prompt_token_ids", "choices": [{"index", "token_ids", "finish_reason", "stop_reason", "logprobs":
{"content": [{"token": "token_id:<id>", "token_id", "logprob", "top_logprobs": []}, ...]}}], "usage",
"policy_version"}. Each logprob entry names its token both ways: renderers 0.1.x reads `token` ("token_id:<id>"),
vLLM 0.32's own answer has `token_id`.

The ids are sampled like `/generate` (the sampler's one token-prompt path, so vLLM and the Tinker sampler both serve
it) under the current policy, and every answer goes into the version ledger. The model name is not a choice: the
current policy answers, as on every policy route. `POST /eval/{target}/inference/v1/generate` is the same for an evaluation: the target (`base`
or a named adapter) samples it, outside the on-policy gate and the ledger, as on the other /eval/{target} routes
(inference/http/evalroutes.py); renderers finds it beside an evaluation's `<gateway>/eval/<target>/v1` base URL.
Refused with a 400 naming the field: multimodal inputs (features,
content_parts), streaming, text output, top-k alternatives (logprobs above 1: only the sampled token's logprob is
returned), prompt logprobs, and any key vLLM's sampler does not take.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Any, Literal, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from inference.errors import BackendError
from inference.http.evalroutes import EvalHost, adapter_of, sampled, target_policy
from inference.http.evalroutes import answer as eval_answer
from inference.http.intake import (
    check_prompt_length,
    check_sampling_sizes,
    json_object,
    move_stop_ids,
    off_loop,
    respond,
    validation_message,
)
from inference.http.sampling_bodies import ServedModel
from inference.wire import Sample, SamplingParams, SamplingRequest, TokenId

ROUTE = "/inference/v1/generate"
# Keys of vLLM's GenerateRequest that ask for something this route does not do, with what to do instead.
REFUSED_KEYS = {
    "features": "multimodal inputs are not served; send text-only prompts",
    "content_parts": "multimodal inputs are not served; send text-only prompts",
    "kv_transfer_params": "disaggregated serving is not served here",
    "ec_transfer_params": "disaggregated serving is not served here",
    "stream": "streaming is not served; send stream=false",
    "stream_options": "streaming is not served; leave stream_options out",
}
# Sampling keys dropped before the sampler's own check (which refuses every key it does not know): logprobs is
# answered by its own rule below, and the rest only shape detokenized text, which this route never answers (renderers
# always sends skip_special_tokens, which the Tinker sampler would refuse).
IGNORED_SAMPLING_KEYS = ("logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens")


class TokenInBody(BaseModel):
    """The body's top level, less the sampling parameters (checked by SamplingRequest) and REFUSED_KEYS."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    request_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    token_ids: list[TokenId] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    # A prefix-cache salt isolates tenants of one vLLM; one trainer's environments are one tenant.
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    # vLLM refuses any other priority unless it schedules by priority, which the gateway's vLLM does not.
    priority: Literal[0] = 0
    return_token_ids: StrictBool | None = None  # the prompt ids are always answered
    output_mode: Literal["tokens"] = "tokens"


class TokenInRequest(BaseModel):
    request_id: str
    sampling: SamplingRequest


class TokenInGateway(EvalHost, Protocol):
    """What the routes use of the gateway (inference.app.Gateway)."""

    async def run(
        self,
        coro_fn: Any,
        request: Request | None = None,
        solo: bool = False,
        n: int = 1,
        prompt_ids: list[int] | None = None,
    ) -> tuple[Any, Any]: ...
    def record(self, prompt_ids: list[int], completion_ids: list[int], policy: Any) -> None: ...


def checked_tokenin(gw: ServedModel, body: dict[str, Any]) -> tuple[TokenInRequest, list[int]]:
    """The body as one checked sampling request (vocabulary, context, sampling parameters), and the integer stop
    entries moved to stop_token_ids."""
    for key, why in REFUSED_KEYS.items():
        if body.get(key):
            raise BackendError(400, f"{key}: {why} (got {body[key]!r:.80})")
    body = {k: v for k, v in body.items() if k not in REFUSED_KEYS}
    context = gw.backend.max_model_len
    check_prompt_length(body.get("token_ids"), context, "token_ids")
    params = body.get("sampling_params")
    if params is not None and not isinstance(params, dict):
        raise BackendError(400, f"sampling_params: expected an object, got {params!r:.80}")
    check_sampling_sizes(params, "sampling_params.")
    try:
        top = TokenInBody.model_validate(body)
    except ValidationError as exc:
        raise BackendError(400, validation_message(exc)) from exc
    sampling = dict(top.sampling_params)
    logprobs = sampling.get("logprobs")
    if logprobs is not None and (type(logprobs) is not int or not 0 <= logprobs <= 1):
        raise BackendError(
            400,
            f"sampling_params.logprobs: only the sampled token's logprob is answered here, so 0 or 1 (got "
            f"{logprobs!r:.40}); leave top-k alternatives out",
        )
    if sampling.get("prompt_logprobs") is not None:
        raise BackendError(
            400,
            "sampling_params.prompt_logprobs: not answered on this route; POST /generate with "
            "{'prompt': {'prompt_token_ids': [...]}, 'prompt_logprobs': k} instead",
        )
    for key in IGNORED_SAMPLING_KEYS:
        sampling.pop(key, None)
    n = sampling.pop("n", 1)
    max_tokens = sampling.pop("max_tokens", None)
    if max_tokens is None:
        if context is None:
            raise BackendError(
                400, "sampling_params.max_tokens: required while the model's context is unknown; send it"
            )
        max_tokens = max(1, context - len(top.token_ids))  # vLLM's own default: the rest of the context
    try:
        moved = move_stop_ids(sampling, "sampling_params.")
        SamplingParams.model_validate(sampling)
        req = SamplingRequest(prompt_token_ids=top.token_ids, n=n, max_tokens=max_tokens, sampling=sampling)
    except ValidationError as exc:
        raise BackendError(400, validation_message(exc, "sampling_params.")) from exc
    gw.validate_tokens(req.prompt_token_ids, req.max_tokens, "token_ids")
    return TokenInRequest(request_id=top.request_id or uuid.uuid4().hex, sampling=req), moved


def tokenin_answer(req: TokenInRequest, samples: list[Sample], version: int) -> dict[str, Any]:
    """vLLM's token-in answer for `samples`, each logprob entry naming its token both ways (module docstring)."""
    choices = []
    for i, s in enumerate(samples):
        content = [
            {"token": f"token_id:{t}", "token_id": t, "logprob": lp, "top_logprobs": []}
            for t, lp in zip(s.token_ids, s.logprobs, strict=True)
        ]
        choices.append(
            {
                "index": i,
                "token_ids": s.token_ids,
                "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason,
                "logprobs": {"content": content},
            }
        )
    prompt_len = len(req.sampling.prompt_token_ids)
    completion = sum(len(s.token_ids) for s in samples)
    return {
        "request_id": req.request_id,
        "created": int(time.time()),
        "output_mode": "tokens",
        "prompt_token_ids": req.sampling.prompt_token_ids,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_len,
            "completion_tokens": completion,
            "total_tokens": prompt_len + completion,
        },
        "policy_version": version,
    }


def check_sampled(samples: list[Sample]) -> None:
    """502 for an answer the client would take apart wrongly: one logprob per sampled id, each finite and <= 0.
    (renderers refuses vLLM's -9999 placeholder for a missing logprob; a sampler answer holding one is a fault.)"""
    for i, s in enumerate(samples):
        if len(s.logprobs) != len(s.token_ids):
            raise BackendError(
                502,
                f"the sampler answered choice {i} with {len(s.token_ids)} ids but {len(s.logprobs)} logprobs",
            )
        bad = next((lp for lp in s.logprobs if not (math.isfinite(lp) and lp <= 0)), None)
        if bad is not None:
            raise BackendError(
                502, f"the sampler answered choice {i} with logprob {bad!r}, not a finite value <= 0"
            )


def token_in_generate_routes(gw: TokenInGateway) -> APIRouter:
    """`gw` is inference.app.Gateway (not imported: app.py imports this module)."""
    router = APIRouter()

    @router.post(ROUTE)
    async def generate(request: Request) -> JSONResponse:
        req, moved = await off_loop(request, checked_tokenin, gw, await json_object(request))
        gw.note_moved_stop_ids(ROUTE, moved)
        # The prompt ids go along: a later turn of an episode stays on its episode's version (Gateway.run).
        samples, policy = await gw.run(
            lambda p: gw.backend.sample(req.sampling, p),
            request,
            False,
            req.sampling.n,
            req.sampling.prompt_token_ids,
        )
        check_sampled(samples)
        for s in samples:
            gw.record(req.sampling.prompt_token_ids, s.token_ids, policy)
        return respond(tokenin_answer(req, samples, policy.version), policy)

    @router.post("/eval/{target}" + ROUTE)
    async def eval_generate(target: str, request: Request) -> JSONResponse:
        policy = target_policy(gw, target)
        with gw.named.running(adapter_of(target)):
            req, moved = await off_loop(request, checked_tokenin, gw, await json_object(request))
            gw.note_moved_stop_ids(f"/eval/{target}{ROUTE}", moved)
            samples = await sampled(gw, request, False, lambda: gw.backend.sample(req.sampling, policy))
        check_sampled(samples)
        body = tokenin_answer(req, samples, 0)
        del body["policy_version"]  # a target is no policy version
        body["eval_target"] = target
        return eval_answer(body, target)

    return router
