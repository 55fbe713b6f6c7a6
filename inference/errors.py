"""The gateway's one error type: every failure carries the HTTP status the client should get."""

from __future__ import annotations


class BackendError(Exception):
    """A request failed; `status` is the HTTP status the gateway answers with, `message` says what to fix, and
    `retry_after` (seconds), when set, becomes a Retry-After header: the failure is temporary."""

    def __init__(self, status: int, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after
