"""Run the gateway as a child process outside a full launch (benchmarks, tests): complete and validate its
section of a run config as the launcher does, write RUN_DIR-style gateway.yaml, start `python -m inference`, wait
until it is healthy."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from trainer.orchestration.launcher import gateway_section, write_private
from trainer.orchestration.preflight import check_model
from trainer.orchestration.processes import stop_child
from trainer.training.config import RunConfig, load_config
from trainer.training.polling import wait_until


def write_gateway_config(
    config: str | None, overrides: list[str], out: Path, address: dict[str, Any] | None = None
) -> Path:
    """RUN_DIR-style gateway.yaml from a run config and dotted overrides (`inference.keep_versions=2`), on
    `address` (default: any free port of 127.0.0.1)."""
    cfg = load_config(RunConfig, config, overrides)
    section = gateway_section(cfg, check_model(cfg.model.path), address or {"port": 0})
    write_private(out, yaml.safe_dump(section, sort_keys=False))
    return out


def gateway_healthy(url: str, proc: subprocess.Popen[bytes]) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"gateway exited with code {proc.returncode} before it was healthy")
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    return False


@contextlib.contextmanager
def spawn_gateway(
    config: str | None,
    overrides: list[str],
    log_dir: Path,
    timeout_s: float = 600.0,
    address: dict[str, Any] | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run `python -m inference` until it is healthy; yield (url, process); SIGTERM it (and so vLLM) at exit."""
    log_dir.mkdir(parents=True, exist_ok=True)
    gateway_yaml = write_gateway_config(config, overrides, log_dir / "gateway.yaml", address)
    port_file = log_dir / "gateway.port"
    port_file.unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "inference",
        "--config",
        str(gateway_yaml),
        "--log-dir",
        str(log_dir),
        "--port-file",
        str(port_file),
    ]
    with (log_dir / "gateway.log").open("ab") as logf:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env={**os.environ})
    try:

        def bound() -> str:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"gateway exited with code {proc.returncode}; read {log_dir / 'gateway.log'}"
                )
            return port_file.read_text().strip() if port_file.exists() else ""

        url = f"http://127.0.0.1:{wait_until(bound, timeout_s, 'gateway bound its port', 0.2)}"
        try:
            wait_until(lambda: gateway_healthy(url, proc), timeout_s, f"gateway at {url} healthy")
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}; read {log_dir}/gateway.log and vllm.log") from exc
        yield url, proc
    finally:
        stop_child(proc, 60)
