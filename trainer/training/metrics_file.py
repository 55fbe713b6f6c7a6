"""metrics.jsonl, one row per step, and the trainer's run of the run's W&B group."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlcommon.redaction import redact
from trainer.training.config import RunConfig
from trainer.training.wandb_group import TRAINER, current_mode, wandb_group, wandb_run_id


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
