"""What the launcher and the trainer share about faults: RUN_DIR/faults.json (restarts the launcher made, read
into the trainer's next metrics row) and the trainer's exit code for "a restart cannot fix this"."""

from __future__ import annotations

import json
from pathlib import Path

FAULTS_FILE = "faults.json"
FAULT_KEYS = (
    "restarts_trainer",
    "restarts_run_api",
    "restarts_env",
    "restarts_gateway",
    "restarts_vllm",
    "lost_queued_sequences",  # rollouts waiting in run-api when it (or the trainer) was restarted
)
EXIT_NEEDS_OPERATOR = 3  # the trainer's exit code for DiskFull: the launcher does not restart it


class DiskFull(RuntimeError):
    """No room for a checkpoint: a restart cannot fix it, a person can."""


PER_ENV_RESTARTS = "restarts_env/"  # restarts_env/<component>: one environment's restarts in a mixed run


def fault_counts(run_dir: Path, reregistrations: int) -> dict[str, float]:
    """The launcher's counts so far, as cumulative `faults/...` metrics, plus the trainer's own count of
    re-registrations with a restarted run-api."""
    counts: dict[str, float] = dict.fromkeys(FAULT_KEYS, 0.0)
    try:
        saved = json.loads((run_dir / FAULTS_FILE).read_text())
        counts.update(
            {k: float(v) for k, v in saved.items() if k in FAULT_KEYS or k.startswith(PER_ENV_RESTARTS)}
        )
    except (OSError, ValueError, AttributeError, TypeError):
        pass  # no launcher (a test driving the loop): zeros
    counts["run_api_reregistrations"] = float(reregistrations)
    return {f"faults/{k}": v for k, v in counts.items()}
