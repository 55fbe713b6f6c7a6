"""Reading a run folder as it is, not as it should be: a run still being written (its last metrics line half
written), one cut off by a crash, a folder without metrics yet, rows that lack keys or hold None. What cannot be
read is skipped and said in words (`Metrics.problems`); nothing here raises on a folder's contents.

Derived per-row values the readers share (added to each row under the `derived/` prefix):
- `derived/elapsed_s`: wall time summed over the run's segments. The trainer's `wall_s` starts again at 0 when it
  is restarted or the run is resumed; the gaps between segments are left out.
- `derived/events/<fault kind>`: each `faults/*` counter that ever rose, made cumulative over the whole run (the
  launcher's counts start again at 0 in a resumed run: a counter that goes down counts afresh from 0), and
  `derived/events/trainer_starts` (the segments so far) when there was more than one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ELAPSED = "derived/elapsed_s"
FAULTS = "faults/"
EVENTS = "derived/events/"  # cumulative fault counts, and the trainer's starts


@dataclass
class Metrics:
    rows: list[dict[str, Any]]
    problems: list[str] = field(default_factory=list)  # what was skipped, in words
    segments: int = 0  # stretches of one trainer process (1 + resumes + trainer restarts)
    fault_totals: dict[str, float] = field(
        default_factory=dict
    )  # fault kind -> count over the run, when not 0


def number(row: dict[str, Any], key: str) -> float | None:
    """The row's value as a finite float; None when missing, None in the row, not a number, NaN or infinite."""
    value = row.get(key)
    # Exact types: JSON gives only these, and True/False (a bool is an int) are not numbers of a metric.
    if type(value) is float:
        return value if math.isfinite(value) else None
    return float(value) if type(value) is int else None


def numbers(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [v for r in rows if (v := number(r, key)) is not None]


def read_metrics(path: Path) -> Metrics:
    """The rows of a metrics.jsonl, with the derived values added; a missing file gives no rows and one problem."""
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return Metrics([], [f"no {path.name} in {path.parent} (no step written yet, or not a run folder)"])
    except OSError as exc:
        return Metrics([], [f"cannot read {path}: {exc}"])
    rows: list[dict[str, Any]] = []
    bad: list[int] = []
    lines = text.split("\n")
    for number_, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad.append(number_)
    problems = []
    # The writer appends whole lines: a last line without its newline is one being written (or cut off by a crash).
    if bad and bad[-1] == len(lines) and not text.endswith("\n"):
        problems.append(f"{path}: the last line ({bad.pop()}) is half-written (the run is still writing it?)")
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else "")
        problems.append(f"{path}: {len(bad)} line(s) are not JSON objects and were skipped (line {shown})")
    metrics = Metrics(rows, problems)
    add_derived(metrics)
    return metrics


def add_derived(metrics: Metrics) -> None:
    offset, last_wall = 0.0, None
    counters: dict[str, float] = {}
    totals: dict[str, float] = {}
    per_row: list[dict[str, float]] = []
    metrics.segments = 1 if metrics.rows else 0
    for row in metrics.rows:
        wall = number(row, "wall_s")
        if wall is not None:
            if last_wall is not None and wall < last_wall:  # a new trainer process: its clock starts at 0
                offset += last_wall
                metrics.segments += 1
            last_wall = wall
            row[ELAPSED] = offset + wall
        for key in [k for k in row if k.startswith(FAULTS)]:
            if (value := number(row, key)) is None:
                continue
            kind = key.removeprefix(FAULTS)
            before = counters.get(kind, 0.0)
            totals[kind] = totals.get(kind, 0.0) + (value - before if value >= before else value)
            counters[kind] = value
        per_row.append({**totals, "trainer_starts": float(metrics.segments)})
    # Only what happened is drawn: kinds whose count rose, and the trainer's starts when there was more than one.
    shown = {k for k, total in totals.items() if total > 0} | (
        {"trainer_starts"} if metrics.segments > 1 else set()
    )
    for row, counts in zip(metrics.rows, per_row, strict=True):
        row.update({EVENTS + k: v for k, v in counts.items() if k in shown})
    metrics.fault_totals = {k: totals[k] for k in sorted(shown - {"trainer_starts"})}


def checkpoint_facts(run_dir: Path) -> dict[str, Any]:
    """Where the run's checkpoints and adapters are, which checkpoint a resume would load, how many adapters."""
    ckpts, adapters = run_dir / "checkpoints", run_dir / "adapters"
    try:
        latest = (ckpts / "latest").read_text().strip() or None
    except OSError:
        latest = None
    try:
        versions = sorted(p.name for p in adapters.iterdir() if p.is_dir() and p.name.startswith("v"))
    except OSError:
        versions = []
    return {
        "checkpoints": str(ckpts) if ckpts.is_dir() else None,
        "latest_checkpoint": latest if latest and (ckpts / latest).is_dir() else None,
        "adapters": str(adapters) if adapters.is_dir() else None,
        "adapter_versions": len(versions),
        "newest_adapter": versions[-1] if versions else None,
    }


def read_eval(run_dir: Path, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """RUN_DIR/eval.jsonl's rows (the held-out evaluations), each placed on the run's wall time: `derived/elapsed_s`
    of the training row written just before it, plus the seconds since (0 before the first). Unreadable lines are
    skipped and said."""
    path = run_dir / "eval.jsonl"
    evals, problems = [], []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return [], []
    except OSError as exc:
        return [], [f"{path} cannot be read: {exc}"]
    for n, text in enumerate(lines, 1):
        try:
            row = json.loads(text)
        except ValueError:
            problems.append(f"{path} line {n} is not JSON; skipped")
            continue
        if isinstance(row, dict):
            evals.append(row)
    clock = [
        (t, e)
        for r in rows
        if (t := number(r, "unix_time")) is not None and (e := number(r, ELAPSED)) is not None
    ]
    for row in evals:
        at = number(row, "unix_time")
        before = [(t, e) for t, e in clock if at is not None and t <= at]
        if at is not None:
            row[ELAPSED] = before[-1][1] + at - before[-1][0] if before else 0.0
    return evals, problems
