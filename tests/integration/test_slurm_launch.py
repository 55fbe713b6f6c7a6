"""`sbatch launch.sh toy --config configs/tiny_cpu.yaml` on a real single-node SLURM (tests/slurm_cluster.py): the job
places every component as a concurrent srun step, learns the toy task, completes, and leaves no process behind.
Also the placement `--dry-run` prints for a multi-node job."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from tests.helpers import assert_learned
from tests.slurm_cluster import SlurmCluster, ensure_installed, pid_alive
from trainer.training.polling import wait_until

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


SBATCH_ARGS = ["--gpus-per-node=0", "--cpus-per-task=2", "--mem=0", "--time=15"]  # this 2-core, GPU-less node


def test_sbatch_scancel_and_a_resumed_job_learn_the_toy_task_and_leave_nothing_behind(tmp_path):
    """What a user does on a cluster: sbatch, scancel mid-run, sbatch --resume. The first job places every component
    as a concurrent srun step; scancel gives the launcher and every step SIGTERM, the gateway stops its vLLM, nothing
    survives the job, and the run folder keeps a complete checkpoint. A second job resumes from it, completes,
    learns the toy task, and leaves nothing behind. (One cluster and one run for what were two tests: each job start
    pays a vLLM start.)"""
    pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")
    reason = ensure_installed()
    if reason is not None:
        pytest.skip(reason)
    run_dir, first_out, job_out = tmp_path / "run", tmp_path / "job1.out", tmp_path / "job2.out"
    with SlurmCluster(tmp_path / "slurm") as cluster:
        # Override the GPU/CPU/memory defaults of launch.sh's #SBATCH header for this 2-core, GPU-less node.
        first = cluster.sbatch(
            [
                *SBATCH_ARGS,
                f"--output={first_out}",
                "launch.sh",
                "toy",
                "--config",
                "configs/tiny_cpu.yaml",
                f"trainer.output_dir={run_dir}",
                "trainer.checkpoint_every=2",
                "launch.slurm_bind_host=127.0.0.1",
            ],
            cwd=ROOT,
        )
        metrics = run_dir / "metrics.jsonl"

        def five_steps() -> bool:
            state = cluster.job_state(first).get("JobState")
            assert state in ("PENDING", "RUNNING"), (state, first_out.read_text())
            return metrics.exists() and len(metrics.read_text().splitlines()) >= 5

        wait_until(five_steps, 400, "five steps of the SLURM job", 0.5)
        cluster.run_client(["scancel", str(first)])
        info = cluster.wait_job(first, timeout_s=120)
        assert info["JobState"] == "CANCELLED", info
        # A slurmstepd outlives squeue's view by a moment while it reaps its tasks (as in SlurmCluster.stop).
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: not cluster.leftover_pids(), 15, "the cancelled job's processes gone", 0.2)
        assert cluster.leftover_pids() == [], "processes outlived the cancelled job"
        ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
        assert (ckpt / "trainer_state.pt").is_file() and (ckpt / "adapter_model.safetensors").is_file()
        cancelled_at = len(metrics.read_text().splitlines())

        job = cluster.sbatch(
            [*SBATCH_ARGS, f"--output={job_out}", "launch.sh", "--resume", str(run_dir)], cwd=ROOT
        )
        info = cluster.wait_job(job, timeout_s=600)
        out = job_out.read_text() if job_out.exists() else "(no job output)"
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{out[-3000:]}"
        # Leftovers are found by the job's environment, so vLLM's engine processes count too.
        leftovers = cluster.stop()
    assert leftovers == [], f"processes of the job outlived it: {leftovers}"
    assert not cluster.running_daemons()
    pids = json.loads((run_dir / "pids.json").read_text())
    assert not [name for name, pid in pids.items() if pid and pid_alive(pid)]

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31)), f"cancelled after {cancelled_at} steps"
    assert_learned([r["reward/mean"] for r in rows])
    assert rows[-1]["policy_version"] >= 10
    assert f"SLURM job {job}: run-api on " in out and "run finished" in out
    # Every component ran as a step of a job, not as a plain child of the batch script.
    for name in ("run-api", "gateway", "env", "trainer"):
        starts = [
            line
            for line in (run_dir / "logs" / f"{name}.log").read_text().splitlines()
            if line.startswith("=== ")
        ]
        assert len(starts) >= 2, f"{name}: started by both jobs: {starts}"
        for line in starts:
            assert line.startswith("=== srun --jobid="), line
            # The zero-GPU options run on a real slurmctld (this node has no GRES: they must still be accepted).
            assert ("--gpus-per-node=0" in line) == (name in ("run-api", "env")), line
    started = datetime.fromisoformat(info["StartTime"]).timestamp()
    print(
        json.dumps(
            {
                "resumed_job_start_to_end_s": round(
                    datetime.fromisoformat(info["EndTime"]).timestamp() - started, 1
                ),
            }
        )
    )


def test_dry_run_prints_a_multi_node_placement():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.orchestration.launcher",
            "toy",
            "--config",
            "configs/tiny_cpu.yaml",
            "--dry-run",
            "--slurm-nodes",
            "gpu[01-03]",
            "distributed.nnodes=2",
            "distributed.nproc_per_node=4",
            "rollout.env_workers=2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "on 3 node(s): gpu01,gpu02,gpu03" in out
    lines = {
        line.split(":", 1)[0]: line
        for line in out.splitlines()
        if line.startswith(("run-api:", "gateway:", "env-", "trainer:"))
    }
    assert "--nodelist=gpu01 " in lines["run-api"] and "--host 0.0.0.0" in lines["run-api"]
    assert "--nodelist=gpu01 " in lines["gateway"]
    assert "--nodelist=gpu03 " in lines["env-0"] and "--nodelist=gpu03 " in lines["env-1"]
    assert "--env.rollout_server_url=http://gpu01:20000" in lines["env-0"]
    assert "--nodelist=gpu01,gpu02 " in lines["trainer"] and "--rdzv-endpoint=gpu01:20002" in lines["trainer"]
    assert "--nproc_per_node=4 --nnodes=2" in lines["trainer"]
    assert "publish_token: <generated at launch>" in out


def test_placement_errors_name_the_fix():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.orchestration.launcher",
            "toy",
            "--config",
            "configs/tiny_cpu.yaml",
            "--dry-run",
            "--slurm-nodes",
            "n[1-2]",
            "distributed.nnodes=3",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "distributed.nnodes=3 but the job has 2 node(s)" in proc.stderr
    assert "--nodes=3" in proc.stderr


def test_slurm_placement_binds_all_interfaces_with_a_publish_token_and_derived_ports():
    from inference.config import GatewayConfig
    from trainer.orchestration.launcher import gateway_section, place_on_slurm
    from trainer.orchestration.slurm import SlurmJob, derive_ports
    from trainer.training.config import RunConfig, load_config

    cfg = load_config(RunConfig, ROOT / "configs" / "tiny_cpu.yaml", ["rollout.env_workers=3"])
    placement, address = place_on_slurm(cfg, SlurmJob(123457, ["a1", "a2"]))
    ports = derive_ports(123457)
    assert (ports.run_api, ports.gateway, ports.rendezvous) == (
        20000 + 3457 * 4,
        20000 + 3457 * 4 + 1,
        20000 + 3457 * 4 + 2,
    )
    assert (
        cfg.launch.run_api_url == f"http://a1:{ports.run_api}"
        and cfg.launch.gateway_url == f"http://a1:{ports.gateway}"
    )
    assert address == {"host": "0.0.0.0", "port": ports.gateway} and len(cfg.inference["publish_token"]) >= 24
    section = gateway_section(
        cfg, "/m", address
    )  # validated by the gateway's own model, in its own interpreter
    loaded = GatewayConfig.model_validate(section)  # what the gateway process will load
    assert (loaded.host, loaded.port, loaded.publish_token) == (
        "0.0.0.0",
        ports.gateway,
        cfg.inference["publish_token"],
    )
    assert placement.hosts["trainer"] == ["a1"] and placement.hosts["gateway"] == ["a1"]
    assert [placement.hosts[f"env-{w}"] for w in range(3)] == [["a2"], ["a2"], ["a2"]]


def test_nodelist_parsing_matches_scontrol_forms():
    from trainer.orchestration.slurm import parse_nodelist
    from trainer.training.config import ConfigError

    assert parse_nodelist("gpu[01-03,7],cpu1") == [
        "gpu01",
        "gpu02",
        "gpu03",
        "gpu7",
        "cpu1",
    ]  # as scontrol prints
    assert parse_nodelist("n[1-2]-ib[0-1]") == ["n1-ib0", "n1-ib1", "n2-ib0", "n2-ib1"]
    with pytest.raises(ConfigError, match="not a number"):
        parse_nodelist("gpu[a-b]")
