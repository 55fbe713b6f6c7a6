"""Dynamic sampling (rollout.refill_zero_variance): a group whose rewards are all equal has zero advantage and
teaches nothing, yet it takes a place in the step's batch. With the refill on, such groups are left out and counted,
and their places go to further groups, up to rollout.refill_max_groups per step so that a solved (or hopeless)
task cannot stall the run: past the bound the step takes what comes, and the intake skips the equal-reward groups
as it always does.

Further groups come from run-api a batch at a time; what a step does not need waits in the trainer's reserve for the
next step (and the staleness check then sees its versions like any other group's). Pure apart from `fetch`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def equal_rewards(group: Any) -> bool:
    """The intake's zero-variance group: every score the same (one sample included) and no token advantages. A
    group whose scores are not all finite numbers is left to the intake, which counts it as malformed."""
    if not isinstance(group, dict) or group.get("advantages"):
        return False
    scores = group.get("scores")
    if not isinstance(scores, list) or not scores:
        return False
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in scores):
        return False
    return max(scores) == min(scores)


def sequences(group: Any) -> int:
    tokens = group.get("tokens") if isinstance(group, dict) else None
    return len(tokens) if isinstance(tokens, list) else 0


@dataclass
class TopUp:
    """The step's batch and what the refill did for it."""

    groups: list[Any]
    replaced: int = 0  # equal-reward groups left out, their places given to further groups
    fetched: int = 0  # batches asked of run-api for this step (0: the reserve held enough)
    bound_reached: bool = False  # an equal-reward group was kept because `max_replaced` were already left out

    def row(self) -> dict[str, float]:
        return {
            "rollouts/zero_variance_groups_replaced": float(self.replaced),
            "rollouts/zero_variance_batches_fetched": float(self.fetched),
            "rollouts/zero_variance_bound_reached": float(self.bound_reached),
        }


@dataclass
class Reserve:
    """Groups run-api handed out that no step has taken yet, oldest first."""

    groups: list[Any] = field(default_factory=list)

    def fill(self, fetch: Callable[[], list[Any]], batch_sequences: int, max_replaced: int) -> TopUp:
        """A batch of at least `batch_sequences` sequences from the reserve, then from `fetch` (one run-api batch
        per call, which may wait for it), leaving out up to `max_replaced` equal-reward groups."""
        out = TopUp([])
        taken = 0
        while taken < batch_sequences:
            if not self.groups:
                batch = fetch()
                out.fetched += 1
                if not batch:
                    break
                self.groups.extend(batch)
                continue
            group = self.groups.pop(0)
            if equal_rewards(group):
                if out.replaced < max_replaced:
                    out.replaced += 1
                    continue
                out.bound_reached = True
            out.groups.append(group)
            taken += sequences(group)
        return out
