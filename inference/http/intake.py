"""Request bodies in, validated requests out: JSON objects, both /generate dialects, lookups, and the one rewrite the
gateway makes (integer stop entries become stop_token_ids). It never calls the sampler, picks a policy or logs.

pydantic validates a whole list in one call that holds the interpreter lock (~50-90 ns a token id), so the lists a
body may carry are bounded before it runs (a prompt by the model's context, sampling lists by a vocabulary), a
lookup's sequences are validated a slice at a time, and a large body's validation runs in the body thread
(off_loop)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError

from inference.errors import BackendError
from inference.http.body_guard import INLINE_BODY_BYTES, PARSED_BODY, ParsedBody, in_body_thread
from inference.policy.registry import Policy
from inference.wire import (
    MAX_LOOKUP_SEQUENCES,
    MAX_TOKEN_ID,
    LookupRequest,
    SamplingParams,
    SamplingRequest,
    SGLangGenerateRequest,
    TokenId,
    VLLMGenerateRequest,
)
from rlcommon.envkeys import env_of_key

T = TypeVar("T")
# Without the model's context (vLLM not up yet, or a Tinker sampler without vllm.max_model_len): no model the
# gateway serves reads a longer prompt.
MAX_PROMPT_IDS = 1 << 20
# Entries of one sampling list (stop, stop_token_ids, bad_words, logit_bias): more than a vocabulary has is no use.
MAX_SAMPLING_ITEMS = 1 << 18
SIZED_SAMPLING_KEYS = ("stop", "stop_token_ids", "bad_words", "logit_bias")
STEP_IDS = 1 << 16  # token ids validated per pydantic call: a few ms
_TOKEN_IDS: TypeAdapter[list[int]] = TypeAdapter(list[TokenId])


VERSION_HEADER = "X-Policy-Version"


def respond(body: Any, policy: Policy) -> JSONResponse:
    """A sampling route's answer, with the version of the policy that produced it in its header."""
    return JSONResponse(body, headers={VERSION_HEADER: str(policy.version)})


def request_env(request: Request) -> str | None:
    """The environment a generation request comes from, by its bearer key (rlcommon/envkeys.py); None for any
    other key or none."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    return env_of_key(key.strip()) if scheme.lower() == "bearer" else None


def validation_message(exc: ValidationError | RequestValidationError, prefix: str = "") -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if p not in ("body", "sampling"))
        msg = err["msg"].removeprefix("Value error, ")  # pydantic's wrapper around a validator's own message
        parts.append(f"{prefix}{loc or 'body'}: {msg} (got {repr(err.get('input'))[:80]})")
    return "; ".join(parts)


async def json_object(request: Request) -> dict[str, Any]:
    """The body the guard parsed (inference/http/body_guard.py); parsed here only for an app without the guard."""
    parsed = request.scope.get(PARSED_BODY)
    if not isinstance(parsed, ParsedBody):
        try:
            parsed = ParsedBody(json.loads(await request.body()), None, 0)
        except (ValueError, UnicodeDecodeError) as exc:
            parsed = ParsedBody(None, str(exc), 0)
    if parsed.error is not None:
        raise BackendError(400, f"request body is not valid JSON: {parsed.error}")
    body = parsed.value
    if not isinstance(body, dict):
        raise BackendError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


async def off_loop(request: Request, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), a route's validation of its body: on the event loop for a small body, in the body thread for a
    large one (pydantic and loops over every token id would stall every other request meanwhile)."""
    parsed = request.scope.get(PARSED_BODY)
    if not isinstance(parsed, ParsedBody) or parsed.size <= INLINE_BODY_BYTES:
        return fn(*args)
    return await in_body_thread(fn, *args)


def check_prompt_length(ids: Any, context: int | None, where: str) -> None:
    """A prompt longer than the model's context is refused before anything validates it id by id."""
    if not isinstance(ids, list):
        return
    if context is not None and len(ids) > context:
        raise BackendError(
            400,
            f"{where}: {len(ids)} tokens, more than the model's context of {context} tokens; shorten the prompt",
            reason="prompt_too_long",
        )
    if len(ids) > MAX_PROMPT_IDS:
        raise BackendError(
            400,
            f"{where}: {len(ids)} tokens, more than the {MAX_PROMPT_IDS} the gateway takes in one prompt; "
            "shorten the prompt",
            reason="prompt_too_long",
        )


def check_sampling_sizes(params: Any, prefix: str = "") -> None:
    for key in SIZED_SAMPLING_KEYS:
        value = params.get(key) if isinstance(params, dict) else None
        if isinstance(value, list | dict) and len(value) > MAX_SAMPLING_ITEMS:
            raise BackendError(
                400,
                f"{prefix}{key}: {len(value)} entries, more than the {MAX_SAMPLING_ITEMS} one request may carry "
                "(a vocabulary's worth); send fewer",
            )


def parse_generate(
    body: dict[str, Any], context: int | None = None
) -> tuple[str, SamplingRequest, list[int]]:
    """Either /generate dialect, every field type- and range-checked, as one SamplingRequest; also the integer
    stop entries that were moved into stop_token_ids (see move_stop_ids). A prompt longer than `context` (the
    model's, when known) is refused first."""
    parsed: VLLMGenerateRequest | SGLangGenerateRequest
    if "input_ids" in body:
        check_prompt_length(body["input_ids"], context, "input_ids")
        check_sampling_sizes(body.get("sampling_params"), "sampling_params.")
    elif isinstance(body.get("prompt"), dict):
        check_prompt_length(body["prompt"].get("prompt_token_ids"), context, "prompt.prompt_token_ids")
        check_sampling_sizes(body)
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


def lookup_request(body: dict[str, Any]) -> LookupRequest:
    """LookupRequest.model_validate(body), its sequences validated STEP_IDS token ids at a time: a trainer's
    lookup of a large batch holds millions of ids, a second of pydantic in one call."""
    sequences = body.get("sequences")
    if not isinstance(sequences, list) or sum(len(s) for s in sequences if isinstance(s, list)) <= STEP_IDS:
        try:
            return LookupRequest.model_validate(body)
        except ValidationError as exc:
            raise BackendError(400, validation_message(exc)) from exc
    if len(sequences) > MAX_LOOKUP_SEQUENCES:
        raise BackendError(
            400,
            f"sequences: {len(sequences)} sequences, more than the {MAX_LOOKUP_SEQUENCES} one lookup takes; "
            "split the lookup",
        )
    try:
        LookupRequest.model_validate({**body, "sequences": []})  # every other key
    except ValidationError as exc:
        raise BackendError(400, validation_message(exc)) from exc
    for i, sequence in enumerate(sequences):
        check_token_ids(sequence, f"sequences.{i}")
    return LookupRequest.model_construct(sequences=sequences)


def check_token_ids(ids: Any, where: str) -> None:
    """400 naming the entry unless `ids` is a list of token ids; validated STEP_IDS at a time."""
    offsets = range(0, len(ids), STEP_IDS) if isinstance(ids, list) else [0]
    for offset in offsets:
        try:
            _TOKEN_IDS.validate_python(ids[offset : offset + STEP_IDS] if isinstance(ids, list) else ids)
        except ValidationError as exc:
            parts = []
            for err in exc.errors():
                loc = [offset + p if i == 0 and isinstance(p, int) else p for i, p in enumerate(err["loc"])]
                field = ".".join([where, *map(str, loc)])
                parts.append(f"{field}: {err['msg']} (got {repr(err.get('input'))[:80]})")
            raise BackendError(400, "; ".join(parts)) from exc


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
