"""Shared-engine benchmark: time from `launch.sh` to a run's first training step, for a run that starts its own
gateway and vLLM against one attached to a running engine (`launch.sh engine`, inference.engine_url), as one JSON.

    python -m benchmarks engine                 # 3 pairs of toy runs of 3 steps, alternating own / attached
    python -m benchmarks engine --pairs 5 --steps 2

The engine is started once (its own start is reported, not counted in any run); the runs alternate so that a slow
moment of the machine hits both kinds. Reported: each run's seconds to its first metrics row, the medians and their
ratio (own / attached).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.onpolicy_bench import launch_toy
from trainer.orchestration.commands import ROOT, git_sha
from trainer.orchestration.processes import stop_child
from trainer.training.polling import wait_until

COMMAND = "python -m benchmarks engine"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__)
    p.add_argument("--pairs", type=int, default=3, help="runs of each kind")
    p.add_argument("--steps", type=int, default=3, help="rollout.num_steps of each run")
    p.add_argument("--config", default=str(ROOT / "configs" / "toy.yaml"))
    p.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    p.add_argument("--out", help="folder for the engine and the runs (default: a new folder under runs/)")
    p.add_argument("overrides", nargs="*", help="more run config overrides for every run")
    return p.parse_args(argv)


def start_engine(config: str, folder: Path) -> tuple[subprocess.Popen[bytes], str, float]:
    """`launch.sh engine` until it prints its URL: (process, URL, seconds it took)."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "engine.out"
    argv = ["bash", str(ROOT / "launch.sh"), "engine", "--config", config, f"trainer.output_dir={folder}"]
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)

    def url() -> str:
        if proc.poll() is not None:
            raise RuntimeError(f"launch.sh engine exited with {proc.returncode}; read {log}")
        text = log.read_text()
        return text.split("engine ready: ", 1)[1].split()[0] if "engine ready: " in text else ""

    found = wait_until(url, 600, "launch.sh engine ready", 0.5)
    return proc, found, time.monotonic() - started


def first_step_s(args: argparse.Namespace, run_dir: Path, *overrides: str) -> dict[str, Any]:
    launched = time.time()
    code, wall = launch_toy(
        args, run_dir, f"rollout.num_steps={args.steps}", "eval.every_steps=0", *overrides
    )
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    first = rows[0]["unix_time"] - launched if rows else None
    return {"exit_code": code, "first_step_s": first, "launch_wall_s": wall, "run_dir": str(run_dir)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out or ROOT / "runs" / f"engine-bench-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    engine, url, engine_start_s = start_engine(args.config, out / "engine")
    runs: list[dict[str, Any]] = []
    try:
        for i in range(args.pairs):
            for kind in ("own", "attached"):
                extra = [f"inference.engine_url={url}"] if kind == "attached" else []
                print(f"engine bench: {kind} run {i + 1}/{args.pairs}", file=sys.stderr, flush=True)
                runs.append({"kind": kind, **first_step_s(args, out / f"{kind}-{i}", *extra)})
    finally:
        stop_child(engine, 60)
    medians = {}
    for kind in ("own", "attached"):
        times = [r["first_step_s"] for r in runs if r["kind"] == kind and r["first_step_s"] is not None]
        medians[kind] = statistics.median(times) if times else None
    own, attached = medians["own"], medians["attached"]
    result = {
        "benchmark": "engine",
        "command": " ".join([COMMAND, *(argv if argv is not None else sys.argv[1:])]),
        "git": git_sha(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "engine_start_s": engine_start_s,
        "first_step_s_median_own": own,
        "first_step_s_median_attached": attached,
        "speedup_first_step": own / attached if own and attached else None,
        "runs": runs,
    }
    print(json.dumps(result, indent=1))
    return 0 if all(r["exit_code"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
