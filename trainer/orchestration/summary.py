"""Summarise a run folder's metrics.jsonl as JSON: time per step split into wait/train/publish (medians), the
trainer's idle share (time waiting for a batch over wall time of steps), reward at the start and end, staleness.

    python -m trainer.orchestration.summary runs/toy-20261121-213950 [more run folders...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float | None:
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(values) if values else None

    rewards = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
    step_total = sum(r["time/step_s"] for r in rows)
    updates = [r for r in rows if r.get("loss") is not None]
    return {
        "steps": len(rows),
        "updates": len(updates),
        "final_policy_version": rows[-1]["policy_version"] if rows else 0,
        "step_s_median": med("time/step_s"),
        "wait_s_median": med("time/wait_for_batch_s"),
        "train_s_median": med("time/train_s"),
        "publish_s_median": statistics.median(r["time/publish_s"] for r in updates) if updates else None,
        "idle_share": sum(r["time/wait_for_batch_s"] for r in rows) / step_total if step_total else None,
        "reward_first3": statistics.fmean(rewards[:3]) if rewards else None,
        "reward_last3": statistics.fmean(rewards[-3:]) if rewards else None,
        "staleness_mean": statistics.fmean(r["policy/staleness_mean"] for r in rows) if rows else None,
        "dropped_stale_total": sum(r["rollouts/dropped_stale"] for r in rows),
        "logprob_diff_mean_max": max((r["importance/logprob_diff_mean"] for r in updates), default=None),
        "wall_s": rows[-1]["wall_s"] if rows else None,
    }


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    out = {}
    for run_dir in argv:
        path = Path(run_dir) / "metrics.jsonl"
        out[run_dir] = summarize([json.loads(line) for line in path.read_text().splitlines() if line])
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
