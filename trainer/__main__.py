"""`python -m trainer`: the trainer process's command line, and the tools that read a run.

python -m trainer run --config RUN_DIR/config.yaml                   # the training loop (launch.sh runs it)
python -m trainer config --config configs/gsm8k.yaml optim.lr=2e-5   # print the resolved config (YAML)
python -m trainer config-reference > docs/configuration.md          # regenerate the configuration reference
python -m trainer tiny-model [--out DIR] [--seed N] [--moe]          # build/cache the offline tiny model
python -m trainer summary RUN_DIR [RUN_DIR ...]                      # a run in a few lines
python -m trainer report RUN_DIR                                     # one run's report, into RUN_DIR/report
python -m trainer report RUN_DIR RUN_DIR [...] --out DIR             # side-by-side comparison report
python -m trainer dashboard [FOLDER ...] [--host H --token T]        # live web page of runs and service clients
python -m trainer eval RUN_DIR [--version N] [--base] [--adapter DIR]  # held-out eval of a run's adapters / the base
python -m trainer export RUN_DIR --out DIR [--merge] [--push REPO_ID]  # the trained policy as an adapter or a model
python -m trainer serve EXPORT_DIR|RUN_DIR [--port N]                   # talk to it: an OpenAI-compatible port

Benchmarks and the soak test are `python -m benchmarks ...` (see `python -m benchmarks --help`).
"""

from __future__ import annotations

import argparse
import signal
import sys

import yaml

from trainer.training.config import ConfigError, RunConfig, load_config

TOOLS = {  # sub-command -> module whose main(argv) it runs
    "summary": "trainer.readout.summary",
    "report": "trainer.readout.report",
    "dashboard": "trainer.readout.dashboard",
    "eval": "trainer.orchestration.eval_cli",
    "export": "trainer.export.cli",
    "serve": "trainer.export.serve",
    "config-reference": "trainer.training.config_reference",
}
MOVED = {  # former sub-command -> the command that runs it now
    "bench": "python -m benchmarks trainer",
    "bench-gateway": "python -m benchmarks gateway",
    "bench-service": "python -m benchmarks service",
    "bench-onpolicy": "python -m benchmarks onpolicy",
    "soak": "python -m benchmarks soak",
}


def train(cfg: RunConfig) -> bool:
    """Build this rank's backend and run the loop on it (the loop never builds one); ranks > 0 of a
    data-parallel job only follow rank 0's collective calls. True when the run reached its last step."""
    from trainer.backends.build import build_backend, follow_rank_zero, is_main_rank, release
    from trainer.training.loop import require_endpoints, run

    require_endpoints(cfg)
    if not is_main_rank():
        follow_rank_zero(cfg)
        return True
    backend = build_backend(cfg)
    finished = run(cfg, backend)
    release(backend)  # not on an exception: see release
    return finished


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for tool in TOOLS:
        sub.add_parser(tool, help=f"see python -m trainer {tool} --help", add_help=False)
    cfg_p = sub.add_parser("config", help="validate and print the resolved config")
    cfg_p.add_argument("--config", help="YAML file")
    cfg_p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    run_p = sub.add_parser("run", help="the training loop: run-api batches in, adapters out to the gateway")
    run_p.add_argument(
        "--config", required=True, help="resolved run config (launch.sh writes RUN_DIR/config.yaml)"
    )
    run_p.add_argument("overrides", nargs="*")
    tiny_p = sub.add_parser("tiny-model", help="build the offline tiny model and print its path")
    tiny_p.add_argument("--out", help="folder to write (default: the shared cache)")
    tiny_p.add_argument("--seed", type=int, default=0)
    tiny_p.add_argument(
        "--moe", action="store_true", help="the mixture-of-experts variant (model.path=tiny-moe)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in and args_in[0] in MOVED:
        print(f"error: `python -m trainer {args_in[0]}` moved: run `{MOVED[args_in[0]]}`", file=sys.stderr)
        return 2
    if args_in and args_in[0] in TOOLS:
        import importlib

        return int(importlib.import_module(TOOLS[args_in[0]]).main(args_in[1:]) or 0)
    args = build_parser().parse_args(args_in)
    if args.command == "run":
        import logging

        from trainer.training.faults import EXIT_NEEDS_OPERATOR, DiskFull
        from trainer.training.publishing import PublishUnverified

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)
        try:
            finished = train(load_config(RunConfig, args.config, args.overrides))
        except (DiskFull, PublishUnverified) as exc:  # a restart would fail the same way: the launcher stops
            logging.getLogger("trainer").error("%s", exc)
            return EXIT_NEEDS_OPERATOR
        # Stopped by a SIGTERM before its last step (not from the launcher, which is stopping anyway): exit as
        # killed by it, so a supervising launcher restarts the trainer instead of reporting the run finished.
        return 0 if finished else 128 + signal.SIGTERM
    if args.command == "config":
        try:
            cfg = load_config(RunConfig, args.config, args.overrides)
        except (ConfigError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    from trainer.backends.tiny_model import build_tiny_model, ensure_tiny_model

    path = (
        build_tiny_model(args.out, args.seed, args.moe)
        if args.out
        else ensure_tiny_model(args.seed, moe=args.moe)
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
