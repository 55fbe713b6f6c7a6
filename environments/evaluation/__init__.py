"""Held-out evaluation, the pure part every environment shares: the eval_* config fields, the unbiased pass@k
estimator, the metrics dict an eval reports and a bounded runner that survives items that fail. No atroposlib here:
environments/common.py does the sampling and the reporting.

A package, not environments/evaluation.py, because every `environments/NAME.py` is a built-in `bash launch.sh NAME`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, Field, model_validator

from rlcommon.pass_at_k import greedy_pass_at_k_problem

log = logging.getLogger("environments.evaluation")

T = TypeVar("T")
R = TypeVar("R")


class EvalSettings(BaseModel):
    """The eval_* fields of a built-in environment's config (`--env.eval_k=4`, ...)."""

    eval_k: int = Field(1, ge=1, description="samples per eval item; pass@k is reported for this k when > 1")
    eval_temperature: float = Field(0.0, ge=0.0, description="eval sampling temperature; 0 = greedy")
    eval_max_items: int = Field(
        0, ge=0, description="eval items to score, from the start of the set; 0 = all"
    )
    eval_max_new_tokens: int | None = Field(
        None, ge=1, description="eval completion length; unset = the environment's max_new_tokens"
    )

    @model_validator(mode="after")
    def _sampled_when_several(self) -> EvalSettings:
        problem = greedy_pass_at_k_problem(self.eval_k, self.eval_temperature, "eval_k", "eval_temperature")
        if problem:
            raise ValueError(problem)
        return self


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c passed: 1 - C(n-c, k) / C(n, k), as the product
    prod_{i=n-c+1}^{n} (1 - k/i), which stays exact in floating point where the binomials overflow."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a passing sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def eval_metrics(
    rewards: Sequence[Sequence[float]], threshold: float, k: int, failed_items: int = 0
) -> dict[str, float | int]:
    """The metrics of one eval from each scored item's sample rewards: a sample passes when its reward is at least
    `threshold`. "pass@1" (the pass rate, averaged over items), "pass@<k>" for k > 1, "reward/mean" over all
    samples, "items" scored, "samples_per_item" and "failed_items" (items that raised and were left out)."""
    if not rewards:
        raise ValueError("no scored eval items: nothing to report")
    short = [i for i, item in enumerate(rewards) if len(item) < k]
    if short:
        raise ValueError(
            f"eval item {short[0]} has {len(rewards[short[0]])} samples, fewer than eval_k={k}: each item needs k"
        )
    passed = [sum(r >= threshold for r in item) for item in rewards]
    metrics: dict[str, float | int] = {
        "pass@1": mean(pass_at_k(len(item), c, 1) for item, c in zip(rewards, passed, strict=True)),
    }
    if k > 1:
        metrics[f"pass@{k}"] = mean(
            pass_at_k(len(item), c, k) for item, c in zip(rewards, passed, strict=True)
        )
    metrics["reward/mean"] = mean(r for item in rewards for r in item)
    metrics["items"] = len(rewards)
    metrics["samples_per_item"] = k
    metrics["failed_items"] = failed_items
    return metrics


def mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values)


class EvalFailed(RuntimeError):
    """Every eval item failed; the message carries the first reason."""


@dataclass
class Outcome(Generic[R]):
    results: list[R] = field(default_factory=list)  # in item order, failed items left out
    failures: list[str] = field(default_factory=list)  # one reason per failed item


async def run_items(
    items: Sequence[T], score: Callable[[T], Awaitable[R]], concurrency: int = 64
) -> Outcome[R]:
    """score(item) for each item, at most `concurrency` at once. An item whose sampling or scoring raises is
    counted with its reason and left out: one bad item does not end the eval; all of them failing does."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int, item: T) -> tuple[bool, Any]:
        async with gate:
            try:
                return True, await score(item)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                return False, f"item {index}: {type(exc).__name__}: {exc}"

    done = await asyncio.gather(*(one(i, item) for i, item in enumerate(items)))
    outcome: Outcome[R] = Outcome()
    for ok, value in done:
        (outcome.results if ok else outcome.failures).append(value)
    for reason in outcome.failures[:3]:
        log.warning("eval %s", reason)
    if items and not outcome.results:
        raise EvalFailed(f"all {len(items)} eval items failed; the first: {outcome.failures[0]}")
    return outcome
