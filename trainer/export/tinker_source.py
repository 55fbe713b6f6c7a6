"""The adapter of a `--backend tinker` run, taken off Tinker: its weights never were in the run folder. A run's
checkpoint records the Tinker state it saved (checkpoints/step-N/tinker_state.json); the export opens a training
client on that state, asks Tinker for the weights in the external (PEFT) format (`save_weights_external`), and
downloads the files from the signed URLs `get_external_weights_urls` answers, into RUN_DIR/tinker_exports/step-N
(kept: a second export reads it again). Hosted Tinker and `bash launch.sh service` alike (TINKER_BASE_URL).

The policy versions a Tinker run published are sampler weights, which Tinker does not hand out: a Tinker run exports
its checkpoints (the newest by default, or --step N of one)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import httpx

from trainer.backends.tinker import STATE_FILE  # what the backend writes into each checkpoint
from trainer.export.origin import ADAPTER_CONFIG, ADAPTER_WEIGHTS, ExportError, ExportSource, base_model

DOWNLOADS = "tinker_exports"
TIMEOUT_S = 300.0


def tinker_checkpoints(run_dir: Path) -> dict[int, Path]:
    """The run's complete Tinker checkpoints by step (the folder name's number)."""
    found = {}
    for folder in (run_dir / "checkpoints").glob("step-*"):
        named = re.fullmatch(r"step-(\d+)", folder.name)
        if named and (folder / STATE_FILE).is_file():
            found[int(named[1])] = folder
    return found


def tinker_source(
    run_dir: Path, config: dict[str, Any], version: int | None, step: int | None
) -> ExportSource:
    if version is not None:
        raise ExportError(
            f"{run_dir} trained on Tinker: its published versions are sampler weights, which Tinker does not hand "
            "out; export a checkpoint instead (--step N of one, or no option for the newest)"
        )
    checkpoints = tinker_checkpoints(run_dir)
    if not checkpoints:
        raise ExportError(
            f"{run_dir} trained on Tinker and saved no checkpoint yet (checkpoints/step-N/{STATE_FILE}); the "
            "weights are exported from a checkpoint's Tinker state. Let it reach trainer.checkpoint_every"
        )
    if step is None:
        step = max(checkpoints)
    elif step not in checkpoints:
        raise ExportError(f"no Tinker checkpoint of step {step} in {run_dir} (steps: {sorted(checkpoints)})")
    state = json.loads((checkpoints[step] / STATE_FILE).read_text())["state_path"]
    folder = run_dir / DOWNLOADS / f"step-{step:06d}"
    if not ((folder / ADAPTER_CONFIG).is_file() and (folder / ADAPTER_WEIGHTS).is_file()):
        # A fresh name each try: an export that failed after Tinker saved must not collide with its own leftover.
        download_external_weights(state, f"export-step-{step:06d}-{int(time.time())}", folder)
    return ExportSource(
        adapter=folder,
        base=base_model(config),
        config=config,
        run_dir=run_dir,
        version=None,
        step=step,
        label=f"Tinker checkpoint step-{step:06d} ({state})",
    )


def download_external_weights(state_path: str, name: str, folder: Path) -> None:
    """Tinker state -> a training client -> its weights saved external -> each file downloaded into `folder`
    (written whole or not at all)."""
    try:
        import tinker
    except ImportError as exc:
        raise ExportError("exporting a Tinker run needs the tinker SDK (pip install -e '.[tinker]')") from exc
    if not os.environ.get("TINKER_API_KEY"):
        raise ExportError(
            "exporting a Tinker run downloads from Tinker: set TINKER_API_KEY (and TINKER_BASE_URL)"
        )
    try:
        service = tinker.ServiceClient()
        client = service.create_training_client_from_state(state_path).result(timeout=TIMEOUT_S)
        saved = client.save_weights_external(name).result(timeout=TIMEOUT_S)
        urls = service.create_rest_client().get_external_weights_urls(saved.path).result(timeout=TIMEOUT_S)
    except (tinker.TinkerError, TimeoutError) as exc:
        where = os.environ.get("TINKER_BASE_URL", "the hosted service")
        raise ExportError(f"Tinker ({where}) did not hand out {state_path}'s weights: {exc}") from exc
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    with httpx.Client(timeout=TIMEOUT_S, follow_redirects=True) as http:
        for rel, url in urls.urls.items():
            target = (partial / rel).resolve()
            if not target.is_relative_to(partial.resolve()):
                raise ExportError(f"Tinker named a file outside the checkpoint: {rel!r}")
            target.parent.mkdir(parents=True, exist_ok=True)
            got = http.get(url)
            if got.status_code != 200:
                raise ExportError(f"downloading {rel} of {saved.path} failed: HTTP {got.status_code}")
            target.write_bytes(got.content)
    if not (partial / ADAPTER_CONFIG).is_file() or not (partial / ADAPTER_WEIGHTS).is_file():
        raise ExportError(f"{saved.path} holds no PEFT adapter ({sorted(urls.urls)})")
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
