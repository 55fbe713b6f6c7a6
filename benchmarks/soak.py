"""Soak benchmark: the toy loop under a fault every M seconds for N minutes, as one JSON object.

    python -m benchmarks soak --minutes 30 --fault-every 60                  # the figure in the README
    python -m benchmarks soak --minutes 5 --fault-every 30 --faults kill_trainer,kill_vllm

Starts `launch.sh toy` (configs/toy.yaml, the CPU recipe) with a step count it will not reach, lets it run
`--warmup-steps` clean steps to measure the clean step time, then injects a random fault (benchmarks/
chaos.py) every `--fault-every` seconds until `--minutes` have passed, and stops the run with SIGTERM. Reports:
faults injected (by kind), faults survived (the run was still alive and made a new step after it), steps done
and redone (rows a restarted trainer dropped and trained again), restarts the launcher recorded, the clean step
time, the wall overhead (1 - net steps x clean step time / wall time of the fault phase), and reward.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.chaos import FAULTS, Fault, Injected, LiveRun, inject
from trainer.orchestration.commands import ROOT
from trainer.orchestration.processes import stop_child

COMMAND = "python -m benchmarks soak"  # the command line the JSON records


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__)
    p.add_argument("--minutes", type=float, default=30.0, help="length of the fault phase")
    p.add_argument("--fault-every", type=float, default=60.0, metavar="SECONDS")
    p.add_argument("--faults", default=",".join(f.name for f in FAULTS), help="comma-separated fault names")
    p.add_argument("--warmup-steps", type=int, default=5, help="clean steps before the first fault")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault sequence")
    p.add_argument(
        "--recover-s",
        type=float,
        default=300.0,
        help="after the fault phase, how long the last faults may take",
    )
    p.add_argument("--out", help="run folder (default: a new folder under runs/)")
    p.add_argument("overrides", nargs="*", help="run config overrides for launch.sh")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the JSON's command
    return args


class StepWatch:
    """Follows metrics.jsonl from another thread: steps done, steps redone after a trainer restart."""

    def __init__(self, run: LiveRun):
        self.run = run
        self.last = 0
        self.redone = 0
        self.done = 0  # rows written, counting redone ones
        self.new_rows_at: list[float] = []  # monotonic times of each new row
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _follow(self) -> None:
        while not self._stop.wait(0.5):
            step = self.run.last_step()
            if step < self.last:
                self.redone += self.last - step
            elif step > self.last:
                self.done += step - self.last
                self.new_rows_at += [time.monotonic()] * (step - self.last)
            self.last = step


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    by_name = {f.name: f for f in FAULTS}
    unknown = [n for n in args.faults.split(",") if n not in by_name]
    if unknown:
        print(f"soak: unknown faults {unknown}; choose from {sorted(by_name)}", file=sys.stderr)
        return 2
    faults = [by_name[n] for n in args.faults.split(",")]
    run_dir = Path(args.out or ROOT / "runs" / f"soak-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    overrides = [
        f"trainer.output_dir={run_dir}",
        "rollout.num_steps=1000000",
        "launch.max_restarts_per_hour=1000",
        "trainer.checkpoint_every=5",
        *args.overrides,
    ]
    cmd = ["bash", str(ROOT / "launch.sh"), "toy", *overrides]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = (run_dir.parent / f"{run_dir.name}.launch.log").open("w")
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    run = LiveRun(run_dir)
    watch = StepWatch(run)
    watch.start()
    rng = random.Random(args.seed)
    injected: list[Injected] = []
    try:
        while watch.last < args.warmup_steps:
            if launcher.poll() is not None:
                raise RuntimeError(
                    f"the run ended during warm-up (exit {launcher.returncode}); read {log.name}"
                )
            time.sleep(1)
        clean = [r["time/step_s"] for r in run.rows()[1:]]  # the first step includes the environment's start
        phase_start, phase_steps = time.monotonic(), watch.last
        deadline = phase_start + args.minutes * 60
        next_fault = phase_start + args.fault_every
        stalls: list[threading.Thread] = []
        while time.monotonic() < deadline and launcher.poll() is None:
            if time.monotonic() >= next_fault:
                # In a thread: a 40 s stall must not hold back the next fault's schedule.
                fault = rng.choice(faults)
                stalls.append(threading.Thread(target=deliver, args=(run, fault, injected)))
                stalls[-1].start()
                next_fault += args.fault_every
            time.sleep(0.5)
        phase_wall = time.monotonic() - phase_start
        for thread in stalls:
            thread.join()
        recovered_by = time.monotonic() + args.recover_s  # the last faults get time to heal before the stop
        while (
            launcher.poll() is None and time.monotonic() < recovered_by and not all_recovered(injected, watch)
        ):
            time.sleep(1)
        alive = launcher.poll() is None
    finally:
        stop_child(launcher, 120)
        watch.stop()
    result = report(
        args, cmd, run, watch, injected, clean, phase_wall, phase_steps, alive, launcher.returncode
    )
    print(json.dumps(result, indent=2))
    return 0 if alive and result["faults_survived"] == result["faults_injected"] else 1


def deliver(run: LiveRun, fault: Fault, into: list[Injected]) -> None:
    print(f"soak: {fault.name} at step {run.last_step()}", file=sys.stderr, flush=True)
    into.append(inject(run, fault))


def all_recovered(injected: list[Injected], watch: StepWatch) -> bool:
    return all(any(t > i.at for t in watch.new_rows_at) for i in injected if i.pid is not None)


def report(
    args: argparse.Namespace,
    cmd: list[str],
    run: LiveRun,
    watch: StepWatch,
    injected: list[Injected],
    clean: list[float],
    phase_wall: float,
    phase_steps: int,
    alive: bool,
    launcher_exit: int | None,
) -> dict[str, Any]:
    delivered = [i for i in injected if i.pid is not None]
    survived = [i for i in delivered if any(t > i.at for t in watch.new_rows_at)]
    recovery = [min(t for t in watch.new_rows_at if t > i.at) - i.at for i in survived]
    clean_step = statistics.median(clean) if clean else None
    net_steps = watch.last - phase_steps
    rows = run.rows()
    faults_file = run.run_dir / "faults.json"
    kinds: dict[str, int] = {}
    for i in delivered:
        kinds[i.fault] = kinds.get(i.fault, 0) + 1
    return {
        "command": " ".join([COMMAND, *args.argv]),
        "launch_command": " ".join(cmd),
        "minutes": args.minutes,
        "fault_every_s": args.fault_every,
        "faults_injected": len(delivered),
        "faults_missed_target": len(injected) - len(delivered),  # the target was mid-restart
        "faults_by_kind": kinds,
        "faults_survived": len(survived),
        "recovery_s_median": statistics.median(recovery) if recovery else None,
        "recovery_s_max": max(recovery) if recovery else None,
        "run_alive_at_end": alive,
        "launcher_exit_code": launcher_exit,
        "steps_done": watch.done,
        "steps_redone": watch.redone,
        "last_step": watch.last,
        "restarts": json.loads(faults_file.read_text()) if faults_file.exists() else {},
        "clean_step_s_median": clean_step,
        "fault_phase_wall_s": phase_wall,
        "wall_overhead": (1 - net_steps * clean_step / phase_wall) if clean_step and phase_wall else None,
        "reward_last10_mean": statistics.fmean(
            r["reward/mean"] for r in rows[-10:] if r["reward/mean"] is not None
        )
        if rows
        else None,
        "run_dir": str(run.run_dir),
    }


if __name__ == "__main__":
    sys.exit(main())
