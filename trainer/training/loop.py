"""The trainer process's loop: register with Atropos's run-api, pull batches, drop rollouts older than the
staleness window (their version read from the gateway's ledger), train one optimizer step per batch, publish the
new adapter to the gateway, write one metrics.jsonl row per step, checkpoint every N steps.

Every batch run-api hands out is one step (run-api and the environments count steps that way); a step whose
rollouts are all stale, malformed or zero-variance makes no update and publishes no new version, so the policy
version can lag the step count. Its parts live beside it: run-api's client (runapi_client.py), the staleness split
(staleness.py), batch conversion (batch.py), publishing (publishing.py), metrics.jsonl (metrics_file.py).
"""

from __future__ import annotations

import json
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
    adapter_dir,
    checkpoint_name,
    disk_free,
    failpoint,
    folder_bytes,
    full_disk_is_one_error,
    read_latest,
    repair,
    write_loop_state,
)
from trainer.training.config import RunConfig
from trainer.training.distill import distill_examples
from trainer.training.faults import fault_counts
from trainer.training.gateway_client import ExpectResponse, GatewayClient, PolicyStatus
from trainer.training.metrics_file import MetricsWriter
from trainer.training.polling import wait_until
from trainer.training.publishing import Publisher, PublishOutcome
from trainer.training.refill import ShortRefill
from trainer.training.retries import ComponentDown, describe
from trainer.training.runapi_client import RunApi, Stopper, StopRequested, sampled_tokens, wait_for_batch
from trainer.training.schedule import build_adam_params
from trainer.training.staleness import StalenessSplit, split_by_staleness, versions_by_group
from trainer.training.topup import Reserve

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
    state = _resume(backend, publisher, run_dir)
    if state.step >= cfg.rollout.num_steps:
        log.info("the run is already at step %d of %d: nothing to do", state.step, cfg.rollout.num_steps)
        return True
    warn_if_disk_short(cfg, backend, run_dir, state)
    quota = cfg.share_quota()
    if quota:
        # The quota from the first version on: environments start sampling once the trainer registers, and a
        # mixed run's environment that started more than its share would keep a stale group queued for the run.
        _close_gate(cfg, gateway, state.version)
    quota_on = gateway.status().instance if quota else None  # the gateway process that holds the quota
    api.register(state.step)
    metrics = MetricsWriter(run_dir / "metrics.jsonl", cfg.launch.wandb, cfg)
    intake = _intake_options(cfg, backend)
    run = RunTally(read_tally(run_dir / "metrics.jsonl"), time.monotonic(), state.step)
    pending: PendingStep | None = None
    reserve = Reserve() if cfg.rollout.refill_zero_variance else None
    shares = env_shares(cfg) if quota else None
    refill = ShortRefill(shares, cfg.publish.gate_refill_s, api, gateway) if shares else None

    def finish_pending(block: bool, stopping: bool = False) -> None:
        """Write the overlapped step's row (and its checkpoint) once its publish is done: as soon as it is while
        the next batch is awaited (`block` False), or now."""
        nonlocal pending
        if pending is not None and (block or pending.publish is None or pending.publish.done()):
            done, pending = pending, None
            _finish_step(
                cfg, backend, metrics, run, done, state, api, run_dir, overlapped=True, stopping=stopping
            )

    def meanwhile() -> None:
        """Before each poll for a batch: the overlapped step's row once its publish is done, a short refill."""
        finish_pending(block=False)
        if refill is not None:
            refill()

    try:
        while state.step < cfg.rollout.num_steps:
            waiting_since = time.monotonic()
            if refill is not None:
                refill.waiting()
            topped = (
                None
                if reserve is None
                else reserve.fill(
                    lambda: wait_for_batch(api, cfg.trainer.batch_poll_s, stopper, meanwhile),
                    cfg.rollout.batch_size,
                    cfg.rollout.refill_max_groups or cfg.rollout.groups_per_step,
                )
            )
            groups = (
                topped.groups if topped else wait_for_batch(api, cfg.trainer.batch_poll_s, stopper, meanwhile)
            )
            finish_pending(block=True)
            served = _ensure_gateway_policy(gateway, publisher, run_dir, state)
            if quota and not gate and served.instance != quota_on:  # a restarted gateway starts with no quota
                _close_gate(cfg, gateway, state.version)
                quota_on = served.instance
            hold = _close_gate(cfg, gateway, state.version + 1) if gate else None
            names = api.env_names(groups) if cfg.rollout.envs else None
            pending = _one_step(
                cfg, backend, gateway, publisher, intake, state, groups, StepTimes(waiting_since), hold, names
            )
            pending.row.update(_gate_row(served))
            if cfg.rollout.envs:
                pending.row.update(api.shortfalls())
            if topped is not None:
                pending.row.update(topped.row())
            if not publisher.overlap:
                _finish_step(cfg, backend, metrics, run, pending, state, api, run_dir)
                pending = None
            stopper.check()
    except StopRequested:
        log.info("stopping at step %d", state.step)
    finally:
        if sys.exc_info()[0] in (None, StopRequested):
            finish_pending(block=True, stopping=True)
        publisher.close()
    if cfg.trainer.checkpoint_every and run.checkpointed != state.step:
        save_checkpoint(backend, run_dir, state)  # the end of the run, or a stop: nothing to redo on resume
    metrics.close()
    gateway.close()
    return state.step >= cfg.rollout.num_steps


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
class RunTally:
    """What the run's rows add up to so far (restored from metrics.jsonl on resume)."""

    totals: dict[str, float]
    started: float
    checkpointed: int


TALLIED = ("rollouts/sequences_taken", "rollouts/dropped_stale")


def read_tally(path: Path) -> dict[str, float]:
    """Sums of the tallied metrics over the rows already written (the rows a resume keeps)."""
    totals = dict.fromkeys(TALLIED, 0.0)
    if not path.exists():
        return totals
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        for key in TALLIED:
            value = row.get(key)
            if isinstance(value, int | float):
                totals[key] += value
    return totals


@dataclass
class PendingStep:
    """A step trained and maybe still publishing: its row is written once the publish is done."""

    row: dict[str, Any]
    times: StepTimes
    publish: Future[PublishOutcome] | None  # None: the step made no update
    version: int | None = None  # the version being published


# On a stop the launcher gives every process 30 s in all before SIGKILL, and it stops the gateway at the same time:
# a publish still running by then may never be answered, and the checkpoint must be written first.
STOP_PUBLISH_WAIT_S = 10.0


def _join_publish(pending: PendingStep, stopping: bool) -> tuple[int | None, PublishOutcome | None]:
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
    run: RunTally,
    pending: PendingStep,
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


def save_checkpoint(backend: TrainingBackend, run_dir: Path, state: LoopState) -> None:
    """Backend state, then loop state, then `latest`: until `latest` moves, the previous checkpoint is the one a
    resume loads (a full disk midway leaves it so)."""
    backend.save_state(checkpoint_name(state.step))
    failpoint("checkpoint-renamed")
    write_loop_state(run_dir, state)
    log.info("checkpoint at step %d (policy version %d)", state.step, state.version)


def warn_if_disk_short(cfg: RunConfig, backend: TrainingBackend, run_dir: Path, state: LoopState) -> None:
    """Warn at start when the disk cannot hold the checkpoints and adapters the rest of the run will write (sizes
    from those already on disk; on a fresh local run, from the trainable parameters at 4 bytes each)."""
    steps_left = cfg.rollout.num_steps - state.step
    adapters = sorted((run_dir / "adapters").glob("v[0-9]*"))
    ckpt = read_latest(run_dir)
    model = getattr(backend, "model", None)  # the local backend's PEFT model; Tinker keeps its weights remote
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) if model is not None else 0
    adapter_bytes = folder_bytes(adapters[-1]) if adapters else 4 * trainable
    ckpt_bytes = folder_bytes(ckpt[0]) if ckpt else 3 * adapter_bytes  # adapter + two Adam moments
    every = cfg.trainer.checkpoint_every
    need = steps_left * adapter_bytes + (steps_left // every + 1 if every else 0) * ckpt_bytes
    free = disk_free(run_dir)
    if need > free:
        log.warning(
            "%s has %d bytes free; the remaining %d steps will write about %d bytes of adapters and checkpoints",
            run_dir,
            free,
            steps_left,
            need,
        )


def _resume(backend: TrainingBackend, publisher: Publisher, run_dir: Path) -> LoopState:
    """Repair the run folder after whatever stopped the last trainer, load the newest complete checkpoint (if
    any), and make its adapter the gateway's current policy, retracting versions published after it."""
    fixed = repair(run_dir)
    for path in fixed.swept:
        log.info("removed an interrupted write: %s", path)
    state = fixed.state or LoopState()
    if fixed.checkpoint is not None:
        backend.load_state(str(fixed.checkpoint))
        log.info(
            "resumed from %s at step %d (policy version %d)", fixed.checkpoint, state.step, state.version
        )
    if fixed.metrics_rows_dropped:
        log.info(
            "dropped %d metrics rows after step %d: they are redone", fixed.metrics_rows_dropped, state.step
        )
    adapter: str | None = None
    if state.version > 0:
        saved = adapter_dir(run_dir, state.version)
        adapter = str(saved) if saved.exists() else backend.save_for_sampler(state.version)
    reply = publisher.republish(state.version, adapter)
    if reply.retracted:
        log.warning("the gateway retracted versions %s of the interrupted run", reply.retracted)
    return state


def _ensure_gateway_policy(
    gateway: GatewayClient, publisher: Publisher, run_dir: Path, state: LoopState
) -> PolicyStatus:
    """A gateway restarted by the launcher serves the base model: publish the trainer's version again. Returns the
    gateway's status as read before any publish."""
    status = gateway.status()
    if status.current_version == state.version:
        return status
    log.warning(
        "the gateway serves version %d, the trainer is at %d (the gateway was restarted): publishing %d again",
        status.current_version,
        state.version,
        state.version,
    )
    adapter = str(adapter_dir(run_dir, state.version)) if state.version > 0 else None
    publisher.republish(state.version, adapter)
    return status


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
) -> PendingStep:
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
        examples = converted.examples
        if cfg.distill.on:
            examples, distilled = with_teacher(cfg, backend, examples)
            train.update(distilled)
        adam = build_adam_params(backend.step, cfg.optim)
        # The means divide by the whole batch taken: zero-variance groups count, as in GRPO's mean (BatchScale).
        scale = converted.scale()
        fb, optim = backend.train_step(examples, cfg.loss_params(), cfg.loss.reduction, adam, scale)
        train.update({"loss": fb.loss, **optim})
        train.update({k: v for k, v in fb.metrics.items() if k in NO_UPDATE_KEYS})
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
    return PendingStep(row, times, publish, version)


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
