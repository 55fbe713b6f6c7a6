"""The trainer's side of a mixed run's refill (trainer/training/refill.py): when, and for whom, it asks."""

from __future__ import annotations

import httpx

from trainer.training.refill import ShortRefill, short_of_share


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Api:
    def __init__(self) -> None:
        self.queued: dict[str, int] | None = {"toy": 48, "residue": 8}
        self.asked = 0

    def queued_by_env(self) -> dict[str, int] | None:
        self.asked += 1
        return self.queued


class Gateway:
    def __init__(self) -> None:
        self.refills: list[dict[str, int]] = []
        self.fail = False

    def refill(self, short: dict[str, int]) -> object:
        if self.fail:
            raise httpx.ConnectError("down")
        self.refills.append(short)
        return None


def test_short_of_share_names_only_the_environments_below_it():
    shares = {"toy": 48, "residue": 16}
    assert short_of_share(shares, {"toy": 56, "residue": 8}) == {"residue": 8}
    assert short_of_share(shares, {"toy": 48}) == {"residue": 16}  # nothing queued, or not registered yet
    assert short_of_share(shares, {"toy": 48, "residue": 16, "other": 0}) == {}


def test_it_asks_after_refill_s_of_waiting_then_every_refill_s_and_survives_a_failure():
    clock, api, gateway = Clock(), Api(), Gateway()
    refill = ShortRefill({"toy": 48, "residue": 16}, 1.0, api, gateway, clock)
    refill.waiting()
    refill()
    clock.now += 0.5
    refill()
    assert api.asked == 0 and gateway.refills == []  # the environments are still sampling, as far as it knows
    clock.now += 0.6
    refill()
    assert gateway.refills == [{"residue": 8}]
    clock.now += 0.3
    refill()
    assert len(gateway.refills) == 1  # not before another refill_s
    clock.now += 1.0
    gateway.fail = True
    refill()  # logged; the next poll asks again
    gateway.fail = False
    api.queued = {"toy": 48, "residue": 16}  # the batch is full: nothing to ask
    clock.now += 1.0
    refill()
    assert len(gateway.refills) == 1 and refill.asked == 2
    api.queued = None  # run-api did not answer
    clock.now += 1.0
    refill()
    refill.waiting()  # the next batch's wait starts the count again
    api.queued = {"toy": 0, "residue": 0}
    clock.now += 0.9
    refill()
    assert len(gateway.refills) == 1
