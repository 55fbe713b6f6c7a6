"""`python -m trainer`: the trainer process's command line.

    python -m trainer config --config configs/gsm8k.yaml optim.lr=2e-5   # print the resolved config (YAML)
    python -m trainer tiny-model [--out DIR] [--seed N]                  # build/cache the offline tiny model
    python -m trainer.bench ...                                          # throughput benchmark (JSON)

The training loop that pulls batches from Atropos's run-api joins this entry point with launch.sh.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from trainer.config import ConfigError, RunConfig, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    cfg_p = sub.add_parser("config", help="validate and print the resolved config")
    cfg_p.add_argument("--config", help="YAML file")
    cfg_p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    tiny_p = sub.add_parser("tiny-model", help="build the offline tiny model and print its path")
    tiny_p.add_argument("--out", help="folder to write (default: the shared cache)")
    tiny_p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.command == "config":
        try:
            cfg = load_config(RunConfig, args.config, args.overrides)
        except (ConfigError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    from trainer.tiny_model import build_tiny_model, ensure_tiny_model

    path = build_tiny_model(args.out, args.seed) if args.out else ensure_tiny_model(args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
