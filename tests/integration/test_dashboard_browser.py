"""The live dashboard in a real headless browser: Chromium from the OS packages, driven by Selenium through the OS
package's chromedriver (nothing is downloaded at test time). `python -m trainer dashboard` runs as its own process
over a run folder and a service client's folder: the page loads, the run's reward plot shows its points, a row
appended to metrics.jsonl appears without a reload, and the client is listed with its loss curve. A screenshot is
kept in the test's tmp folder; with DASHBOARD_SCREENSHOT=FILE it is also copied there (the docs' picture:
DASHBOARD_SCREENSHOT=docs/images/dashboard.png).

Skipped, saying what to install, where the browser, its driver or Selenium is missing. The dashboard of a real
launch is checked in tests/integration/test_launch.py, on the staleness run (one stack start for both).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser import MISSING, By, chromium, points

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
WAIT_S = 20.0


def row(step: int) -> dict[str, Any]:
    reward = 1 - math.exp(-step / 8)
    return {
        "step": step,
        "wall_s": 2.0 * step,
        "unix_time": time.time(),
        "reward/mean": reward,
        "loss": -0.05 / step,
        "time/step_s": 2.0,
        "time/train_s": 1.6,
        "time/wait_for_batch_s": 0.3,
        "time/publish_s": 0.1,
        "policy/staleness_mean": 0.7,
        "policy/staleness_max": 1,
        "rollouts/dropped_stale": int(step % 3 == 0),
        "optim/grad_norm": 1 / math.sqrt(step),
        "perf/tokens_per_s": 900 + 10 * step,
    }


def append(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    run = root / "toy-20261125-210000"
    (run / "adapters" / "v000030").mkdir(parents=True)
    (run / "checkpoints" / "step-000030").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step-000030")
    (run / "config.yaml").write_text("model:\n  path: tiny\nrollout:\n  num_steps: 40\n")
    append(run / "metrics.jsonl", [row(s) for s in range(1, 31)])
    evals = [{"step": s, "unix_time": time.time(), "eval/pass@1": 0.8 * s / 30} for s in (10, 20, 30)]
    append(run / "eval.jsonl", evals)
    client = root / "service" / "s0_train_0"
    client.mkdir(parents=True)
    calls = [{"call": "forward_backward", "loss": 2.5 / (1 + i / 4), "seconds": 0.2} for i in range(25)]
    append(client / "metrics.jsonl", calls)
    return root


def serve(runs: Path, log: Path, *args: str) -> Iterator[str]:
    """`python -m trainer dashboard` over `runs`, run from the folder above it: the page then names the runs by
    relative paths (so does the docs' picture). Yields the URL it prints once it listens."""
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer", "dashboard", runs.name, "--port", "0", *args],
            cwd=runs.parent,
            env={**os.environ, "PYTHONPATH": pythonpath},
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("dashboard: http://127.0.0.1:"), f"{line!r}; log: {log.read_text()}"
            yield line.split(" ", 1)[1].strip()
        finally:
            proc.terminate()
            proc.wait(timeout=10)


@pytest.fixture
def dashboard(runs: Path, tmp_path: Path) -> Iterator[str]:
    yield from serve(runs, tmp_path / "dashboard.log")


@pytest.fixture
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


def wait_for(what: str, check: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.2)
    raise AssertionError(f"not seen within {WAIT_S} s: {what}")


def test_dashboard_page_shows_a_live_run_and_a_service_client(
    dashboard: str, browser: Any, runs: Path, tmp_path: Path
) -> None:
    browser.get(dashboard + "#" + "0:toy-20261125-210000")
    wait_for("the run listed", lambda: "toy-20261125-210000" in browser.find_element(By.ID, "runs").text)
    # reward/mean (30 rows) and eval pass@1 (3 rows) on the reward panel
    wait_for("the reward plot's 33 points", lambda: points(browser, "reward per step") == 33)
    assert "step-000030" in browser.find_element(By.ID, "saved").text
    assert "num_steps: 40" in browser.find_element(By.ID, "config").text
    painted = browser.execute_script(
        "const c = document.querySelector('.chart canvas');"
        "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        "let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i + 3] && d[i + 2] > 150 && d[i] < 80) n++;"
        "return n;"
    )
    assert painted > 100, f"the reward line is not drawn ({painted} blue pixels)"

    append(runs / "toy-20261125-210000" / "metrics.jsonl", [row(31), row(32)])
    wait_for("two appended rows without a reload", lambda: points(browser, "reward per step") == 35)
    assert browser.execute_script("return performance.getEntriesByType('navigation').length") == 1

    clients = browser.find_element(By.ID, "clients")
    assert "service/s0_train_0" in clients.text
    shot = tmp_path / "dashboard.png"
    browser.save_screenshot(str(shot))
    if target := os.environ.get("DASHBOARD_SCREENSHOT"):
        shutil.copyfile(shot, target)
    clients.find_element(By.TAG_NAME, "li").click()
    wait_for("the client's 25 losses", lambda: points(browser, "loss per forward_backward call") == 25)
    browser.save_screenshot(str(tmp_path / "dashboard-client.png"))


def test_a_dashboard_with_a_token_serves_the_page_that_carries_it(
    runs: Path, browser: Any, tmp_path: Path
) -> None:
    token = "k" * 24
    for url in serve(runs, tmp_path / "dashboard-token.log", "--token", token):
        browser.get(url)  # without the token: refused
        assert "needs its token" in browser.find_element(By.TAG_NAME, "body").text
        browser.get(f"{url}?token={token}#0:toy-20261125-210000")  # the page sends it with every API call
        wait_for("the run's reward plot", lambda: points(browser, "reward per step") == 33)
