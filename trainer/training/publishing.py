"""Getting each new adapter to the sampler: write it, let the gateway load it, and prove the served adapter is the
trained one before it serves anything.

The proof (publish.verify, local backend): the trainer sends, with the publish, a few fixed prompts and its own
top-k logprobs of the next token after each; the gateway has vLLM sample one greedy token per prompt on the loaded
adapter and refuses the publish (422) when vLLM's top-k logprobs differ by more than the tolerance
(inference/probe_check.py). A refused publish is written again and retried `publish.verify_retries` times, then the
run stops for a person (PublishUnverified: exit code 3, which the launcher does not restart).

With publish.overlap a publish runs on a worker thread while the loop waits for the next batch; the loop joins it
before it reads the next batch's versions, checkpoints, or stops. The model is not touched meanwhile: the loop
only does HTTP while the worker reads the weights. The worker is a daemon thread: on a stop the loop waits for it
only so long (the gateway may be stopping too), and a publish stuck on a gateway that is gone must not hold the
process open past its checkpoint.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from trainer.backends.base import TrainingBackend
from trainer.training.config import RunConfig
from trainer.training.gateway_client import (
    GatewayClient,
    PublishProbe,
    PublishResponse,
    verification_failure,
)

log = logging.getLogger("trainer.training.publishing")

PROBE_PROMPT_TOKENS = 16
PROBE_TOP_K = 20  # vLLM's default --max-logprobs
FLOAT32_TOLERANCE = 1e-3
LOW_PRECISION_TOLERANCE = 0.1


class PublishUnverified(RuntimeError):
    """The gateway kept serving logprobs that are not the trainer's: a restart would not fix it."""


def probe_prompts(vocab_size: int, count: int, length: int = PROBE_PROMPT_TOKENS) -> list[list[int]]:
    """Fixed prompts: ids spread over the middle of the vocabulary, away from the special tokens that tokenizers
    put at either end; every prompt the same length (one unpadded forward on the trainer)."""
    low, span = vocab_size // 4, max(1, vocab_size // 2)
    return [
        [low + (7919 * (i + length * p) + 104729 * p) % span for i in range(length)] for p in range(count)
    ]


def verify_tolerance(cfg: RunConfig, device_type: str) -> float:
    """publish.verify_tolerance, or a dtype-aware default: float32 end to end (trainer weights, saved adapter,
    vLLM) agrees to ~1e-5 on CPU; a bfloat16 base, adapter or vLLM moves logprobs by up to a few 1e-2."""
    if cfg.publish.verify_tolerance is not None:
        return cfg.publish.verify_tolerance
    auto = "float32" if device_type == "cpu" else "bfloat16"
    model = auto if cfg.model.dtype == "auto" else cfg.model.dtype
    saved = auto if cfg.trainer.save_dtype == "auto" else cfg.trainer.save_dtype
    vllm = cfg.inference.get("vllm", {}).get("dtype")
    return FLOAT32_TOLERANCE if model == saved == vllm == "float32" else LOW_PRECISION_TOLERANCE


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
        self.tolerance = verify_tolerance(cfg, getattr(getattr(local, "device", None), "type", "cpu"))
        self._probe_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="probe")

    def close(self) -> None:
        self._probe_pool.shutdown(wait=True)

    def probe(self) -> tuple[PublishProbe | None, float]:
        """The probe for the backend's current weights (None when not verifying), and the seconds it took."""
        if not self.verify:
            return None, 0.0
        started = time.perf_counter()
        prompts = probe_prompts(self.backend.vocab_size, self.cfg.publish.verify_prompts)
        top = self.backend.probe(prompts, PROBE_TOP_K)  # type: ignore[attr-defined]
        probe = PublishProbe(prompts=prompts, top_logprobs=top, tolerance=self.tolerance)
        return probe, time.perf_counter() - started

    def republish(self, version: int, adapter: str | None) -> PublishResponse:
        """A version the gateway must serve again (a resume, a restarted gateway), rolling back anything newer;
        checked like a new one when the backend holds that version's weights."""
        probe, _ = self.probe() if adapter is not None else (None, 0.0)
        try:
            return self.gateway.publish(version, adapter, replace_newer=True, probe=probe)
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
            return PublishOutcome(version, reply, time.perf_counter() - started, verify_s, failures, worst)
        raise AssertionError("unreachable: the last attempt returns or raises")

    @staticmethod
    def metrics(outcome: PublishOutcome | None) -> dict[str, Any]:
        if outcome is None:
            return {key: None for key in PUBLISH_KEYS}
        return {
            "publish/verify_max_abs_diff": outcome.reply.verify_max_abs_diff,
            "publish/verify_s": outcome.verify_s,
            "publish/verify_failures": float(outcome.failures),
            "publish/verify_refused_max_abs_diff": outcome.worst_refused_diff,
            "gateway/hold_s": outcome.reply.hold_s,
            "gateway/held_requests": float(outcome.reply.held_requests),
        }


PUBLISH_KEYS = (
    "publish/verify_max_abs_diff",
    "publish/verify_s",
    "publish/verify_failures",
    "publish/verify_refused_max_abs_diff",
    "gateway/hold_s",
    "gateway/held_requests",
)
