"""The trainer process's loop: register with Atropos's run-api, pull batches, drop rollouts older than the
staleness window (their version read from the gateway's ledger), train one optimizer step per batch, publish the
new adapter to the gateway, write one metrics.jsonl row per step, checkpoint every N steps.

Every batch run-api hands out is one step (run-api and the environments count steps that way); a step whose
rollouts are all stale, malformed or zero-variance makes no update and publishes no new version, so the policy
version can lag the step count. Pure helpers (staleness filter) are separate; the loop itself does the I/O.
"""

from __future__ import annotations

import json
import logging
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rlcommon.redaction import redact
from trainer.training.backend import TeacherScoring, TrainingBackend
from trainer.training.batch import (
    ConvertedBatch,
    IntakeOptions,
    TrainingExample,
    convert_batch,
    earlier_turn_ends,
    parse_batch_response,
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
from trainer.training.polling import wait_until
from trainer.training.publishing import Publisher, PublishOutcome
from trainer.training.refill import ShortRefill
from trainer.training.retries import ComponentDown, Edge, checked, describe
from trainer.training.schedule import build_adam_params
from trainer.training.wandb_group import TRAINER, current_mode, wandb_group, wandb_run_id

log = logging.getLogger("trainer.training.loop")


@dataclass
class StalenessSplit:
    kept: list[Any]
    staleness: list[int]  # per kept group
    dropped_stale: int  # sequences
    dropped_unknown: int  # sequences sampled by an abandoned policy, or unknown ones with keep_unknown off
    kept_unknown: int = 0  # sequences the gateway never saw, trained under atroposlib's own lag bound
    # (index in groups, "stale" or "unknown_version") of each group dropped for its policy version
    dropped_groups: list[tuple[int, str]] = field(default_factory=list)
    kept_staleness: list[list[int]] = field(default_factory=list)  # per kept group, its known sequences' lags


ABANDONED = -1  # the gateway's lookup answer for a sequence sampled by a policy a rollback abandoned


def split_by_staleness(
    groups: list[Any],
    versions: list[list[int | None]],
    current: int,
    max_staleness: int,
    keep_unknown: bool = False,
) -> StalenessSplit:
    """Keep groups whose every sequence was sampled within `max_staleness` versions of `current`. A sequence the
    gateway never saw (an environment that re-tokenized a multi-turn chat, say) is kept with `keep_unknown`: the
    environment's max_batches_offpolicy still bounds its lag; one sampled by an abandoned policy never is."""
    out = StalenessSplit([], [], 0, 0)
    for index, (group, group_versions) in enumerate(zip(groups, versions)):
        n = len(group_versions)
        unknown = sum(v is None for v in group_versions)
        if ABANDONED in group_versions or (unknown and not keep_unknown):
            out.dropped_unknown += n
            out.dropped_groups.append((index, "unknown_version"))
            continue
        known = [v for v in group_versions if v is not None]
        lag = current - min(known, default=current)
        if lag > max_staleness:
            out.dropped_stale += n
            out.dropped_groups.append((index, "stale"))
            continue
        out.kept.append(group)
        out.kept_unknown += unknown
        out.staleness.extend(current - v for v in known)
        out.kept_staleness.append([current - v for v in known])
    return out


MAX_REREGISTRATIONS = 5


class RunApi:
    """Atropos's run-api, as the trainer uses it. Calls are retried through transient failures; a run-api that
    answers "not registered" was restarted (by the launcher) and is registered with again at the current step."""

    def __init__(self, cfg: RunConfig, url: str, log: str):
        self.cfg = cfg
        self.edge = Edge("run-api", url, log, cfg.trainer.retry_budget_s)
        self._http = httpx.Client(base_url=url, timeout=cfg.trainer.request_timeout_s)
        self.step = 0  # where a re-registration starts; the loop keeps it current
        self.reregistrations = 0
        self.unanswered = 0  # re-registrations in a row that run-api did not take
        self._env_names: dict[int, str] = {}

    def register(self, starting_step: int) -> None:
        self.step = starting_step
        cfg = self.cfg
        body = {
            "wandb_group": wandb_group(Path(cfg.trainer.output_dir)),  # the environments' W&B runs join it
            "wandb_project": cfg.launch.wandb_project,
            "batch_size": cfg.rollout.batch_size,
            # -1: atroposlib drops a whole group when any sequence reaches max_token_len, which a completion cut
            # at the environment's own budget does. The trainer applies its limit per sequence instead
            # (trainer.max_seq_len, trainer.overlong), so nothing the environment scored is lost whole.
            "max_token_len": -1,
            "checkpoint_dir": str(Path(cfg.trainer.output_dir) / "checkpoints"),
            "save_checkpoint_interval": cfg.trainer.checkpoint_every,
            "starting_step": starting_step,
            "num_steps": cfg.rollout.num_steps,
        }
        self.edge.call(lambda: checked(self._http.post("/register", json=body)), "/register")

    def fetch_batch(self) -> list[Any] | None:
        body = self.edge.call(lambda: checked(self._http.get("/batch")), "/batch").json()
        if (
            isinstance(body, dict)
            and body.get("status") == "error"
            and "register" in str(body.get("message"))
        ):
            self.unanswered += 1
            if self.unanswered > MAX_REREGISTRATIONS:
                # run-api keeps its first state: one that got data before any registration never takes one.
                raise RuntimeError(
                    f"run-api at {self.edge.url} still answers 'not registered' after {MAX_REREGISTRATIONS} "
                    "registrations; its state is broken (data arrived before the trainer registered). "
                    f"Read {self.edge.log}; a restart of run-api (with the trainer) clears it"
                )
            log.warning(
                "run-api has no registration (it was restarted); registering again at step %d", self.step
            )
            self.reregistrations += 1
            self.register(self.step)
            return None
        self.unanswered = 0
        return parse_batch_response(body)

    def env_names(self, groups: list[Any]) -> dict[int, str]:
        """run-api env id -> environment name for a mixed run (its run-api's GET /envs; the launcher names each
        process `<name>-<worker>`). Asked again only when a batch holds an id not seen yet (a restarted
        environment registers under a new one); an unanswered ask leaves those groups unnamed."""
        ids = {g.get("env_id") for g in groups if isinstance(g, dict)}
        if not ids <= self._env_names.keys():
            try:
                body = checked(self._http.get("/envs")).json()
                self._env_names = {e["env_id"]: str(e["name"]).rsplit("-", 1)[0] for e in body["envs"]}
            except (httpx.HTTPError, ComponentDown, ValueError, KeyError, TypeError) as exc:
                log.warning("run-api did not name its environments (GET /envs): %s", exc)
        return self._env_names

    def queued_by_env(self) -> dict[str, int] | None:
        """A mixed run: the sequences run-api has queued from each connected environment (its workers summed);
        None when run-api does not answer."""
        try:
            envs = checked(self._http.get("/envs")).json()["envs"]
            out: dict[str, int] = {}
            for e in envs:
                if e["connected"]:
                    name = str(e["name"]).rsplit("-", 1)[0]
                    out[name] = out.get(name, 0) + int(e["queued_sequences"])
            return out
        except (httpx.HTTPError, ComponentDown, ValueError, KeyError, TypeError) as exc:
            log.warning("run-api did not report its environments' queues (GET /envs): %s", exc)
            return None

    def shortfalls(self) -> dict[str, float]:
        """A mixed run's `rollouts/<env>/short_batches` and `.../shortfall_sequences`: batches run-api formed
        without an environment's full share after rollout.mix_wait_s (trainer/orchestration/run_api.py), and the
        sequences it fell short by, counted since run-api started. Empty when run-api does not answer."""
        out: dict[str, float] = {}
        try:
            envs = checked(self._http.get("/envs")).json()["envs"]
            for e in envs:
                name = str(e["name"]).rsplit("-", 1)[0]
                for key in ("short_batches", "shortfall_sequences"):
                    out[f"rollouts/{name}/{key}"] = out.get(f"rollouts/{name}/{key}", 0.0) + float(e[key])
        except (httpx.HTTPError, ComponentDown, ValueError, KeyError, TypeError) as exc:
            log.warning("run-api did not report its environments' shortfall (GET /envs): %s", exc)
        return out


class MetricsWriter:
    """metrics.jsonl, and with launch.wandb the trainer's run of the run's W&B group (trainer.training.wandb_group;
    the evaluations have a run of their own there, written by the launcher)."""

    def __init__(self, path: Path, use_wandb: bool, cfg: RunConfig):
        self.path = path
        self._wandb = None
        if use_wandb:
            import wandb

            # Online with a W&B login, else offline under RUN_DIR/wandb, unless WANDB_MODE says otherwise.
            run_dir = path.parent
            self._wandb = wandb.init(
                project=cfg.launch.wandb_project,
                group=wandb_group(run_dir),
                job_type=TRAINER,
                name=f"{wandb_group(run_dir)}-{TRAINER}",
                id=wandb_run_id(run_dir, TRAINER),
                dir=str(run_dir),
                mode=current_mode(),  # type: ignore[arg-type]
                config=redact(cfg.model_dump(mode="json")),  # W&B uploads it: tokens and keys hidden
                resume="allow",
                reinit="create_new",  # beside any other run of this process
            )

    def write(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if v is not None}, step=row["step"])

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()


class StopRequested(Exception):
    """SIGTERM arrived while the trainer was between steps."""


class Stopper:
    """SIGTERM (the launcher stopping the run) ends the loop at the next step boundary, where the state on disk
    and in memory agree, so the final checkpoint is exact; a step under way is finished first."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, _: Any) -> None:
        log.warning("signal %d: stopping after the current step with a final checkpoint", signum)
        self.requested = True

    def check(self) -> None:
        if self.requested:
            raise StopRequested


def wait_for_batch(
    api: RunApi,
    poll_s: float,
    stopper: Stopper | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> list[Any]:
    """The next batch, however long the environments take to fill it (or until a stop is requested); `meanwhile`
    runs before each poll."""

    def ready() -> list[Any] | None:
        if stopper is not None:
            stopper.check()
        if meanwhile is not None:
            meanwhile()
        return api.fetch_batch()

    return wait_until(ready, None, "a batch from run-api", poll_s)


def sampled_tokens(groups: list[Any]) -> int:
    return sum(sum(1 for m in row if m != -100) for g in groups for row in g.get("masks", []))


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
    assert cfg.launch.run_api_url is not None and cfg.launch.gateway_url is not None
    logs = run_dir / "logs"
    gateway = GatewayClient(
        cfg.launch.gateway_url,
        cfg.inference.get("publish_token"),
        lease=cfg.inference.get("engine_lease") if cfg.inference.get("engine_url") else None,
        timeout_s=cfg.trainer.request_timeout_s,
        retry_budget_s=cfg.trainer.retry_budget_s,
        log=(
            f"the shared engine's logs/gateway.log ({cfg.inference['engine_url']})"
            if cfg.inference.get("engine_url")
            else str(logs / "gateway.log")
        ),
    )
    api = RunApi(cfg, cfg.launch.run_api_url, str(logs / "run-api.log"))
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
    if gate:
        # The quota from the first version on: environments start sampling once the trainer registers, and a
        # mixed run's environment that started more than its share would keep a stale group queued for the run.
        _close_gate(cfg, gateway, state.version)
    api.register(state.step)
    metrics = MetricsWriter(run_dir / "metrics.jsonl", cfg.launch.wandb, cfg)
    intake = IntakeOptions(
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
    run = RunTally(read_tally(run_dir / "metrics.jsonl"), time.monotonic(), state.step)
    pending: PendingStep | None = None
    shares = env_shares(cfg) if gate and cfg.publish.gate_quota else None
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
            groups = wait_for_batch(api, cfg.trainer.batch_poll_s, stopper, meanwhile)
            finish_pending(block=True)
            served = _ensure_gateway_policy(gateway, publisher, run_dir, state)
            hold = _close_gate(cfg, gateway, state.version + 1) if gate else None
            names = api.env_names(groups) if cfg.rollout.envs else None
            pending = _one_step(
                cfg, backend, gateway, publisher, intake, state, groups, StepTimes(waiting_since), hold, names
            )
            # Episode turns the gateway recognised as continuing an earlier turn (a multi-turn environment's later
            # turns, token-in): 0 in such a run means its turns reach the trainer as unrelated prompts.
            pending.row["gateway/continuations_total"] = float(served.gate_continuations_total)
            if cfg.rollout.envs:
                pending.row.update(api.shortfalls())
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


def _close_gate(cfg: RunConfig, gateway: GatewayClient, version: int) -> ExpectResponse:
    """Hold new requests for `version` (opens the gate when it is not newer than the current one)."""
    quota = cfg.rollout.batch_size if cfg.publish.gate_quota else None
    env_quotas = env_shares(cfg) if quota else None
    return gateway.expect(version, cfg.publish.gate_hold_s, quota, cfg.publish.gate_refill_s, env_quotas)


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


def versions_by_group(gateway: GatewayClient, groups: list[Any]) -> list[list[int | None]]:
    """The policy version that sampled each sequence, grouped like `groups` (one gateway lookup per batch). A
    multi-turn sequence gets its oldest turn's version: an episode can span a publish, and then its earlier turns were
    sampled by the version before. Each earlier turn is looked up as the prefix that ends with its reply; a prefix the
    ledger does not know (a re-tokenized turn) leaves the sequence's own version."""
    sequences = [list(seq) for g in groups for seq in g.get("tokens", [])]
    masks = [
        (g.get("masks") or [])[k] if k < len(g.get("masks") or []) else None
        for g in groups
        for k in range(len(g.get("tokens", [])))
    ]
    queries, turns = list(sequences), []
    for i, (seq, mask) in enumerate(zip(sequences, masks, strict=True)):
        if isinstance(mask, list) and len(mask) == len(seq):
            for end in earlier_turn_ends(mask):
                turns.append((i, len(queries)))
                queries.append(seq[:end])
    answers = gateway.lookup(queries)
    flat = answers[: len(sequences)]
    for i, q in turns:
        own, turn = flat[i], answers[q]
        if own is not None and turn is not None:
            flat[i] = min(own, turn)  # ABANDONED (-1) wins, as it should
    versions, i = [], 0
    for g in groups:
        n = len(g.get("tokens", []))
        versions.append(flat[i : i + n])
        i += n
    return versions


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
