"""The trainer side's one way to wait for something: poll a check until it answers, with a deadline or none."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, stop_never, wait_fixed

T = TypeVar("T")


def wait_until(
    check: Callable[[], T | None], timeout_s: float | None, what: str, interval_s: float = 0.5
) -> T:
    """Call `check` every `interval_s` until it returns a truthy value, and return that value. An exception from
    `check` ends the wait at once (use it for "the process died"); past the deadline (None: never) a TimeoutError
    names `what`."""
    poll = Retrying(
        stop=stop_never if timeout_s is None else stop_after_delay(timeout_s),
        wait=wait_fixed(interval_s),
        retry=retry_if_result(lambda value: not value),
    )
    try:
        found = poll(check)
    except RetryError:
        raise TimeoutError(f"{what}: not within {timeout_s:.0f}s") from None
    assert found is not None  # the poll stops only on a truthy value
    return found
