"""Summarise a run folder's metrics.jsonl as JSON: time per step split into wait/train/publish (medians), the
trainer's idle share (wall time of steps spent neither training nor publishing inline), publish p50/p99 and its
verification cost, the stale fraction, reward at the start and end and when it first reached 0.8, and for a
distillation run the teacher KL at the start and the end and the teacher's seconds per step.

    python -m trainer summary runs/toy-20261121-213950 [more run folders...]

A folder of the Tinker-protocol service (one per training client, rows with a "call") gets its own summary: calls
by kind, tokens trained and sampled, seconds per call, and the loss of the first and last forward_backward.

A half-written last line, a missing metrics.jsonl or rows without some keys are summarised as they are: "problems"
says what could not be read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from trainer.readout.runfolder import ELAPSED, number, numbers, read_metrics


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile by linear interpolation between closest ranks (numpy's default), None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows may lack keys or hold None (a step without an update, a publish a stop cut short): each figure uses
    the rows that have it, and is None when none do."""
    updates = [r for r in rows if r.get("loss") is not None]
    return {
        "steps": len(rows),
        "updates": len(updates),
        "final_policy_version": int(_last(rows, "policy_version") or 0),
        **_timing(rows, updates),
        **_learning(rows, updates),
        "wall_s": _wall_s(rows[-1]) if rows else None,
    }


def _timing(rows: list[dict[str, Any]], updates: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the wall time goes: steps, waits, training, publishing and its verification."""
    step_total = sum(numbers(rows, "time/step_s"))
    # None: a publish a stop cut short (the resume publishes that version again).
    publishes = numbers(updates, "time/publish_s")
    # A publish overlapped with the next batch's wait is off the trainer's path: only inline ones add to wall time.
    inline_publish = sum(
        numbers([r for r in updates if not r.get("time/publish_overlapped")], "time/publish_s")
    )
    verified = [r for r in updates if number(r, "publish/verify_s") is not None]
    verify = numbers(verified, "publish/verify_s")
    verified_publish = sum(numbers(verified, "time/publish_s"))
    return {
        "step_s_median": _median(numbers(rows, "time/step_s")),
        "wait_s_median": _median(numbers(rows, "time/wait_for_batch_s")),
        "train_s_median": _median(numbers(rows, "time/train_s")),
        "publish_s_median": _median(publishes),
        "publish_s_p99": percentile(publishes, 0.99),
        "publish_overlapped_share": (
            sum(1 for r in updates if r.get("time/publish_overlapped")) / len(updates) if updates else None
        ),
        # The trainer's idle share: wall time spent neither training nor publishing on its own path.
        "idle_share": (
            (step_total - sum(numbers(rows, "time/train_s")) - inline_publish) / step_total
            if step_total
            else None
        ),
        "publish_share": inline_publish / step_total if step_total else None,
        "verify_s_median": _median(verify),
        "verify_share_of_publish": sum(verify) / verified_publish if verify and verified_publish else None,
        "verify_max_abs_diff_max": max(numbers(updates, "publish/verify_max_abs_diff"), default=None),
        "gateway_hold_s_median": _median(numbers(rows, "gateway/hold_s")),
    }


def _learning(rows: list[dict[str, Any]], updates: list[dict[str, Any]]) -> dict[str, Any]:
    """Rewards, staleness, what was dropped, and the distillation teacher's KL (None without a teacher)."""
    rewards = numbers(rows, "reward/mean")
    taken = sum(numbers(rows, "rollouts/sequences_taken"))
    dropped = sum(numbers(rows, "rollouts/dropped_stale"))
    reached = next((r for r in rows if (number(r, "reward/mean") or 0.0) >= 0.8), None)
    teacher_kl = numbers(rows, "distill/teacher_kl")
    return {
        "reward_first3": _mean(rewards[:3]),
        "reward_last3": _mean(rewards[-3:]),
        "staleness_mean": _mean(numbers(rows, "policy/staleness_mean")),
        "dropped_stale_total": dropped,
        "stale_fraction": dropped / taken if taken else None,
        "steps_without_update": len(rows) - len(updates),
        "step_reaching_reward_0.8": reached.get("step") if reached else None,
        "wall_s_to_reward_0.8": _wall_s(reached) if reached else None,
        "logprob_diff_mean_max": max(numbers(updates, "importance/logprob_diff_mean"), default=None),
        # the reverse KL to the teacher at the start and the end
        "teacher_kl_first3": _mean(teacher_kl[:3]),
        "teacher_kl_last3": _mean(teacher_kl[-3:]),
        "teacher_s_median": _median(numbers(rows, "distill/teacher_s")),
        "teacher_tokens_scored_total": sum(numbers(rows, "distill/tokens_scored")) if teacher_kl else None,
    }


def _wall_s(row: dict[str, Any]) -> float | None:
    """Wall time summed over a resumed run's segments where read_metrics added it, else the row's own clock."""
    return number(row, ELAPSED) if ELAPSED in row else number(row, "wall_s")


def _last(rows: list[dict[str, Any]], key: str) -> float | None:
    return next((v for r in reversed(rows) if (v := number(r, key)) is not None), None)


def summarize_service_client(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One service training client's (or the base sampler's) rows: what it did and how long each call took."""
    calls: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        calls.setdefault(str(r.get("call")), []).append(r)
    fb = calls.get("forward_backward", [])
    samples = calls.get("sample", [])
    secs = {k: statistics.median(s) for k, v in calls.items() if (s := numbers(v, "seconds"))}
    losses = numbers(fb, "loss")
    unix = numbers(rows, "unix_time")
    return {
        "model_id": rows[0].get("model_id") if rows else None,
        "calls": {k: len(v) for k, v in calls.items()},
        "optim_steps": len(calls.get("optim_step", [])),
        "tokens_trained": sum(numbers(fb, "tokens")),
        "tokens_sampled": sum(numbers(samples, "sampled_tokens")),
        "seconds_median_by_call": secs,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "wall_s": unix[-1] - unix[0] if len(unix) > 1 else 0.0,
    }


def summarize_folder(folder: Path) -> dict[str, Any]:
    """A run folder's or a service client's summary, with what could not be read said under "problems"."""
    if not folder.is_dir():
        return {"problems": [f"{folder} is not a folder"]}
    metrics = read_metrics(folder / "metrics.jsonl")
    rows = metrics.rows
    out = summarize_service_client(rows) if rows and "call" in rows[0] else summarize(rows)
    if metrics.problems:
        out["problems"] = metrics.problems
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer summary",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "folders", nargs="+", metavar="FOLDER", help="a run folder or a service client's folder"
    )
    folders = parser.parse_args(argv).folders
    out = {f: summarize_folder(Path(f)) for f in folders}
    print(json.dumps(out, indent=2))
    # Exit 2 only when no folder given was there at all: anything else is summarised as it is.
    return 2 if all(not Path(f).is_dir() for f in folders) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
