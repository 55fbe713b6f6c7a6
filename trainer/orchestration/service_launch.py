"""`bash launch.sh service [--config FILE] [key=value ...]`: the Tinker-protocol service and, beside it, the gateway
with its vLLM that samples for it, supervised together.

The launcher binds the gateway's socket itself and hands it over (`--fd`), so a gateway that dies comes back on the
same address (its vLLM's restarts are the gateway's own business); the service loads its sampler adapters into the
new one on first use. `service.sampling=false` (or a `service.gateway_url` of a gateway running elsewhere) starts
no gateway. Ctrl-C or SIGTERM stops both; the service exiting ends the launch with its exit code. Must not import
the service or the gateway: they are processes of their own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import yaml

from trainer.orchestration.gateway_process import gateway_healthy
from trainer.orchestration.launcher import gateway_section, redacted, redacted_override, write_private
from trainer.orchestration.preflight import check_model, describe_model
from trainer.orchestration.processes import die_with_parent, listen, stop_child
from trainer.training.config import ConfigError, RunConfig, load_config
from trainer.training.polling import wait_until

# The service's sampler adapters are named, not policy versions: what it needs is LoRA slots in vLLM (rlcommon.lora_slots).
SERVICE_KEEP_VERSIONS = 2
GATEWAY_START_S = 900.0  # a GPU vLLM loading 8B weights and compiling graphs takes minutes


class Stop(Exception):
    """SIGTERM or SIGINT reached the launcher."""


def start_gateway(gateway_yaml: Path, sock: socket.socket, log_dir: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "inference", "--config", str(gateway_yaml), "--log-dir", str(log_dir)]
    argv += ["--fd", str(sock.fileno())]
    with (log_dir / "gateway.log").open("ab") as logf:
        return subprocess.Popen(
            argv,
            stdout=logf,
            stderr=subprocess.STDOUT,
            pass_fds=(sock.fileno(),),
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log_dir: Path) -> None:
    try:
        wait_until(lambda: gateway_healthy(url, proc), GATEWAY_START_S, f"gateway at {url} healthy", 0.5)
    except (RuntimeError, TimeoutError) as exc:
        raise RuntimeError(f"{exc}; read {log_dir}/gateway.log and {log_dir}/vllm.log") from exc


@dataclass
class Started:
    """The processes this launch started, as they are now (a restarted gateway replaces the dead one)."""

    service: subprocess.Popen[bytes] | None = None
    gateway: subprocess.Popen[bytes] | None = None


def supervise(
    procs: Started, restart_gateway: Callable[[], subprocess.Popen[bytes]] | None, max_restarts_per_hour: int
) -> int:
    """Wait for the service to end, restarting the gateway when it dies (within the hourly budget)."""
    assert procs.service is not None
    restarts: list[float] = []
    while True:
        code = procs.service.poll()
        if code is not None:
            return code
        if restart_gateway is not None and procs.gateway is not None and procs.gateway.poll() is not None:
            now = time.monotonic()
            restarts = [t for t in restarts if now - t < 3600] + [now]
            if len(restarts) > max_restarts_per_hour:
                print(
                    f"launch.sh: the gateway died {len(restarts)} times within an hour; stopping", flush=True
                )
                return 1
            print(
                f"launch.sh: gateway died (exit code {procs.gateway.returncode}); restarting it", flush=True
            )
            procs.gateway = restart_gateway()
        time.sleep(0.5)


def gateway_config(cfg: RunConfig, port: int, model_path: str) -> dict[str, object]:
    """The gateway's section as a run's launcher completes it, with 4 adapters per vLLM batch unless configured."""
    address: dict[str, object] = {"port": port}
    if "keep_versions" not in cfg.inference:  # the service has no rollout window: 2 gives lora_slots(2) = 5
        address["keep_versions"] = SERVICE_KEEP_VERSIONS
    return gateway_section(cfg, model_path, address)


def dry_run(cfg: RunConfig, service_argv: list[str], log_dir: Path) -> int:
    if cfg.service.sampling and cfg.service.gateway_url is None:
        # a dry run downloads nothing: the config below shows model.path as given
        print(f"# {describe_model(cfg.model.path)}")
        print(f"# gateway config ({log_dir / 'gateway.yaml'}; its port is chosen at start)")
        print(yaml.safe_dump(redacted(gateway_config(cfg, 0, cfg.model.path)), sort_keys=False))
        print(f"# gateway: {sys.executable} -m inference --config {log_dir / 'gateway.yaml'}")
        service_argv = [*service_argv, "service.gateway_url=http://127.0.0.1:<gateway port>"]
    print("# service: " + " ".join(redacted_override(arg) for arg in service_argv))
    print(
        f"# listens on http://{cfg.service.host}:{cfg.service.port}; records under {cfg.service.output_dir}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bash launch.sh service", description=__doc__)
    parser.add_argument("--config", help="run config YAML (model:, lora:, inference:, service:)")
    parser.add_argument("--dry-run", action="store_true", help="print the gateway's config and both commands")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. service.port=8100")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(RunConfig, args.config, args.overrides)
    except ConfigError as exc:
        print(f"launch.sh service: {exc}", file=sys.stderr)
        return 2
    log_dir = Path(cfg.service.output_dir) / "logs"
    if args.dry_run:
        shown = [sys.executable, "-m", "trainer.service"] + (["--config", args.config] if args.config else [])
        return dry_run(cfg, [*shown, *args.overrides], log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    # The resolved config goes to the service in a file only its user reads: an override such as
    # service.api_key=... on its command line would be visible to every user of the machine (ps).
    service_yaml = log_dir / "service.yaml"
    write_private(service_yaml, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    service_argv = [sys.executable, "-m", "trainer.service", "--config", str(service_yaml)]

    def on_signal(signum: int, _: FrameType | None) -> None:
        raise Stop(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    procs = Started()
    try:
        restart: Callable[[], subprocess.Popen[bytes]] | None = None
        if cfg.service.sampling and cfg.service.gateway_url is None:
            sock = listen("127.0.0.1")
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            # a local folder (downloaded now if need be): the gateway serves folders, never hub ids
            section = gateway_config(cfg, sock.getsockname()[1], check_model(cfg.model.path))
            gateway_yaml = log_dir / "gateway.yaml"
            write_private(gateway_yaml, yaml.safe_dump(section, sort_keys=False))
            print(f"launch.sh: starting the gateway and vLLM at {url} (logs in {log_dir})", flush=True)
            procs.gateway = start_gateway(gateway_yaml, sock, log_dir)
            wait_healthy(url, procs.gateway, log_dir)
            service_argv.append(f"service.gateway_url={url}")

            def restart() -> subprocess.Popen[bytes]:
                return start_gateway(gateway_yaml, sock, log_dir)

        procs.service = subprocess.Popen(service_argv, env={**os.environ}, preexec_fn=die_with_parent)
        return supervise(procs, restart, cfg.launch.max_restarts_per_hour)
    except Stop:
        return 143
    except (ConfigError, RuntimeError) as exc:
        print(f"launch.sh service: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for proc in (procs.service, procs.gateway):  # the service first: it may be sampling
            if proc is not None:
                with contextlib.suppress(Exception):
                    stop_child(proc, 60)


if __name__ == "__main__":
    sys.exit(main())
