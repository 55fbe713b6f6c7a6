"""Side-by-side report of two or more run folders: a markdown table and PNG plots of the seed's comparison —
time per step, sampling and training tokens, estimated cost, mean |trainer - sampler| logprob, reward per step,
reward over wall clock.

    python -m trainer report runs/toy-local runs/toy-tinker --out reports/toy

Cost uses each run's `pricing:` section: Tinker runs pay per token (sampling and training), local runs pay
GPU-hours of wall time. Prices default to 0; set them in the config to get dollars.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

PLOTS = [
    ("reward_per_step.png", "step", "reward/mean", "reward per step"),
    ("reward_over_wall_clock.png", "wall_s", "reward/mean", "reward over wall clock (s)"),
    ("step_time.png", "step", "time/step_s", "time per step (s)"),
    ("logprob_diff.png", "step", "importance/logprob_diff_mean", "mean |trainer - sampler| logprob"),
]


@dataclass
class Run:
    name: str
    config: dict[str, Any]
    rows: list[dict[str, Any]]


def load_run(folder: Path) -> Run:
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{folder} has no metrics.jsonl: pass run folders made by launch.sh")
    config = (
        yaml.safe_load((folder / "config.yaml").read_text()) if (folder / "config.yaml").is_file() else {}
    )
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    return Run(folder.name, config or {}, rows)


def _values(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) is not None]


def estimate_cost_usd(run: Run) -> float:
    pricing = run.config.get("pricing", {})
    if run.config.get("launch", {}).get("backend") == "tinker":
        sampled = sum(_values(run.rows, "tokens/sampled"))
        trained = sum(_values(run.rows, "tokens/trained"))
        return (
            sampled * pricing.get("tinker_sample_usd_per_mtok", 0.0)
            + trained * pricing.get("tinker_train_usd_per_mtok", 0.0)
        ) / 1e6
    wall_s = run.rows[-1]["wall_s"] if run.rows else 0.0
    return float(wall_s) / 3600 * pricing.get("local_gpu_usd_per_hour", 0.0)


def summarize_run(run: Run) -> dict[str, Any]:
    rewards = _values(run.rows, "reward/mean")
    diffs = _values(run.rows, "importance/logprob_diff_mean")
    reached = next((r["wall_s"] for r in run.rows if (r.get("reward/mean") or 0) >= 0.8), None)
    return {
        "run": run.name,
        "backend": run.config.get("launch", {}).get("backend", "local"),
        "model": run.config.get("model", {}).get("path", "?"),
        "steps": len(run.rows),
        "step_s_median": statistics.median(_values(run.rows, "time/step_s")) if run.rows else None,
        "tokens_sampled": sum(_values(run.rows, "tokens/sampled")),
        "tokens_trained": sum(_values(run.rows, "tokens/trained")),
        "cost_usd": estimate_cost_usd(run),
        "logprob_diff_mean": statistics.fmean(diffs) if diffs else None,
        "reward_first3": statistics.fmean(rewards[:3]) if rewards else None,
        "reward_last3": statistics.fmean(rewards[-3:]) if rewards else None,
        "wall_s_to_reward_0.8": reached,
        "wall_s": run.rows[-1]["wall_s"] if run.rows else None,
    }


def markdown_table(summaries: list[dict[str, Any]]) -> str:
    columns = list(summaries[0])

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(s[c]) for c in columns) + " |" for s in summaries]
    return "\n".join(lines)


def plot(runs: list[Run], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for filename, x_key, y_key, title in PLOTS:
        fig, ax = plt.subplots(figsize=(7, 4))
        for run in runs:
            pts = [
                (r[x_key], r[y_key])
                for r in run.rows
                if r.get(x_key) is not None and r.get(y_key) is not None
            ]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", markersize=3, label=run.name)
        ax.set_title(title)
        ax.set_xlabel(x_key)
        ax.set_ylabel(y_key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / filename, dpi=100)
        plt.close(fig)
        written.append(filename)
    return written


def write_report(folders: list[Path], out: Path) -> Path:
    runs = [load_run(f) for f in folders]
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarize_run(r) for r in runs]
    images = plot(runs, out)
    text = ["# Run comparison", "", markdown_table(summaries), ""]
    text += [f"![{name}]({name})" for name in images]
    (out / "summary.json").write_text(json.dumps(summaries, indent=2))
    report = out / "report.md"
    report.write_text("\n".join(text) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m trainer report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", nargs="+", help="run folders (each with metrics.jsonl and config.yaml)")
    p.add_argument("--out", required=True, help="folder for report.md, summary.json and the PNGs")
    args = p.parse_args(argv)
    try:
        report = write_report([Path(r) for r in args.runs], Path(args.out))
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
