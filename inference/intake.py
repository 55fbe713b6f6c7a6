"""Request bodies in, validated requests out: JSON objects, both /generate dialects, and the one rewrite the gateway
makes (integer stop entries become stop_token_ids). It never calls the sampler, picks a policy or logs."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from inference.errors import BackendError
from inference.wire import (
    MAX_TOKEN_ID,
    SamplingParams,
    SamplingRequest,
    SGLangGenerateRequest,
    VLLMGenerateRequest,
)


def validation_message(exc: ValidationError | RequestValidationError, prefix: str = "") -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if p not in ("body", "sampling"))
        msg = err["msg"].removeprefix("Value error, ")  # pydantic's wrapper around a validator's own message
        parts.append(f"{prefix}{loc or 'body'}: {msg} (got {repr(err.get('input'))[:80]})")
    return "; ".join(parts)


async def json_object(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise BackendError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BackendError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_generate(body: dict[str, Any]) -> tuple[str, SamplingRequest, list[int]]:
    """Either /generate dialect, every field type- and range-checked, as one SamplingRequest; also the integer
    stop entries that were moved into stop_token_ids (see move_stop_ids)."""
    parsed: VLLMGenerateRequest | SGLangGenerateRequest
    try:
        if "input_ids" in body:
            dialect, parsed = "sglang", SGLangGenerateRequest.model_validate(body)
        elif "prompt" in body:
            dialect, parsed = "vllm", VLLMGenerateRequest.model_validate(body)
        else:
            raise BackendError(
                400,
                "expected 'prompt': {'prompt_token_ids': [...]} (vLLM style) or 'input_ids' (SGLang style)",
            )
    except ValidationError as exc:
        raise BackendError(400, validation_message(exc)) from exc
    # SGLang puts n, max_new_tokens and the sampling parameters under sampling_params.
    prefix = "sampling_params." if dialect == "sglang" else ""
    try:
        req = parsed.to_sampling()
        moved = move_stop_ids(req.sampling, prefix)
        SamplingParams.model_validate(req.sampling)
    except ValidationError as exc:
        raise BackendError(400, validation_message(exc, prefix)) from exc
    if dialect == "sglang" and req.sampling.get("prompt_logprobs") is not None:
        raise BackendError(
            400,
            f"sampling_params.prompt_logprobs: the SGLang-style answer has no place for prompt logprobs (got "
            f"{req.sampling['prompt_logprobs']!r:.40}); send the vLLM-style body "
            "{'prompt': {'prompt_token_ids': [...]}, 'prompt_logprobs': k} instead",
        )
    return dialect, req, moved


def move_stop_ids(params: dict[str, Any], prefix: str = "") -> list[int]:
    """Move the integer entries of params["stop"] into params["stop_token_ids"] (after those given there, without
    repeats), keep its strings in "stop", and return the ids moved. Some environments send the EOS token id as a
    stop entry (`stop=[eos_id]`, or one int, or ints mixed with strings); vLLM takes only strings in `stop` and
    would refuse the request. Any other entry (float, bool, object) is a 400 naming it."""
    stop = params.get("stop")
    if stop is None or isinstance(stop, str):
        return []
    entries = stop if isinstance(stop, list) else [stop]
    texts: list[str] = []
    ids: list[int] = []
    for i, entry in enumerate(entries):
        where = f"{prefix}stop[{i}]" if isinstance(stop, list) else f"{prefix}stop"
        if isinstance(entry, str):
            texts.append(entry)
        elif isinstance(entry, int) and not isinstance(entry, bool) and 0 <= entry <= MAX_TOKEN_ID:
            ids.append(entry)
        else:
            raise BackendError(
                400,
                f"{where}: expected a stop string or a token id (an integer 0..{MAX_TOKEN_ID}), got "
                f"{entry!r:.80}; send stop strings in stop and token ids in stop_token_ids",
            )
    if not ids:
        return []
    given = params.get("stop_token_ids")
    if given is not None and not isinstance(given, list):
        raise BackendError(400, f"{prefix}stop_token_ids: expected a list of token ids, got {given!r:.80}")
    merged = list(given or [])
    # `in`, not a set: a bad entry of stop_token_ids may be unhashable; SamplingParams reports it afterwards.
    merged += [t for i, t in enumerate(ids) if t not in merged and t not in ids[:i]]
    params["stop_token_ids"] = merged
    if texts:
        params["stop"] = texts
    else:
        del params["stop"]
    return ids


DISCONNECT_POLL_S = 0.25


def resolved_path(path: str | None) -> str | None:
    """The adapter folder as the registry compares it (absolute, links resolved); URIs as given."""
    if path is None or "://" in path:
        return path
    try:
        return str(Path(path).resolve())
    except (OSError, ValueError) as exc:
        raise BackendError(400, f"adapter_path {path[:200]!r} is not a usable path: {exc}") from exc


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work` unless the client disconnects first; then cancel it (closing its connection to vLLM, which
    aborts the generation) so an abandoned request stops holding the sampler."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, BackendError):
                    await task
                raise BackendError(499, "client disconnected; its sampling request was aborted")
    finally:
        if not task.done():
            task.cancel()
