"""The on-policy gate: while the trainer trains on a batch, new generation requests wait for the version it is about
to publish instead of sampling on a policy that is about to be replaced (and whose rollouts the trainer would drop
as stale at max_staleness 0).

- **Closed for a version.** The trainer closes the gate when it takes a batch ("version v+1 is coming, hold for at
  most hold_s"); the publish of v+1 (or any publish: a rollback included) opens it. Requests already running are
  not touched: they finish on v. A trainer that dies with the gate closed cannot stall the environments for long:
  the gate opens by itself at the deadline, and what it held is served on whatever is current then.
- **A quota per version.** Atropos environments decide how many groups to start from run-api's queue as they last
  polled it, so they can start the whole next batch before the trainer has taken the current one; on v, those are
  stale the moment v+1 is published. With a quota (the trainer's batch size, in sequences), once that many
  sequences have been started on the current version, further requests wait for the next one too. An environment
  that throws groups away (equal scores, failures) needs more than a batch: when nothing is running on the current
  version and the trainer has not taken a batch within `refill_s`, the held requests go through on it after all.
- **A quota per environment** in a mixed run. run-api fills each batch with each environment's share, and
  atroposlib's pacing keeps one group per environment queued beyond it; under one quota for the whole batch,
  whichever environment asks first starts more than its share on a version, and what run-api does not hand out
  with that version's batch is stale a version later. With `env_quotas` each environment (named by the bearer key
  of its requests, rlcommon/envkeys.py) may start its own share per version; requests naming no
  environment of the quotas count against the batch's. Only the trainer knows which environment is short of its
  share (it reads run-api's queue): it asks for that environment's refill (`refill_envs`), and the timed refill
  lifts the batch's quota alone. Refilling every environment would start the others' extra groups on the version.
- **Every hold has a deadline.** A request waits at most `hold_s` (the trainer's `publish.gate_hold_s`, carried by
  each close and quota) from its arrival, whatever holds it: a closed gate, the quota, or one after the other. Past
  it the request goes through on the current version and is counted (`deadline_passes_total`): a trainer or
  environment that never moves again costs its environments a bounded wait, never a hang.
- **Continuations pass.** A request that continues an episode (its prompt starts with a turn the gateway sampled:
  the app asks the ledger, inference/policy/registry.py VersionLedger.continued) neither waits nor counts against
  the quota: the episode was admitted with its first turn. Held at a closed gate, its later turns would be sampled
  by the next version, and the trainer counts an episode as its oldest turn's version: stale as a whole at
  max_staleness 0. Counted against the quota, a 3-turn episode would take three of a batch's sequences.
- **Whole groups.** A group is `group_size` samples of one prompt. Atropos's ManagedServer asks for them in one
  request (n = group_size); verifiers asks once per rollout (n = 1, the same prompt each time). Admitted request by
  request, the quota's last group would start partly on this version and partly on the next: mixed, it is stale as a
  whole at max_staleness 0, and so is the next version's last group (measured: 8 sequences per environment dropped at
  every step of a verifiers run). So the first request of a prompt (its group key) on a version reserves the whole
  group (max(n, group_size) against the quota) and the group's further requests pass at once, closed gate or not,
  until the group's size is used up. Prompts alike in every group (one fixed prompt) share that reservation. A
  reservation no other sample used by the time its request ends (an eval prompt asked for once) goes back to the
  quota.
- **A refill waits for quiet.** Between two turns of an episode nothing of its environment runs, yet the
  environment is busy, not short: refilled then, it starts a group beyond its share on the version, which lands in
  the next batch as stale, and the refill that the next wait brings does the same again (measured: one 3-turn group
  dropped at every step from the first such refill on). So an environment is refilled (and the timed refill lets
  unnamed requests through) only once none of its requests has run for `refill_s`. An environment whose episodes
  pause longer than that between turns (a slow tool) needs a larger refill_s.

Pure asyncio, no I/O.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from rlcommon.timeouts import GATE_HOLD_S

log = logging.getLogger("inference.gate")
MAX_SEEN_ENVS = 256  # environment names counted for GET /policy: a client naming endless ones grows nothing
MAX_GROUPS = 65536  # groups reserved on one version: past it, a group's further requests wait as any would
DEADLINE_LOG_EVERY_S = 30.0


@dataclass(frozen=True)
class GateClosing:
    """One closing of the gate, as reported when it opens."""

    version: int  # the version it waited for
    closed_s: float  # how long it was closed
    held_requests: int  # requests that arrived while it was closed (or over the quota) and waited
    expired: bool  # opened by its deadline, not by a publish
    continuations: int = 0  # episode turns let through while it was closed


class Gate:
    def __init__(self, running_on_current: Callable[[], int] = lambda: 0) -> None:
        self._running_on_current = running_on_current
        self._cond = asyncio.Condition()
        self._waiting_for: int | None = None
        self._closed_at = 0.0
        self._held = 0  # requests held while it is closed
        self._continued = 0  # continuations let through while it is closed
        self._holding_now = 0
        self._deadline: asyncio.TimerHandle | None = None
        # The quota: sequences allowed on the current version (None: no limit), and how many were started.
        self.quota: int | None = None
        self.env_quotas: dict[str, int] = {}
        self.refill_s = 1.0
        # The longest any request waits, from its arrival (publish.gate_hold_s's default until the trainer says).
        self.hold_s = GATE_HOLD_S
        self.lead = 0  # versions of sampling ahead the quotas allow (see set_quota)
        self._lead_pending = 0  # the head start the next opening grants
        self._granted: int | None = None  # the current version's quota before a carry (a head start included)
        self._granted_env: dict[str, int] = {}
        self._allowed: int | None = None
        self._started = 0
        self._allowed_env: dict[str, int] = {}  # per environment of env_quotas, as _allowed for the batch
        self._started_env: dict[str, int] = {}
        self._over_quota = 0  # sequences waiting only for the quota
        self._over_env: dict[str, int] = {}  # the same, by environment of env_quotas
        # Started on this version by each environment named (GET /policy).
        self._seen_env: dict[str, int] = {}
        self._refill: asyncio.TimerHandle | None = None
        self.last: GateClosing | None = None
        self.held_total = 0
        self.hold_s_total = 0.0  # summed over held requests
        self.expired_total = 0
        self.refills_total = 0
        # Sequences taken off a version's quota for what the one before started beyond it.
        self.carried_total = 0
        self.continuations_total = 0
        self.deadline_passes_total = (
            0  # requests let through on the current version because their hold_s ran out
        )
        self._deadline_logged_at = float("-inf")
        # Groups admitted on the current version: (environment, group key) -> samples still reserved for them.
        self.group_size: int | None = None  # of requests naming no environment of env_quotas
        self.env_group_sizes: dict[str, int] = {}
        self._groups: dict[tuple[str | None, str], int] = {}
        self._reserved: dict[tuple[str | None, str], int] = {}  # what each reservation held when it was made
        self._group_running: dict[tuple[str | None, str], int] = {}  # requests of each group running now
        self.group_passes_total = 0  # requests let through as the rest of a group admitted on their version
        self.openings = 0  # versions opened (each starts its quotas and group reservations afresh)
        self.released_total = 0  # samples of group reservations given back unused
        # Requests running now and when one last started or ended, by environment (None: unnamed, or past
        # MAX_SEEN_ENVS): what tells a refill whether an environment is quiet (module docstring).
        self._busy: dict[str | None, int] = {}
        self._last_active: dict[str | None, float] = {}

    @property
    def waiting_for(self) -> int | None:
        return self._waiting_for

    @property
    def holding(self) -> int:
        """Requests waiting at the gate now."""
        return self._holding_now

    def started_by_env(self) -> dict[str, int]:
        """Sequences started on the current version by each environment named in requests; "" for the rest."""
        return {**self._seen_env, "": self._started - sum(self._seen_env.values())}

    def set_quota(
        self,
        sequences: int | None,
        refill_s: float,
        env_quotas: dict[str, int] | None = None,
        hold_s: float | None = None,
        lead: int = 0,
        group_size: int | None = None,
        env_group_sizes: dict[str, int] | None = None,
    ) -> bool:
        """From the next opening on, allow `sequences` per version (None: no quota), and each environment of
        `env_quotas` its own number; requests arriving from now on wait at most `hold_s` (None: as before).
        `lead` (without the gate, rollout.max_staleness): the first version opened under new quotas allows 1 + lead
        times as many, so environments sample the next batch while the trainer trains on this one; each version
        after starts one batch, which the trainer takes `lead` versions later. `group_size` (per environment:
        `env_group_sizes`) is what the first request of a prompt reserves (module docstring: whole groups).
        Returns whether the quotas differ from those set before."""
        quotas = dict(env_quotas or {}) if sequences is not None else {}
        changed = (sequences, quotas, lead) != (self.quota, self.env_quotas, self.lead)
        self.quota, self.refill_s, self.env_quotas, self.lead = sequences, refill_s, quotas, lead
        if changed:
            self._lead_pending = lead
        if hold_s is not None:
            self.hold_s = hold_s
        self.group_size, self.env_group_sizes = group_size, dict(env_group_sizes or {})
        return changed

    def close(self, version: int, hold_s: float) -> None:
        """Hold new requests until `version` is published, for at most `hold_s` from now. Closing again (a retried
        call, or a newer version) restarts the deadline."""
        if self._waiting_for is None:
            self._closed_at = time.monotonic()
            self._held = self._holding_now  # those over the quota were already held for this version
            self._continued = 0
        self._waiting_for = version
        self.hold_s = hold_s
        self._cancel_refill()
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = asyncio.get_running_loop().call_later(hold_s, self._expire, version, hold_s)

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

    def open(self, expired: bool = False) -> GateClosing | None:
        """A new version is current (or none is coming): let requests through, with a fresh quota. Returns the
        closing that ended, or None if the gate was not closed."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._cancel_refill()
        # Sequences a version started beyond its quota (a refill let them through) are queued beyond the next
        # batch: run-api hands them out first, oldest first, with the next version's batch. At max_staleness 0 they
        # are stale there and each takes a fresh group's place, which is stale a batch later, and so on for the rest
        # of the run (measured: one group per environment per step, from the first refill on). The next version
        # starts that many fewer, so the surplus is used up in one batch.
        carry = self._surplus(self._started, self._granted)
        carry_env = {
            env: self._surplus(self._started_env.get(env, 0), self._granted_env.get(env))
            for env in self.env_quotas
        }
        times, self._lead_pending = 1 + self._lead_pending, 0
        self._granted = None if self.quota is None else self.quota * times
        self._granted_env = {env: q * times for env, q in self.env_quotas.items()}
        self._allowed = None if self._granted is None else max(0, self._granted - carry)
        self._started = 0
        self._allowed_env = {env: max(0, q - carry_env[env]) for env, q in self._granted_env.items()}
        self._started_env = dict.fromkeys(self.env_quotas, 0)
        self.carried_total += sum(carry_env.values()) if carry_env else carry
        self._seen_env = {}
        self._groups, self._reserved, self._group_running = {}, {}, {}
        self.openings += 1
        closing = None
        if self._waiting_for is not None:
            closed_s = time.monotonic() - self._closed_at
            closing = GateClosing(self._waiting_for, closed_s, self._held, expired, self._continued)
            self._waiting_for = None
            self.last = closing
        self._wake()
        return closing

    @staticmethod
    def _surplus(started: int, granted: int | None) -> int:
        """What a version that ran under a quota started beyond it."""
        return 0 if granted is None else max(0, started - granted)

    def _passable(self, n: int, env: str | None) -> bool:
        if self._waiting_for is not None:
            return False
        # One request larger than the whole quota still goes through on a fresh version.
        if env in self._allowed_env:
            started, allowed = self._started_env[env], self._allowed_env[env]
            return started + n <= allowed or (started == 0 and allowed > 0)
        if self._allowed is None:
            return True
        return self._started + n <= self._allowed or (self._started == 0 and self._allowed > 0)

    def _start(self, n: int, env: str | None) -> None:
        self._started += n
        if env is not None and (env in self._seen_env or len(self._seen_env) < MAX_SEEN_ENVS):
            self._seen_env[env] = self._seen_env.get(env, 0) + n
        if env in self._started_env:
            self._started_env[env] += n

    def _cost(self, n: int, env: str | None, group: str | None, reserve: bool = True) -> int:
        """What a request that starts a group takes off the quota: the whole group (module docstring), or what
        the quota has left when that is less. A refill lifts the quota by the samples held, not by whole groups: a
        group's late rollouts, whose first one's reservation went back unused, must fit what it lifted; so a
        request that waited over the quota (`reserve` False) takes only its own samples."""
        if group is None or self._allowed is None or not reserve:
            return n
        if env in self._allowed_env:
            size = self.env_group_sizes.get(env, self.group_size)
            left = self._allowed_env[env] - self._started_env[env]
        else:
            size, left = self.group_size, self._allowed - self._started
        return max(n, min(size or n, left))

    def _in_group(self, n: int, env: str | None, group: str | None) -> bool:
        """Whether a group admitted on this version still holds `n` samples for this request."""
        return group is not None and self._groups.get((env, group), 0) >= n

    def _admit(self, n: int, env: str | None, group: str | None, reserve: bool = True) -> None:
        if self._in_group(n, env, group):
            assert group is not None
            self._groups[(env, group)] -= n
            self.group_passes_total += 1
            return
        cost = self._cost(n, env, group, reserve)
        self._start(cost, env)
        if group is not None and cost > n and len(self._groups) < MAX_GROUPS:
            self._groups[(env, group)] = self._groups.get((env, group), 0) + cost - n
            self._reserved[(env, group)] = self._groups[(env, group)]
            if self._holding_now:  # the group's other requests may be waiting already: they may go now
                self._wake()

    def _may_start(self, n: int, env: str | None, group: str | None, reserve: bool = True) -> bool:
        return self._in_group(n, env, group) or self._passable(self._cost(n, env, group, reserve), env)

    async def wait(self, n: int = 1, env: str | None = None, group: str | None = None) -> float:
        """Return once a request for `n` sequences from environment `env` (None: not named) may start; the
        seconds it was held. `group` names the prompt it samples (module docstring: whole groups)."""
        if self._may_start(n, env, group):
            self._admit(n, env, group)
            return 0.0
        started = time.monotonic()
        deadline = started + self.hold_s
        self._held += 1
        self.held_total += 1
        self._holding_now += 1
        counted: tuple[str | None, int] | None = (
            None  # (environment or None, sequences) counted as over the quota
        )
        counted_on = -1  # the opening whose quota held it
        # The deadline wakes the waiters (a timer, not a cancelled wait: cancelling a task inside Condition.wait
        # while it re-takes the lock lost a wake-up now and then, and a request then waited for ever).
        alarm = asyncio.get_running_loop().call_at(
            asyncio.get_running_loop().time() + self.hold_s, self._wake
        )
        try:
            async with self._cond:
                # Held over this version's quota, it is let through by a refill, which lifts the quota by the
                # samples held: it takes only its own then (_cost). On a new version it starts a group as any would.
                while not self._may_start(n, env, group, counted is None or counted_on != self.openings):
                    # Held by the quota, not (or no longer) by a closed gate: counted as over it, which lets the
                    # refill see it. A request held by the closed gate counts from the opening on, where the new
                    # version's quota (less a carry) may hold it too; uncounted, no refill would ever come.
                    if counted is None and self._waiting_for is None:
                        counted, counted_on = (env if env in self._allowed_env else None, n), self.openings
                        self._count_over(*counted)
                        self._arm_refill()  # nothing may be running to end and arm it
                    if time.monotonic() >= deadline:
                        self._pass_by_deadline(n, env)
                        break
                    await self._cond.wait()
                self._admit(n, env, group, counted is None or counted_on != self.openings)
        finally:
            alarm.cancel()
            self._holding_now -= 1
            if counted is not None:
                self._count_over(counted[0], -counted[1])
            held = time.monotonic() - started
            self.hold_s_total += held
        return held

    def _pass_by_deadline(self, n: int, env: str | None) -> None:
        self.deadline_passes_total += 1
        now = time.monotonic()
        if now - self._deadline_logged_at < DEADLINE_LOG_EVERY_S:
            return  # a dead trainer lets every request through this way: one line per interval says it
        self._deadline_logged_at = now
        why = f"version {self._waiting_for} not published" if self._waiting_for is not None else "the quota"
        log.warning(
            "on-policy gate: a request for %d sequence(s)%s waited its %.3gs (%s); serving it on the current "
            "version (%d so far; is the trainer alive? read its log)",
            n,
            f" from {env}" if env else "",
            self.hold_s,
            why,
            self.deadline_passes_total,
        )

    def _count_over(self, env: str | None, n: int) -> None:
        self._over_quota += n
        if env is not None:
            self._over_env[env] = self._over_env.get(env, 0) + n

    def admit_continuation(self) -> None:
        """Let a request through that continues an episode already admitted: at once, closed or not, outside the
        quota (module docstring)."""
        self.continuations_total += 1
        self._continued += 1 if self._waiting_for is not None else 0

    def _activity_key(self, env: str | None) -> str | None:
        if env in self._busy or len(self._busy) < MAX_SEEN_ENVS:
            return env
        return None

    def request_started(self, env: str | None = None, group: str | None = None) -> None:
        """Called when a request (a first turn or a continuation) starts running, paired with request_done."""
        key = self._activity_key(env)
        self._busy[key] = self._busy.get(key, 0) + 1
        self._last_active[key] = time.monotonic()
        if group is not None and (env, group) in self._groups:
            self._group_running[(env, group)] = self._group_running.get((env, group), 0) + 1

    def _release_unused(self, env: str | None, group: str | None) -> None:
        """A request that reserved a group ended and none of the group's other samples came (an eval prompt asked
        for once, a client that never asks per rollout): its reservation goes back to the quota."""
        if group is None or (env, group) not in self._group_running:
            return
        key = (env, group)
        self._group_running[key] -= 1
        if self._group_running[key] > 0 or self._groups.get(key) != self._reserved.get(key):
            return
        unused = self._groups.pop(key)
        del self._reserved[key], self._group_running[key]
        self._start(-unused, env)
        self.released_total += unused
        if self._holding_now:
            self._wake()

    def _quiet_s(self, env: str | None = None, every: bool = False) -> float:
        """How long nothing of `env` (`every`: of any environment) has run; 0.0 while something runs."""
        keys = list(self._busy) if every else [self._activity_key(env)]
        if any(self._busy.get(k, 0) > 0 for k in keys):
            return 0.0
        last = max((self._last_active.get(k, float("-inf")) for k in keys), default=float("-inf"))
        return time.monotonic() - last

    def request_done(self, env: str | None = None, group: str | None = None) -> None:
        """Called when a request ends: with nothing left running on the current version while requests wait over
        the quota, the environment is short of a batch (it discarded groups); give the trainer `refill_s` to take
        one, then, if nothing has run meanwhile, let the held requests through on the current version."""
        key = self._activity_key(env)
        if self._busy.get(key, 0) > 0:
            self._busy[key] -= 1
            self._last_active[key] = time.monotonic()
        self._release_unused(env, group)
        self._arm_refill()

    def _arm_refill(self) -> None:
        if self._waiting_for is not None or not self._over_quota or self._refill is not None:
            return
        if self._running_on_current():
            return
        self._refill = asyncio.get_running_loop().call_later(self.refill_s, self._do_refill)

    def _do_refill(self) -> None:
        self._refill = None
        # Environments of env_quotas wait for refill_envs: the trainer names the one that is short.
        unnamed = self._over_quota - sum(self._over_env.get(env, 0) for env in self._allowed_env)
        if self._waiting_for is not None or not unnamed or self._allowed is None:
            return
        if self._running_on_current():  # a request started meanwhile (one smaller than the quota's rest)
            return
        quiet = self._quiet_s(every=True)
        if quiet < self.refill_s:  # an episode between two turns: its next turn is coming (module docstring)
            wait = self.refill_s - quiet if quiet > 0 else self.refill_s
            self._refill = asyncio.get_running_loop().call_later(wait, self._do_refill)
            return
        self.refills_total += 1
        self._allowed = self._started + unnamed
        self._wake()

    def refill_envs(self, short: dict[str, int]) -> list[str]:
        """The trainer waits for a batch that these environments are short of (sequences, from run-api's queue):
        let what each of them holds over its quota through on the current version, up to the whole groups it lacks,
        once none of its requests has run for refill_s (any surplus comes off the next version: open). Returns those
        refilled."""
        if self._waiting_for is not None:
            return []
        refilled = [
            env
            for env, n in short.items()
            if n > 0
            and env in self._allowed_env
            and self._over_env.get(env, 0)
            and self._quiet_s(env) >= self.refill_s
        ]
        for env in refilled:
            # As many whole groups as the batch lacks: the environment's further held groups would start on this
            # version beyond its share, queued past the batch and stale in the next one.
            size = self.env_group_sizes.get(env) or 1
            lacking = -(-short[env] // size) * size
            self._allowed_env[env] = self._started_env[env] + min(self._over_env[env], lacking)
        if refilled:
            self.refills_total += 1
            self._wake()
        return refilled

    def _cancel_refill(self) -> None:
        if self._refill is not None:
            self._refill.cancel()
            self._refill = None

    def _wake(self) -> None:
        async def notify() -> None:
            async with self._cond:
                self._cond.notify_all()

        asyncio.get_running_loop().create_task(notify())
