"""Who a run is on Weights & Biases (launch.wandb=true): one W&B group per run, one W&B run per process in it.

- the trainer's run (job type `trainer`) holds the trainer's metrics and the whole resolved RunConfig;
- each environment process's run (job type `environment`) is Atropos's own: BaseEnv asks run-api's /wandb_info
  for the group and project the trainer registered, and logs what it measures with its own config;
- the evaluations' run (job type `eval`, EvalRun) is written by the launcher as it records each evaluation, since
  the final one runs after the trainer has exited.

A group rather than one shared run: a W&B run has one writer, and every process logs at a step of its own
(an environment at the step run-api last told it), which one run's history would drop as out of order. An
environment process is told who it is through W&B's own environment variables (process_environ), so it imports
nothing of the trainer. Run ids are derived from the run folder, so a restarted process, or a resumed run, goes on
in the same W&B run when online.
"""

from __future__ import annotations

import hashlib
import netrc
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rlcommon.redaction import redact

TRAINER = "trainer"
ENVIRONMENT = "environment"
EVALUATION = "eval"
EVAL_STEP = "eval/step"  # the step whose policy an evaluation sampled: the x-axis of eval/* and reported/*


def wandb_group(run_dir: Path) -> str:
    """The run's W&B group: its folder's name (what the trainer registers with run-api as wandb_group)."""
    return Path(run_dir).name


def wandb_run_id(run_dir: Path, process: str) -> str:
    """A W&B run id for one process of the run at `run_dir`: stable across restarts and resumes, distinct between
    run folders of the same name (the hash of the absolute path), and within W&B's id alphabet and length."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", Path(run_dir).name)[:32].strip("-") or "run"
    return f"{name}-{digest}-{re.sub(r'[^A-Za-z0-9_-]+', '-', process)[:16]}"


def has_credentials(environ: Mapping[str, str]) -> bool:
    """Whether W&B has a login here without asking the server: an API key or identity token in the environment,
    a key saved in W&B's settings, or a .netrc entry for its server (what `wandb login` writes)."""
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    import wandb

    # W&B's own reading of its settings files and WANDB_BASE_URL; not wandb.setup(), which starts a wandb-core
    # service that every process the launcher starts would then attach to.
    settings = wandb.Settings()
    settings.update_from_system_settings()
    settings.update_from_env_vars(dict(environ))
    if settings.api_key:
        return True
    host = urlparse(settings.base_url).hostname
    try:
        found = netrc.netrc(environ.get("NETRC")).authenticators(host or "")
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(found and found[2])


def wandb_mode(environ: Mapping[str, str], logged_in: Callable[[], bool]) -> str:
    """WANDB_MODE when the user set it; else online with a W&B login and offline without one (the run is kept
    under RUN_DIR/wandb for a later `wandb sync`)."""
    chosen = environ.get("WANDB_MODE", "").strip()
    if chosen:
        return chosen
    return "online" if logged_in() else "offline"


def process_environ(run_dir: Path, process: str, job_type: str, project: str, mode: str) -> dict[str, str]:
    """The W&B environment variables of one process of the run: where its run is kept (RUN_DIR/wandb), which
    group, job type and run id it has, whether it is online. wandb.init reads them for whatever it is not passed,
    which is how an Atropos environment's own wandb.init joins the run without the trainer's code."""
    return {
        "WANDB_MODE": mode,
        "WANDB_DIR": str(run_dir),
        "WANDB_PROJECT": project,
        "WANDB_RUN_GROUP": wandb_group(run_dir),
        "WANDB_JOB_TYPE": job_type,
        "WANDB_RUN_ID": wandb_run_id(run_dir, process),
        "WANDB_RESUME": "allow",
    }


def current_mode() -> str:
    return wandb_mode(os.environ, lambda: has_credentials(os.environ))


def describe(run_dir: Path, project: str, mode: str) -> str:
    """The launcher's line about where the run's W&B group goes."""
    where = f"W&B: group {wandb_group(run_dir)} in project {project}"
    if mode == "offline":
        return (
            f"{where}, offline (no W&B login here, or WANDB_MODE=offline) in {run_dir / 'wandb'}; upload it later "
            f"with `wandb sync {run_dir / 'wandb'}/offline-run-*`"
        )
    return f"{where}, WANDB_MODE={mode}"


def eval_numbers(row: Mapping[str, Any]) -> dict[str, float]:
    """What W&B gets of one eval.jsonl row: nothing unless it is `ok`; else its eval/* and reported/* numbers and
    eval/step."""
    if row.get("status") != "ok":
        return {}
    numbers = {
        k: float(v)
        for k, v in row.items()
        if k.startswith(("eval/", "reported/")) and isinstance(v, int | float) and not isinstance(v, bool)
    }
    return {**numbers, EVAL_STEP: float(row.get("step") or 0)}


class EvalRun:
    """The run's evaluations on W&B: the group's `eval` run, written by the launcher as each evaluation is recorded.
    Rows are plotted against eval/step (W&B's own step only counts them), so a resumed run's catch-up evaluation of
    an earlier step lands where it belongs."""

    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]):
        import wandb

        self._run = wandb.init(
            project=project,
            group=wandb_group(run_dir),
            job_type=EVALUATION,
            name=f"{wandb_group(run_dir)}-{EVALUATION}",
            id=wandb_run_id(run_dir, EVALUATION),
            dir=str(run_dir),
            mode=current_mode(),  # type: ignore[arg-type]
            config=redact(config),
            resume="allow",
            reinit="create_new",  # beside any other run of this process
            # The launcher's own output is not the evaluations', and it says where the group goes (describe).
            settings=wandb.Settings(console="off", silent=True),
        )
        # wandb.init exports its service's address for child processes to share; the launcher's (the trainer, the
        # environments, perhaps on other nodes) start their own.
        os.environ.pop(wandb.env.SERVICE, None)
        self._run.define_metric(EVAL_STEP)
        for pattern in ("eval/*", "reported/*"):
            self._run.define_metric(pattern, step_metric=EVAL_STEP)

    def log(self, row: Mapping[str, Any]) -> None:
        numbers = eval_numbers(row)
        if numbers:
            self._run.log(numbers)

    def close(self) -> None:
        self._run.finish()
