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
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from trainer.backends.base import TrainingBackend
from trainer.backends.collectives import rank_info
from trainer.backends.data_parallel import RankZeroBackend
from trainer.training.batch import ConvertedBatch, IntakeOptions, convert_batch, parse_batch_response
from trainer.training.config import RunConfig
from trainer.training.gateway_client import GatewayClient
from trainer.training.polling import wait_until
from trainer.training.schedule import build_adam_params

log = logging.getLogger("trainer.training.loop")
LATEST = "latest"  # file in checkpoints/ naming the newest complete checkpoint


@dataclass
class StalenessSplit:
    kept: list[Any]
    staleness: list[int]  # per kept group
    dropped_stale: int  # sequences
    dropped_unknown: int  # sequences whose version the gateway does not know


def split_by_staleness(
    groups: list[Any], versions: list[list[int | None]], current: int, max_staleness: int
) -> StalenessSplit:
    """Keep groups whose every sequence was sampled within `max_staleness` versions of `current`."""
    out = StalenessSplit([], [], 0, 0)
    for group, group_versions in zip(groups, versions):
        n = len(group_versions)
        if any(v is None for v in group_versions):
            out.dropped_unknown += n
            continue
        known = [v for v in group_versions if v is not None]
        lag = current - min(known)
        if lag > max_staleness:
            out.dropped_stale += n
            continue
        out.kept.append(group)
        out.staleness.extend(current - v for v in known)
    return out


class RunApi:
    def __init__(self, url: str, timeout_s: float = 30.0):
        self._http = httpx.Client(base_url=url, timeout=timeout_s)

    def register(self, cfg: RunConfig, starting_step: int) -> None:
        body = {
            "wandb_group": Path(cfg.trainer.output_dir).name,
            "wandb_project": cfg.launch.wandb_project,
            "batch_size": cfg.rollout.batch_size,
            "max_token_len": cfg.rollout.max_token_length,
            "checkpoint_dir": str(Path(cfg.trainer.output_dir) / "checkpoints"),
            "save_checkpoint_interval": cfg.trainer.checkpoint_every,
            "starting_step": starting_step,
            "num_steps": cfg.rollout.num_steps,
        }
        self._http.post("/register", json=body).raise_for_status()

    def fetch_batch(self) -> list[Any] | None:
        r = self._http.get("/batch")
        r.raise_for_status()
        return parse_batch_response(r.json())


class MetricsWriter:
    def __init__(self, path: Path, use_wandb: bool, cfg: RunConfig):
        self.path = path
        self._wandb = None
        if use_wandb:
            import wandb

            # WANDB_MODE=offline (launch.sh's default) keeps it local: runs sync later with `wandb sync`.
            self._wandb = wandb.init(
                project=cfg.launch.wandb_project,
                name=path.parent.name,
                dir=str(path.parent),
                config=cfg.model_dump(mode="json"),
                resume="allow",
            )

    def write(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if v is not None}, step=row["step"])

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()


@dataclass
class LoopState:
    step: int = 0  # batches consumed
    version: int = 0  # latest published policy version (= optimizer updates made)


def latest_checkpoint(run_dir: Path) -> tuple[Path, LoopState] | None:
    pointer = run_dir / "checkpoints" / LATEST
    if not pointer.exists():
        return None
    ckpt = run_dir / "checkpoints" / pointer.read_text().strip()
    state = json.loads((ckpt.parent / f"{ckpt.name}.loop.json").read_text())
    return ckpt, LoopState(step=int(state["step"]), version=int(state["version"]))


def save_checkpoint(backend: TrainingBackend, run_dir: Path, state: LoopState) -> None:
    name = f"step-{state.step:06d}"
    backend.save_state(name)
    ckpts = run_dir / "checkpoints"
    for path, text in (
        (ckpts / f"{name}.loop.json", json.dumps({"step": state.step, "version": state.version})),
        (ckpts / LATEST, name),
    ):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)  # `latest` moves only once the checkpoint and its loop state are complete


def wait_for_batch(api: RunApi, poll_s: float) -> list[Any]:
    """The next batch, however long the environments take to fill it."""
    return wait_until(api.fetch_batch, None, "a batch from run-api", poll_s)


def sampled_tokens(groups: list[Any]) -> int:
    return sum(sum(1 for m in row if m != -100) for g in groups for row in g.get("masks", []))


def build_training_backend(cfg: RunConfig) -> TrainingBackend:
    if cfg.launch.backend == "tinker":
        from trainer.backends.tinker import TinkerBackend  # the local path never imports tinker

        return TinkerBackend(cfg)
    from trainer.backends.local import LocalBackend

    local = LocalBackend(cfg)
    return RankZeroBackend(local) if local.ranks.world_size > 1 else local


def follow_rank_zero(cfg: RunConfig) -> None:
    """Ranks > 0 of a data-parallel trainer: no I/O, only the collective calls rank 0 makes."""
    from trainer.backends.data_parallel import follow
    from trainer.backends.local import LocalBackend

    follow(LocalBackend(cfg))


def run(cfg: RunConfig) -> None:
    run_dir = Path(cfg.trainer.output_dir)
    if cfg.launch.run_api_url is None or cfg.launch.gateway_url is None:
        raise ValueError("launch.run_api_url and launch.gateway_url must be set (launch.sh sets them)")
    if not rank_info().is_main:
        follow_rank_zero(cfg)
        return
    backend = build_training_backend(cfg)
    _run_main(cfg, backend, run_dir)
    # On an exception rank 0 exits instead; torchrun then stops the other ranks (a stop message could land in the
    # middle of a collective they are waiting in).
    if isinstance(backend, RankZeroBackend):
        backend.close()  # releases the other ranks


def _run_main(cfg: RunConfig, backend: TrainingBackend, run_dir: Path) -> None:
    assert cfg.launch.run_api_url is not None and cfg.launch.gateway_url is not None
    gateway = GatewayClient(cfg.launch.gateway_url, cfg.inference.get("publish_token"))
    api = RunApi(cfg.launch.run_api_url)
    state = _resume(backend, gateway, run_dir)
    api.register(cfg, state.step)
    metrics = MetricsWriter(run_dir / "metrics.jsonl", cfg.launch.wandb, cfg)
    intake = IntakeOptions(
        vocab_size=backend.vocab_size,
        max_seq_len=cfg.trainer.max_seq_len,
        normalize_std=cfg.normalize_std(),
        std_eps=cfg.advantage.std_eps,
        require_sampler_logprobs=cfg.loss.name != "cross_entropy",
    )
    started = time.monotonic()
    while state.step < cfg.rollout.num_steps:
        row = _one_step(cfg, backend, gateway, api, intake, state)
        row["wall_s"] = time.monotonic() - started
        row["unix_time"] = time.time()  # lines steps up with outside clocks (e.g. a SLURM job's start time)
        metrics.write(row)
        if cfg.trainer.checkpoint_every and state.step % cfg.trainer.checkpoint_every == 0:
            save_checkpoint(backend, run_dir, state)
    metrics.close()
    gateway.close()


def _resume(backend: TrainingBackend, gateway: GatewayClient, run_dir: Path) -> LoopState:
    """Load the newest checkpoint (if any) and make its adapter the gateway's current policy."""
    found = latest_checkpoint(run_dir)
    if found is None:
        return LoopState()
    ckpt, state = found
    backend.load_state(str(ckpt))
    _truncate_metrics(run_dir / "metrics.jsonl", state.step)
    _set_aside_newer_adapters(run_dir / "adapters", state.version)
    if state.version > 0:
        adapter = run_dir / "adapters" / f"v{state.version:06d}"
        path = str(adapter) if adapter.exists() else backend.save_for_sampler(state.version)
        gateway.publish(state.version, path)
    log.info("resumed from %s at step %d (policy version %d)", ckpt, state.step, state.version)
    return state


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Drop rows of steps after the checkpoint: the resumed run does them again."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(row + "\n" for row in rows))
    tmp.replace(path)


def _set_aside_newer_adapters(adapters: Path, version: int) -> None:
    """Adapters published after the checkpoint belong to the interrupted timeline: move them out of the way (kept
    for inspection) so the resumed run writes those versions afresh."""
    newer = [p for p in adapters.glob("v*") if p.is_dir() and int(p.name[1:]) > version]
    if not newer:
        return
    aside = adapters / f"discarded-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir(parents=True, exist_ok=True)
    for path in newer:
        path.rename(aside / path.name)
    log.info("moved %d adapters newer than version %d to %s", len(newer), version, aside)


def versions_by_group(gateway: GatewayClient, groups: list[Any]) -> list[list[int | None]]:
    """The policy version that sampled each sequence, grouped like `groups` (one gateway lookup per batch)."""
    flat = gateway.lookup([list(seq) for g in groups for seq in g.get("tokens", [])])
    versions, i = [], 0
    for g in groups:
        n = len(g.get("tokens", []))
        versions.append(flat[i : i + n])
        i += n
    return versions


@dataclass
class StepTimes:
    started: float
    batch: float = 0.0  # batch in hand
    trained: float = 0.0  # optimizer step done
    published: float = 0.0  # new version live on the gateway


def _one_step(
    cfg: RunConfig,
    backend: TrainingBackend,
    gateway: GatewayClient,
    api: RunApi,
    intake: IntakeOptions,
    state: LoopState,
) -> dict[str, Any]:
    """Consume one batch; train and publish if anything in it is trainable. Advances `state`."""
    times = StepTimes(time.monotonic())
    groups = wait_for_batch(api, cfg.trainer.batch_poll_s)
    times.batch = time.monotonic()
    versions = versions_by_group(gateway, groups)
    split = split_by_staleness(groups, versions, state.version, cfg.rollout.max_staleness)
    converted = convert_batch(split.kept, intake)
    for drop in converted.drops:
        log.warning("dropped rollout: %s", drop)
    state.step += 1
    if split.dropped_stale or split.dropped_unknown:
        stale, unknown = split.dropped_stale, split.dropped_unknown
        log.info("step %d: dropped %d stale and %d unknown-version sequences", state.step, stale, unknown)
    train = _train_and_publish(cfg, backend, gateway, converted, state, times)
    if not converted.examples:
        why = "stale, malformed or zero-variance"
        log.info("step %d: nothing trainable in %d groups (%s); no update", state.step, len(groups), why)
    return _metrics_row(state, groups, split, converted, train, times)


def _train_and_publish(
    cfg: RunConfig,
    backend: TrainingBackend,
    gateway: GatewayClient,
    converted: ConvertedBatch,
    state: LoopState,
    times: StepTimes,
) -> dict[str, Any]:
    """One optimizer step on what is trainable, then its adapter published as the next version. Returns the
    training metrics (null when nothing was trainable: no update, no new version)."""
    train: dict[str, Any] = {key: None for key in NO_UPDATE_KEYS}
    train["tokens/trained"] = 0.0
    if converted.examples:
        adam = build_adam_params(backend.step, cfg.optim)
        fb, optim = backend.train_step(converted.examples, cfg.loss.params(), cfg.loss.reduction, adam)
        train.update({"loss": fb.loss, **optim})
        train.update({k: v for k, v in fb.metrics.items() if k in NO_UPDATE_KEYS})
        times.trained = time.monotonic()
        gateway.publish(state.version + 1, backend.save_for_sampler(state.version + 1))
        state.version += 1
    else:
        times.trained = time.monotonic()
    times.published = time.monotonic()
    return train


def _metrics_row(
    state: LoopState,
    groups: list[Any],
    split: StalenessSplit,
    converted: ConvertedBatch,
    train: dict[str, Any],
    times: StepTimes,
) -> dict[str, Any]:
    scores = converted.scores
    train_s = times.trained - times.batch
    return {
        "step": state.step,
        "policy_version": state.version,
        "reward/mean": statistics.fmean(scores) if scores else None,
        "reward/std": statistics.pstdev(scores) if len(scores) > 1 else 0.0,
        **train,
        "tokens/sampled": float(sampled_tokens(groups)),
        "policy/staleness_mean": statistics.fmean(split.staleness) if split.staleness else 0.0,
        "policy/staleness_max": float(max(split.staleness, default=0)),
        "rollouts/dropped_stale": float(split.dropped_stale),
        "rollouts/dropped_unknown_version": float(split.dropped_unknown),
        **converted.metrics(),
        "time/step_s": times.published - times.started,
        "time/wait_for_batch_s": times.batch - times.started,
        "time/train_s": train_s,
        "time/publish_s": times.published - times.trained,
        "perf/tokens_per_s": train["tokens/trained"] / max(train_s, 1e-9),
    }


NO_UPDATE_KEYS = (
    "loss",
    "optim/grad_norm",
    "optim/lr",
    "optim/skipped_nonfinite",
    "time/optim_s",
    "tokens/trained",
    "importance/ratio_mean",
    "importance/ratio_min",
    "importance/ratio_max",
    "importance/clip_fraction",
    "importance/mismatch_kl",
    "importance/logprob_diff_mean",
)
