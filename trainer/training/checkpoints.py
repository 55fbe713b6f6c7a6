"""The run folder's durable state and its repair after a crash.

    checkpoints/step-NNNNNN/        adapter, optimizer and RNG state (written by the backend, atomically)
    checkpoints/step-NNNNNN.loop.json   the loop's step and policy version at that checkpoint
    checkpoints/latest              names the newest checkpoint whose folder and loop state are both complete
    adapters/vNNNNNN/               one folder per published policy version
    metrics.jsonl                   one row per step

Every file here is written atomically (temp file, fsync, rename, fsync of the folder), and `latest` moves last, so
a crash at any point leaves either the old or the new checkpoint as `latest`. What a crash can leave behind (temp
folders, a checkpoint newer than `latest`, adapters of steps that were never checkpointed) is swept or set aside by
`repair` when the trainer starts; nothing is deleted that a person might want to look at, except temp folders.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.training.faults import DiskFull

log = logging.getLogger("trainer.training.checkpoints")
LATEST = "latest"
STEP_DIR = re.compile(r"^step-(\d+)$")
VERSION_DIR = re.compile(r"^v(\d+)$")
TEMP = re.compile(r"^\..*\.tmp-\d+$")  # `.NAME.tmp-PID`: a write that was cut off


@dataclass
class LoopState:
    step: int = 0  # batches consumed
    version: int = 0  # latest published policy version (= optimizer updates made)


FAILPOINT_ENV = "RL_FAILPOINTS"


def failpoint(name: str) -> None:
    """For the fault suite: with RL_FAILPOINTS="NAME:MARKER_FILE[,...]" in the environment, the process SIGKILLs
    itself when it reaches NAME, once (MARKER_FILE records that it fired, so the restarted process goes on). The
    instants a kill from outside cannot hit: inside an adapter save, between a checkpoint's rename and `latest`."""
    for spec in os.environ.get(FAILPOINT_ENV, "").split(","):
        point, _, marker = spec.partition(":")
        if point == name and marker and not os.path.exists(marker):
            Path(marker).write_text(f"{name} fired in pid {os.getpid()}\n")
            os.kill(os.getpid(), signal.SIGKILL)


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def adapter_dir(run_dir: Path, version: int) -> Path:
    return run_dir / "adapters" / f"v{version:06d}"


def fsync_path(path: Path) -> None:
    """Flush a file, or a folder's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_loop_state(run_dir: Path, state: LoopState) -> None:
    """The loop state beside checkpoint `step-N` (which must already be complete), then `latest` pointing at it."""
    ckpts = run_dir / "checkpoints"
    name = checkpoint_name(state.step)
    write_atomic(ckpts / f"{name}.loop.json", json.dumps({"step": state.step, "version": state.version}))
    write_atomic(ckpts / LATEST, name)


def _loop_state(ckpts: Path, name: str) -> LoopState | None:
    try:
        data = json.loads((ckpts / f"{name}.loop.json").read_text())
        return LoopState(step=int(data["step"]), version=int(data["version"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_latest(run_dir: Path) -> tuple[Path, LoopState] | None:
    """The checkpoint `latest` names, if it and its loop state are there; reads only."""
    ckpts = run_dir / "checkpoints"
    try:
        name = (ckpts / LATEST).read_text().strip()
    except OSError:
        return None
    state = _loop_state(ckpts, name) if STEP_DIR.match(name) else None
    if state is None or not (ckpts / name).is_dir():
        return None
    return ckpts / name, state


@dataclass
class Repair:
    """What `repair` found and did, for the log and the tests."""

    checkpoint: Path | None = None
    state: LoopState | None = None
    swept: list[str] = field(default_factory=list)  # temp folders and files removed
    set_aside: list[str] = field(default_factory=list)  # moved to a discarded-* folder
    metrics_rows_dropped: int = 0


def repair(run_dir: Path) -> Repair:
    """Make the run folder consistent with its newest complete checkpoint (or with a fresh start when there is
    none): sweep temp writes; set aside checkpoints newer than `latest` or without loop state, and adapters and
    metrics rows of steps after it. Returns the checkpoint to load, if any."""
    out = Repair()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for folder in (run_dir / "checkpoints", run_dir / "adapters", run_dir):
        out.swept += _sweep_temp(folder)
    found = read_latest(run_dir)
    if found is None and (run_dir / "checkpoints" / LATEST).exists():
        log.error("checkpoints/latest names no complete checkpoint; starting from the newest complete one")
        found = _newest_complete(run_dir / "checkpoints")
    out.checkpoint, out.state = found if found else (None, None)
    state = out.state or LoopState()
    out.set_aside += _set_aside_checkpoints(run_dir / "checkpoints", state.step, stamp)
    out.set_aside += _set_aside_adapters(run_dir / "adapters", state.version, stamp)
    out.metrics_rows_dropped = truncate_metrics(run_dir / "metrics.jsonl", state.step)
    return out


def _sweep_temp(folder: Path) -> list[str]:
    swept = []
    for path in folder.glob(".*.tmp-*") if folder.is_dir() else []:
        if TEMP.match(path.name):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            swept.append(str(path))
    return swept


def _newest_complete(ckpts: Path) -> tuple[Path, LoopState] | None:
    best: tuple[Path, LoopState] | None = None
    for path in ckpts.glob("step-*"):
        state = _loop_state(ckpts, path.name) if path.is_dir() and STEP_DIR.match(path.name) else None
        if state is not None and (best is None or state.step > best[1].step):
            best = (path, state)
    return best


def _set_aside_checkpoints(ckpts: Path, step: int, stamp: str) -> list[str]:
    """Checkpoint folders after `step`, or without loop state, and loop states without a folder."""
    moving: list[Path] = []
    for path in sorted(ckpts.glob("step-*")) if ckpts.is_dir() else []:
        name = path.name.removesuffix(".loop.json")
        match = STEP_DIR.match(name)
        if match is None:
            continue
        complete = (ckpts / name).is_dir() and _loop_state(ckpts, name) is not None
        if int(match.group(1)) > step or not complete:
            moving.append(path)
    return _move_aside(moving, ckpts / f"discarded-{stamp}")


def _set_aside_adapters(adapters: Path, version: int, stamp: str) -> list[str]:
    """Adapters published after the checkpoint belong to the abandoned timeline; the resumed run writes those
    versions afresh."""
    newer = [
        p
        for p in (adapters.iterdir() if adapters.is_dir() else [])
        if (m := VERSION_DIR.match(p.name)) and int(m.group(1)) > version
    ]
    return _move_aside(newer, adapters / f"discarded-{stamp}")


def _move_aside(paths: list[Path], aside: Path) -> list[str]:
    if not paths:
        return []
    aside.mkdir(parents=True, exist_ok=True)
    for path in paths:
        path.rename(aside / path.name)
    log.warning("set aside %d entries in %s: %s", len(paths), aside, ", ".join(p.name for p in paths))
    return [str(aside / p.name) for p in paths]


def truncate_metrics(path: Path, last_step: int) -> int:
    """Drop rows of steps after the checkpoint (the resumed run does them again); returns how many."""
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if _row_step(line) <= last_step]
    if len(kept) != len(lines):
        write_atomic(path, "".join(row + "\n" for row in kept))
    return len(lines) - len(kept)


def _row_step(line: str) -> float:
    try:
        row: Any = json.loads(line)
        return float(row["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")  # a row cut off by a crash (or a full disk): drop it


FULL_BELOW_BYTES = 1 << 20  # a write that failed with less free than this failed for want of space


def looks_like_full_disk(exc: BaseException, run_dir: Path) -> bool:
    """safetensors and torch.save report ENOSPC in their own exception types; the free space tells."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    return "no space left" in str(exc).lower() or disk_free(run_dir) < FULL_BELOW_BYTES


@contextlib.contextmanager
def full_disk_is_one_error(run_dir: Path) -> Iterator[None]:
    """Any write of the run failing for want of space becomes one DiskFull naming the folder, the bytes free and
    the checkpoint a resume will load."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as exc:
        if not looks_like_full_disk(exc, run_dir):
            raise
        previous = read_latest(run_dir)
        raise DiskFull(
            f"disk full under {run_dir} ({disk_free(run_dir)} bytes free): {exc}. The last good checkpoint is "
            f"{previous[0] if previous else 'none (the run restarts from step 0)'}; free some space (old runs, "
            f"adapters/) and continue with: bash launch.sh --resume {run_dir}"
        ) from exc


def disk_free(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
