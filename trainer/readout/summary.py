"""Summarise a run folder's metrics.jsonl as JSON: time per step split into wait/train/publish (medians), the
trainer's idle share (wall time of steps spent neither training nor publishing inline), publish p50/p99 and its
verification cost, the stale fraction, reward at the start and end and when it first reached 0.8.

    python -m trainer summary runs/toy-20261121-213950 [more run folders...]

A folder of the Tinker-protocol service (one per training client, rows with a "call") gets its own summary: calls
by kind, tokens trained and sampled, seconds per call, and the loss of the first and last forward_backward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile by linear interpolation between closest ranks (numpy's default), None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float | None:
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(values) if values else None

    def total(key: str) -> float:
        return sum(r.get(key) or 0.0 for r in rows)

    rewards = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
    step_total = total("time/step_s")
    updates = [r for r in rows if r.get("loss") is not None]
    # None: a publish a stop cut short (the resume publishes that version again).
    publishes = [r["time/publish_s"] for r in updates if r.get("time/publish_s") is not None]
    # A publish overlapped with the next batch's wait is off the trainer's path: only inline ones add to wall time.
    inline_publish = sum(
        r.get("time/publish_s") or 0.0 for r in updates if not r.get("time/publish_overlapped")
    )
    verify = [r["publish/verify_s"] for r in updates if r.get("publish/verify_s") is not None]
    taken = total("rollouts/sequences_taken")
    reached = next((r for r in rows if (r.get("reward/mean") or 0.0) >= 0.8), None)
    return {
        "steps": len(rows),
        "updates": len(updates),
        "final_policy_version": rows[-1]["policy_version"] if rows else 0,
        "step_s_median": med("time/step_s"),
        "wait_s_median": med("time/wait_for_batch_s"),
        "train_s_median": med("time/train_s"),
        "publish_s_median": statistics.median(publishes) if publishes else None,
        "publish_s_p99": percentile(publishes, 0.99),
        "publish_overlapped_share": (
            sum(1 for r in updates if r.get("time/publish_overlapped")) / len(updates) if updates else None
        ),
        # The trainer's idle share: wall time spent neither training nor publishing on its own path.
        "idle_share": (
            (step_total - total("time/train_s") - inline_publish) / step_total if step_total else None
        ),
        "publish_share": inline_publish / step_total if step_total else None,
        "verify_s_median": statistics.median(verify) if verify else None,
        "verify_share_of_publish": (
            sum(verify) / sum(r["time/publish_s"] for r in updates if r.get("publish/verify_s") is not None)
            if verify
            else None
        ),
        "verify_max_abs_diff_max": max(
            (
                r["publish/verify_max_abs_diff"]
                for r in updates
                if r.get("publish/verify_max_abs_diff") is not None
            ),
            default=None,
        ),
        "reward_first3": statistics.fmean(rewards[:3]) if rewards else None,
        "reward_last3": statistics.fmean(rewards[-3:]) if rewards else None,
        "staleness_mean": statistics.fmean(r["policy/staleness_mean"] for r in rows) if rows else None,
        "dropped_stale_total": total("rollouts/dropped_stale"),
        "stale_fraction": total("rollouts/dropped_stale") / taken if taken else None,
        "steps_without_update": len(rows) - len(updates),
        "gateway_hold_s_median": med("gateway/hold_s"),
        "step_reaching_reward_0.8": reached["step"] if reached else None,
        "wall_s_to_reward_0.8": reached["wall_s"] if reached else None,
        "logprob_diff_mean_max": max((r["importance/logprob_diff_mean"] for r in updates), default=None),
        "wall_s": rows[-1]["wall_s"] if rows else None,
    }


def summarize_service_client(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One service training client's (or the base sampler's) rows: what it did and how long each call took."""
    calls: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        calls.setdefault(str(r.get("call")), []).append(r)
    fb = calls.get("forward_backward", [])
    samples = calls.get("sample", [])
    secs = {
        k: statistics.median(r["seconds"] for r in v) for k, v in calls.items() if v and "seconds" in v[0]
    }
    return {
        "model_id": rows[0].get("model_id") if rows else None,
        "calls": {k: len(v) for k, v in calls.items()},
        "optim_steps": len(calls.get("optim_step", [])),
        "tokens_trained": sum(r.get("tokens") or 0 for r in fb),
        "tokens_sampled": sum(r.get("sampled_tokens") or 0 for r in samples),
        "seconds_median_by_call": secs,
        "loss_first": fb[0]["loss"] if fb else None,
        "loss_last": fb[-1]["loss"] if fb else None,
        "wall_s": rows[-1]["unix_time"] - rows[0]["unix_time"] if len(rows) > 1 else 0.0,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer summary",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "folders", nargs="+", metavar="FOLDER", help="a run folder or a service client's folder"
    )
    out = {}
    for run_dir in parser.parse_args(argv).folders:
        path = Path(run_dir) / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        out[run_dir] = summarize_service_client(rows) if rows and "call" in rows[0] else summarize(rows)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
