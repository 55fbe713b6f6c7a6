"""The on-policy gate: while the trainer trains on a batch, new generation requests wait for the version it is about
to publish instead of sampling on a policy that is about to be replaced (and whose rollouts the trainer would drop
as stale at max_staleness 0).

The trainer closes the gate when it takes a batch ("version v+1 is coming, hold for at most hold_s"); the publish
of v+1 (or any publish: a rollback included) opens it. Requests already running are not touched: they finish on v.
A trainer that dies with the gate closed cannot stall the environments for long: the gate opens by itself at the
deadline, and the requests it held are served on whatever is current then. Pure asyncio, no I/O.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

log = logging.getLogger("inference.gate")


@dataclass(frozen=True)
class GateSpell:
    """One closing of the gate, as reported when it opens."""

    version: int  # the version it waited for
    closed_s: float  # how long it was closed
    held_requests: int  # requests that arrived while it was closed and waited
    expired: bool  # opened by its deadline, not by a publish


class Gate:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._waiting_for: int | None = None
        self._closed_at = 0.0
        self._held = 0  # requests held in the current spell
        self._holding_now = 0
        self._timer: asyncio.TimerHandle | None = None
        self.last: GateSpell | None = None
        self.held_total = 0
        self.hold_s_total = 0.0  # summed over held requests
        self.expired_total = 0

    @property
    def waiting_for(self) -> int | None:
        return self._waiting_for

    @property
    def holding(self) -> int:
        """Requests waiting at the gate now."""
        return self._holding_now

    def close(self, version: int, hold_s: float) -> None:
        """Hold new requests until `version` is published, for at most `hold_s` from now. Closing again (a retried
        call, or a newer version) restarts the deadline."""
        if self._waiting_for is None:
            self._closed_at = time.monotonic()
            self._held = 0
        self._waiting_for = version
        self._open.clear()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(hold_s, self._expire, version, hold_s)

    def _expire(self, version: int, hold_s: float) -> None:
        if self._waiting_for != version:
            return
        log.warning(
            "on-policy gate: version %d was not published within %.0fs; serving the %d held request(s) on the "
            "current version (is the trainer alive? read its log)",
            version,
            hold_s,
            self._holding_now,
        )
        self.expired_total += 1
        self.open(expired=True)

    def open(self, expired: bool = False) -> GateSpell | None:
        """Let held and new requests through; the spell that ended, or None if the gate was open."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._waiting_for is None:
            return None
        spell = GateSpell(self._waiting_for, time.monotonic() - self._closed_at, self._held, expired)
        self._waiting_for = None
        self._open.set()
        self.last = spell
        return spell

    async def wait(self) -> float:
        """Return once the gate is open; the seconds this request was held."""
        if self._open.is_set():
            return 0.0
        started = time.monotonic()
        self._held += 1
        self.held_total += 1
        self._holding_now += 1
        try:
            await self._open.wait()
        finally:
            self._holding_now -= 1
            held = time.monotonic() - started
            self.hold_s_total += held
        return held
