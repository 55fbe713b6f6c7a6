"""On-policy benchmark: the toy loop at several staleness bounds, with the on-policy gate on and off, as one JSON.

    python -m benchmarks onpolicy                                   # staleness 0, 1, 3 x gate on, off; 30 steps
    python -m benchmarks onpolicy --staleness 0 --gates on --steps 12
    python -m benchmarks onpolicy --mix --staleness 0 --gates on,off --steps 20   # toy 3 : residue 1, one run
    python -m benchmarks onpolicy --mix --staleness 1 --gates off --quotas on,off --steps 24   # the quota alone

Runs `launch.sh toy` (configs/tiny_cpu.yaml unless --config) once per (max_staleness, gate) pair, one after
another (the runs share the machine's cores), and summarises each run's metrics.jsonl (trainer/readout/
summary.py): stale fraction, steps per minute, wall seconds to reward 0.8, trainer idle share, publish p50/p99
and the verification's share of the publish; with --mix, each environment's stale fraction too. The first step of each run includes the environment's start and is
left out of the timing figures (not of the stale fraction).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trainer.orchestration.commands import ROOT, git_sha
from trainer.orchestration.processes import stop_child
from trainer.readout.summary import summarize

COMMAND = "python -m benchmarks onpolicy"  # the command line the JSON records
RESIDUE = ROOT / "tests" / "envs" / "residue_tokens.py"
MIX = f"rollout.envs=[{{env: toy, weight: 3}}, {{env: {RESIDUE}, name: residue, weight: 1}}]"
MIX_ENVS = ("toy", "residue")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__)
    p.add_argument("--staleness", default="0,1,3", help="comma-separated rollout.max_staleness values")
    p.add_argument("--gates", default="on,off", help="comma-separated publish.gate values (on, off)")
    p.add_argument("--quotas", default="on", help="comma-separated publish.gate_quota values (on, off)")
    p.add_argument("--steps", type=int, default=30, help="rollout.num_steps of each run")
    p.add_argument("--config", default=str(ROOT / "configs" / "tiny_cpu.yaml"))
    p.add_argument(
        "--mix",
        action="store_true",
        help="mix toy (weight 3) with tests/envs/residue_tokens.py (weight 1) instead of toy alone",
    )
    p.add_argument("--timeout-s", type=float, default=1200.0, help="per run")
    p.add_argument("--out", help="folder for the runs (default: a new folder under runs/)")
    p.add_argument("overrides", nargs="*", help="more run config overrides for every run")
    return p.parse_args(argv)


def launch_toy(args: argparse.Namespace, run_dir: Path, *overrides: str) -> tuple[int | None, float]:
    """`launch.sh toy --config args.config` into `run_dir` with the overrides (then args.overrides), its output in
    `<run_dir>.launch.log`; (exit code or None past args.timeout_s, wall seconds). The launcher is stopped at the
    end either way. Shared by the benchmarks that compare toy runs."""
    # A mix names its environments in rollout.envs, and launch.sh then takes no ENV argument.
    mixed = getattr(args, "mix", False)  # the distillation benchmark's arguments have no --mix
    cmd = [
        "bash",
        str(ROOT / "launch.sh"),
        *([] if mixed else ["toy"]),
        "--config",
        args.config,
        f"trainer.output_dir={run_dir}",
        *([MIX] if mixed else []),
        *overrides,
        *args.overrides,
    ]
    started = time.monotonic()
    with run_dir.with_suffix(".launch.log").open("w") as log:
        launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            code: int | None = launcher.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            stop_child(launcher, 120)
    return code, time.monotonic() - started


def run_one(
    args: argparse.Namespace, out: Path, staleness: int, gate: str, quota: str = "on"
) -> dict[str, Any]:
    run_dir = out / f"staleness{staleness}-gate-{gate}-quota-{quota}"
    overrides = [
        f"rollout.max_staleness={staleness}",
        f"publish.gate={gate}",
        f"publish.gate_quota={quota == 'on'}",
        f"rollout.num_steps={args.steps}",
    ]
    code, wall_s = launch_toy(args, run_dir, *overrides)
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line] if metrics.exists() else []
    whole = summarize(rows)
    timed = summarize(rows[1:]) if len(rows) > 1 else whole
    steps_wall = sum(r["time/step_s"] for r in rows[1:])
    return {
        "max_staleness": staleness,
        "gate": gate,
        "quota": quota,
        "launcher_exit_code": code,
        "launch_wall_s": wall_s,
        "steps": whole["steps"],
        "updates": whole["updates"],
        "stale_fraction": whole["stale_fraction"],
        "steps_without_update": whole["steps_without_update"],
        "steps_per_minute": 60 * (len(rows) - 1) / steps_wall if steps_wall else None,
        # What a run buys: sequences that reached the loss, per minute of steps (the first step's start excluded).
        "sequences_trained_per_minute": (
            60 * sum(r.get("rollouts/sequences_trained", 0) for r in rows[1:]) / steps_wall
            if steps_wall
            else None
        ),
        "wall_s_to_reward_0.8": whole["wall_s_to_reward_0.8"],
        "step_reaching_reward_0.8": whole["step_reaching_reward_0.8"],
        "reward_last3": whole["reward_last3"],
        "trainer_idle_share": timed["idle_share"],
        "publish_s_p50": timed["publish_s_median"],
        "publish_s_p99": timed["publish_s_p99"],
        "publish_overlapped_share": timed["publish_overlapped_share"],
        "verify_s_median": timed["verify_s_median"],
        "verify_share_of_publish": timed["verify_share_of_publish"],
        "verify_max_abs_diff_max": whole["verify_max_abs_diff_max"],
        "gateway_hold_s_median": timed["gateway_hold_s_median"],
        **({"stale_fraction_by_env": stale_by_env(rows)} if args.mix else {}),
        "run_dir": str(run_dir),
    }


def stale_by_env(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Of the sequences each environment of the mix sent, the share dropped as stale."""
    out: dict[str, float | None] = {}
    for env in MIX_ENVS:
        sent = sum(r.get(f"rollouts/{env}/sequences_received", 0) for r in rows)
        stale = sum(r.get(f"rollouts/{env}/sequences_dropped_stale", 0) for r in rows)
        out[env] = stale / sent if sent else None
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gates = [g.strip() for g in args.gates.split(",")]
    quotas = [q.strip() for q in args.quotas.split(",")]
    if any(g not in ("on", "off") for g in gates + quotas):
        print(
            f"onpolicy: --gates and --quotas take on and off, got {args.gates!r}, {args.quotas!r}",
            file=sys.stderr,
        )
        return 2
    staleness = [int(s) for s in args.staleness.split(",")]
    out = Path(args.out or ROOT / "runs" / f"onpolicy-bench-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for s in staleness:
        for gate in gates:
            for quota in quotas:
                print(f"onpolicy: max_staleness={s} gate={gate} quota={quota}", file=sys.stderr, flush=True)
                results.append(run_one(args, out, s, gate, quota))
    print(
        json.dumps(
            {
                "command": COMMAND + " " + " ".join(argv if argv is not None else sys.argv[1:]),
                "git": git_sha(),
                "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                "runs": results,
            },
            indent=2,
        )
    )
    return 0 if all(r["launcher_exit_code"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
