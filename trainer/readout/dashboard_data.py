"""What the live dashboard shows, read from disk as it is: which folders are runs and which are clients of the
Tinker-protocol service, a folder's curves from a given row on (so a page that polls gets only the rows it lacks),
and its facts (config, checkpoints and adapters, faults). Built on runfolder's tolerant readers: a half-written
last line, a missing file or a run still being written is shown as it is, never raised on.

A folder is a run when it holds metrics.jsonl whose first row is a training step, or a config.yaml, faults.json or
adapters/ (a run that has not written a step yet); a service client when its first metrics row has a "call".
Folders given are looked into two levels deep (`runs/` -> `runs/toy-...`, `runs/service/<session>_train_0`).
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rlcommon.redaction import HIDDEN, is_secret_name, redact, redact_text
from trainer.readout.plots import thin
from trainer.readout.runfolder import (
    EVENTS,
    Metrics,
    add_derived,
    checkpoint_facts,
    number,
    read_eval,
    read_metrics,
)
from trainer.readout.summary import summarize_service_client

MAX_POINTS = 2000  # per series and answer: the page draws every point it gets
# Rows held per metrics file (~10 KB each parsed, ~3 KB on disk): past it every other one is let go, and then only
# every 2nd, 4th... new one kept, so a 1 GB file costs about 100 MB, not its parsed 3-4 GB. Curves are drawn
# from at most MAX_POINTS points anyway.
MAX_ROWS = 10_000
READ_CHUNK_BYTES = 8 << 20  # a file is read this much at a time, never whole
SEARCH_DEPTH = 2
RUN_SERIES = (
    "reward/mean",
    "loss",
    "time/step_s",
    "time/wait_for_batch_s",
    "time/train_s",
    "time/publish_s",
    "policy/staleness_mean",
    "policy/staleness_max",
    "rollouts/dropped_stale",
    "optim/grad_norm",
    "perf/tokens_per_s",
)
RUN_MARKERS = ("metrics.jsonl", "config.yaml", "faults.json", "adapters")
# Config keys whose values are secrets (the publish token, API keys): shown as <hidden>.
NEWEST_SHOWN = 5  # checkpoints, adapters and saved client states listed per folder


@dataclass(frozen=True)
class Source:
    id: str  # stable while the folder exists: "<index of the root given>:<path under it>"
    kind: str  # "run" or "client"
    name: str
    path: Path


def discover(roots: list[Path]) -> dict[str, Source]:
    found: dict[str, Source] = {}
    for i, root in enumerate(roots):
        _walk(i, root, root, SEARCH_DEPTH, found)
    return found


def resolve(roots: list[Path], source_id: str) -> Source | None:
    """The source with this id, found without listing every folder (the page asks for one every 2 s); None when
    the id names no run or client folder within the depth searched under a root given."""
    index, _, rel = source_id.partition(":")
    # ASCII digits only, and few: int() refuses '²' and a 5000-digit number with an exception, not a miss.
    if not (index.isascii() and index.isdigit() and len(index) <= 6) or int(index) >= len(roots) or not rel:
        return None
    parts = Path(rel).parts
    if rel != "." and (".." in parts or Path(rel).is_absolute() or len(parts) > SEARCH_DEPTH):
        return None
    folder = roots[int(index)] / rel if rel != "." else roots[int(index)]
    try:
        kind = folder_kind(folder) if folder.is_dir() else None
    except OSError:  # a name the file system refuses (too long, ...) names no run
        return None
    if kind is None:
        return None
    return Source(source_id, kind, folder.name if rel == "." else Path(rel).as_posix(), folder)


def _walk(index: int, root: Path, folder: Path, depth: int, found: dict[str, Source]) -> None:
    kind = folder_kind(folder)
    if kind is not None:
        rel = folder.relative_to(root).as_posix()
        name = folder.name if rel == "." else rel
        found[f"{index}:{rel}"] = Source(f"{index}:{rel}", kind, name, folder)
        return
    if depth == 0:
        return
    try:
        children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:  # gone, or not readable: nothing to list there
        return
    for child in children:
        _walk(index, root, child, depth - 1, found)


def folder_kind(folder: Path) -> str | None:
    first = _first_line(folder / "metrics.jsonl")
    if first is not None:
        try:
            row = json.loads(first)
        except ValueError:
            row = None
        if isinstance(row, dict) and "call" in row:
            return "client"
        return "run"
    return "run" if any((folder / m).exists() for m in RUN_MARKERS) else None


def regular_file(path: Path) -> bool:
    """A plain file (a link to one included): a FIFO would block the reading thread, /dev/zero never end."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def _first_line(path: Path) -> str | None:
    if not regular_file(path):
        return None
    try:
        with path.open("rb") as f:
            return f.readline(1 << 16).decode("utf-8", errors="replace")
    except OSError:
        return None


@dataclass
class _Tail:
    inode: int
    size: int
    mtime_ns: int
    offset: int  # bytes read up to the end of the last whole line
    rows: list[dict[str, Any]]
    bad_lines: list[int]  # numbers of whole lines that are not JSON objects
    lines: int  # whole lines read
    metrics: Metrics
    stride: int = 1  # every stride-th line (by its number) is kept in rows
    newest: dict[str, Any] | None = None  # the newest row read, kept or not


class Reader:
    """A metrics.jsonl read as runfolder.read_metrics reads it, but only its new whole lines each time it grew:
    a poll of a 100k-step run being written does not parse 100k lines again. The derived values are worked out
    again over all rows when lines were added (runfolder.add_derived: ~0.7 s per 100k rows on 2 cores)."""

    def __init__(self) -> None:
        self._tails: dict[Path, _Tail] = {}
        # The server answers polls on several threads at once; a tail is read and extended by one at a time.
        self._lock = threading.Lock()

    def metrics(self, path: Path) -> tuple[Metrics, str]:
        """The file's metrics and a key that changes when the file is replaced (a poller then starts over)."""
        with self._lock:
            return self._metrics(path)

    def _metrics(self, path: Path) -> tuple[Metrics, str]:
        try:
            st = os.stat(path)
        except OSError:
            self._tails.pop(path, None)
            return read_metrics(path), ""
        if not stat.S_ISREG(st.st_mode):
            self._tails.pop(path, None)
            return Metrics([], [f"{path} is not a regular file: not read"]), ""
        tail = self._tails.get(path)
        if tail is not None and (tail.inode, tail.size, tail.mtime_ns) == (
            st.st_ino,
            st.st_size,
            st.st_mtime_ns,
        ):
            return tail.metrics, _key(st, tail)
        if tail is None or tail.inode != st.st_ino or st.st_size < tail.offset:  # new, replaced or cut short
            tail = _Tail(st.st_ino, 0, 0, 0, [], [], 0, Metrics([]))
        try:
            partial = self._read_lines(path, tail, st.st_size)
        except OSError as exc:
            return Metrics([], [f"cannot read {path}: {exc}"]), _key(st, tail)
        tail.size, tail.mtime_ns = st.st_size, st.st_mtime_ns
        problems, rows = [], list(tail.rows)
        if tail.newest is not None and (not rows or rows[-1] is not tail.newest):
            rows.append(tail.newest)  # the page's latest figures are the file's, kept or not
        last = _json_object(partial.decode("utf-8", errors="replace")) if partial.strip() else None
        if (
            last is not None
        ):  # whole but without its newline (a writer that died after the row): read_metrics reads it
            rows.append(last)
        elif partial.strip():
            line = tail.lines + 1
            problems.append(f"{path}: the last line ({line}) is half-written (the run is still writing it?)")
        if tail.stride > 1:
            problems.append(
                f"{path}: {tail.lines} rows; 1 in {tail.stride} is shown (the dashboard holds {MAX_ROWS} "
                "per file), and the newest"
            )
        if tail.bad_lines:
            shown = ", ".join(map(str, tail.bad_lines[:5])) + (" ..." if len(tail.bad_lines) > 5 else "")
            problems.append(
                f"{path}: {len(tail.bad_lines)} line(s) are not JSON objects and were skipped (line {shown})"
            )
        tail.metrics = Metrics(rows, problems)
        add_derived(
            tail.metrics
        )  # over all rows: a resume's restarted clock and counters span the whole file
        self._tails[path] = tail
        return tail.metrics, _key(st, tail)

    @staticmethod
    def _read_lines(path: Path, tail: _Tail, size: int) -> bytes:
        """Parse the whole lines written since tail.offset, a chunk at a time; returns the unfinished last one."""
        carry = b""
        with path.open("rb") as f:
            f.seek(tail.offset)
            remaining = size - tail.offset
            while remaining > 0:
                chunk = f.read(min(READ_CHUNK_BYTES, remaining))
                if not chunk:
                    break
                remaining -= len(chunk)
                data = carry + chunk
                cut = data.rfind(b"\n") + 1
                if cut:
                    Reader._parse(tail, data[:cut].decode("utf-8", errors="replace"))
                    tail.offset += cut
                carry = data[cut:]
        return carry

    @staticmethod
    def _parse(tail: _Tail, text: str) -> None:
        for line in text.split("\n")[:-1]:
            tail.lines += 1
            if not line.strip():
                continue
            row = _json_object(line)
            if row is None:
                tail.bad_lines.append(tail.lines)
                continue
            tail.newest = row
            if tail.lines % tail.stride:
                continue
            tail.rows.append(row)
            if len(tail.rows) > MAX_ROWS:
                tail.rows = tail.rows[1::2]  # the even line numbers of the old stride: every 2*stride-th line
                tail.stride *= 2


def _key(st: os.stat_result, tail: _Tail) -> str:
    """Changes when the file is replaced, and when its rows were thinned (a poller then starts over)."""
    return f"{st.st_dev}-{st.st_ino}-{tail.stride}"


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def series(
    source: Source, reader: Reader, since: int = 0, eval_since: int = 0, key: str = ""
) -> dict[str, Any]:
    """The folder's curves from metrics row `since` on, and its held-out eval curves from eval row `eval_since`
    on, each thinned to MAX_POINTS. A poller replaces what it holds when the answer's `since` (or `eval_since`) is
    0 and appends otherwise. Everything is sent from row 0 when the poller's `key` is not the file's any more or
    the file now has fewer rows than the poller has seen (a resume rewrote it)."""
    metrics, file_key = reader.metrics(source.path / "metrics.jsonl")
    rows = metrics.rows
    if since > len(rows) or (key != "" and key != file_key):
        since, eval_since = 0, 0
    evals: list[dict[str, Any]] = []
    problems = list(metrics.problems)
    eval_lines: dict[str, tuple[list[float], list[float]]] = {}
    if source.kind == "client":
        lines = _client_series(rows, since)
    else:
        # add_derived puts these event keys on every row, so the last row names them all.
        keys = [*RUN_SERIES, *sorted(k for k in (rows[-1] if rows else {}) if k.startswith(EVENTS))]
        lines = {k: _points(rows, since, "step", k) for k in keys}
        evals, eval_problems = read_eval(source.path, rows)
        problems += eval_problems
        eval_since = 0 if eval_since > len(evals) else eval_since
        eval_keys = sorted({k for r in evals for k in r if k.startswith(("eval/reward/", "eval/pass@"))})
        eval_lines = {k: _points(evals, eval_since, "step", k) for k in eval_keys}
    return {
        "id": source.id,
        "kind": source.kind,
        "key": file_key,
        "since": since,
        "rows": len(rows),
        "eval_since": eval_since,
        "eval_rows": len(evals),
        "series": {k: v for k, v in lines.items() if v[0]},
        "eval_series": {k: v for k, v in eval_lines.items() if v[0]},
        "problems": problems,
    }


def _points(rows: list[dict[str, Any]], since: int, x: str, y: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for i, r in enumerate(rows[since:], start=since):
        value = number(r, y)
        if value is not None:
            at = number(r, x)
            xs.append(at if at is not None else float(i))  # a row without a step: its place in the file
            ys.append(value)
    return thin(xs, ys, MAX_POINTS)


def _client_series(rows: list[dict[str, Any]], since: int) -> dict[str, tuple[list[float], list[float]]]:
    """A service client's loss per forward_backward call and grad norm per optim_step (x: the call's number
    among its kind, counted from the file's start), and seconds per call of each kind (x: the row's number)."""
    counts: dict[str, int] = {}
    loss: tuple[list[float], list[float]] = ([], [])
    grad: tuple[list[float], list[float]] = ([], [])
    seconds: dict[str, tuple[list[float], list[float]]] = {}
    for i, r in enumerate(rows):
        call = str(r.get("call"))
        counts[call] = counts.get(call, 0) + 1
        if i < since:
            continue
        n = float(counts[call])
        if call == "forward_backward" and (v := number(r, "loss")) is not None:
            loss[0].append(n)
            loss[1].append(v)
        if call == "optim_step" and (v := number(r, "grad_norm")) is not None:
            grad[0].append(n)
            grad[1].append(v)
        if (v := number(r, "seconds")) is not None:
            xs, ys = seconds.setdefault(f"seconds/{call}", ([], []))
            xs.append(float(i))
            ys.append(v)
    out = {"loss": loss, "grad_norm": grad, **dict(sorted(seconds.items()))}
    return {k: thin(xs, ys, MAX_POINTS) for k, (xs, ys) in out.items()}


def facts(source: Source, reader: Reader) -> dict[str, Any]:
    """What the page shows beside the curves: the config (secrets hidden), newest checkpoints and adapters or
    saved states, faults and restarts, the latest row's figures, and what could not be read."""
    metrics, _ = reader.metrics(source.path / "metrics.jsonl")
    out: dict[str, Any] = {
        "id": source.id,
        "kind": source.kind,
        "name": source.name,
        "path": str(source.path),
    }
    out["rows"] = len(metrics.rows)
    out["updated_unix"] = _mtime(source.path / "metrics.jsonl")
    problems = list(metrics.problems)
    if source.kind == "client":
        out["summary"] = summarize_service_client(metrics.rows)
        out["saved"] = {k: _newest(source.path / k) for k in ("weights", "sampler_weights")}
    else:
        out["config"], config_problem = config_text(source.path / "config.yaml")
        problems += [config_problem] if config_problem else []
        out["checkpoints"] = {
            **checkpoint_facts(source.path),
            "newest_checkpoints": _newest(source.path / "checkpoints", prefix="step-"),
            "newest_adapters": _newest(source.path / "adapters", prefix="v"),
        }
        out["faults"], faults_problem = _faults(source.path / "faults.json")
        problems += [faults_problem] if faults_problem else []
        out["fault_totals"] = metrics.fault_totals
        out["segments"] = metrics.segments
        last = metrics.rows[-1] if metrics.rows else {}
        out["latest"] = {k: last[k] for k in ("step", "policy_version", *RUN_SERIES) if k in last}
    out["problems"] = problems
    return out


def config_text(path: Path) -> tuple[str | None, str | None]:
    """The YAML with every secret hidden (rlcommon/redaction.py: keys, flags in argument lists, URL credentials);
    (None, why) when it cannot be read. A file that does not parse (half-written, hand-edited) is shown line by
    line, each line's secret hidden."""
    if path.exists() and not regular_file(path):
        return None, f"{path} is not a regular file: not read"
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return None, f"no {path.name} in {path.parent}"
    except OSError as exc:
        return None, f"{path} cannot be read: {exc}"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    if isinstance(data, dict):
        return yaml.safe_dump(redact(data), sort_keys=False).rstrip("\n"), None
    return "\n".join(_hide_secret(line) for line in text.splitlines()), None


def _hide_secret(line: str) -> str:
    match = re.match(r"^(\s*-?\s*)([^:#\s][^:#]*):(\s*)(\S.*)?$", line)
    if match and is_secret_name(match.group(2)) and match.group(4) not in (None, "null", "~", "''", '""'):
        return f"{match.group(1)}{match.group(2)}:{match.group(3) or ' '}{HIDDEN}"
    return redact_text(line)


def _faults(path: Path) -> tuple[dict[str, Any], str | None]:
    if path.exists() and not regular_file(path):
        return {}, f"{path} is not a regular file: not read"
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return {}, None  # no restart so far
    except (OSError, ValueError) as exc:
        return {}, f"{path} cannot be read: {exc}"
    return (value, None) if isinstance(value, dict) else ({}, f"{path} is not a JSON object")


def _newest(folder: Path, prefix: str = "") -> list[dict[str, Any]]:
    try:
        entries = [
            (p.name, p.stat().st_mtime)
            for p in folder.iterdir()
            if p.is_dir() and p.name.startswith(prefix) and not p.name.startswith(".")
        ]
    except OSError:  # not there (yet), or removed while listed
        return []
    entries.sort(key=lambda e: (e[1], e[0]), reverse=True)
    return [{"name": n, "mtime_unix": t} for n, t in entries[:NEWEST_SHOWN]]


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def listing(sources: dict[str, Source]) -> list[dict[str, Any]]:
    return [
        {"id": s.id, "kind": s.kind, "name": s.name, "path": str(s.path), "updated_unix": _updated(s.path)}
        for s in sources.values()
    ]


def _updated(folder: Path) -> float | None:
    times = [t for m in RUN_MARKERS if (t := _mtime(folder / m)) is not None]
    return max(times, default=None)
