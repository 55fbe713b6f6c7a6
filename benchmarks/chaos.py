"""Breaking a live run on purpose, as a bad night would: the fault injector behind the fault suite
(tests/integration/test_faults.py) and the soak benchmark (benchmarks/soak.py). Each process is found from the run's
own records (RUN_DIR/pids.json, which the launcher rewrites after every restart, and the gateway's /policy for
vLLM), never by name, and only processes of that run are touched."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

STALL_S = 40.0  # a SIGSTOP long enough to outlast every per-request timeout of 30 s


@dataclass(frozen=True)
class Fault:
    action: str  # "kill" (SIGKILL) or "stall" (SIGSTOP, then SIGCONT after STALL_S)
    target: str  # vllm | vllm_engine | env | run_api | trainer | gateway

    @property
    def name(self) -> str:
        return f"{self.action}_{self.target}"


FAULTS = (
    Fault("kill", "vllm"),
    Fault("kill", "vllm_engine"),
    Fault("kill", "env"),
    Fault("kill", "run_api"),
    Fault("kill", "trainer"),
    Fault("kill", "gateway"),
    Fault("stall", "run_api"),
    Fault("stall", "gateway"),
)


def children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            kids += [int(c) for c in (task / "children").read_text().split()]
    return kids


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class LiveRun:
    """A run started by launch.sh, seen through its run folder."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir

    def config(self) -> dict[str, Any]:
        return dict(yaml.safe_load((self.run_dir / "config.yaml").read_text()))

    def pids(self) -> dict[str, int | None]:
        try:
            return dict(json.loads((self.run_dir / "pids.json").read_text()))
        except (OSError, ValueError):
            return {}

    def vllm_pid(self) -> int | None:
        cfg = self.config()
        token = cfg["inference"].get("publish_token")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            url = f"{cfg['launch']['gateway_url']}/policy"
            pid = httpx.get(url, headers=headers, timeout=5).json()["backend_pid"]
            return int(pid) if pid else None
        return None

    def pid(self, target: str) -> int | None:
        if target == "vllm":
            return self.vllm_pid()
        if target == "vllm_engine":  # vLLM's engine core runs as a child process of its API server
            server = self.vllm_pid()
            kids = children(server) if server else []
            engines = [k for k in kids if "EngineCore" in command_line(k) or "EngineCor" in _comm(k)]
            found = engines or kids
            return found[0] if found else None
        pids = self.pids()
        name = {"run_api": "run-api"}.get(target, target)
        if target == "env":
            name = next((n for n in pids if n.startswith("env")), "env")
        return pids.get(name)

    def rows(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        text = path.read_text()
        rows = []
        for line in text.splitlines()[: text.count("\n")]:
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
        return rows

    def last_step(self) -> int:
        rows = self.rows()
        return int(rows[-1]["step"]) if rows else 0


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text()
    except OSError:
        return ""


@dataclass
class Injected:
    fault: str
    pid: int | None
    step: int  # the run's last completed step when the fault hit
    at: float  # time.monotonic()


def inject(run: LiveRun, fault: Fault, stall_s: float = STALL_S) -> Injected:
    """Deliver one fault (a stall blocks for `stall_s`). A target that is not running now (e.g. mid-restart) is
    recorded with pid None and nothing is sent."""
    pid = run.pid(fault.target)
    record = Injected(fault.name, pid, run.last_step(), time.monotonic())
    if pid is None:
        return record
    try:
        if fault.action == "kill":
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(stall_s)
            finally:
                os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        record.pid = None
    return record
