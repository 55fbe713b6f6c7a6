"""The gateway's one error type: every failure carries the HTTP status the client should get, and a short stable
reason key that the gateway's rejection counters (GET /policy) and error bodies use."""

from __future__ import annotations

from typing import Literal

# Why a request was refused. Stable keys: the launcher reads them from GET /policy to explain an idle run.
Reason = Literal[
    "invalid_request",  # the gateway's own validation (a field's type or range, JSON, an unsupported option)
    "prompt_too_long",  # prompt + max_tokens past the model's context (the gateway's check or vLLM's)
    "body_too_large",  # over inference.max_body_bytes, or nested past inference.max_json_depth
    "backend_rejected",  # vLLM's own validation refused a request the gateway passed on
    "adapter_not_loaded",  # vLLM does not hold the policy's adapter (it restarted and is catching up)
    "not_ready",  # the sampler is starting, restarting, failed or stopped, or did not answer in time
    "backend_error",  # the sampler failed (5xx from vLLM, Tinker errors)
    "client_disconnected",  # the client went away; its request was aborted
    "unauthorized",  # a publish without the token
    "conflict",  # a publish that would go back in time
    "verification_failed",  # a publish whose adapter, once loaded, did not give the trainer's probe logprobs
    "from_web_page",  # a write a web page could send (another site's Origin, a form type) or a non-loopback Host
    "quarantined",  # a request vLLM died on twice: never sent to it again (inference/samplers/quarantine.py)
    "no_lease",  # on a shared engine: the caller does not hold the lease (inference/http/engine.py)
    "lease_held",  # on a shared engine: another run holds the lease
    "model_mismatch",  # on a shared engine: the run's model or tokenizer is not the engine's
    "engine_too_small",  # on a shared engine: the run needs more versions kept than the engine keeps
    "internal_error",  # an exception the gateway did not expect (a bug)
]


def default_reason(status: int) -> Reason:
    """The reason for a status when the code that refused did not name a more precise one."""
    by_status: dict[int, Reason] = {
        401: "unauthorized",
        409: "conflict",
        413: "body_too_large",
        499: "client_disconnected",
        503: "not_ready",
    }
    if status in by_status:
        return by_status[status]
    return "invalid_request" if status < 500 else "backend_error"


class BackendError(Exception):
    """A request failed; `status` is the HTTP status the gateway answers with, `message` says what to fix, and
    `retry_after` (seconds), when set, becomes a Retry-After header: the failure is temporary. `reason` names the
    kind of failure where the status alone does not (default_reason otherwise)."""

    def __init__(
        self,
        status: int,
        message: str,
        retry_after: float | None = None,
        reason: Reason | None = None,
        detail: dict[str, float | int | None] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after
        self.reason: Reason = reason or default_reason(status)
        self.detail = detail or {}  # numbers a client reads from the error body besides the message
