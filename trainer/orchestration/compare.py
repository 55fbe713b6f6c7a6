"""`bash launch.sh compare ENV [--backends local,tinker] [--config FILE] [--out DIR] [k=v ...] [BACKEND:k=v ...]`:
the same recipe, seed, data order and overrides on each backend, then one side-by-side report. An override prefixed
with a backend's name (`tinker:optim.lr=2e-4`, `local:inference.engine_url=URL`) goes to that run alone, and the
report lists it as a difference.

The runs go one after the other on this box (a Tinker run needs no GPU here, but on a CPU box the two would share
its cores and their step times would not be comparable), each a plain `launch.sh` run in OUT/<backend>. The report
(`python -m trainer report`, OUT/report) puts reward, held-out evaluation, the trainer/sampler mismatch, step time,
tokens and cost side by side and lists every config key on which the runs differ beyond the backend. Held-out
evaluation runs on the gateway's vLLM, which a Tinker run has not: with tinker among the backends it is off for every
run, so that both are the same recipe.

The Tinker side talks to TINKER_BASE_URL (the hosted service by default); `bash launch.sh service` serves the same
protocol on this box, and TINKER_BASE_URL=http://127.0.0.1:PORT points a comparison at it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from trainer.orchestration.commands import PY, ROOT
from trainer.orchestration.launcher import RUNS

BACKENDS = ("local", "tinker")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="launch.sh compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("env", nargs="?", help="environment name (toy, gsm8k) or an Atropos env file")
    p.add_argument("--config", help="run config YAML (default: configs/<env>.yaml)")
    p.add_argument(
        "--backends",
        default="local,tinker",
        help="comma-separated, run in this order (default local,tinker)",
    )
    p.add_argument("--out", help="folder for the runs and the report (default runs/compare-<env>-<time>)")
    p.add_argument("--wait", action="store_true", help="a run attached to an engine waits for its lease")
    p.add_argument(
        "overrides",
        nargs="*",
        help="dotted overrides for every run (optim.lr=2e-5), or for one (tinker:optim.lr=2e-4)",
    )
    args = p.parse_intermixed_args(argv)
    if args.env and "=" in args.env and not Path(args.env).exists():
        args.overrides.insert(0, args.env)
        args.env = None
    if not args.env and not args.config:
        p.error("give an environment (e.g. toy) or --config FILE")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or len(backends) < 2 or len(set(backends)) != len(backends):
        p.error(f"--backends {args.backends!r}: name at least two of {', '.join(BACKENDS)}, each once")
    for o in args.overrides:
        side, _, override = o.partition(":") if ":" in o.split("=", 1)[0] else ("", "", o)
        if side and side not in backends:
            p.error(f"{o}: {side!r} is not one of the compared backends ({', '.join(backends)})")
        if override.startswith(("trainer.output_dir=", "launch.backend=")):
            p.error(f"{o}: a comparison sets each run's folder and backend itself (--out, --backends)")
    args.backends = backends
    return args


def run_argv(args: argparse.Namespace, backend: str, folder: Path) -> list[str]:
    """One run of the comparison: the launcher with the shared arguments and this run's backend and folder."""
    shared = [args.env] if args.env else []
    if args.config:
        shared += ["--config", args.config]
    same = ["eval.every_steps=0"] if "tinker" in args.backends else []
    mine = [one_side(o, backend) for o in args.overrides]
    return [
        PY,
        "-m",
        "trainer.orchestration.launcher",
        *shared,
        "--backend",
        backend,
        *same,
        *(["--wait"] if args.wait else []),
        *(o for o in mine if o is not None),
        f"trainer.output_dir={folder}",
    ]


def one_side(override: str, backend: str) -> str | None:
    """The override as this backend's run gets it: as it is, without its prefix, or not at all (another side's)."""
    key = override.split("=", 1)[0]
    if ":" not in key:
        return override
    side, _, rest = override.partition(":")
    return rest if side == backend else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    name = args.env or Path(args.config).stem
    out = Path(args.out).resolve() if args.out else RUNS / f"compare-{Path(name).stem}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    if "tinker" in args.backends:
        print("launch.sh compare: held-out evaluation off for every run (a Tinker run has none)", flush=True)
    codes: dict[str, int] = {}
    for backend in args.backends:
        folder = out / backend
        print(f"launch.sh compare: the {backend} run in {folder}", flush=True)
        try:
            codes[backend] = subprocess.run(run_argv(args, backend, folder), cwd=ROOT).returncode
        except KeyboardInterrupt:  # the run itself got the Ctrl-C too and stopped its processes
            print("launch.sh compare: interrupted; no report", file=sys.stderr, flush=True)
            return 130
        if codes[backend] != 0:
            print(
                f"launch.sh compare: the {backend} run exited with {codes[backend]}",
                file=sys.stderr,
                flush=True,
            )
    folders = [out / b for b in args.backends if (out / b / "metrics.jsonl").exists()]
    if len(folders) < 2:
        print("launch.sh compare: fewer than two runs wrote metrics; no report", file=sys.stderr)
        return max(codes.values()) or 1
    argv = [PY, "-m", "trainer.readout.report", *map(str, folders), "--out", str(out / "report")]
    made = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if made.returncode != 0:
        print(f"launch.sh compare: the report failed: {made.stderr.strip()}", file=sys.stderr, flush=True)
        return made.returncode
    print(f"comparison: {made.stdout.strip()}", flush=True)
    return max(codes.values())


if __name__ == "__main__":
    sys.exit(main())
