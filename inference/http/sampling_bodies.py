"""A sampling route's body read, checked against the served model (its context and vocabulary) and answered: what the
policy routes (inference/app.py), the named-adapter routes (named_adapters.py) and the evaluation routes (evalroutes.py) share,
so that one body gets one answer on each. It never picks a policy or calls the sampler.
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import Request
from pydantic import ValidationError

from inference.errors import BackendError
from inference.http.intake import (
    check_prompt_length,
    check_sampling_sizes,
    json_object,
    move_stop_ids,
    off_loop,
    parse_generate,
    validation_message,
)
from inference.wire import (
    OpenAIBodyLimits,
    Sample,
    SamplingRequest,
    sglang_generate_response,
    vllm_generate_response,
)


class ServedModel(Protocol):
    """What the checks use of the gateway (inference.app.Gateway)."""

    backend: Any

    def validate_tokens(self, ids: list[int], max_tokens: int, field: str) -> None: ...
    def note_moved_stop_ids(self, route: str, ids: list[int]) -> None: ...


def check_backend_up(backend: Any) -> None:
    """503 for a sampler that will not answer (failed or stopped); one starting or restarting is waited for."""
    if not backend.ready and backend.state in ("failed", "stopped"):
        raise BackendError(503, f"sampling backend is {backend.state}")


def check_openai_body(gw: ServedModel, body: dict[str, Any]) -> None:
    """Validate an OpenAI completions/chat body before anything converts it: its numbers and sampling
    parameters, and a token-id prompt against the vocabulary and the context."""
    try:
        limits = OpenAIBodyLimits.model_validate(body)
    except ValidationError as exc:
        raise BackendError(400, validation_message(exc)) from exc
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
        batch = prompt if isinstance(prompt[0], list) else [prompt]  # one token-id prompt, or several
        for one in batch:
            check_prompt_length(one, gw.backend.max_model_len, "prompt")
            try:
                ids = SamplingRequest.model_validate({"prompt_token_ids": one}).prompt_token_ids
            except ValidationError as exc:
                raise BackendError(400, "prompt: " + validation_message(exc)) from exc
            gw.validate_tokens(ids, limits.max_tokens or limits.max_completion_tokens or 16, "prompt")
    elif prompt is not None and not isinstance(prompt, str | list):
        raise BackendError(
            400, f"prompt: expected text, a list of texts or a list of token ids, got {prompt!r:.80}"
        )


def checked_openai_body(gw: ServedModel, body: dict[str, Any]) -> list[int]:
    """Integer stop entries moved (returned), then the body checked (off the loop when large)."""
    check_sampling_sizes(body)
    moved = move_stop_ids(body)
    check_openai_body(gw, body)
    return moved


def checked_generate(gw: ServedModel, body: dict[str, Any]) -> tuple[str, SamplingRequest, list[int]]:
    """A /generate body parsed and checked against the vocabulary and the context (off the loop when large)."""
    dialect, req, moved = parse_generate(body, gw.backend.max_model_len)
    gw.validate_tokens(req.prompt_token_ids, req.max_tokens, "prompt token ids")
    return dialect, req, moved


async def read_generate(gw: ServedModel, request: Request, route: str) -> tuple[str, SamplingRequest]:
    """A /generate body (either dialect) as its dialect and one checked SamplingRequest."""
    dialect, req, moved = await off_loop(request, checked_generate, gw, await json_object(request))
    gw.note_moved_stop_ids(route, moved)
    return dialect, req


async def read_openai(gw: ServedModel, request: Request, route: str) -> dict[str, Any]:
    """An OpenAI completions/chat body, checked and ready for the sampler."""
    body = await json_object(request)
    if body.get("stream"):
        raise BackendError(400, "stream=true is not supported by the gateway; send stream=false")
    gw.note_moved_stop_ids(route, await off_loop(request, checked_openai_body, gw, body))
    # The policy routes' ledger records the sampled ids; every route answers with them, so one body gets one answer.
    body.setdefault("return_token_ids", True)
    return body


def scores_prompt(body: dict[str, Any]) -> bool:
    """An OpenAI body that asks for the prompt's logprobs (prompt_logprobs, or echo with logprobs)."""
    return body.get("prompt_logprobs") is not None or bool(body.get("echo"))


def check_prompt_logprobs(req: SamplingRequest, samples: list[Sample]) -> None:
    """502 if prompt logprobs were asked for and the sampler gave none: atroposlib's get_logprobs would fail on
    the answer with a message that blames the client."""
    if req.sampling.get("prompt_logprobs") is not None and (
        not samples or samples[0].prompt_logprobs is None
    ):
        raise BackendError(502, "the sampler answered without the prompt_logprobs that were asked for")


def generate_answer(
    dialect: str, req: SamplingRequest, samples: list[Sample], version: int | None
) -> dict[str, Any] | list[Any]:
    """/generate's answer in the request's dialect; `version` None (a sampler that is no policy version) leaves
    out its policy_version."""
    check_prompt_logprobs(req, samples)
    if dialect == "sglang":
        answer = sglang_generate_response(samples, version or 0, len(req.prompt_token_ids))
        if version is None:
            for one in answer if isinstance(answer, list) else [answer]:
                del one["meta_info"]["policy_version"]
        return answer
    body = vllm_generate_response(samples, version or 0)
    if version is None:
        del body["policy_version"]
    return body
