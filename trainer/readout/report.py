"""Reports on run folders: PNG plots, a markdown page and summary.json.

    python -m trainer report RUN_DIR                                  # one run: written into RUN_DIR/report/
    python -m trainer report runs/toy-local runs/toy-tinker --out reports/toy    # several runs side by side

One run gets its own report (launch.sh writes it into RUN_DIR/report/ when a run ends, stops or fails): reward per
step and over wall time, loss, grad norm, trainer/sampler mismatch, staleness and stale drops, the step-time split,
trained tokens/s, restarts and faults over wall time, and report.md with steps done of planned, final and best
reward, wall time, restarts and where the checkpoints are. With --out, one run's report goes there instead.

Several runs get the comparison: a table (backend, model, steps, median step time, tokens, estimated cost, logprob
mismatch, reward at start and end, wall time to reward 0.8) and plots of reward per step and over wall clock, time
per step and mean |trainer - sampler| logprob. Cost uses each run's `pricing:` section: Tinker runs pay per token
(sampling and training), local runs pay GPU-hours of wall time. Prices default to 0; set them to get dollars.

A run still being written, a half-written last line, a missing metrics.jsonl or rows without some keys are reported
on as they are (report.md lists what could not be read); a folder that does not exist is an error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from trainer.readout.config_diff import config_differences
from trainer.readout.plots import Panel, draw
from trainer.readout.runfolder import (
    ELAPSED,
    EVENTS,
    checkpoint_facts,
    number,
    numbers,
    read_eval,
    read_metrics,
)
from trainer.readout.summary import summarize

WALL = "wall time (s, summed over the run's segments)"
COMPARE_PANELS = [
    Panel("reward_per_step.png", "reward per step", "step", ys=("reward/mean",)),
    Panel("reward_over_wall_clock.png", "reward over wall clock (s)", ELAPSED, WALL, ys=("reward/mean",)),
    Panel("step_time.png", "time per step (s)", "step", ys=("time/step_s",)),
    Panel(
        "logprob_diff.png", "mean |trainer - sampler| logprob", "step", ys=("importance/logprob_diff_mean",)
    ),
]
RUN_PANELS = [
    Panel("reward_per_step.png", "reward per step", "step", ys=("reward/mean",)),
    Panel("reward_over_wall_time.png", "reward over wall time", ELAPSED, WALL, ys=("reward/mean",)),
    Panel("loss.png", "loss", "step", ys=("loss",)),
    Panel(
        "distill.png",
        "distillation: reverse KL to the teacher per token (estimate)",
        "step",
        ys=("distill/teacher_kl",),
        skip_empty=True,
    ),
    Panel("grad_norm.png", "gradient norm", "step", ys=("optim/grad_norm",)),
    Panel(
        "mismatch.png",
        "trainer / sampler mismatch",
        "step",
        ys=("importance/mismatch_kl",),
        right=("importance/logprob_diff_mean",),
    ),
    Panel(
        "staleness.png",
        "policy staleness (versions) and rollouts dropped as stale",
        "step",
        ys=("policy/staleness_max", "policy/staleness_mean"),
        right=("rollouts/dropped_stale",),
    ),
    Panel(
        "step_time.png",
        "step time split (s)",
        "step",
        ys=("time/step_s", "time/wait_for_batch_s", "time/train_s", "time/publish_s"),
    ),
    Panel("tokens_per_s.png", "trained tokens per second", "step", ys=("perf/tokens_per_s",)),
    Panel(
        "faults.png",
        "restarts and faults over wall time (cumulative)",
        ELAPSED,
        WALL,
        ys_prefix=EVENTS,
        steps=True,
        empty_note="no restarts or faults",
    ),
]
# Drawn when the run has evaluations (RUN_DIR/eval.jsonl): held-out pass@k and reward beside the training reward, and
# whatever an environment's own evaluate() reported through wandb_log (`reported/<key>`).
EVAL_SCORES = r"eval/(.+/)?(pass@\d+|reward/mean)"  # eval/pass@1, or eval/<env>/pass@1 in a mixed run
EVAL_PANELS = [
    Panel(
        "eval.png",
        "held-out eval and training reward per step",
        "step",
        ys=("reward/mean",),
        ys_pattern=EVAL_SCORES,
    ),
    Panel(
        "eval_over_wall_time.png",
        "held-out eval and training reward over wall time",
        ELAPSED,
        WALL,
        ys=("reward/mean", "eval/reward/mean"),
        ys_prefix="eval/pass@",
    ),
    Panel(
        "eval_reported.png",
        "what the environment's evaluate() reported",
        "step",
        ys_prefix="reported/",
        skip_empty=True,
    ),
]
REPORT_DIR = "report"  # a run's own report: RUN_DIR/report/


@dataclass
class Run:
    name: str
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    folder: Path = Path()
    problems: list[str] = field(default_factory=list)
    segments: int = 0
    fault_totals: dict[str, float] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)  # RUN_DIR/eval.jsonl


@dataclass
class Plotted:
    name: str
    rows: list[dict[str, Any]]


def load_run(folder: Path) -> Run:
    """What the folder holds; only a folder that is not there raises (FileNotFoundError)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder: pass run folders made by launch.sh")
    metrics = read_metrics(folder / "metrics.jsonl")
    problems = list(metrics.problems)
    config: Any = {}
    try:
        config = yaml.safe_load((folder / "config.yaml").read_text()) or {}
    except FileNotFoundError:
        problems.append(f"no config.yaml in {folder}")
    except (OSError, yaml.YAMLError) as exc:
        problems.append(f"{folder / 'config.yaml'} cannot be read: {str(exc).splitlines()[0]}")
    if not isinstance(config, dict):
        problems.append(f"{folder / 'config.yaml'} is not a mapping")
        config = {}
    evals, eval_problems = read_eval(folder, metrics.rows)
    return Run(
        folder.name,
        config,
        metrics.rows,
        folder,
        problems + eval_problems,
        metrics.segments,
        metrics.fault_totals,
        evals,
    )


def _section(run: Run, name: str) -> dict[str, Any]:
    value = run.config.get(name)
    return value if isinstance(value, dict) else {}


def _last(rows: list[dict[str, Any]], key: str) -> float | None:
    return next((v for r in reversed(rows) if (v := number(r, key)) is not None), None)


def estimate_cost_usd(run: Run) -> float | None:
    """The run's cost from its `pricing:` section; None (shown as "-") when the prices its backend needs are unset
    (0), never a cost of $0 that nobody priced."""
    pricing = _section(run, "pricing")
    if _section(run, "launch").get("backend") == "tinker":
        sample, train = (pricing.get(f"tinker_{k}_usd_per_mtok", 0.0) for k in ("sample", "train"))
        if not (sample or train):
            return None
        sampled = sum(numbers(run.rows, "tokens/sampled"))
        trained = sum(numbers(run.rows, "tokens/trained"))
        return (sampled * sample + trained * train) / 1e6
    per_hour = pricing.get("local_gpu_usd_per_hour", 0.0)
    if not per_hour:
        return None
    wall_s = _last(run.rows, ELAPSED) or 0.0
    return wall_s / 3600 * per_hour


def summarize_run(run: Run) -> dict[str, Any]:
    rewards = numbers(run.rows, "reward/mean")
    diffs = numbers(run.rows, "importance/logprob_diff_mean")
    step_s = numbers(run.rows, "time/step_s")
    reached = next((r.get(ELAPSED) for r in run.rows if (number(r, "reward/mean") or 0) >= 0.8), None)
    return {
        "run": run.name,
        "backend": _section(run, "launch").get("backend", "local"),
        "model": _section(run, "model").get("path", "?"),
        "steps": len(run.rows),
        "step_s_median": statistics.median(step_s) if step_s else None,
        "tokens_sampled": sum(numbers(run.rows, "tokens/sampled")),
        "tokens_trained": sum(numbers(run.rows, "tokens/trained")),
        "cost_usd": estimate_cost_usd(run),
        "logprob_diff_mean": statistics.fmean(diffs) if diffs else None,
        "reward_first3": statistics.fmean(rewards[:3]) if rewards else None,
        "reward_last3": statistics.fmean(rewards[-3:]) if rewards else None,
        "wall_s_to_reward_0.8": reached,
        "wall_s": _last(run.rows, ELAPSED),
    }


def cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def markdown_table(summaries: list[dict[str, Any]]) -> str:
    columns = list(summaries[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(s[c]) for c in columns) + " |" for s in summaries]
    return "\n".join(lines)


def write_comparison(folders: list[Path], out: Path) -> Path:
    runs = [load_run(f) for f in folders]
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarize_run(r) for r in runs]
    images, _ = draw(runs, COMPARE_PANELS, out)
    differences = config_differences({r.name: r.config for r in runs})
    text = ["# Run comparison", "", markdown_table(summaries), ""]
    text += [f"- {r.name}: {p}" for r in runs for p in r.problems]
    text += ["", "## Config differences beyond the backend", ""]
    text += [f"- {line}" for line in differences] or ["none: the same recipe, seed and overrides"]
    text += [""]
    text += [f"![{name}]({name})" for name in images]
    write_whole(out / "summary.json", json.dumps(summaries, indent=2))
    write_whole(out / "differences.json", json.dumps(differences, indent=2))
    report = out / "report.md"
    write_whole(report, "\n".join(text) + "\n")
    return report


def run_facts(run: Run, ended: str | None) -> dict[str, Any]:
    """The numbers on a run's summary page (and in its summary.json)."""
    steps_done = max((int(s) for r in run.rows if (s := number(r, "step")) is not None), default=0)
    planned = _section(run, "rollout").get("num_steps")
    rewards = [(v, r.get("step")) for r in run.rows if (v := number(r, "reward/mean")) is not None]
    best = max(rewards, key=lambda p: p[0], default=None)
    unix = numbers(run.rows, "unix_time")
    if ended is None and isinstance(planned, int) and steps_done >= planned:
        ended = "finished"
    return {
        "run": str(run.folder),
        "ended": ended,
        "steps_done": steps_done,
        "steps_planned": planned,
        "rows": len(run.rows),
        "reward_final": rewards[-1][0] if rewards else None,
        "reward_final_step": rewards[-1][1] if rewards else None,
        "reward_best": best[0] if best else None,
        "reward_best_step": best[1] if best else None,
        "reward_first": rewards[0][0] if rewards else None,
        "wall_s": _last(run.rows, ELAPSED),
        "segments": run.segments,
        "first_to_last_step_s": unix[-1] - unix[0] if len(unix) > 1 else None,
        "faults": run.fault_totals,
        **checkpoint_facts(run.folder),
        "eval": eval_facts(run.evals),
        "problems": run.problems,
    }


def eval_facts(evals: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first and last successful evaluation's numbers, and how many evaluations ran and failed."""
    if not evals:
        return None
    ok = [r for r in evals if r.get("status") == "ok"]

    def numbers_of(r: dict[str, Any]) -> dict[str, float]:
        return {
            k.removeprefix("eval/"): v
            for k, v in r.items()
            if k.startswith("eval/") and number(r, k) is not None
        }

    return {
        "evaluations": len(evals),
        "failed": sum(r.get("status") == "failed" for r in evals),
        "skipped": sum(r.get("status") == "skipped" for r in evals),
        "first": {"step": ok[0].get("step"), **numbers_of(ok[0])} if ok else None,
        "last": {"step": ok[-1].get("step"), **numbers_of(ok[-1])} if ok else None,
        "failures": [f"{r.get('target')}: {r.get('reason')}" for r in evals if r.get("status") == "failed"][
            -3:
        ],
    }


def eval_cell(e: dict[str, Any] | None) -> str:
    if e is None:
        return "none (eval.every_steps=0)"
    parts = []
    for end in ("first", "last"):
        if e[end] is not None:
            shown = [f"{k} {cell(v)}" for k, v in e[end].items() if "pass@" in k or k.endswith("reward/mean")]
            parts.append(f"step {e[end]['step']}: " + ", ".join(shown))
    text = " -> ".join(parts) or "no evaluation succeeded"
    text += f" ({e['evaluations']} evaluations, {e['failed']} failed, {e['skipped']} skipped while one ran)"
    if e["failures"]:
        text += "; failed: " + "; ".join(e["failures"])
    return text


def run_page(facts: dict[str, Any], timing: dict[str, Any], images: list[str], empty: list[str]) -> str:
    f = facts
    planned = f["steps_planned"] if f["steps_planned"] is not None else "?"
    reward = "no reward in the metrics"
    if f["reward_final"] is not None:
        reward = (
            f"final {cell(f['reward_final'])} (step {f['reward_final_step']}), best {cell(f['reward_best'])} "
            f"(step {f['reward_best_step']}), first {cell(f['reward_first'])}"
        )
    wall = "-" if f["wall_s"] is None else f"{f['wall_s']:.0f} s on the trainer's clock"
    if f["segments"] > 1:
        wall += f", summed over {f['segments']} segments (resumed or the trainer restarted)"
        if f["first_to_last_step_s"] is not None:
            wall += f"; {f['first_to_last_step_s']:.0f} s from the first step to the last, gaps included"
    faults = ", ".join(f"{k} {v:g}" for k, v in f["faults"].items()) or "none"
    split = "-"
    if timing.get("step_s_median") is not None:
        parts = [("wait", "wait_s_median"), ("train", "train_s_median"), ("publish", "publish_s_median")]
        split = f"{timing['step_s_median']:.3g} s: " + ", ".join(
            f"{name} {cell(timing[key])}" for name, key in parts
        )
    ckpt = "none yet"
    if f["checkpoints"]:
        latest = f["latest_checkpoint"]
        ckpt = f"{f['checkpoints']} (" + (f"a resume loads {latest})" if latest else "none complete yet)")
    adapters = "none yet"
    if f["adapters"]:
        adapters = f"{f['adapters']} ({f['adapter_versions']} versions, newest {f['newest_adapter'] or '-'})"
    table = [
        ("ended", f["ended"] or "not finished (stopped, failed or still running)"),
        ("steps", f"{f['steps_done']} of {planned}"),
        ("reward", reward),
        ("held-out eval", eval_cell(f["eval"])),
        ("wall time", wall),
        ("restarts and faults", faults),
        ("median step", split),
        ("trained tokens/s (median)", cell(timing.get("tokens_per_s_median"))),
        ("checkpoints", ckpt),
        ("adapters", adapters),
        ("written", datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")),
    ]
    text = [f"# Run {Path(f['run']).name}", "", "| | |", "|---|---|"]
    text += [f"| {k} | {v.replace('|', '/')} |" for k, v in table]  # a "|" in a message would end the cell
    if f["problems"]:
        text += ["", "Read as it is:", *[f"- {p}" for p in f["problems"]]]
    text += ["", "## Plots", ""]
    titles = {p.filename: p.title for p in [*RUN_PANELS, *EVAL_PANELS]}
    for name in images:
        if name not in empty:
            text += [f"### {titles.get(name, name)}", "", f"![{name}]({name})", ""]
    if empty:
        text += ["", "No data in this run for: " + ", ".join(empty)]
    return "\n".join(text) + "\n"


def write_run_report(folder: Path, out: Path | None = None, ended: str | None = None) -> Path:
    """One run's report, into `out` (default RUN_DIR/report/); rewritten whole each time."""
    run = load_run(folder)
    out = out or folder / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    images, empty = draw([run], RUN_PANELS, out)
    if run.evals:
        more, _ = draw([Plotted(run.name, run.rows + run.evals)], EVAL_PANELS, out)
        images += more
    facts = run_facts(run, ended)
    timing = summarize(run.rows)
    tokens_s = numbers(run.rows, "perf/tokens_per_s")
    timing["tokens_per_s_median"] = statistics.median(tokens_s) if tokens_s else None
    write_whole(out / "summary.json", json.dumps({**facts, "summary": timing}, indent=2) + "\n")
    report = out / "report.md"
    write_whole(report, run_page(facts, timing, images, empty))
    return report


def write_whole(path: Path, text: str) -> None:
    """A page rewritten while someone reads it (or cut off by a kill) is the old one or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m trainer report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", nargs="+", help="run folders (each with metrics.jsonl and config.yaml)")
    p.add_argument(
        "--out",
        help="folder for report.md, summary.json and the PNGs (needed for several runs; one run's default: "
        "RUN_DIR/report)",
    )
    p.add_argument(
        "--ended",
        help="how the run ended, for one run's page (launch.sh passes it: finished, stopped, failed)",
    )
    args = p.parse_args(argv)
    folders = [Path(r) for r in args.runs]
    out = Path(args.out) if args.out else None
    try:
        if len(folders) == 1:
            report = write_run_report(folders[0], out, args.ended)
        elif out is None:
            p.error("comparing several runs needs --out DIR (one run's report goes into RUN_DIR/report)")
        else:
            report = write_comparison(folders, out)
    except OSError as exc:  # a folder that is not there, or a report folder that cannot be written
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
