"""Distillation benchmark: on the toy task, train a teacher with RL, then a fresh student two ways, by on-policy
distillation from the teacher alone (no reward in the loss) and by RL from scratch, and compare, as one JSON.

    python -m benchmarks distill                      # teacher 30 steps; students 20 steps each
    python -m benchmarks distill --teacher runs/toy-... --steps 12   # an existing run's newest adapter as teacher

Each run is `launch.sh toy` (the toy recipe unless --config), one after another. Per student: the step at which the
training reward (still computed by the environment, never used by the distilled student's loss) first reaches 0.8,
held-out eval pass@1 at the start and the end, and for the distilled one `distill/teacher_kl` at its first and last
steps and their ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.onpolicy_bench import launch_toy
from trainer.orchestration.commands import ROOT, git_sha
from trainer.readout.summary import summarize

COMMAND = "python -m benchmarks distill"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__)
    p.add_argument("--teacher", help="a run folder or adapter folder to distill from (default: train one)")
    p.add_argument("--teacher-steps", type=int, default=30, help="rollout.num_steps of the teacher's RL run")
    p.add_argument("--steps", type=int, default=20, help="rollout.num_steps of each student")
    p.add_argument("--kl-coef", type=float, default=1.0)
    p.add_argument("--config", default=str(ROOT / "configs" / "toy.yaml"))
    p.add_argument("--timeout-s", type=float, default=1200.0, help="per run")
    p.add_argument("--out", help="folder for the runs (default: a new folder under runs/)")
    p.add_argument("overrides", nargs="*", help="more run config overrides for every run")
    return p.parse_args(argv)


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def student(args: argparse.Namespace, run_dir: Path, *overrides: str) -> dict[str, Any]:
    code, wall = launch_toy(
        args, run_dir, f"rollout.num_steps={args.steps}", "eval.every_steps=5", *overrides
    )
    rows = jsonl(run_dir / "metrics.jsonl")
    evals = {e["step"]: e for e in jsonl(run_dir / "eval.jsonl") if e.get("status") == "ok"}
    kl = [r["distill/teacher_kl"] for r in rows if r.get("distill/teacher_kl") is not None]
    whole = summarize(rows)
    last_eval = evals[max(evals)] if evals else {}
    return {
        "launcher_exit_code": code,
        "launch_wall_s": wall,
        "steps": whole["steps"],
        "step_reaching_reward_0.8": whole["step_reaching_reward_0.8"],
        "wall_s_to_reward_0.8": whole["wall_s_to_reward_0.8"],
        "reward_last3": whole["reward_last3"],
        "eval_pass@1_start": evals.get(0, {}).get("eval/pass@1"),
        "eval_pass@1_end": last_eval.get("eval/pass@1"),
        "eval_reward_end": last_eval.get("eval/reward/mean"),
        "teacher_kl_first": kl[0] if kl else None,
        "teacher_kl_last": kl[-1] if kl else None,
        "teacher_kl_fall": kl[0] / kl[-1] if len(kl) > 1 and kl[-1] > 0 else None,
        "run_dir": str(run_dir),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out or ROOT / "runs" / f"distill-bench-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    teacher_run: dict[str, Any] = {}
    teacher = args.teacher
    if teacher is None:
        print("distill: training the teacher (RL)", file=sys.stderr, flush=True)
        code, wall = launch_toy(
            args, out / "teacher", f"rollout.num_steps={args.teacher_steps}", "eval.every_steps=0"
        )
        teacher_run = {
            "launcher_exit_code": code,
            "launch_wall_s": wall,
            **summarize(jsonl(out / "teacher" / "metrics.jsonl")),
        }
        teacher = str(out / "teacher")
    print("distill: the student distilled from the teacher (reward_coef 0)", file=sys.stderr, flush=True)
    distilled = student(
        args,
        out / "distilled",
        f"distill.teacher={teacher}",
        f"distill.kl_coef={args.kl_coef}",
        "distill.reward_coef=0",
    )
    print("distill: the student trained by RL from scratch", file=sys.stderr, flush=True)
    rl = student(args, out / "rl")
    print(
        json.dumps(
            {
                "command": COMMAND + " " + " ".join(argv if argv is not None else sys.argv[1:]),
                "git": git_sha(),
                "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                "teacher": teacher,
                "teacher_run": teacher_run or None,
                "distilled": distilled,
                "rl_from_scratch": rl,
            },
            indent=2,
        )
    )
    return 0 if distilled["launcher_exit_code"] == 0 and rl["launcher_exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
