"""What an export starts from: one adapter folder of a run (a published policy version, the version a step produced,
or a checkpoint's adapter), the run's config as it was written, and the base model as a local folder. Every refusal
says what was found and what to do; nothing here writes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from trainer.export.origin import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    ExportError,
    ExportSource,
    base_model,
)
from trainer.export.tinker_source import tinker_source
from trainer.readout.runfolder import number, read_metrics
from trainer.training.checkpoints import adapter_dir


def find_source(path: Path, version: int | None = None, step: int | None = None) -> ExportSource:
    """The adapter `path` names: a run folder (its newest published version, or `version`, or the version `step`
    produced), a checkpoint folder, or one adapters/vNNNNNN folder of a run."""
    if not path.is_dir():
        raise ExportError(
            f"{path}: no such folder; give a run folder (RUN_DIR), a checkpoint or an adapter folder"
        )
    if (path / "trainer_state.pt").is_file():
        if version is not None or step is not None:
            raise ExportError(f"{path} is a checkpoint: it holds one adapter; drop --version/--step")
        return _checkpoint(path)
    if (path / "config.yaml").is_file():
        return _run_version(path, version, step)
    versioned = re.fullmatch(r"v(\d+)", path.name)
    if versioned and path.parent.name == "adapters" and (path.parent.parent / "config.yaml").is_file():
        if step is not None or (version is not None and version != int(versioned[1])):
            raise ExportError(f"{path} is version {int(versioned[1])}'s adapter; drop --version/--step")
        return _run_version(path.parent.parent, int(versioned[1]), None)
    raise ExportError(
        f"{path} is not a run folder (no config.yaml), a checkpoint (no trainer_state.pt) or a run's adapters/vN "
        "folder; give the folder `bash launch.sh` printed as the run's"
    )


def _run_config(run_dir: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ExportError(f"{run_dir / 'config.yaml'} cannot be read: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ExportError(f"{run_dir / 'config.yaml'} is not a run config (a mapping)")
    return loaded


def published_versions(run_dir: Path) -> dict[int, int]:
    """Policy version -> the step that published it, from the run's metrics (a resumed run's redone steps win)."""
    versions: dict[int, int] = {}
    for row in read_metrics(run_dir / "metrics.jsonl").rows:
        v, s = number(row, "policy_version"), number(row, "step")
        if v is not None and s is not None and v > 0:
            versions[int(v)] = int(s)
    return versions


def _run_version(run_dir: Path, version: int | None, step: int | None) -> ExportSource:
    config = _run_config(run_dir)
    if (config.get("launch") or {}).get("backend") == "tinker":
        return tinker_source(run_dir, config, version, step)
    versions = published_versions(run_dir)
    if not versions:
        raise ExportError(
            f"{run_dir} has no adapter yet: no step of its metrics.jsonl published a version above 0 (the base). "
            "Let it train a step, or export a checkpoint folder"
        )
    if step is not None:
        by_step = {s: v for v, s in versions.items()}
        if step not in by_step:
            raise ExportError(
                f"step {step} published no version in {run_dir} (steps that did: {_span(sorted(by_step))})"
            )
        version = by_step[step]
    elif version is None:
        version = max(versions)
    elif version not in versions:
        raise ExportError(
            f"version {version} was never published by {run_dir} (published: {_span(sorted(versions))}); "
            "pass one of those to --version"
        )
    folder = adapter_dir(run_dir, version)
    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise ExportError(
            f"version {version}'s adapter folder {folder} is missing or incomplete (was it deleted?)"
        )
    return ExportSource(
        adapter=folder,
        base=base_model(config),
        config=config,
        run_dir=run_dir,
        version=version,
        step=versions[version],
        label=f"version {version} (step {versions[version]})",
    )


def _checkpoint(path: Path) -> ExportSource:
    try:
        config = json.loads((path / "run_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(
            f"{path / 'run_config.json'} cannot be read ({exc}): not a checkpoint of this trainer"
        ) from exc
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise ExportError(f"{path} holds no adapter (adapter_config.json, adapter_model.safetensors)")
    named = re.fullmatch(r"step-(\d+)", path.name)
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else None
    return ExportSource(
        adapter=path,
        base=base_model(config),
        config=config,
        run_dir=run_dir,
        version=None,
        step=int(named[1]) if named else None,
        label=f"checkpoint {path.name}",
    )


def _span(values: list[int]) -> str:
    if len(values) > 6:
        return f"{values[0]}..{values[-1]} ({len(values)} in all)"
    return ", ".join(map(str, values))
