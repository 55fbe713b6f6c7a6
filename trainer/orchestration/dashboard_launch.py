"""`launch.dashboard=true`: the live dashboard (`python -m trainer dashboard`) beside a run, over its run folder.

The launcher binds the dashboard's socket itself (127.0.0.1, a free port) and hands it over (`--fd`), as it does for
run-api and the gateway: the URL is known, and printed, before the dashboard has started, and no port is chosen by
one process and bound by another. It is a viewer: its death stops nothing and it is not restarted.
"""

from __future__ import annotations

import sys
from pathlib import Path

from trainer.orchestration.processes import Component, listen
from trainer.training.config import RunConfig

DASHBOARD_HOST = "127.0.0.1"  # beside a run: this machine only (another host needs a token: run it by hand)


def dashboard_argv(run_dir: Path, fd: int) -> list[str]:
    return [sys.executable, "-m", "trainer", "dashboard", str(run_dir), "--fd", str(fd)]


def start_dashboard(cfg: RunConfig, run_dir: Path) -> Component | None:
    """Start the dashboard when `launch.dashboard` is set and print `dashboard: http://127.0.0.1:PORT/`; None
    when it is not set. The launcher stops it with the run's other components (stop_all)."""
    if not cfg.launch.dashboard:
        return None
    sock = listen(DASHBOARD_HOST)
    port = sock.getsockname()[1]
    comp = Component(
        "dashboard",
        dashboard_argv(run_dir, sock.fileno()),
        run_dir / "logs" / "dashboard.log",
        pass_fds=(sock.fileno(),),
    )
    try:
        comp.start()
    finally:
        sock.close()  # the dashboard holds its own copy; it is never restarted, so the launcher needs none
    print(f"dashboard: http://{DASHBOARD_HOST}:{port}/", flush=True)
    return comp
