"""Who holds a shared engine (`launch.sh engine`): one run at a time, through a lease it renews every few seconds.
A run that dies stops renewing, and its lease lapses after `ttl_s`; the next run attaches then. Pure state: the
caller passes the time."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Lease:
    holder: str  # the run's lease id (kept in its config.yaml, so a resumed run is the same holder)
    who: str  # for people: the run folder and the launcher's host and PID
    acquired_at: float
    renewed_at: float


class LeaseHeld(Exception):
    def __init__(self, lease: Lease, expires_in_s: float):
        super().__init__(lease.who)
        self.lease = lease
        self.expires_in_s = expires_in_s


class LeaseBook:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._lease: Lease | None = None
        self._last: str | None = (
            None  # the holder of the newest lease granted: its run's state is on the engine
        )
        self.runs = 0  # leases newly granted: each starts a run, whose policy names are its own
        self.lapsed = 0  # leases that ran out without a release (a run that died or stopped renewing)

    def current(self, now: float) -> Lease | None:
        lease = self._lease
        if lease is not None and now - lease.renewed_at > self.ttl_s:
            self._lease = None
            self.lapsed += 1
        return self._lease

    def expires_in(self, now: float) -> float:
        lease = self.current(now)
        return 0.0 if lease is None else max(0.0, self.ttl_s - (now - lease.renewed_at))

    def attach(self, holder: str, who: str, now: float) -> bool:
        """Grant the lease to `holder`; True when a new run starts (the engine then starts from a clean policy
        state), False when the engine holds `holder`'s run already: it holds the lease (a relaunched or resumed run),
        or its lease lapsed with nobody attaching since (a run whose renewals were late). LeaseHeld when another run
        holds it."""
        lease = self.current(now)
        if lease is not None and lease.holder != holder:
            raise LeaseHeld(lease, self.expires_in(now))
        if lease is not None:
            lease.renewed_at, lease.who = now, who
            return False
        self._lease = Lease(holder, who, now, now)
        if holder == self._last:
            return False
        self._last = holder
        self.runs += 1
        return True

    def renew(self, holder: str, now: float) -> bool:
        """Renew `holder`'s lease; False when it does not hold it (lapsed, released, or another run's)."""
        lease = self.current(now)
        if lease is None or lease.holder != holder:
            return False
        lease.renewed_at = now
        return True

    def release(self, holder: str, now: float) -> bool:
        if not self.renew(holder, now):
            return False
        self._lease = None
        return True

    def holds(self, holder: str | None, now: float) -> bool:
        lease = self.current(now)
        return lease is not None and holder is not None and lease.holder == holder
