"""The test SLURM cluster itself: a batch job's concurrent `srun --overlap` steps really run side by side, the
job completes with exit 0, and stop() leaves no daemon, slurmstepd or job process behind."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from tests.slurm_cluster import SlurmCluster, ensure_installed, parse_scontrol_record, pid_alive
from trainer.training.polling import wait_until

pytestmark = pytest.mark.slow

# Each step stamps its start and end; 2 s apart so serialised steps (no --overlap) would be unmistakable.
TWO_STEPS = """
for s in a b; do
  srun --overlap -N1 -n1 bash -c "date +%s.%N > $s.start; sleep 2; date +%s.%N > $s.end" &
done
wait
"""


@pytest.fixture
def cluster_or_skip() -> None:
    reason = ensure_installed()
    if reason is not None:
        pytest.skip(reason)


def test_parse_scontrol_record_keeps_values_with_spaces() -> None:
    rec = parse_scontrol_record(
        "JobId=7 JobName=a b JobState=COMPLETED ExitCode=0:0 AllocNode:Sid=h:1 Power="
    )
    assert rec == {
        "JobId": "7",
        "JobName": "a b",
        "JobState": "COMPLETED",
        "ExitCode": "0:0",
        "AllocNode:Sid": "h:1",
        "Power": "",
    }


def test_overlapping_steps_then_clean_stop(tmp_path: Path, cluster_or_skip: None) -> None:
    cluster = SlurmCluster(tmp_path / "cluster")
    jobdir = tmp_path / "job"
    jobdir.mkdir()
    with cluster:
        job = cluster.sbatch(["--wrap", TWO_STEPS, "-o", str(jobdir / "out.txt")], cwd=jobdir)
        rec = cluster.wait_job(job, timeout_s=30)
        log = (jobdir / "out.txt").read_text()
        assert rec["JobState"] == "COMPLETED", (rec, log)
        assert rec["ExitCode"] == "0:0", (rec, log)
        t = {f.name: float(f.read_text()) for f in jobdir.glob("[ab].*")}
        assert len(t) == 4, (sorted(t), log)
        assert t["a.start"] < t["b.end"] and t["b.start"] < t["a.end"], t  # the steps overlapped...
        # ...from (nearly) the start, not one after the other.
        assert abs(t["a.start"] - t["b.start"]) < 1.5, t

        # linuxproc loses a process re-parented to init: the job ends, the process lives on, and only the
        # cluster's own scan finds it (stop() must SIGKILL exactly that one).
        escape = "setsid -f bash -c 'echo $$ > escaped.pid; exec sleep 300'; sleep 0.5"
        cluster.wait_job(cluster.sbatch(["--wrap", escape, "-o", "/dev/null"], cwd=jobdir), timeout_s=30)
        escaped = int((jobdir / "escaped.pid").read_text())
        # The job's slurmstepd may outlive COMPLETED by a few ms.
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: cluster.leftover_pids() == [escaped], 5, "slurmstepd gone", 0.05)
        assert pid_alive(escaped) and cluster.leftover_pids() == [escaped]

        # A job still running at stop() must be cancelled by it, background and step processes included.
        busy = cluster.sbatch(
            ["--wrap", "sleep 300 & srun --overlap -n1 sleep 300 & wait", "-o", "/dev/null"], cwd=jobdir
        )
        # 2 slurmstepds, the batch shell, 2 sleeps (+ the escaped sleep)
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: len(cluster.leftover_pids()) >= 6, 20, "the busy job's processes", 0.1)
        running = [pid for pid in cluster.leftover_pids() if pid != escaped]
        assert cluster.job_state(busy)["JobState"] == "RUNNING"
        assert len(running) >= 5, running
        daemons = cluster.daemon_pids

    assert cluster.killed_leftovers == [escaped], "scancel should have ended all but the escaped process"
    assert cluster.running_daemons() == {}
    assert not [pid for pid in daemons.values() if pid_alive(pid)], daemons
    assert not [pid for pid in [*running, escaped] if pid_alive(pid)], running
    assert cluster.leftover_pids() == []
