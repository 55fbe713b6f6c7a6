"""`bash launch.sh engine [ENV] [--config FILE] [k=v ...]`: a shared engine. Starts the gateway and vLLM for the
recipe's model once and keeps them until Ctrl-C; runs attach to it one at a time
(`bash launch.sh ENV inference.engine_url=URL`, trainer/orchestration/attach.py) and pay no vLLM start.

The gateway is a child on a socket this process holds, so a gateway that dies is restarted on the same URL (within
launch.max_restarts_per_hour); vLLM's own crashes are healed inside the gateway, as in any run. The engine's folder
(trainer.output_dir, default runs/engine-<time>) holds gateway.yaml and the logs; its record in runs/engines/
(mode 0600) holds the URL and the publish token an attaching run reads, and goes when the engine stops.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from trainer.orchestration.attach import write_record
from trainer.orchestration.commands import PY, ROOT
from trainer.orchestration.launcher import RUNS, bind_locally, gateway_section, write_private
from trainer.orchestration.processes import Component, drain_backlog, stop_all
from trainer.orchestration.supervisor import LaunchError, wait_http
from trainer.training.config import ConfigError, RunConfig, load_config

HOUR_S = 3600.0
DEFAULT_ENV = "toy"


def resolve_engine(args: argparse.Namespace) -> tuple[RunConfig, Path]:
    env = args.env or (None if args.config else DEFAULT_ENV)
    config = Path(args.config) if args.config else ROOT / "configs" / f"{env}.yaml"
    if not config.is_file():
        raise ConfigError(
            f"no config {config}: pass --config FILE (a run config: its model and inference section)"
        )
    cfg = load_config(RunConfig, config, args.overrides)
    if cfg.launch.backend != "local":
        raise ConfigError("an engine serves the local backend (vLLM); a Tinker run needs none")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    explicit = any(o.startswith("trainer.output_dir=") for o in args.overrides)
    run_dir = Path(cfg.trainer.output_dir).resolve() if explicit else RUNS / f"engine-{stamp}"
    print(f"engine for {config.relative_to(ROOT) if config.is_relative_to(ROOT) else config}", flush=True)
    return cfg, run_dir


def engine_section(cfg: RunConfig, model_path: str, address: dict[str, Any]) -> dict[str, Any]:
    """The gateway's config for an engine: always a publish token (runs attach with it), a slot for evaluations,
    the lease on."""
    cfg.inference.setdefault("publish_token", secrets.token_urlsafe(32))
    cfg.inference.setdefault("named_slots", 1)
    section = gateway_section(cfg, model_path, address)
    section["engine"] = True
    return section


class Engine:
    def __init__(self, cfg: RunConfig, folder: Path, gateway: Component, url: str):
        self.cfg, self.folder, self.gateway, self.url = cfg, folder, gateway, url
        self.restarted_at: list[float] = []

    def start(self) -> None:
        self.gateway.start()
        print(f"waiting for the gateway and vLLM (logs in {self.folder / 'logs'})", flush=True)
        wait_http(f"{self.url}/health", self.gateway, self.cfg.launch.health_timeout_s, "healthy")

    def watch(self) -> None:
        """Until a signal: restart a gateway that died (on the same socket), within the hourly budget."""
        while True:
            time.sleep(0.5)
            code = self.gateway.exited()
            if code is None:
                continue
            now = time.monotonic()
            self.restarted_at = [t for t in self.restarted_at if now - t < HOUR_S]
            limit = self.cfg.launch.max_restarts_per_hour
            if len(self.restarted_at) >= limit:
                raise LaunchError(
                    f"the engine's gateway exited with code {code} and was restarted {len(self.restarted_at)} times "
                    f"within the hour (launch.max_restarts_per_hour={limit}); read {self.gateway.log}:\n"
                    f"{self.gateway.tail()}"
                )
            self.restarted_at.append(now)
            print(
                f"engine: the gateway died (exit code {code}); restarting it (log {self.gateway.log})",
                flush=True,
            )
            for fd in self.gateway.pass_fds:
                drain_backlog(fd)
            self.start()
            print("engine: the gateway is back; attached runs attach again by themselves", flush=True)


def serve(cfg: RunConfig, folder: Path) -> int:
    from trainer.orchestration.preflight import download_model, find_model

    found = find_model(cfg.model.path)
    model_path = found if isinstance(found, str) else download_model(found)
    cfg.model.path = model_path
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    fds, address = bind_locally(cfg)
    os.close(fds["run-api"])  # an engine has no run-api: only the gateway's socket is kept
    url = str(cfg.launch.gateway_url)
    section = engine_section(cfg, model_path, address)
    write_private(folder / "gateway.yaml", yaml.safe_dump(section, sort_keys=False))
    argv = [
        PY,
        "-m",
        "inference",
        "--config",
        str(folder / "gateway.yaml"),
        "--log-dir",
        str(folder / "logs"),
    ]
    gateway = Component(
        "gateway",
        [*argv, "--fd", str(fds["gateway"])],
        folder / "logs" / "gateway.log",
        cwd=ROOT,
        pass_fds=(fds["gateway"],),
    )
    engine = Engine(cfg, folder, gateway, url)
    stopping = {"signal": 0}

    def on_signal(signum: int, _: Any) -> None:
        stopping["signal"] = signum
        raise KeyboardInterrupt

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    record = None
    try:
        engine.start()
        record = write_record(url, section["publish_token"], folder, os.getpid(), model_path)
        print(
            f"engine ready: {url} serving {model_path}\n"
            f"  publish token: in {record} (mode 0600; never printed)\n"
            f"  attach a run:  bash launch.sh ENV inference.engine_url={url}\n"
            "  stop it with Ctrl-C",
            flush=True,
        )
        engine.watch()
        return 0
    except KeyboardInterrupt:
        print(f"engine: stopping on signal {stopping['signal'] or 'SIGINT'}", flush=True)
        return 0
    finally:
        stop_all([gateway])
        if record is not None:
            record.unlink(missing_ok=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="launch.sh engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("env", nargs="?", help=f"the recipe whose model the engine serves (default {DEFAULT_ENV})")
    p.add_argument("--config", help="run config YAML (default: configs/<env>.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. inference.keep_versions=4")
    args = p.parse_intermixed_args(argv)
    if args.env and "=" in args.env:
        args.overrides.insert(0, args.env)
        args.env = None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg, folder = resolve_engine(args)
        return serve(cfg, folder)
    except ConfigError as exc:
        print(f"launch.sh engine: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        print(f"launch.sh engine: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
