"""Client side of the gateway: one method per route (same pydantic bodies as the server), and a helper that runs
`python -m inference` as a child process for benchmarks and tests. Used by the trainer to publish policies."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from inference.wire import LookupRequest, LookupResponse, PolicyStatus, PublishRequest, PublishResponse


class GatewayClient:
    def __init__(self, url: str, publish_token: str | None = None, timeout_s: float = 600.0):
        headers = {"Authorization": f"Bearer {publish_token}"} if publish_token else {}
        self.url = url
        self._http = httpx.Client(base_url=url, timeout=timeout_s, headers=headers)

    def close(self) -> None:
        self._http.close()

    def health(self) -> bool:
        try:
            return self._http.get("/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def _post(self, path: str, body: dict) -> dict:
        r = self._http.post(path, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"gateway {path} answered {r.status_code}: {r.text}")
        return dict(r.json())

    def publish(self, version: int, adapter_path: str) -> PublishResponse:
        body = PublishRequest(version=version, adapter_path=adapter_path).model_dump()
        return PublishResponse.model_validate(self._post("/policy/publish", body))

    def lookup(self, sequences: list[list[int]]) -> list[int | None]:
        body = LookupRequest(sequences=sequences).model_dump()
        return LookupResponse.model_validate(self._post("/policy/lookup", body)).versions

    def status(self) -> PolicyStatus:
        r = self._http.get("/policy")
        r.raise_for_status()
        return PolicyStatus.model_validate(r.json())

    def wait_healthy(self, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.health():
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"gateway exited with code {proc.returncode} before it was healthy")
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway at {self.url} not healthy within {timeout_s}s")
            time.sleep(0.5)


@contextlib.contextmanager
def spawn_gateway(config: str | None, overrides: list[str], log_dir: Path,
                  timeout_s: float = 600.0) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run `python -m inference` until it is healthy; yield (url, process); SIGTERM it (and so vLLM) at exit."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port_file = Path(tempfile.mkdtemp()) / "port"
    argv = [sys.executable, "-m", "inference", "--log-dir", str(log_dir), "--port-file", str(port_file)]
    if config:
        argv += ["--config", config]
    argv += ["inference.port=0", *overrides]
    with (log_dir / "gateway.log").open("ab") as logf:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        deadline = time.monotonic() + timeout_s
        while not port_file.exists() or not port_file.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start; read {log_dir / 'gateway.log'}")
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port_file.read_text().strip()}"
        client = GatewayClient(url)
        try:
            client.wait_healthy(max(1.0, deadline - time.monotonic()), proc)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}; read {log_dir}/gateway.log and vllm.log") from exc
        finally:
            client.close()
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
