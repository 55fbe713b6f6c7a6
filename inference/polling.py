"""The gateway's one way to wait for something: poll an async check until it answers, with a deadline."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import AsyncRetrying, RetryError, retry_if_result, stop_after_delay, wait_fixed

T = TypeVar("T")


async def poll_until(
    check: Callable[[], Awaitable[T]], timeout_s: float, interval_s: float = 0.5
) -> T | None:
    """Await `check` every `interval_s` until it returns a truthy value, and return it; None past the deadline.
    An exception from `check` ends the wait at once (use it for "the process died")."""
    poll = AsyncRetrying(
        stop=stop_after_delay(timeout_s),
        wait=wait_fixed(interval_s),
        retry=retry_if_result(lambda value: not value),
    )
    try:
        return await poll(check)
    except RetryError:
        return None
