"""The gate's property test (tests/unit/gate_property.py) over many more seeds and longer runs than the fast tier's:
no request waits past its hold, none starts while a version is awaited unless its hold ran out, no count goes
negative, nothing is left counted. About 20 seconds; no server."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.gate_property import drive

pytestmark = pytest.mark.slow  # real-time holds: alone on the box, with the servers (tests/run.sh)


async def test_many_seeds_of_random_interleavings_keep_every_promise():
    failures = {}
    passed_by_deadline = 0
    for seed in range(100, 120):
        world = await asyncio.wait_for(drive(seed, events=300), 60)  # a hang fails, naming the seed
        passed_by_deadline += world.passed_by_deadline
        if world.violations:
            failures[seed] = world.violations[:3]
    assert not failures, failures
    assert passed_by_deadline > 0
