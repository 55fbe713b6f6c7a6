"""python -m trainer.service [--config FILE] [key=value ...]: serve the tinker SDK's protocol on service.host:port.

Ready when GET /health answers 200; the chosen port is printed on stdout ("listening on http://HOST:PORT")."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys

import uvicorn

from trainer.service.policies import MultiLora
from trainer.service.routes import build_app
from trainer.training.config import ConfigError, RunConfig, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.service", description=__doc__)
    parser.add_argument("--config", help="run config YAML (model:, lora:, trainer:, service:)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. service.port=8100")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(RunConfig, args.config, args.overrides)
    except ConfigError as exc:
        print(f"trainer.service: {exc}", file=sys.stderr)
        return 2
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.service.host, cfg.service.port))
    except OSError as exc:
        print(
            f"trainer.service: cannot bind {cfg.service.host}:{cfg.service.port} ({exc}); set service.port",
            file=sys.stderr,
        )
        return 2
    app = build_app(cfg, MultiLora(cfg))
    host, port = sock.getsockname()[:2]
    print(f"listening on http://{host}:{port}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    asyncio.run(server.serve(sockets=[sock]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
