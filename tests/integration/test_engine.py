"""A shared engine (`launch.sh engine`, the session's `shared_engine`): toy runs attach to it one after another
(the first with dynamic sampling, rollout.refill_zero_variance)
with `inference.engine_url`, pay no vLLM start, each learn, and do not see each other's versions or samples; a
second run is refused while the first holds the lease, and attaches once a killed holder's lease lapses; a kill -9 of
vLLM under an attached run is healed by the engine and the run finishes; the killed run resumes on the engine. One test for all of it: each run costs a
toy run's minute, and the later checks need the earlier runs' state."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import SharedEngine
from tests.helpers import ROOT, assert_learned, launch_cmd, read_metrics, run_launch, stop_process
from trainer.training.polling import wait_until

pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")

PROBE = list(range(40, 72))  # a prompt no toy environment sends: its completion is this test's own sample


def attached(run_dir: Path, url: str, *overrides: str) -> list[str]:
    return launch_cmd(run_dir, f"inference.engine_url={url}", *overrides)


def probe_version(url: str) -> tuple[list[int], int | None]:
    """Sample the probe prompt on the engine's current policy; the sequence and the version the ledger gives it."""
    body = {"prompt": {"prompt_token_ids": PROBE}, "max_tokens": 8, "temperature": 1.0, "logprobs": 0}
    answer = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    completion = [int(next(iter(step[0]))) for step in answer["logprobs"][0]]
    seq = PROBE + completion
    found = httpx.post(f"{url}/policy/lookup", json={"sequences": [seq]}, timeout=30).json()["versions"][0]
    return seq, found


def lookup(url: str, seq: list[int]) -> int | None:
    return httpx.post(f"{url}/policy/lookup", json={"sequences": [seq]}, timeout=30).json()["versions"][0]


def rewards(run_dir: Path) -> list[float | None]:
    return [r.get("reward/mean") for r in read_metrics(run_dir)]


def started(run_dir: Path, proc: subprocess.Popen[str], rows: int) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"the run in {run_dir} exited with {proc.returncode}")
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and metrics.read_text().count("\n") >= rows


def test_runs_attach_one_at_a_time_learn_keep_their_own_versions_and_ride_out_a_vllm_kill(
    tmp_path, shared_engine: SharedEngine
):
    url = shared_engine.url
    # 1. A whole toy run on the engine, with dynamic sampling: it learns, and what it sampled is in the ledger under
    # its versions. Equal-reward groups (the toy's early all-0 groups, its solved all-1 ones) are left out and
    # replaced; one stays in a step's batch only once the step has left out its bound of them.
    first = tmp_path / "first"
    rc, out, _ = run_launch(attached(first, url, "rollout.refill_zero_variance=true"), 600)
    assert rc == 0, out[-3000:]
    assert "attached to the engine at" in out and "waiting for the gateway and vLLM" not in out
    assert_learned(rewards(first))
    rows = read_metrics(first)
    assert sum(r["rollouts/zero_variance_groups_replaced"] for r in rows) > 0
    assert sum(r["rollouts/zero_variance_batches_fetched"] for r in rows) > len(
        rows
    )  # batches beyond one a step
    for r in rows:
        assert not r["rollouts/groups_zero_variance"] or r["rollouts/zero_variance_bound_reached"] == 1, r
    record = json.loads((first / "engine.json").read_text())
    assert record["engine_url"] == url and "publish_token" not in record
    assert not (first / "gateway.yaml").exists()
    seq, version = probe_version(url)
    assert version is not None and version >= 1  # the first run's last policy, still current on the engine

    # 2. While a run holds the engine, another is refused with the holder's name; killed, its lease lapses.
    holder = tmp_path / "holder"
    steps = ["rollout.num_steps=200", "optim.total_steps=200", "trainer.checkpoint_every=1"]
    proc = subprocess.Popen(
        attached(holder, url, *steps),
        cwd=ROOT,
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: started(holder, proc, 2), 300, "the holder's second step", 0.5)
        second = tmp_path / "second"
        rc, out, _ = run_launch(attached(second, url), 120)
        assert rc == 2 and f"leased to the run in {holder}" in out, out[-2000:]
        os.kill(proc.pid, signal.SIGKILL)  # the launcher: its components follow it (die_with_parent)
        proc.wait(timeout=30)
    finally:
        stop_process(proc)

    # 3. The next run waits for the lapse, attaches to a clean state, and rides out a kill -9 of vLLM.
    proc = subprocess.Popen(
        [*attached(second, url), "--wait"],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: started(second, proc, 3), 300, "the second run's third step", 0.5)
        pids = json.loads((second / "pids.json").read_text())
        assert "gateway" not in pids and "vllm" not in pids and pids["engine_vllm"]
        os.kill(pids["engine_vllm"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        stop_process(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "waiting for the engine: this engine is leased to" in out
    assert "a clean policy state" in out
    assert_learned(rewards(second))
    faults = json.loads((second / "faults.json").read_text())
    assert faults["restarts_vllm"] >= 1, faults
    # The second run's ledger knows nothing of the first's samples.
    assert lookup(url, seq) is None

    # 4. The killed run resumes on the engine as the same run (its lease id), from its checkpoint, to its end.
    lease = yaml.safe_load((holder / "config.yaml").read_text())["inference"]["engine_lease"]
    done = int((holder / "checkpoints" / "latest").read_text().split("-")[1])
    resume = ["bash", str(ROOT / "launch.sh"), "--resume", str(holder), f"rollout.num_steps={done + 2}"]
    rc, out, _ = run_launch(resume, 600)
    assert rc == 0 and "attached to the engine at" in out, out[-3000:]
    assert yaml.safe_load((holder / "config.yaml").read_text())["inference"]["engine_lease"] == lease
    assert [r["step"] for r in read_metrics(holder)] == list(range(1, done + 3))
    engine = httpx.get(f"{url}/engine", timeout=10).json()
    assert engine["runs"] >= 4 and engine["lapsed"] >= 1
