"""The one plotting path of the run reports: a panel is a PNG of one or more metrics against one x key, drawn for
each run given (the comparison report) or for one (the report in a run folder). A panel with no points still gets
its file, saying which keys it looked for; long runs are thinned to at most MAX_POINTS points per line, keeping each
stretch's lowest and highest value so a spike stays visible."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trainer.readout.runfolder import number

MAX_POINTS = 4000
MARKERS_UP_TO = 200  # points per line; more are drawn as a plain line


@dataclass(frozen=True)
class Panel:
    filename: str
    title: str
    x: str  # the row key of the x axis
    xlabel: str = ""  # default: the key
    ys: tuple[str, ...] = ()  # row keys, a line each
    ys_prefix: str | None = None  # and: every key a run has with this prefix (e.g. the fault kinds it saw)
    ys_pattern: str | None = None  # and: every key a run has that this regular expression matches whole
    right: tuple[str, ...] = ()  # row keys on a second y axis (another unit or scale), drawn dashed
    steps: bool = False  # counters: drawn as steps
    skip_empty: bool = False  # no file at all when no run has a point (eval, which few runs log)
    empty_note: str = ""  # said on a panel with no points, instead of the keys it looked for

    def keys(self, rows: list[dict[str, Any]]) -> list[str]:
        if self.ys_pattern is not None:
            return [*self.ys, *sorted(k for k in set().union(*rows) if re.fullmatch(self.ys_pattern, k))]
        if self.ys_prefix is None:
            return [*self.ys, *self.right]
        return [*self.ys, *sorted(k for k in set().union(*rows) if k.startswith(self.ys_prefix))]


class Plotted(Protocol):
    name: str
    rows: list[dict[str, Any]]


def points(rows: list[dict[str, Any]], x: str, y: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        a, b = number(r, x), number(r, y)
        if a is not None and b is not None:
            xs.append(a)
            ys.append(b)
    return thin(xs, ys)


def thin(xs: list[float], ys: list[float], limit: int = MAX_POINTS) -> tuple[list[float], list[float]]:
    """At most `limit` points: in each of limit/2 equal stretches, its lowest and highest point, in x order."""
    if len(xs) <= limit:
        return xs, ys
    buckets = limit // 2
    keep: list[int] = []
    for b in range(buckets):
        idx = range(b * len(xs) // buckets, (b + 1) * len(xs) // buckets)
        if idx:
            low, high = min(idx, key=ys.__getitem__), max(idx, key=ys.__getitem__)
            keep += sorted({low, high})
    return [xs[i] for i in keep], [ys[i] for i in keep]


def draw(runs: Sequence[Plotted], panels: Sequence[Panel], out: Path) -> tuple[list[str], list[str]]:
    """Write each panel's PNG into `out`; returns (files written, files of those that have no points and no note
    saying why)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written, empty = [], []
    for panel in panels:
        fig, ax = plt.subplots(figsize=(7, 4))
        drawn, looked_for = _lines(ax, runs, panel)
        if not drawn and panel.skip_empty:
            plt.close(fig)
            continue
        ax.set_title(panel.title)
        ax.set_xlabel(panel.xlabel or panel.x)
        ax.grid(alpha=0.3)
        if not drawn:
            what = panel.empty_note or "no data\n(" + (", ".join(looked_for) or f"{panel.ys_prefix}*") + ")"
            ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes)
            if not panel.empty_note:
                empty.append(panel.filename)
        # Fixed margins, not tight_layout: that lays every label out twice and made the report 1.5x slower.
        fig.subplots_adjust(left=0.11, right=0.88 if panel.right else 0.97, bottom=0.13, top=0.91)
        save_png(fig, out / panel.filename)
        plt.close(fig)
        written.append(panel.filename)
    return written, empty


def _lines(ax: Any, runs: Sequence[Plotted], panel: Panel) -> tuple[int, list[str]]:
    """Draw every run's lines of the panel; returns how many were drawn and the keys looked for."""
    right = ax.twinx() if panel.right else None
    drawn, looked_for = 0, set()
    for run in runs:
        keys = panel.keys(run.rows)
        looked_for.update(keys)
        for key in keys:
            xs, ys = points(run.rows, panel.x, key)
            if not xs:
                continue
            shown = key if key in panel.ys else key.removeprefix(panel.ys_prefix or "")
            label = run.name if len(keys) == 1 else shown if len(runs) == 1 else f"{run.name}: {shown}"
            style: dict[str, Any] = {"drawstyle": "steps-post"} if panel.steps else {}
            if len(xs) <= MARKERS_UP_TO and not panel.steps:
                style.update(marker="o", markersize=3)
            if key in panel.right and right is not None:
                style.update(linestyle="--", color=f"C{drawn}")
                right.plot(xs, ys, label=f"{label} (right axis)", **style)
            else:
                ax.plot(xs, ys, label=label, color=f"C{drawn}", **style)
            drawn += 1
    if len(panel.ys) == 1:
        ax.set_ylabel(panel.ys[0])
    if panel.steps:
        ax.yaxis.get_major_locator().set_params(integer=True)
    if right is not None:
        right.set_ylabel(", ".join(panel.right))
    if drawn:
        handles = [h for a in (ax, right) if a is not None for h in a.get_legend_handles_labels()[0]]
        ax.legend(handles=handles, fontsize=8)
    return drawn, sorted(looked_for)


def save_png(fig: Any, path: Path) -> None:
    """Whole files only: a report rewritten while someone views it (or cut off by a kill) never leaves half a PNG."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fig.savefig(tmp, dpi=100, format="png")
    os.replace(tmp, path)
