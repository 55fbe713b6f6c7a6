"""The trainer process's loop: register with Atropos's run-api, pull batches, drop rollouts older than the
staleness window (their version read from the gateway's ledger), train one optimizer step per batch, publish the
new adapter to the gateway, write one metrics.jsonl row per step, checkpoint every N steps.

Every batch run-api hands out is one step (run-api and the environments count steps that way); a step whose
rollouts are all stale, malformed or zero-variance makes no update and publishes no new version, so the policy
version can lag the step count. Its parts live beside it: run-api's client (runapi_client.py), the staleness split
(staleness.py), batch conversion (batch.py), publishing (publishing.py), metrics.jsonl (metrics_file.py), resume and
checkpoints (recovery.py). `_Steps.step` is one step, top to bottom.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from trainer.training.backend import TeacherScoring, TrainingBackend
from trainer.training.batch import (
    ConvertedBatch,
    IntakeOptions,
    TrainingExample,
    convert_batch,
    per_env_metrics,
)
from trainer.training.checkpoints import (
    LoopState,
    full_disk_is_one_error,
)
from trainer.training.config import RunConfig
from trainer.training.distill import distill_examples
from trainer.training.faults import fault_counts
from trainer.training.gateway_client import ExpectResponse, GatewayClient, PolicyStatus
from trainer.training.metrics_file import MetricsWriter
from trainer.training.polling import wait_until
from trainer.training.publishing import Publisher, PublishOutcome
from trainer.training.recovery import (
    TALLIED,
    RunTotals,
    ensure_gateway_policy,
    read_tally,
    republish,
    restore,
    save_checkpoint,
    warn_if_disk_short,
)
from trainer.training.refill import ShortRefill
from trainer.training.retries import ComponentDown, describe
from trainer.training.runapi_client import RunApi, Stopper, StopRequested, sampled_tokens, wait_for_batch
from trainer.training.schedule import build_adam_params
from trainer.training.staleness import StalenessSplit, split_by_staleness, versions_by_group
from trainer.training.topup import Reserve, TopUp

log = logging.getLogger("trainer.training.loop")


def require_endpoints(cfg: RunConfig) -> None:
    if cfg.launch.run_api_url is None or cfg.launch.gateway_url is None:
        raise ValueError("launch.run_api_url and launch.gateway_url must be set (launch.sh sets them)")


def run(cfg: RunConfig, backend: TrainingBackend) -> bool:
    """The training loop on `backend` (the entry point builds it: trainer.backends.build); True when the run
    reached rollout.num_steps, False when a SIGTERM stopped it first."""
    require_endpoints(cfg)
    run_dir = Path(cfg.trainer.output_dir)
    with full_disk_is_one_error(run_dir):
        return _run_main(cfg, backend, run_dir)


def _run_main(cfg: RunConfig, backend: TrainingBackend, run_dir: Path) -> bool:
    assert cfg.launch.run_api_url is not None
    gateway = _gateway_client(cfg, run_dir / "logs")
    api = RunApi(cfg, cfg.launch.run_api_url, str(run_dir / "logs" / "run-api.log"))
    stopper = Stopper()
    stopper.install()
    state = restore(backend, run_dir)
    # A fresh run without a share quota registers with run-api at once: its environments (started beside vLLM by
    # the launcher) then get through Atropos's registration and start-up pause while vLLM boots, and their first
    # requests, for the base model, wait in the gateway. A resumed run first makes its version current, and a
    # quota must be in place before anything samples (_Steps.start).
    registered = state.step == 0 and state.version == 0 and not cfg.share_quota()
    if registered:
        api.register(state.step)
        api.open_to_environments()
    # The launcher may start the trainer while vLLM boots: wait for the gateway here, not in a publish's retries.
    what = f"the gateway at {cfg.launch.gateway_url} healthy"
    wait_until(lambda: stopper.requested or gateway.health(), cfg.launch.health_timeout_s, what, 0.2)
    if stopper.requested:
        log.info("stopped before the gateway was up: nothing trained")
        gateway.close()
        return False
    gate = cfg.publish.gate_on(cfg.rollout.max_staleness)
    # A publish may overlap the next batch's wait when what is sampled meanwhile is still usable: the gate holds
    # it for the new version, or the staleness window accepts the current one.
    publisher = Publisher(
        cfg, backend, gateway, overlap=cfg.publish.overlap and (gate or cfg.rollout.max_staleness >= 1)
    )
    republish(backend, publisher, run_dir, state)
    if state.step >= cfg.rollout.num_steps:
        log.info("the run is already at step %d of %d: nothing to do", state.step, cfg.rollout.num_steps)
        return True
    warn_if_disk_short(cfg, backend, run_dir, state)
    steps = _Steps.start(cfg, backend, gateway, api, publisher, state, run_dir, stopper, registered)
    try:
        while state.step < cfg.rollout.num_steps:
            steps.step()
            stopper.check()
    except StopRequested:
        log.info("stopping at step %d", state.step)
    finally:
        if sys.exc_info()[0] in (None, StopRequested):
            steps.finish_pending(block=True, stopping=True)
        publisher.close()
    if cfg.trainer.checkpoint_every and steps.tally.checkpointed != state.step:
        save_checkpoint(backend, run_dir, state)  # the end of the run, or a stop: nothing to redo on resume
    steps.metrics.close()
    gateway.close()
    return state.step >= cfg.rollout.num_steps


@dataclass
class _Steps:
    """What the run's steps share, and one step: wait for a batch, close the gate for the next version, train on
    what is fresh, publish (overlapped with the next wait where that is safe), write the row."""

    cfg: RunConfig
    backend: TrainingBackend
    gateway: GatewayClient
    api: RunApi
    publisher: Publisher
    state: LoopState
    run_dir: Path
    stopper: Stopper
    metrics: MetricsWriter
    tally: RunTotals
    intake: IntakeOptions
    quota_on: str | None  # the gateway process that holds the share quota (None: the run has none)
    reserve: Reserve | None  # zero-variance groups replaced from later batches
    refill: ShortRefill | None  # a mixed run's environment short of its share is let through
    pending: StepAwaitingPublish | None = None  # the step whose publish overlaps the next wait

    @classmethod
    def start(
        cls,
        cfg: RunConfig,
        backend: TrainingBackend,
        gateway: GatewayClient,
        api: RunApi,
        publisher: Publisher,
        state: LoopState,
        run_dir: Path,
        stopper: Stopper,
        registered: bool = False,
    ) -> _Steps:
        quota_on = None
        if cfg.share_quota():
            # The quota from the first version on: environments start sampling once the trainer registers, and a
            # mixed run's environment that started more than its share would keep a stale group queued for the run.
            _close_gate(cfg, gateway, state.version)
            quota_on = gateway.status().instance
        if not registered:
            api.register(state.step)
        shares = env_shares(cfg) if quota_on is not None else None
        return cls(
            cfg,
            backend,
            gateway,
            api,
            publisher,
            state,
            run_dir,
            stopper,
            MetricsWriter(run_dir / "metrics.jsonl", cfg.launch.wandb, cfg),
            RunTotals(read_tally(run_dir / "metrics.jsonl"), time.monotonic(), state.step),
            _intake_options(cfg, backend),
            quota_on,
            Reserve() if cfg.rollout.refill_zero_variance else None,
            ShortRefill(shares, cfg.publish.gate_refill_s, api, gateway) if shares else None,
        )

    def finish_pending(self, block: bool, stopping: bool = False) -> None:
        """Write the overlapped step's row (and its checkpoint) once its publish is done: as soon as it is while
        the next batch is awaited (`block` False), or now."""
        done = self.pending
        if done is not None and (block or done.publish is None or done.publish.done()):
            self.pending = None
            args = (self.metrics, self.tally, done, self.state, self.api, self.run_dir)
            _finish_step(self.cfg, self.backend, *args, overlapped=True, stopping=stopping)

    def meanwhile(self) -> None:
        """Before each poll for a batch: the overlapped step's row once its publish is done, a short refill."""
        self.finish_pending(block=False)
        if self.refill is not None:
            self.refill()

    def batch(self) -> tuple[list[Any], TopUp | None]:
        """The step's groups: run-api's next batch, or one topped up past its zero-variance groups."""
        if self.refill is not None:
            self.refill.waiting()

        def fetch() -> list[Any]:
            return wait_for_batch(self.api, self.cfg.trainer.batch_poll_s, self.stopper, self.meanwhile)

        if self.reserve is None:
            return fetch(), None
        r = self.cfg.rollout
        topped = self.reserve.fill(fetch, r.batch_size, r.refill_max_groups or r.groups_per_step)
        return topped.groups, topped

    def step(self) -> None:
        cfg, gateway, state = self.cfg, self.gateway, self.state
        waiting_since = time.monotonic()
        groups, topped = self.batch()
        self.finish_pending(block=True)
        served = ensure_gateway_policy(gateway, self.publisher, self.run_dir, state)
        gate = cfg.publish.gate_on(cfg.rollout.max_staleness)
        if self.quota_on is not None and not gate and served.instance != self.quota_on:
            _close_gate(cfg, gateway, state.version)  # a restarted gateway starts with no quota
            self.quota_on = served.instance
        hold = _close_gate(cfg, gateway, state.version + 1) if gate else None
        names = self.api.env_names(groups) if cfg.rollout.envs else None
        times = StepTimes(waiting_since)
        pending = _one_step(
            cfg, self.backend, gateway, self.publisher, self.intake, state, groups, times, hold, names
        )
        pending.row.update(_gate_row(served))
        if cfg.rollout.envs:
            pending.row.update(self.api.shortfalls())
        if topped is not None:
            pending.row.update(topped.row())
        if self.publisher.overlap:
            self.pending = pending
        else:
            _finish_step(cfg, self.backend, self.metrics, self.tally, pending, state, self.api, self.run_dir)


def _gateway_client(cfg: RunConfig, logs: Path) -> GatewayClient:
    assert cfg.launch.gateway_url is not None
    engine = cfg.inference.get("engine_url")
    return GatewayClient(
        cfg.launch.gateway_url,
        cfg.inference.get("publish_token"),
        lease=cfg.inference.get("engine_lease") if engine else None,
        timeout_s=cfg.trainer.request_timeout_s,
        retry_budget_s=cfg.trainer.retry_budget_s,
        log=f"the shared engine's logs/gateway.log ({engine})" if engine else str(logs / "gateway.log"),
    )


def _intake_options(cfg: RunConfig, backend: TrainingBackend) -> IntakeOptions:
    return IntakeOptions(
        vocab_size=backend.vocab_size,
        max_seq_len=cfg.trainer.max_seq_len,
        overlong=cfg.trainer.overlong,
        # Tinker computes the loss remotely from the logprobs it is sent: only the local trainer can stand in.
        missing_sampler_logprobs=cfg.rollout.missing_logprobs if cfg.launch.backend == "local" else "drop",
        normalize_std=cfg.normalize_std(),
        std_eps=cfg.advantage.std_eps,
        require_sampler_logprobs=cfg.loss_name != "cross_entropy",
        keep_zero_variance=cfg.distill.on,
    )


def _gate_row(served: PolicyStatus) -> dict[str, float]:
    return {
        # Episode turns the gateway recognised as continuing an earlier turn (a multi-turn environment's later
        # turns, token-in): 0 in such a run means its turns reach the trainer as unrelated prompts.
        "gateway/continuations_total": float(served.gate_continuations_total),
        # Rollouts of a group asked for one at a time that the gate admitted with their group (verifiers).
        "gateway/group_passes_total": float(served.gate_group_passes_total),
    }


def _close_gate(
    cfg: RunConfig, gateway: GatewayClient, version: int, batch_taken: bool = False
) -> ExpectResponse:
    """Hold new requests for `version` (opens the gate when it is not newer than the current one); with
    `batch_taken`, the current version's quotas start over (a step that made no update)."""
    quota = cfg.rollout.batch_size if cfg.publish.gate_quota else None
    env_quotas = env_shares(cfg) if quota else None
    # Without the gate, environments sample a batch ahead (within max_staleness) while the trainer trains.
    lead = 0 if cfg.publish.gate_on(cfg.rollout.max_staleness) else cfg.rollout.max_staleness
    r = cfg.rollout
    return gateway.expect(
        version,
        cfg.publish.gate_hold_s,
        quota,
        cfg.publish.gate_refill_s,
        env_quotas,
        lead,
        batch_taken,
        r.group_size if quota else None,
        {spec.name: spec.group_size for spec in r.env_specs()} if env_quotas else None,
    )


def env_shares(cfg: RunConfig) -> dict[str, int] | None:
    """A mixed run: the sequences run-api fills each batch with from each environment first (its share, up to whole
    groups), which the gate's quota holds each environment to per version (named by its bearer key)."""
    r = cfg.rollout
    return {spec.name: spec.batch_sequences(r.batch_size) for spec in r.env_specs()} if r.envs else None


@dataclass
class StepAwaitingPublish:
    """A step trained and maybe still publishing: its row is written once the publish is done."""

    row: dict[str, Any]
    times: StepTimes
    publish: Future[PublishOutcome] | None  # None: the step made no update
    version: int | None = None  # the version being published


# On a stop the launcher gives every process 30 s in all before SIGKILL, and it stops the gateway at the same time:
# a publish still running by then may never be answered, and the checkpoint must be written first.
STOP_PUBLISH_WAIT_S = 10.0


def _join_publish(pending: StepAwaitingPublish, stopping: bool) -> tuple[int | None, PublishOutcome | None]:
    """The version the trainer's weights now are, and the publish's outcome if it completed. Stopping, a publish
    the gateway does not complete within STOP_PUBLISH_WAIT_S (or fails to reach it) still leaves the weights at the
    new version: the checkpoint says so, and the resume publishes that version again (verified)."""
    if pending.publish is None:
        return None, None
    if not stopping:
        outcome = pending.publish.result()
        return outcome.version, outcome
    try:
        outcome = pending.publish.result(timeout=STOP_PUBLISH_WAIT_S)
        return outcome.version, outcome
    except (TimeoutError, ComponentDown, httpx.HTTPError) as exc:
        log.warning(
            "stopping: the publish of version %s did not complete (%s); the checkpoint holds that version's "
            "weights and the resume publishes it again",
            pending.version,
            describe(exc)
            if not isinstance(exc, TimeoutError)
            else f"no answer within {STOP_PUBLISH_WAIT_S:.0f}s",
        )
        return pending.version, None


def _finish_step(
    cfg: RunConfig,
    backend: TrainingBackend,
    metrics: MetricsWriter,
    run: RunTotals,
    pending: StepAwaitingPublish,
    state: LoopState,
    api: RunApi,
    run_dir: Path,
    overlapped: bool = False,
    stopping: bool = False,
) -> None:
    """Join the step's publish (its version becomes the trainer's), complete and write its row, checkpoint if due."""
    row, times = pending.row, pending.times
    version, outcome = _join_publish(pending, stopping)
    if version is not None:
        state.version = version
        row["policy_version"] = state.version
    if outcome is not None:
        row["time/publish_s"] = outcome.seconds
        row.update(Publisher.metrics(outcome))
    elif version is not None:
        row["time/publish_s"] = None  # a stop cut it short
    # Overlapped, the publish ran while the next batch was awaited: this step ended when its training did, and any
    # wait for the publish after the next batch arrived counts in that step's time/wait_for_batch_s.
    row["time/publish_overlapped"] = float(overlapped)
    row["time/step_s"] = (times.trained if overlapped else time.monotonic()) - times.started
    for key in TALLIED:
        run.totals[key] += row[key]
    taken = run.totals["rollouts/sequences_taken"]
    row["rollouts/stale_fraction_cum"] = run.totals["rollouts/dropped_stale"] / taken if taken else 0.0
    api.step = state.step
    row["wall_s"] = time.monotonic() - run.started
    row["unix_time"] = time.time()  # lines steps up with outside clocks (e.g. a SLURM job's start time)
    row.update(fault_counts(run_dir, api.reregistrations))
    metrics.write(row)
    if cfg.trainer.checkpoint_every and row["step"] % cfg.trainer.checkpoint_every == 0:
        save_checkpoint(backend, run_dir, state)
        run.checkpointed = state.step


def with_teacher(
    cfg: RunConfig, backend: TrainingBackend, examples: list[TrainingExample]
) -> tuple[list[TrainingExample], dict[str, float]]:
    """The step's examples with distillation advantages (trainer/training/distill.py) and the `distill/*` metrics."""
    if not isinstance(backend, TeacherScoring):
        raise TypeError(
            f"distill.teacher needs a backend that scores a teacher; {type(backend).__name__} does not"
        )
    started = time.monotonic()
    teacher = backend.teacher_logprobs(examples)
    out, metrics = distill_examples(examples, teacher, cfg.distill.kl_coef, cfg.distill.reward_coef)
    metrics["distill/teacher_s"] = time.monotonic() - started
    return out, metrics


@dataclass
class StepTimes:
    started: float  # waiting for the batch began
    batch: float = 0.0  # batch in hand (and the previous step's publish joined)
    trained: float = 0.0  # optimizer step done


def _one_step(
    cfg: RunConfig,
    backend: TrainingBackend,
    gateway: GatewayClient,
    publisher: Publisher,
    intake: IntakeOptions,
    state: LoopState,
    groups: list[Any],
    times: StepTimes,
    hold: ExpectResponse | None,
    env_names: dict[int, str] | None = None,
) -> StepAwaitingPublish:
    """Consume one batch; train and start publishing if anything in it is trainable. Advances `state.step`; the
    version advances when the publish is joined (_finish_step)."""
    times.batch = time.monotonic()
    versions = versions_by_group(gateway, groups)
    split = split_by_staleness(
        groups, versions, state.version, cfg.rollout.max_staleness, cfg.rollout.unknown_version == "keep"
    )
    converted = convert_batch(split.kept, intake)
    for drop in converted.drops:
        log.warning("dropped rollout: %s", drop)
    state.step += 1
    if split.dropped_stale or split.dropped_unknown:
        stale, unknown = split.dropped_stale, split.dropped_unknown
        log.info("step %d: dropped %d stale and %d unknown-version sequences", state.step, stale, unknown)
    train: dict[str, Any] = {key: None for key in NO_UPDATE_KEYS}
    train["tokens/trained"] = 0.0
    publish: Future[PublishOutcome] | None = None
    version: int | None = None
    if converted.examples:
        train.update(_train(cfg, backend, converted))
        times.trained = time.monotonic()
        publish = publisher.start(state.version + 1)
        version = state.version + 1
    else:
        times.trained = time.monotonic()
        why = "stale, malformed or zero-variance"
        log.info("step %d: nothing trainable in %d groups (%s); no update", state.step, len(groups), why)
        if hold is not None:  # nothing is coming: let the held requests through on the current version
            hold = _close_gate(cfg, gateway, state.version)
        elif cfg.share_quota():  # the batch it took was the version's: the next one may start on it
            _close_gate(cfg, gateway, state.version, batch_taken=True)
    row = _metrics_row(state, groups, split, converted, train, times)
    if env_names is not None:  # a mixed run: the same counts per environment
        envs = [spec.name for spec in cfg.rollout.env_specs()]
        lags = split.kept_staleness
        row.update(
            per_env_metrics(groups, split.dropped_groups, split.kept, converted, env_names, envs, lags)
        )
    row.update(Publisher.metrics(None))
    if hold is not None and publish is None:
        row["gateway/hold_s"], row["gateway/held_requests"] = hold.hold_s, float(hold.held_requests)
    return StepAwaitingPublish(row, times, publish, version)


def _train(cfg: RunConfig, backend: TrainingBackend, converted: ConvertedBatch) -> dict[str, Any]:
    """One optimizer step on the batch's examples (scored by the teacher when distilling): the row's figures."""
    examples, train = converted.examples, {}
    if cfg.distill.on:
        examples, distilled = with_teacher(cfg, backend, examples)
        train.update(distilled)
    adam = build_adam_params(backend.step, cfg.optim)
    # The means divide by the whole batch taken: zero-variance groups count, as in GRPO's mean (BatchScale).
    fb, optim = backend.train_step(examples, cfg.loss_params(), cfg.loss.reduction, adam, converted.scale())
    train.update({"loss": fb.loss, **optim})
    train.update({k: v for k, v in fb.metrics.items() if k in NO_UPDATE_KEYS})
    return train


def _metrics_row(
    state: LoopState,
    groups: list[Any],
    split: StalenessSplit,
    converted: ConvertedBatch,
    train: dict[str, Any],
    times: StepTimes,
) -> dict[str, Any]:
    """The step's row as far as training goes; _finish_step adds the publish, the times and the run's totals."""
    scores = converted.scores
    train_s = times.trained - times.batch
    taken = sum(len(g.get("tokens", [])) for g in groups)
    return {
        "step": state.step,
        "policy_version": state.version,
        "reward/mean": statistics.fmean(scores) if scores else None,
        "reward/std": statistics.pstdev(scores) if len(scores) > 1 else 0.0,
        **train,
        "tokens/sampled": float(sampled_tokens(groups)),
        "policy/staleness_mean": statistics.fmean(split.staleness) if split.staleness else 0.0,
        "policy/staleness_max": float(max(split.staleness, default=0)),
        "rollouts/sequences_taken": float(taken),
        "rollouts/dropped_stale": float(split.dropped_stale),
        # Stale drops over everything run-api handed out, before any other drop (zero-variance groups are
        # used data, not waste).
        "rollouts/stale_fraction": split.dropped_stale / taken if taken else 0.0,
        "rollouts/dropped_unknown_version": float(split.dropped_unknown),
        "rollouts/kept_unknown_version": float(split.kept_unknown),
        **converted.metrics(),
        "time/wait_for_batch_s": times.batch - times.started,
        "time/train_s": train_s,
        "time/publish_s": 0.0,
        "perf/tokens_per_s": train["tokens/trained"] / max(train_s, 1e-9),
    }


NO_UPDATE_KEYS = (
    "loss",
    "optim/grad_norm",
    "optim/lr",
    "optim/skipped_nonfinite",
    "time/optim_s",
    "tokens/trained",
    "tokens/forward",
    "tokens/forward_computed",
    "importance/ratio_mean",
    "importance/ratio_min",
    "importance/ratio_max",
    "importance/clip_fraction",
    "importance/masked_fraction",
    "importance/mismatch_kl",
    "importance/logprob_diff_mean",
)
