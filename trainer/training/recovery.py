"""What lets a run pick up where it stopped: checkpoints (saved so a full disk midway leaves the previous one
loadable), the resume from the newest complete one, the run's tallies restored from metrics.jsonl, the trainer's
version published again to a gateway that restarted, and a warning at start when the disk cannot hold the rest."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from trainer.training.backend import TrainingBackend
from trainer.training.checkpoints import (
    LoopState,
    adapter_dir,
    checkpoint_name,
    disk_free,
    failpoint,
    folder_bytes,
    read_latest,
    repair,
    write_loop_state,
)
from trainer.training.config import RunConfig
from trainer.training.gateway_client import GatewayClient, PolicyStatus
from trainer.training.publishing import Publisher

log = logging.getLogger(__name__)


@dataclass
class RunTotals:
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


def restore(backend: TrainingBackend, run_dir: Path) -> LoopState:
    """Repair the run folder after whatever stopped the last trainer and load the newest complete checkpoint (if
    any). Needs no gateway: the trainer does it while vLLM may still be starting."""
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
    return state


def republish(backend: TrainingBackend, publisher: Publisher, run_dir: Path, state: LoopState) -> None:
    """Make the restored state's adapter the gateway's current policy, retracting versions published after it."""
    adapter: str | None = None
    if state.version > 0:
        saved = adapter_dir(run_dir, state.version)
        adapter = str(saved) if saved.exists() else backend.save_for_sampler(state.version)
    reply = publisher.republish(state.version, adapter)
    if reply.retracted:
        log.warning("the gateway retracted versions %s of the interrupted run", reply.retracted)


def ensure_gateway_policy(
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
