"""While the trainer waits for a batch of a mixed run with the on-policy gate's quotas: name the environments short
of their share to the gateway, so that only those go on sampling on the current version.

Each environment may start only its share of a batch per version (inference/policy/gate.py). One that discards a
group (equal scores, a failure) then falls short, and the batch waits. The gateway cannot tell which one: it sees
requests, not run-api's queue. So, once the trainer has waited `gate_refill_s` for a batch, it reads each
environment's queue from run-api (GET /envs) and asks the gateway to refill those below their share
(POST /policy/refill), again every `gate_refill_s` while it waits. The gateway refills an environment only once
none of its requests has run for `gate_refill_s`: one still sampling (or between two turns of its episodes) will fill
its share by itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import httpx

from trainer.training.retries import ComponentDown

log = logging.getLogger("trainer.refill")


class Queues(Protocol):
    def queued_by_env(self) -> dict[str, int] | None: ...


class Refills(Protocol):
    def refill(self, short: dict[str, int]) -> object: ...


def short_of_share(shares: dict[str, int], queued: dict[str, int]) -> dict[str, int]:
    """Sequences each environment lacks of its share of the batch."""
    return {env: need - queued.get(env, 0) for env, need in shares.items() if queued.get(env, 0) < need}


class ShortRefill:
    """Called before each poll for a batch; `waiting()` when a wait starts (after the batch before was taken)."""

    def __init__(
        self,
        shares: dict[str, int],
        every_s: float,
        api: Queues,
        gateway: Refills,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.shares, self.every_s, self.api, self.gateway, self.clock = shares, every_s, api, gateway, clock
        self._since: float | None = None
        self._last = 0.0
        self.asked = 0  # refills asked for (the gateway may have had nothing to let through)

    def waiting(self) -> None:
        self._since = self.clock()

    def __call__(self) -> None:
        now = self.clock()
        if self._since is None:
            self._since = now
        if now - self._since < self.every_s or now - self._last < self.every_s:
            return
        self._last = now
        queued = self.api.queued_by_env()
        if queued is None:
            return
        short = short_of_share(self.shares, queued)
        if not short:
            return
        self.asked += 1
        try:
            self.gateway.refill(short)
        except (httpx.HTTPError, ComponentDown) as exc:  # the next poll asks again
            log.warning("the gateway did not take the refill of %s: %s", sorted(short), exc)
