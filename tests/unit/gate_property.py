"""A seeded random driver of the on-policy gate (inference/policy/gate.py): requests of random sizes from random
environments arrive, run for a while and end, or are cancelled while they wait; the trainer closes the gate, sets
quotas (per environment too), publishes, refills short environments, or stops answering (a dead trainer); restarts
replace the gate. After every event and at the end it checks what the gate promises:

- no request waits past its hold (hold_s from its arrival, plus scheduling slack);
- no request starts while the gate is closed unless its hold ran out (what starts on a version that is about to be
  replaced is what max_staleness 0 would throw away);
- the gate's counts never go negative, and once everything ended nothing is left counted as held or over quota.

Used by tests/unit/test_gate_property.py (a few seeds, fast tier) and tests/integration/test_gate_property_long.py."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

from inference.policy.gate import Gate

HOLD_S = 0.08
SLACK_S = 0.05  # event-loop scheduling on a loaded 2-core box
ENVS = ("a", "b", None)
GROUPS = (None, "p1", "p2", "p3")  # prompts: a group's requests share one


@dataclass
class World:
    gate: Gate
    running: int = 0  # requests started on the current version and not ended
    version: int = 0
    violations: list[str] = field(default_factory=list)
    # (environment, prompt) -> the gate's opening in which a request of it last started
    admitted: dict[tuple[str | None, str], int] = field(default_factory=dict)
    started: int = 0
    passed_by_deadline: int = 0

    def check_counts(self, where: str) -> None:
        g = self.gate
        counts = {
            "holding": g.holding,
            "over_quota": g._over_quota,
            "started": g._started,
            **{f"over_env[{k}]": v for k, v in g._over_env.items()},
            **{f"started_env[{k}]": v for k, v in g._started_env.items()},
        }
        negative = {k: v for k, v in counts.items() if v < 0}
        if negative:
            self.violations.append(f"{where}: negative counts {negative}")


async def request(world: World, rng: random.Random, n: int, env: str | None, group: str | None) -> None:
    gate = world.gate
    arrived, hold = time.monotonic(), gate.hold_s
    await gate.wait(
        n, env, group
    )  # it returns in the step that admitted it: the state below is the admission's
    waited = time.monotonic() - arrived
    if waited > hold + SLACK_S:
        world.violations.append(f"a request for {n} from {env} waited {waited:.3f}s > hold {hold}s")
    # The rest of a group admitted on this version passes a closed gate: split, the group would be stale.
    rest_of_group = group is not None and world.admitted.get((env, group)) == gate.openings
    if gate.waiting_for is not None and waited < hold and not rest_of_group:
        world.violations.append(
            f"a request for {n} from {env} started after {waited:.3f}s while version {gate.waiting_for} was awaited"
        )
    if group is not None:
        world.admitted[(env, group)] = gate.openings
    world.passed_by_deadline += waited >= hold
    world.started += 1
    world.running += 1
    gate.request_started(env)
    try:
        await asyncio.sleep(rng.uniform(0, 0.03))
    finally:
        world.running -= 1
        gate.request_done(env)


async def drive(seed: int, events: int = 150) -> World:
    """One seeded run of `events` random events; returns the world with any violations found."""
    rng = random.Random(seed)
    world = World(Gate(lambda: world.running))
    world.gate.hold_s = HOLD_S
    tasks: list[asyncio.Task[None]] = []
    trainer_alive = True
    for i in range(events):
        kind = rng.choices(
            ["request", "close", "publish", "quota", "refill", "cancel", "die", "restart", "pause"],
            weights=[10, 2, 2, 2, 1, 1, 0.2, 0.2, 3],
        )[0]
        gate = world.gate
        if kind == "request":
            args = (rng.choice([1, 1, 1, 2, 3, 6]), rng.choice(ENVS), rng.choice(GROUPS))  # often one rollout
            tasks.append(asyncio.create_task(request(world, rng, *args)))
        elif kind == "close" and trainer_alive:
            gate.close(world.version + 1, HOLD_S)
        elif kind == "publish" and trainer_alive and gate.waiting_for is not None:
            world.version = gate.waiting_for
            gate.open()
        elif kind == "quota" and trainer_alive:
            quotas = {e: rng.randint(1, 8) for e in ("a", "b") if rng.random() < 0.6}
            gate.set_quota(
                rng.choice([None, 4, 8, 16]),
                rng.choice([0.01, 0.05]),
                quotas,
                HOLD_S,
                rng.choice([0, 0, 1]),
                rng.choice([None, 2, 4]),
                {e: rng.choice([2, 4]) for e in quotas},
            )
        elif kind == "refill" and trainer_alive:
            gate.refill_envs({e: rng.randint(0, 4) for e in ("a", "b")})
        elif kind == "cancel" and tasks:
            rng.choice(tasks).cancel()
        elif kind == "die":
            trainer_alive = False  # nothing closes, publishes or refills again: only deadlines move the gate
        elif kind == "restart":  # the gateway restarts: a fresh gate; what waited on the old one is cut off
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            tasks.clear()
            world.check_counts(f"event {i} (restart)")
            world.gate = Gate(lambda: world.running)
            world.gate.hold_s = HOLD_S
            trainer_alive = True
        else:
            await asyncio.sleep(rng.uniform(0, 0.02))
        await asyncio.sleep(0)
        world.check_counts(f"event {i} ({kind})")
    await asyncio.gather(*tasks, return_exceptions=True)
    world.check_counts("end")
    gate = world.gate
    if gate.holding or gate._over_quota or any(gate._over_env.values()) or any(gate._busy.values()):
        world.violations.append(
            f"end: still counted held {gate.holding}, over quota {gate._over_quota}, {gate._over_env}, "
            f"running {gate._busy}"
        )
    return world
