"""python -m trainer serve PATH [--host H] [--port N] [--config FILE] [key=value ...]

Answers with what a run trained behind an OpenAI-compatible port until Ctrl-C: PATH is a merged export (served as
the model itself), an exported adapter folder (its base with the adapter), a run folder (its newest published
policy), a checkpoint or a run's adapters/vN folder. It is the gateway with vLLM the launcher starts
(trainer.orchestration.gateway_process), so /v1/completions, /v1/chat/completions and /v1/models answer as they do
in a run; every request is served by the trained policy whatever model name it gives. The gateway is built from a run
config: --config FILE (a recipe: on a CPU, one that sizes vLLM's memory such as configs/tiny_cpu.yaml), else the
run's own config.yaml when PATH belongs to a run, else the defaults; dotted overrides apply on top
(`inference.vllm.max_model_len=4096`)."""

from __future__ import annotations

import argparse
import json
import secrets
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from trainer.export.origin import ADAPTER_CONFIG, ExportError, base_model
from trainer.export.source import find_source

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Served:
    model: Path  # the folder vLLM loads
    adapter: Path | None  # published on top of it as the policy, when not merged
    config: Path | None  # the run config the gateway is built from (None: the defaults)
    logs: Path  # where the gateway and vLLM write their logs


def resolve(path: Path) -> Served:
    """What serving `path` means; ExportError for a folder that is none of the kinds above."""
    if (path / "config.json").is_file() and not (path / ADAPTER_CONFIG).is_file():
        return Served(path.resolve(), None, None, Path(tempfile.mkdtemp(prefix="serve-logs-")))
    in_run = (
        (path / "config.yaml").is_file()
        or (path / "trainer_state.pt").is_file()
        or path.parent.name == "adapters"
    )
    if in_run:
        src = find_source(path)
        config = (
            src.run_dir / "config.yaml" if src.run_dir and (src.run_dir / "config.yaml").is_file() else None
        )
        logs = src.run_dir / "serve" if src.run_dir else Path(tempfile.mkdtemp(prefix="serve-logs-"))
        return Served(src.base.folder, src.adapter, config, logs)
    if (path / ADAPTER_CONFIG).is_file():  # an exported adapter: its config names the base
        named = json.loads((path / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        base = base_model({"model": {"path": named}})
        return Served(base.folder, path.resolve(), None, Path(tempfile.mkdtemp(prefix="serve-logs-")))
    raise ExportError(
        f"{path} is neither an export (config.json or adapter_config.json) nor a run folder, checkpoint or adapter "
        "of a run; give what `python -m trainer export` wrote, or the run's folder"
    )


def overrides_for(served: Served, extra: list[str]) -> list[str]:
    out = [f"model.path={served.model}", "launch.backend=local", "eval.every_steps=0"]
    if served.adapter is not None:
        rank = int(json.loads((served.adapter / ADAPTER_CONFIG).read_text()).get("r") or 8)
        out.append(f"inference.vllm.max_lora_rank={max(rank, 8)}")
    return out + extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("path", type=Path, help="an export, a run folder, a checkpoint or adapters/vN")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port to answer on (0: any free one)")
    parser.add_argument(
        "--config",
        type=Path,
        help="run config (YAML) whose inference section (vLLM's memory, context length) to serve with; default: "
        "the run's own config.yaml when PATH belongs to a run, else the defaults (sized for a GPU)",
    )
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides of the run config")
    args = parser.parse_args(argv)
    from trainer.orchestration.gateway_process import spawn_gateway
    from trainer.training.config import ConfigError
    from trainer.training.gateway_client import GatewayClient

    try:
        served = resolve(args.path)
        overrides = overrides_for(served, args.overrides)
        token = None
        if args.host not in LOOPBACK:  # reachable from elsewhere: only this process may change what is served
            token = secrets.token_urlsafe(32)
            overrides.append(f"inference.publish_token={token}")
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"serve: starting vLLM with {served.model} (logs in {served.logs})", flush=True)
        address = {"host": args.host, "port": args.port}
        config = str(args.config or served.config) if (args.config or served.config) else None
        with spawn_gateway(config, overrides, served.logs, address=address) as (url, proc):
            if served.adapter is not None:
                GatewayClient(url, publish_token=token).publish(1, str(served.adapter))
            shown = url if args.host in LOOPBACK else url.replace("127.0.0.1", args.host)
            what = f"{served.model.name} + adapter {served.adapter}" if served.adapter else served.model.name
            print(f"serve: {what} answers at {shown}/v1 (any model name); Ctrl-C stops it", flush=True)
            print(
                f"  curl {shown}/v1/chat/completions -H 'content-type: application/json' "
                """-d '{"model": "policy", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}'""",
                flush=True,
            )
            while not stop.wait(1.0):
                if proc.poll() is not None:
                    raise ExportError(f"the gateway exited with code {proc.returncode}; read {served.logs}")
        print("serve: stopped", flush=True)
    except (ExportError, ConfigError, RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
