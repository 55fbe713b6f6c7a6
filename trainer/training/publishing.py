"""Getting each new adapter to the sampler: write it, let the gateway load it, and prove the served adapter is the
trained one before it serves anything.

The proof (publish.verify, local backend): the trainer sends, with the publish, a few fixed prompts and its own
top-k logprobs of the next token after each; the gateway has vLLM sample one greedy token per prompt on the loaded
adapter and refuses the publish (422) when vLLM's top-k logprobs differ by more than the tolerance
(inference/policy/probe_check.py): the largest difference in float32, the mean difference against a tolerance the
gateway calibrates on the base model with any bfloat16. The probe also carries the trainer's answers with the
adapter off and for the previous verified version, so each row says how far a wrong adapter would have been. A refused publish is written again and retried `publish.verify_retries` times, then the
run stops for a person (PublishUnverified: exit code 3, which the launcher does not restart).

With publish.overlap a publish runs on a worker thread while the loop waits for the next batch; the loop joins it
before it reads the next batch's versions, checkpoints, or stops. The model is not touched meanwhile: the loop
only does HTTP while the worker reads the weights. The worker is a daemon thread: on a stop the loop waits for it
only so long (the gateway may be stopping too), and a publish stuck on a gateway that is gone must not hold the
process open past its checkpoint.
"""

from __future__ import annotations

import logging
import math
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from trainer.training.backend import TrainingBackend
from trainer.training.config import RunConfig, sampler_dtype
from trainer.training.gateway_client import (
    GatewayClient,
    ProbeStatistic,
    PublishProbe,
    PublishResponse,
    verification_failure,
)
from trainer.training.logprobs import top_logprobs

log = logging.getLogger("trainer.training.publishing")

PROBE_PROMPT_TOKENS = 16
PROBE_TOP_K = 20  # vLLM's default --max-logprobs
FLOAT32_TOLERANCE = 1e-3  # on the largest difference
LOW_PRECISION_TOLERANCE = 0.02  # the floor of the calibrated tolerance on the mean difference


class PublishUnverified(RuntimeError):
    """The gateway kept serving logprobs that are not the trainer's: a restart would not fix it."""


def probe_prompts(vocab_size: int, count: int, length: int = PROBE_PROMPT_TOKENS) -> list[list[int]]:
    """Fixed prompts: ids spread over the middle of the vocabulary, away from the special tokens that tokenizers
    put at either end; every prompt the same length (one unpadded forward on the trainer)."""
    low, span = vocab_size // 4, max(1, vocab_size // 2)
    return [
        [low + (7919 * (i + length * p) + 104729 * p) % span for i in range(length)] for p in range(count)
    ]


def verify_dtypes(cfg: RunConfig, device_type: str) -> tuple[str, str, str]:
    """The trainer's model dtype, the saved adapter's and vLLM's, as names ('auto' resolved for this device)."""
    auto = "float32" if device_type == "cpu" else "bfloat16"
    model = auto if cfg.model.dtype == "auto" else cfg.model.dtype
    saved = auto if cfg.trainer.save_dtype == "auto" else cfg.trainer.save_dtype
    return model, saved, sampler_dtype(cfg, cuda=device_type == "cuda")


def logit_epsilon(cfg: RunConfig, device_type: str) -> float:
    """The relative spacing of the coarser of the two dtypes the probe's logits are rounded to (the trainer's
    model, vLLM's): 2**-7 when either is bfloat16."""
    model, _, sampler = verify_dtypes(cfg, device_type)
    # vLLM's --dtype names (float32, float, bfloat16, float16, half) are torch's own attribute names.
    return max(torch.finfo(getattr(torch, name, torch.float32)).eps for name in (model, sampler))


def verify_tolerance(cfg: RunConfig, device_type: str) -> tuple[float, ProbeStatistic]:
    """The statistic the dtypes allow and its tolerance (publish.verify_tolerance when set): float32 end to end
    (trainer weights, saved adapter, vLLM) agrees to ~1e-5 on CPU, so the largest difference is held to 1e-3; a
    bfloat16 base, adapter or vLLM moves single logprobs by 0.1-0.3, so the mean difference is compared with a
    tolerance the gateway calibrates, which this value only floors."""
    model, saved, sampler = verify_dtypes(cfg, device_type)
    exact = model == saved == sampler == "float32"
    default = FLOAT32_TOLERANCE if exact else LOW_PRECISION_TOLERANCE
    tolerance = cfg.publish.verify_tolerance if cfg.publish.verify_tolerance is not None else default
    return tolerance, "max" if exact else "mean"


def adapter_effect(logprobs_PV: torch.Tensor, base_PV: torch.Tensor, top: list[dict[int, float]]) -> float:
    """Mean |logprob with the adapter - without| over the ids of `top` (the expected top-k of each prompt)."""
    diffs = [abs(logprobs_PV[i, t] - base_PV[i, t]).item() for i, ids in enumerate(top) for t in ids]
    return sum(diffs) / len(diffs) if diffs else 0.0


def logit_spacing(logits_PV: torch.Tensor, top: list[dict[int, float]], epsilon: float) -> float:
    """Mean over the prompts of the spacing of representable logits at the largest |logit| among each prompt's
    expected top-k ids. Two implementations that round a logit to neighbouring values (0.125 apart in bfloat16 for
    logits in [16, 32)) move every logprob of that prompt by up to this much through the log-sum-exp; a sharpening
    policy's logits grow, and so does this part of the noise, which the base model's calibration never sees."""
    spacings = []
    for i, ids in enumerate(top):
        largest = max((abs(logits_PV[i, t].item()) for t in ids), default=0.0)
        spacings.append(epsilon * 2.0 ** math.floor(math.log2(largest)) if largest > 0 else 0.0)
    return sum(spacings) / len(spacings) if spacings else 0.0


@dataclass
class PublishOutcome:
    version: int
    reply: PublishResponse
    seconds: float  # the whole publish: write, probe, load, check
    verify_s: float | None  # the trainer's probe (what outlasted the adapter write) plus the gateway's check
    failures: int  # refused verifications before the one that passed
    worst_refused_diff: float | None


class Publisher:
    def __init__(self, cfg: RunConfig, backend: TrainingBackend, gateway: GatewayClient, overlap: bool):
        self.cfg = cfg
        self.backend = backend
        self.gateway = gateway
        self.overlap = overlap
        self.verify = cfg.publish.verify and hasattr(backend, "probe")
        if cfg.publish.verify and not self.verify:
            log.info(
                "publish.verify: the %s backend cannot compute the probe here; not checked",
                cfg.launch.backend,
            )
        local = getattr(backend, "local", backend)
        device_type = getattr(getattr(local, "device", None), "type", "cpu")
        self.tolerance, self.statistic = verify_tolerance(cfg, device_type)
        self._logit_epsilon = logit_epsilon(cfg, device_type)
        self._probe_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="probe")
        self._base_logprobs: torch.Tensor | None = None  # the probe's answers with the adapter off, once
        self._previous: list[dict[int, float]] | None = None  # the last verified version's expected answers

    def close(self) -> None:
        self._probe_pool.shutdown(wait=True)

    def probe(self) -> tuple[PublishProbe | None, float]:
        """The probe for the backend's current weights (None when not verifying), and the seconds it took."""
        if not self.verify:
            return None, 0.0
        started = time.perf_counter()
        prompts = probe_prompts(self.backend.vocab_size, self.cfg.publish.verify_prompts)
        references: dict[str, list[dict[int, float]]] = {}
        effect = spacing = None
        if hasattr(self.backend, "probe_logits"):
            logits_PV = self.backend.probe_logits(prompts)
            logprobs_PV = torch.log_softmax(logits_PV, dim=-1)
            top = top_logprobs(logprobs_PV, PROBE_TOP_K)
            if self._base_logprobs is None:
                self._base_logprobs = torch.log_softmax(
                    self.backend.probe_logits(prompts, adapter=False), dim=-1
                )
            references["base"] = top_logprobs(self._base_logprobs, PROBE_TOP_K)
            effect = adapter_effect(logprobs_PV, self._base_logprobs, top)
            if self.statistic == "mean":
                spacing = logit_spacing(logits_PV, top, self._logit_epsilon)
        else:
            top = self.backend.probe(prompts, PROBE_TOP_K)  # type: ignore[attr-defined]
        if self._previous is not None:
            references["previous"] = self._previous
        probe = PublishProbe(
            prompts=prompts,
            top_logprobs=top,
            tolerance=self.tolerance,
            statistic=self.statistic,
            references=references,
            adapter_effect=effect,
            logit_spacing=spacing,
        )
        return probe, time.perf_counter() - started

    def republish(self, version: int, adapter: str | None) -> PublishResponse:
        """A version the gateway must serve again (a resume, a restarted gateway), rolling back anything newer;
        checked like a new one when the backend holds that version's weights."""
        probe, _ = self.probe() if adapter is not None else (None, 0.0)
        try:
            reply = self.gateway.publish(version, adapter, replace_newer=True, probe=probe)
            self._previous = None if probe is None else probe.top_logprobs
            return reply
        except httpx.HTTPStatusError as exc:
            failure = verification_failure(exc)
            if failure is None:
                raise
            raise PublishUnverified(failure[0]) from exc

    def start(self, version: int) -> Future[PublishOutcome]:
        """Publish `version` from the backend's current weights: now, or on a worker with publish.overlap (the loop
        joins one publish before it starts the next)."""
        done: Future[PublishOutcome] = Future()

        def work() -> None:
            try:
                done.set_result(self._publish(version))
            except BaseException as exc:  # re-raised by result(), inline or overlapped alike
                done.set_exception(exc)

        if self.overlap:
            threading.Thread(target=work, name=f"publish-v{version}", daemon=True).start()
        else:
            work()
        return done

    def _publish(self, version: int) -> PublishOutcome:
        started = time.perf_counter()
        failures, worst = 0, None
        for attempt in range(self.cfg.publish.verify_retries + 1):
            # The probe (a forward) runs while the adapter is written (file I/O); only what outlasts the write
            # counts as its cost.
            probing = self._probe_pool.submit(self.probe)
            path = self.backend.save_for_sampler(version)
            written = time.perf_counter()
            probe, _ = probing.result()
            probe_s = time.perf_counter() - written
            try:
                reply = self.gateway.publish(version, path, probe=probe)
            except httpx.HTTPStatusError as exc:
                failure = verification_failure(exc)
                if failure is None:
                    raise
                message, diff = failure
                failures += 1
                worst = diff if worst is None or (diff is not None and diff > worst) else worst
                if attempt == self.cfg.publish.verify_retries:
                    raise PublishUnverified(
                        f"{message} (refused {failures} time(s); publish.verify_retries="
                        f"{self.cfg.publish.verify_retries}). The run stops here for a person to look: the "
                        "gateway's log and vLLM's log say what it loaded"
                    ) from exc
                log.error(
                    "%s; writing the adapter again and retrying (%d of %d)",
                    message,
                    attempt + 1,
                    self.cfg.publish.verify_retries,
                )
                shutil.rmtree(path, ignore_errors=True)
                continue
            verify_s = None if probe is None else probe_s + (reply.verify_s or 0.0)
            self._previous = None if probe is None else probe.top_logprobs
            return PublishOutcome(version, reply, time.perf_counter() - started, verify_s, failures, worst)
        raise AssertionError("unreachable: the last attempt returns or raises")

    @staticmethod
    def metrics(outcome: PublishOutcome | None) -> dict[str, Any]:
        if outcome is None:
            return {key: None for key in PUBLISH_KEYS}
        return {
            "publish/verify_max_abs_diff": outcome.reply.verify_max_abs_diff,
            "publish/verify_mean_abs_diff": outcome.reply.verify_mean_abs_diff,
            "publish/verify_tolerance": outcome.reply.verify_tolerance,
            "publish/verify_noise": outcome.reply.verify_noise,
            "publish/verify_margin": outcome.reply.verify_margin,
            "publish/verify_separation": outcome.reply.verify_separation,
            "publish/verify_s": outcome.verify_s,
            "publish/verify_failures": float(outcome.failures),
            "publish/verify_refused_max_abs_diff": outcome.worst_refused_diff,
            "gateway/hold_s": outcome.reply.hold_s,
            "gateway/held_requests": float(outcome.reply.held_requests),
        }


PUBLISH_KEYS = (
    "publish/verify_max_abs_diff",
    "publish/verify_mean_abs_diff",
    "publish/verify_tolerance",
    "publish/verify_noise",
    "publish/verify_margin",
    "publish/verify_separation",
    "publish/verify_s",
    "publish/verify_failures",
    "publish/verify_refused_max_abs_diff",
    "gateway/hold_s",
    "gateway/held_requests",
)
