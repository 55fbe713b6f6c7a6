"""Calls from the trainer to another process that survive a blip: a restart of run-api or the gateway, a vLLM
restart behind the gateway, a process stopped for a while. Transient failures (no connection, a timeout, 502, 503,
504) are retried with jittered exponential backoff until a budget runs out; a 4xx is the caller's own mistake and
is raised at once. Past the budget the error names the component, its URL and the log to read."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx
from tenacity import (
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    wait_random_exponential,
)

T = TypeVar("T")
log = logging.getLogger("trainer.training.retries")

TRANSIENT_STATUS = frozenset({502, 503, 504})


class ComponentDown(RuntimeError):
    """A component stayed unreachable (or kept failing transiently) for the whole retry budget."""


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, httpx.TransportError):  # refused, reset, connect/read/write/pool timeouts
        return True
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code in TRANSIENT_STATUS
    return False


@dataclass(frozen=True)
class RemoteComponent:
    """One process the trainer talks to."""

    component: str  # "run-api", "gateway"
    url: str
    log: str  # where the component writes its log
    budget_s: float
    max_wait_s: float = 10.0  # longest pause between two attempts

    def call(self, fn: Callable[[], T], what: str) -> T:
        """`fn()`, retried while it fails transiently and the budget lasts."""

        def note(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "%s %s failed (%s); retrying (attempt %d, %.0fs of %.0fs budget used)",
                self.component,
                what,
                describe(exc),
                state.attempt_number,
                state.seconds_since_start or 0.0,
                self.budget_s,
            )

        retrying = Retrying(
            stop=stop_after_delay(self.budget_s),
            wait=wait_random_exponential(multiplier=0.5, max=self.max_wait_s),
            retry=retry_if_exception(is_transient),
            before_sleep=note,
        )
        try:
            return retrying(fn)
        except RetryError as exc:
            last = exc.last_attempt.exception()
            raise ComponentDown(
                f"{self.component} at {self.url}: {what} kept failing for {self.budget_s:.0f}s "
                f"({describe(last)}); read {self.log}"
            ) from last


def describe(exc: BaseException | None) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}: {exc.response.text[:200]}"
    return repr(exc)


def checked(response: httpx.Response) -> httpx.Response:
    """The response, or HTTPStatusError for any status but 2xx (with the body in the message: it says why)."""
    if response.is_success:
        return response
    raise httpx.HTTPStatusError(
        f"{response.request.method} {response.request.url} answered {response.status_code}: {response.text[:500]}",
        request=response.request,
        response=response,
    )
