"""`bash launch.sh service --dry-run` (a child process): the gateway config and both commands it
would run, the tokens never printed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT

# A dry run starts nothing: runs beside the servers' tests (tests/run.sh).
pytestmark = pytest.mark.beside_servers


def test_launch_service_dry_run_prints_the_gateway_config_and_both_commands():
    argv = [sys.executable, "-m", "trainer.orchestration.service_launch", "--config", "configs/tiny_cpu.yaml"]
    done = subprocess.run([*argv, "--dry-run", "service.port=8199"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "keep_versions: 2" in done.stdout  # vLLM batches 5 adapters: --max-loras = keep_versions + 3
    assert "-m inference --config" in done.stdout and "service.gateway_url=http://127.0.0.1:" in done.stdout
    assert "http://127.0.0.1:8199" in done.stdout
    bad = subprocess.run([*argv, "--dry-run", "service.prot=1"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "service.prot" in bad.stderr
    # A publish token given on the command line is never printed, in the gateway's config or the service's command.
    token = "dry-run-secret-token-0123456789"
    shown = subprocess.run(
        [*argv, "--dry-run", f"inference.publish_token={token}"], cwd=ROOT, capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr
    assert token not in shown.stdout + shown.stderr and "<hidden>" in shown.stdout
