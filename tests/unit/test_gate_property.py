"""The on-policy gate driven through seeded random interleavings of requests, closes, quotas, publishes, refills,
cancellations, a trainer that stops answering and gateway restarts (tests/unit/gate_property.py): no request waits
past its hold, none starts while a version is awaited unless its hold ran out, no count goes negative, nothing is
left counted at the end. A few seeds here; tests/integration/test_gate_property_long.py runs many more."""

from __future__ import annotations

import asyncio
import time

import pytest

from inference.policy.gate import Gate
from tests.unit.gate_property import drive


@pytest.mark.parametrize("seed", range(6))
async def test_random_interleavings_keep_every_promise(seed):
    world = await asyncio.wait_for(drive(seed), 30)  # a hang fails instead of holding the suite
    assert not world.violations, world.violations[:5]
    assert world.started > 20, "too few requests started: the driver exercised little"


async def test_an_environment_over_its_quota_with_the_trainer_gone_waits_one_hold_at_most():
    """Only the trainer refills a named environment (it reads run-api's queue): with the trainer dead, what that
    environment holds over its quota would wait forever without the hold's deadline."""
    gate = Gate(lambda: 0)
    gate.set_quota(8, 0.01, {"a": 2}, hold_s=0.2)
    gate.open()
    await gate.wait(2, "a")  # its share of this version
    started = time.monotonic()
    held = await asyncio.wait_for(asyncio.gather(gate.wait(2, "a"), gate.wait(1, "a")), timeout=5)
    assert all(0.19 <= h <= 0.5 for h in held) and time.monotonic() - started < 0.5, held
    assert gate.deadline_passes_total == 2 and gate.holding == 0 and gate._over_env == {"a": 0}
