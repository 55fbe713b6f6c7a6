"""Dynamic sampling (rollout.refill_zero_variance): equal-reward groups are left out up to a bound, their places
filled from further run-api batches, and what a step does not need is kept for the next."""

from __future__ import annotations

from typing import Any

import pytest

from trainer.training.config import ConfigError, RunConfig, load_config
from trainer.training.topup import Reserve, equal_rewards


def group(name: str, scores: list[float]) -> dict[str, Any]:
    return {"name": name, "scores": scores, "tokens": [[1, 2]] * len(scores)}


def batches(*names_and_scores: list[tuple[str, list[float]]]):
    """A fake run-api: each call hands out the next batch, and records the call."""
    queue = [[group(n, s) for n, s in b] for b in names_and_scores]
    calls: list[int] = []

    def fetch() -> list[Any]:
        calls.append(1)
        return queue.pop(0)

    return fetch, calls


SIGNAL, FLAT = [0.0, 1.0], [1.0, 1.0]


def test_equal_rewards_is_a_zero_advantage_group():
    assert equal_rewards(group("a", [1.0, 1.0])) and equal_rewards(group("a", [0.5]))
    assert not equal_rewards(group("a", [1.0, 0.0]))
    assert not equal_rewards(
        {"tokens": [[1]]}
    )  # no scores: not ours to judge, the intake drops it as malformed
    assert not equal_rewards(group("a", [float("nan")] * 2))
    assert not equal_rewards(
        {**group("a", FLAT), "advantages": [[0.5, -0.5], [0.1, 0.2]]}
    )  # token advantages
    assert equal_rewards({**group("a", FLAT), "advantages": []})  # atroposlib's "absent"


def test_equal_reward_groups_are_replaced_and_the_surplus_waits_for_the_next_step():
    fetch, _ = batches(
        [("a", SIGNAL), ("b", FLAT), ("c", SIGNAL)],
        [("d", FLAT), ("e", SIGNAL), ("f", SIGNAL)],
    )
    reserve = Reserve()
    step = reserve.fill(fetch, batch_sequences=6, max_replaced=3)
    assert [g["name"] for g in step.groups] == ["a", "c", "e"]
    assert (step.replaced, step.fetched, step.bound_reached) == (2, 2, False)
    assert [g["name"] for g in reserve.groups] == ["f"]  # handed out, not needed: the next step's first
    assert step.row()["rollouts/zero_variance_groups_replaced"] == 2.0


def test_past_the_bound_a_step_takes_what_comes():
    """A solved task: every group scores the same. The step leaves out its bound and then trains (skips) the
    rest, so it asks run-api for one more batch at most."""
    fetch, calls = batches([("a", FLAT), ("b", FLAT)], [("c", FLAT), ("d", FLAT)], [("e", FLAT)])
    step = Reserve().fill(fetch, batch_sequences=4, max_replaced=2)
    assert [g["name"] for g in step.groups] == ["c", "d"] and step.bound_reached and len(calls) == 2


def test_a_reserve_that_holds_a_batch_asks_run_api_for_nothing():
    reserve = Reserve([group("a", SIGNAL), group("b", SIGNAL)])
    step = reserve.fill(lambda: pytest.fail("fetched"), batch_sequences=4, max_replaced=4)
    assert step.fetched == 0 and len(step.groups) == 2 and not reserve.groups


def test_the_refill_is_off_by_default_and_refused_with_distillation():
    cfg = load_config(RunConfig, None, ["rollout.env=toy", "rollout.num_steps=30"])
    assert not cfg.rollout.refill_zero_variance and cfg.rollout.refill_max_groups is None
    assert cfg.runapi_batches() == 30
    # A step may take a further batch per groups_per_step replaced: run-api must not run dry before the last step
    # (the environments stop sampling once it has handed out its num_steps batches).
    on = ["rollout.env=toy", "rollout.num_steps=30", "rollout.refill_zero_variance=true"]
    assert load_config(RunConfig, None, on).runapi_batches() == 60
    assert load_config(RunConfig, None, [*on, "rollout.refill_max_groups=9"]).runapi_batches() == 90
    with pytest.raises(ConfigError, match=r"rollout\.refill_zero_variance=true with distill"):
        load_config(
            RunConfig, None, ["rollout.env=toy", "rollout.refill_zero_variance=true", "distill.teacher=tiny"]
        )
