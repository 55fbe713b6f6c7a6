"""Publish verification, the gateway's part: the probe's prompts on the new adapter (and on the base model, for the
noise it is judged against) through vLLM, compared with the trainer's answers by inference/policy/probe_check.py. A
refusal unloads what it loaded and answers 422 with the numbers and the cause (docs/gateway-api.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from typing import Any, Protocol

from inference.errors import BackendError
from inference.policy.probe_check import (
    NoiseFloor,
    ProbeCheck,
    calibrated_tolerance,
    compare_probe,
    mean_distance,
    refusal_cause,
    separation,
)
from inference.policy.registry import Policy, PolicyRegistry
from inference.samplers.solo_lane import SoloLane
from inference.wire import PublishProbe

log = logging.getLogger("inference.app")


class ProbedBackend(Protocol):
    """What verification uses of a sampling backend (inference/app.py SamplingBackend)."""

    @property
    def restarts(self) -> int: ...
    async def forward(self, path: str, body: dict[str, Any], policy: Policy) -> dict[str, Any]: ...
    async def unload_adapter(self, policy: Policy) -> None: ...


class PublishVerifier:
    def __init__(self, backend: ProbedBackend, lane: SoloLane, registry: PolicyRegistry) -> None:
        self.backend, self.lane, self.registry = backend, lane, registry
        # The base model's mean |vLLM - trainer| on a probe's prompts, measured at every publish: the noise floor
        # of the `mean` verification statistic, per probe.
        self.base_noise: dict[tuple[tuple[int, ...], ...], NoiseFloor] = {}

    async def probe_answer(self, probe: PublishProbe, policy: Policy) -> list[dict[int, float]]:
        body = {
            "prompt": probe.prompts,
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": max(len(top) for top in probe.top_logprobs),
            "return_tokens_as_token_ids": True,
        }
        async with self.lane.enter(False):
            return served_top_logprobs(await self.backend.forward("/v1/completions", body, policy))

    async def calibrate(self, probe: PublishProbe) -> float | None:
        """The `mean` statistic's noise floor: the base model on both sides of the probe, measured now and folded
        into the probe's rolling estimate (a vLLM restart starts it afresh). A base that does not even share its
        top tokens with the trainer's base is not the trainer's model: nothing can be verified."""
        if probe.statistic != "mean" or "base" not in probe.references:
            return None
        check = compare_probe(
            probe.references["base"], await self.probe_answer(probe, self.registry.base), 1.0
        )
        if not math.isfinite(check.mean_abs_diff):
            raise BackendError(
                422,
                "publish verification: vLLM's base model does not give the trainer's base-model logprobs on "
                f"the probe prompts ({check.describe()}); the gateway serves another model than the "
                "trainer trains, or a broken one. Check inference.model against model.path",
                reason="verification_failed",
            )
        floor = self.base_noise.setdefault(tuple(tuple(prompt) for prompt in probe.prompts), NoiseFloor())
        restarts = self.backend.restarts
        if restarts != floor.process:
            log.info(
                "publish verification calibrates on the base model (vLLM process %d): %s",
                restarts,
                check.describe(),
            )
        return floor.add(check.mean_abs_diff, restarts)

    async def verify(
        self, policy: Policy, probe: PublishProbe, loaded_now: bool, noise: float | None
    ) -> tuple[ProbeCheck, float]:
        """One greedy token per probe prompt on `policy` (not yet serving), its top-k logprobs compared with the
        trainer's; on a mismatch the adapter is unloaded again and the publish refused with the numbers."""
        started = time.perf_counter()
        tolerance = probe.tolerance
        if noise is not None:
            tolerance = calibrated_tolerance(
                probe.tolerance, noise, probe.adapter_effect or 0.0, probe.logit_spacing or 0.0
            )
        try:
            served = await self.probe_answer(probe, policy)
        except BackendError:
            # vLLM refused or lost the probe itself (e.g. a probe prompt past the context): the version is refused
            # all the same, and nothing may stay loaded under its name, or its next publish would be "loaded already".
            if loaded_now:
                with contextlib.suppress(BackendError):
                    await self.backend.unload_adapter(policy)
            raise
        check = compare_probe(probe.top_logprobs, served, tolerance, probe.statistic)
        check = dataclasses.replace(
            check, separation=separation(probe.top_logprobs, probe.references, tolerance)
        )
        if check.passed:
            return check, time.perf_counter() - started
        served_from = {name: mean_distance(ref, served) for name, ref in probe.references.items()}
        cause = refusal_cause(check, noise, served_from)
        log.error(
            "publish of version %d refused: the loaded adapter %s does not give the trainer's logprobs (%s): %s",
            policy.version,
            policy.adapter_path,
            check.describe(),
            cause,
        )
        if loaded_now:
            with contextlib.suppress(BackendError):
                await self.backend.unload_adapter(policy)
        raise BackendError(
            422,
            f"publish verification failed for version {policy.version} ({policy.adapter_path}): "
            f"{check.describe()}. Cause: {cause}; it was not made current. Check that the folder was written "
            "completely and matches the trainer's base model",
            reason="verification_failed",
            detail={
                "max_abs_diff": check.max_abs_diff if math.isfinite(check.max_abs_diff) else None,
                "mean_abs_diff": check.mean_abs_diff if math.isfinite(check.mean_abs_diff) else None,
                "tolerance": check.tolerance,
                "noise": noise,
                "compared": check.compared,
            },
        )


def served_top_logprobs(answer: dict[str, Any]) -> list[dict[int, float]]:
    """Per choice (one per probe prompt), the first generated position's top-k logprobs from an OpenAI
    completions body asked with return_tokens_as_token_ids ("token_id:<id>" keys); {} where absent."""
    tops: list[dict[int, float]] = []
    for choice in sorted(answer.get("choices", []), key=lambda c: c.get("index", 0)):
        positions = (choice.get("logprobs") or {}).get("top_logprobs") or [{}]
        top = positions[0] or {}
        tops.append({int(str(k).removeprefix("token_id:")): float(v) for k, v in top.items()})
    return tops
