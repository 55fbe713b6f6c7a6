"""The routes a token-in chat client calls (verifiers v0's `interleaved_rollouts`): `/tokenize` and
`/v1/chat/completions/tokens`.

`/tokenize` is vLLM's own (a chat's messages or a text to token ids, the served chat template applied); it samples
nothing, so it runs outside the on-policy gate and leaves the ledger alone.

`/v1/chat/completions/tokens` (prime-rl's route) is a chat completion whose prompt is given as token ids: the
client sends its `messages` and the ids it built for them (the earlier turns' ids exactly as sampled, then the
environment's turn), and the ids are what is sampled from. vLLM's chat route takes no token prompt, so the body is
sampled through `/v1/completions` with the ids as the prompt and the answer reshaped into a chat completion (the
text as the message, one chat logprob entry per sampled token, the prompt and sampled ids). It is sampled under the
current policy and recorded in the ledger like `/v1/chat/completions`; ids that continue an episode (an earlier
turn as sampled) pass the on-policy gate and stay on that turn's version (inference.app.Gateway.run). No tool call is parsed from the text (that
is vLLM's chat route's parser), so a body that offers tools is refused rather than answered without its calls.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from inference.errors import BackendError
from inference.http.intake import check_token_ids, json_object, off_loop, respond, until_disconnect
from inference.http.sampling_bodies import ServedModel, check_backend_up, checked_openai_body
from inference.samplers.tinker import TinkerSamplingBackend

# What a /tokenize body may carry (vLLM's tokenize request, less the chat template a client would run on vLLM).
TOKENIZE_KEYS = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "tools",
        "add_generation_prompt",
        "add_special_tokens",
        "continue_final_message",
        "return_token_strs",
    }
)
TOKENIZE_FLAGS = (
    "add_generation_prompt",
    "add_special_tokens",
    "continue_final_message",
    "return_token_strs",
)

# Keys of a tokens chat body that only shape how messages are rendered: the token ids replace that rendering.
RENDERING_KEYS = frozenset(
    {"model", "messages", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"}
)
# Sampling keys passed on to /v1/completions as they are (checked there like any completions body).
PASSED_KEYS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "n",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "ignore_eos",
        "include_stop_str_in_output",
        "min_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "logit_bias",
        "bad_words",
        "return_token_ids",
        "stream",
    }
)
TOOL_KEYS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
MAPPED_KEYS = frozenset({"tokens", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs"})


def check_tokenize_body(body: dict[str, Any]) -> dict[str, Any]:
    """A /tokenize body as vLLM takes it: a text `prompt` or a list of chat `messages` (not both), optional tools
    and the rendering flags. Anything else is refused, naming the key."""
    unknown = sorted(set(body) - TOKENIZE_KEYS)
    if unknown:
        raise BackendError(
            400, f"/tokenize: unsupported key(s) {unknown}; supported: {sorted(TOKENIZE_KEYS)}"
        )
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise BackendError(
            400, "/tokenize: send either `prompt` (a text) or `messages` (a chat), exactly one"
        )
    if has_prompt and not isinstance(body["prompt"], str):
        raise BackendError(400, f"/tokenize: prompt must be a text, got {type(body['prompt']).__name__}")
    if has_messages:
        check_messages(body["messages"], "/tokenize: messages")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BackendError(400, f"/tokenize: tools must be a list of tool objects or null, got {tools!r:.80}")
    for flag in TOKENIZE_FLAGS:
        if flag in body and not isinstance(body[flag], bool):
            raise BackendError(400, f"/tokenize: {flag} must be true or false, got {body[flag]!r:.80}")
    return body


def check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise BackendError(400, f"{where}: expected a non-empty list of chat messages, got {messages!r:.80}")
    bad = next((i for i, m in enumerate(messages) if not isinstance(m, dict) or "role" not in m), None)
    if bad is not None:
        raise BackendError(
            400, f"{where}[{bad}]: a chat message is an object with a role, got {messages[bad]!r:.80}"
        )


def completions_body(body: dict[str, Any]) -> dict[str, Any]:
    """The /v1/completions body that samples a tokens chat body: `tokens` as the prompt, the chat's logprobs
    (true, with top_logprobs alternatives) as the completions' count of alternatives, max_completion_tokens as
    max_tokens. Refused: a body without token ids, one that offers tools, and keys this route does not know."""
    unknown = sorted(set(body) - RENDERING_KEYS - PASSED_KEYS - TOOL_KEYS - MAPPED_KEYS)
    if unknown:
        raise BackendError(
            400,
            f"/v1/chat/completions/tokens: unsupported key(s) {unknown}; it takes the token ids (`tokens`), the "
            f"sampling keys {sorted(PASSED_KEYS | MAPPED_KEYS - {'tokens'})} and the chat's rendering keys "
            f"{sorted(RENDERING_KEYS)}, which the token ids make moot",
        )
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise BackendError(
            400, f"tokens: expected the prompt as a non-empty list of token ids, got {tokens!r:.80}"
        )
    check_token_ids(tokens, "tokens")
    if body.get("messages") is not None:
        check_messages(body["messages"], "messages")
    if body.get("tools") and body.get("tool_choice", "auto") != "none":
        raise BackendError(
            400,
            "tools: the token-in route samples text and parses no tool calls from it; send a request that offers "
            "tools to /v1/chat/completions (or set tool_choice to 'none')",
        )
    out = {k: v for k, v in body.items() if k in PASSED_KEYS}
    out["prompt"] = tokens
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        out["max_tokens"] = limit
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BackendError(400, f"logprobs: a chat body's logprobs is true or false, got {logprobs!r:.80}")
    if logprobs:
        out["logprobs"] = 0 if top is None else top  # checked as a completions body's count (0..20) below
    elif top:
        raise BackendError(400, "top_logprobs: asks for alternatives without logprobs=true")
    out.setdefault("return_token_ids", True)  # the ledger records the sampled ids; the answer carries them
    return out


def chat_logprobs(logprobs: dict[str, Any] | None) -> dict[str, Any] | None:
    """A completions choice's logprobs (tokens, token_logprobs, top_logprobs) as a chat choice's: one entry per
    sampled token with its alternatives."""
    if logprobs is None:
        return None
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    content = []
    for token, value, top in zip(tokens, values, tops, strict=True):
        alternatives = [{"token": t, "logprob": lp, "bytes": None} for t, lp in (top or {}).items()]
        content.append({"token": token, "logprob": value, "bytes": None, "top_logprobs": alternatives})
    return {"content": content}


def chat_answer(result: dict[str, Any], prompt_ids: list[int]) -> dict[str, Any]:
    """vLLM's completions answer for the token prompt as the chat completion the client asked for."""
    choices: list[dict[str, Any]] = []
    for choice in result.get("choices", []):
        choices.append(
            {
                "index": choice.get("index", len(choices)),
                "message": {"role": "assistant", "content": choice.get("text", ""), "tool_calls": []},
                "logprobs": chat_logprobs(choice.get("logprobs")),
                "finish_reason": choice.get("finish_reason"),
                "stop_reason": choice.get("stop_reason"),
                "token_ids": choice.get("token_ids"),
            }
        )
    return {
        "id": "chatcmpl-" + str(result.get("id", "")).removeprefix("cmpl-"),
        "object": "chat.completion",
        "created": result.get("created", int(time.time())),
        "model": result.get("model"),
        "choices": choices,
        "prompt_token_ids": prompt_ids,
        "usage": result.get("usage"),
    }


def checked_tokens_body(gw: ServedModel, body: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """The completions body, checked against the model like any completions body (vocabulary, context, sampling
    numbers), and the integer stop entries it moved to stop_token_ids. Without a limit a chat completion may run
    to the end of the context; a completions body would stop at vLLM's default of 16 tokens, so the limit is set."""
    out = completions_body(body)
    context = gw.backend.max_model_len
    if "max_tokens" not in out and context is not None:
        out["max_tokens"] = max(1, context - len(out["prompt"]))
    return out, checked_openai_body(gw, out)


def serves_token_routes(backend: Any) -> bool:
    """vLLM answers /tokenize; the Tinker sampler (a forward() that samples whatever it gets) does not, and a
    token-in client needs both routes."""
    return not isinstance(backend, TinkerSamplingBackend)


def tokenize_chat_routes(gw: Any) -> APIRouter:
    """`gw` is inference.app.Gateway (not imported: app.py imports this module)."""

    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = check_tokenize_body(await json_object(request))
        if not serves_token_routes(gw.backend):
            raise BackendError(501, "/tokenize is not served by the Tinker sampler; leave token-in turns off")
        check_backend_up(gw.backend)
        # The base model's name: its adapter is loaded for the life of vLLM, and a LoRA adapter has the base's
        # tokenizer, so the ids are the same under every version.
        return JSONResponse(
            await until_disconnect(request, gw.backend.forward("/tokenize", body, gw.registry.base))
        )

    @router.post("/v1/chat/completions/tokens")
    async def chat_tokens(request: Request) -> JSONResponse:
        raw = await json_object(request)
        if not serves_token_routes(gw.backend):
            raise BackendError(
                501, "token-in chat is not served by the Tinker sampler; send messages instead"
            )
        if raw.get("stream"):
            raise BackendError(400, "stream=true is not supported by the gateway; send stream=false")
        body, moved = await off_loop(request, checked_tokens_body, gw, raw)
        gw.note_moved_stop_ids("/v1/chat/completions/tokens", moved)
        n = body.get("n") or 1
        result, policy = await gw.run(
            lambda p: gw.backend.forward("/v1/completions", body, p), request, False, n, body["prompt"]
        )
        answer = chat_answer(result, list(body["prompt"]))
        for choice in answer["choices"]:
            if choice["token_ids"] is not None:
                gw.record(answer["prompt_token_ids"], list(choice["token_ids"]), policy)
        answer["policy_version"] = policy.version
        return respond(answer, policy)

    return router
